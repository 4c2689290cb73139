#include "tests/unit/engine/torchfile/torchfile_testutil.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <unordered_set>

#include "engine/core/dtype.h"
#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/torchfile/zip.h"
#include "tests/testutil/testutil.h"

namespace ucp::torchfile::test {

using nlohmann::json;
using pickle::Kind;
using pickle::Value;

int RunPythonScript(std::string_view script, const std::string& args,
                    std::string* output) {
  testutil::TempDir dir;
  const std::filesystem::path file = dir / "script.py";
  testutil::WriteFile(file, script);
  return testutil::RunCommand(testutil::Python() + " " +
                                  testutil::ShellQuote(file.string()) + " " +
                                  args,
                              output);
}

bool HaveTool(std::string_view name) {
  return std::filesystem::exists(testutil::SourceDir() / "tests/tools" /
                                 std::string(name));
}

int CheckTorchFiles(const std::string& args, std::string* output) {
  const std::filesystem::path tool =
      testutil::SourceDir() / "tests/tools/check_torch_files.py";
  return testutil::RunCommand(testutil::Python() + " " +
                                  testutil::ShellQuote(tool.string()) + " " +
                                  args,
                              output);
}

namespace {

void Walk(const Value* v, TensorPath& path,
          std::unordered_set<const Value*>& on_path,
          std::vector<Reached>& out) {
  const bool is_list = v->kind == Kind::kList || v->kind == Kind::kTuple;
  if (!is_list && !v->IsDictLike()) {
    out.push_back({path, v});
    return;
  }
  if (!on_path.insert(v).second) return;  // a cycle (Python would recurse)
  if (is_list) {
    for (size_t i = 0; i < v->items.size(); ++i) {
      path.emplace_back(static_cast<int64_t>(i));
      Walk(v->items[i], path, on_path, out);
      path.pop_back();
    }
  } else {
    for (const auto& [k, value] : v->entries) {
      if (k->kind == Kind::kStr) {
        path.emplace_back(k->s);
      } else if (k->kind == Kind::kInt && k->big.empty()) {
        path.emplace_back(k->i);
      } else {
        ADD_FAILURE() << "dict key " << pickle::Repr(k)
                      << " cannot be a path component";
        continue;
      }
      Walk(value, path, on_path, out);
      path.pop_back();
    }
  }
  on_path.erase(v);
}

json PathToJson(const TensorPath& path) {
  json j = json::array();
  for (const PathComponent& c : path) {
    if (const auto* s = std::get_if<std::string>(&c)) {
      j.push_back(*s);
    } else {
      j.push_back(std::get<int64_t>(c));
    }
  }
  return j;
}

std::string LeafType(const Value* v) {
  switch (v->kind) {
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    default:
      return "";
  }
}

std::string TopType(const TorchFile& file, const Value* root) {
  if (root->kind == Kind::kDict) return "dict";
  if (root->IsObjectOf("collections", "OrderedDict")) return "OrderedDict";
  return PyClassName(file, root);
}

}  // namespace

std::vector<Reached> WalkContainers(const Value* root) {
  std::vector<Reached> out;
  TensorPath path;
  std::unordered_set<const Value*> on_path;
  Walk(root, path, on_path, out);
  return out;
}

std::string TensorBytes(const TorchFile& file, const TensorInfo& tensor) {
  std::string out(tensor.nbytes, '\0');
  file.ReadTensor(tensor,
                  std::span<std::byte>(reinterpret_cast<std::byte*>(out.data()),
                                       out.size()));
  return out;
}

std::string PyClassName(const TorchFile& file, const Value* v) {
  switch (v->kind) {
    case Kind::kNone:
      return "builtins.NoneType";
    case Kind::kBool:
      return "builtins.bool";
    case Kind::kInt:
      return "builtins.int";
    case Kind::kFloat:
      return "builtins.float";
    case Kind::kStr:
      return "builtins.str";
    case Kind::kBytes:
      return "builtins.bytes";
    case Kind::kByteArray:
      return "builtins.bytearray";
    case Kind::kTuple:
      return "builtins.tuple";
    case Kind::kList:
      return "builtins.list";
    case Kind::kDict:
      return "builtins.dict";
    case Kind::kSet:
      return "builtins.set";
    case Kind::kFrozenSet:
      return "builtins.frozenset";
    case Kind::kGlobal:
      if (v->module == "torch" && DTypeFromName(v->name)) {
        return v->ClassName();
      }
      return "builtins.type";
    case Kind::kPersId:
      return "persistent id";
    case Kind::kObject:
      break;
  }
  if (const TensorInfo* t = file.FindTensor(v); t != nullptr && t->node == v) {
    if (t->wrapper == TensorWrapper::kSubclass) {
      return v->args->items[1]->ClassName();
    }
    return t->is_parameter ? "torch.nn.parameter.Parameter" : "torch.Tensor";
  }
  // numpy scalars pickle as numpy.core.multiarray.scalar(dtype, bytes); their
  // class follows from the dtype (pickle::Value::ClassName does not do this).
  if (v->IsObjectOf("numpy.core.multiarray", "scalar") && v->args != nullptr &&
      !v->args->items.empty() && v->args->items[0]->args != nullptr &&
      !v->args->items[0]->args->items.empty()) {
    static const std::map<std::string, std::string> kCodes = {
        {"f8", "float64"},   {"f4", "float32"},    {"f2", "float16"},
        {"i8", "int64"},     {"i4", "int32"},      {"i2", "int16"},
        {"i1", "int8"},      {"u1", "uint8"},      {"u2", "uint16"},
        {"u4", "uint32"},    {"u8", "uint64"},     {"b1", "bool_"},
        {"c8", "complex64"}, {"c16", "complex128"}};
    auto it = kCodes.find(v->args->items[0]->args->items[0]->s);
    if (it != kCodes.end()) return "numpy." + it->second;
  }
  return v->ClassName();
}

std::string PathJson(const TensorPath& path) { return PathToJson(path).dump(); }

std::vector<std::filesystem::path> FindPtFiles(
    const std::filesystem::path& dir) {
  std::vector<std::filesystem::path> out;
  if (!std::filesystem::is_directory(dir)) return out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().extension() == ".pt") {
      out.push_back(e.path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string CompareWithDescription(const TorchFile& file,
                                   const std::filesystem::path& json_path) {
  json d;
  try {
    d = json::parse(testutil::ReadFile(json_path));
  } catch (const std::exception& e) {
    return StrCat("cannot parse ", json_path.string(), ": ", e.what());
  }
  auto diff = [&](auto&&... args) {
    return StrCat(file.path().string(), " vs ", json_path.filename().string(),
                  ": ", args...);
  };
  const std::string format =
      file.format() == TorchFile::Format::kZip ? "zip" : "legacy";
  if (d.at("format") != format) {
    return diff("format ", format, " != ", d.at("format").dump());
  }
  if (format == "zip") {
    if (d.at("archive_name") != file.archive_name()) {
      return diff("archive_name ", file.archive_name(),
                  " != ", d.at("archive_name").dump());
    }
    json records = json::array();
    const std::string prefix = file.archive_name() + "/";
    for (const ZipEntry& e : file.zip()->entries()) {
      records.push_back(
          e.name.starts_with(prefix) ? e.name.substr(prefix.size()) : e.name);
    }
    if (records != d.at("records")) {
      return diff("records ", records.dump(), " != ", d.at("records").dump());
    }
  }
  if (d.contains("top_type")) {
    const std::string top = TopType(file, file.root());
    if (d.at("top_type") != top) {
      return diff("top_type ", top, " != ", d.at("top_type").dump());
    }
  }

  json tensors = json::array();
  json leaves = json::array();
  json objects = json::array();
  for (const Reached& r : WalkContainers(file.root())) {
    const json path = PathToJson(r.path);
    const TensorInfo* t = file.FindTensor(r.node);
    if (t != nullptr && t->node == r.node) {
      json e;
      e["path"] = path;
      e["dtype"] = std::string(DTypeName(t->dtype));
      e["shape"] = t->shape;
      e["stride"] = t->stride;
      e["storage_offset"] = t->storage_offset;
      e["storage_key"] = t->storage_key();
      e["storage_nbytes"] = t->storage->nbytes;
      e["device"] = t->device();
      e["requires_grad"] = t->requires_grad;
      e["is_parameter"] = t->is_parameter;
      e["sha256"] = testutil::Sha256Hex(TensorBytes(file, *t));
      tensors.push_back(std::move(e));
    } else if (std::string type = LeafType(r.node); !type.empty()) {
      leaves.push_back({{"path", path},
                        {"type", type},
                        {"repr", pickle::Repr(r.node, size_t{1} << 30)}});
    } else {
      objects.push_back({{"path", path}, {"class", PyClassName(file, r.node)}});
    }
  }
  for (const char* section : {"tensors", "leaves", "objects"}) {
    const json& want = d.at(section);
    const json& got = std::string(section) == "tensors"  ? tensors
                      : std::string(section) == "leaves" ? leaves
                                                         : objects;
    if (want.size() != got.size()) {
      return diff(section, ": ", got.size(), " entries != ", want.size());
    }
    for (size_t i = 0; i < want.size(); ++i) {
      for (auto it = want[i].begin(); it != want[i].end(); ++it) {
        if (!got[i].contains(it.key())) continue;  // extra field (e.g. notes)
        if (got[i].at(it.key()) != it.value()) {
          return diff(section, "[", i, "] at ", got[i].at("path").dump(), ": ",
                      it.key(), " ", got[i].at(it.key()).dump(),
                      " != ", it.value().dump());
        }
      }
      for (auto it = got[i].begin(); it != got[i].end(); ++it) {
        if (!want[i].contains(it.key())) {
          return diff(section, "[", i, "]: description lacks ", it.key());
        }
      }
    }
  }

  std::set<std::string> globals;
  for (const Value& v : file.arena().nodes()) {
    if (v.kind == Kind::kGlobal) globals.insert(v.module + "." + v.name);
  }
  json got_globals(globals);
  if (got_globals != d.at("globals")) {
    return diff("globals ", got_globals.dump(), " != ", d.at("globals").dump());
  }
  return "";
}

}  // namespace ucp::torchfile::test
