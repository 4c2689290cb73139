// ucp inspect: the key tree of torch.save files.

#include <boost/program_options.hpp>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cli/command.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/atoms/signature.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/zip.h"
#include "engine/universal/model.h"

namespace ucp::cli {
namespace {

namespace po = boost::program_options;
namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;
using torchfile::TensorInfo;
using torchfile::TorchFile;

constexpr const char* kInspectHelp =
    "usage: ucp inspect PATH... [--json] [--max-items N]\n"
    "\n"
    "Shows what a torch.save file holds without loading tensor data: the tree "
    "of\n"
    "dicts, lists and tuples with every tensor's dtype, shape and size "
    "(views,\n"
    "Parameters, requires_grad and the saving device are marked), scalars, "
    "and\n"
    "opaque objects by class (argparse.Namespace, numpy arrays, framework\n"
    "classes). Nothing in the file is executed; globals that could run code "
    "when\n"
    "Python loads the file (os.system, builtins.eval, ...) are reported as\n"
    "suspicious. A folder is searched recursively for torch.save files (zip "
    "or\n"
    "legacy format, recognised by content). A universal file (HDF5) is shown "
    "as\n"
    "its parameters with shape, training dtype, layout rule and state kinds.\n"
    "A checkpoint folder of a format that keeps an index of its own is shown\n"
    "by it first (keys, global shapes, chunks and files), and a file holding\n"
    "several torch.save archives is shown archive by archive (PATH@offset).\n"
    "A checkpoint whose files are not torch.save files (a .ckpt file or a\n"
    "sharded save of such files) is shown by its records, as ucp reads them.\n"
    "\n"
    "examples:\n"
    "  ucp inspect iter_0000100/mp_rank_00/model_optim_rng.pt\n"
    "  ucp inspect checkpoints/iter_0000100            # every rank file\n"
    "  ucp inspect --json model.pt | jq '.files[0].totals'\n"
    "  ucp inspect gpt.ucp.h5                          # a universal file\n"
    "\n"
    "options";

// A universal file: root attributes and every param with its atoms.
json::Value InspectUniversal(const fs::path& path, bool print) {
  atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(path);
  const atoms::RootInfo& root = store.root();
  const universal::Model model = universal::ModelFromRoot(root, path);
  json::Value doc;
  doc["path"] = path.string();
  doc["format"] = "universal";
  doc["iteration"] = root.iteration;
  doc["consumed_samples"] = root.consumed_samples;
  doc["source"] =
      root.source.empty() ? json::Value() : universal::SourceJson(model.source);
  doc["model"] = root.model.empty() ? json::Value()
                                    : universal::VariablesJson(model.variables);
  json::Value params = json::Value::Array();
  uint64_t total = 0;
  if (print) {
    std::printf("%s  (universal file, iteration %lld)\n",
                OneLine(path.string()).c_str(),
                static_cast<long long>(root.iteration));
    if (!root.source.empty())
      std::printf("  source: %s\n",
                  OneLine(universal::SourceJson(model.source).Dump()).c_str());
  }
  for (const atoms::StoredParam& p : store.params()) {
    json::Value j;
    j["name"] = p.info.fqn;
    j["shape"] = json::Value::Array();
    for (int64_t d : p.info.shape) j["shape"].Append(d);
    j["dtype"] = std::string(DTypeName(p.info.dtype));
    j["rule"] = p.info.rule;
    json::Value kinds = json::Value::Array();
    std::string line;
    for (atoms::DatasetId id : p.atoms) {
      const atoms::DatasetInfo& d = store.dataset(id);
      kinds.Append(d.state_kind);
      line += StrCat(line.empty() ? "" : " ", d.state_kind);
      total += d.nbytes;
    }
    for (atoms::DatasetId id : p.pads) total += store.dataset(id).nbytes;
    j["state_kinds"] = std::move(kinds);
    // The reader guarantees pad datasets at least one dim (the rows).
    const int64_t pad_rows =
        p.pads.empty() ? 0 : store.dataset(p.pads.front()).shape.front();
    if (!p.pads.empty()) j["padding_rows"] = pad_rows;
    if (print) {
      const std::string pads =
          p.pads.empty() ? "" : StrCat(", ", pad_rows, " padding rows");
      std::printf("  %s: %s %s  [%s]  rule %s%s\n", OneLine(p.info.fqn).c_str(),
                  std::string(DTypeName(p.info.dtype)).c_str(),
                  ShapeString(p.info.shape).c_str(), OneLine(line).c_str(),
                  OneLine(p.info.rule).c_str(), pads.c_str());
    }
    params.Append(std::move(j));
  }
  doc["params"] = std::move(params);
  doc["tensor_bytes"] = total;
  if (print) {
    std::printf("totals: %zu params, %zu datasets, %s of tensors\n\n",
                store.params().size(), store.datasets().size(),
                HumanBytes(total).c_str());
  }
  return doc;
}

bool LooksLikeTorchFile(const fs::path& path) {
  try {
    File f = File::OpenRead(path);
    unsigned char head[4] = {0, 0, 0, 0};
    if (f.ReadSome(head, 4, 0) < 4) return false;
    if (head[0] == 'P' && head[1] == 'K' && head[2] == 3 && head[3] == 4)
      return true;
    // Legacy format: a protocol-2 pickle starting with the LONG1 magic number.
    return head[0] == 0x80 && head[1] == 0x02 && head[2] == 0x8a &&
           head[3] == 0x0a;
  } catch (const Error&) {
    return false;
  }
}

// The checkpoints of known formats under one PATH argument (found through
// the driver registry, opened once per folder): their inventories, and the
// torch.save archives each of their files holds.
class Checkpoints {
 public:
  /// `on_inventory` receives the inventory of each checkpoint opened that
  /// has one, once.
  explicit Checkpoints(std::function<void(const json::Value&)> on_inventory)
      : on_inventory_(std::move(on_inventory)) {}
  /// Opens the checkpoint at `path` if there is one (its inventory shown):
  /// a folder, or a file that is itself a checkpoint of a format that is
  /// not torch.save (a torch.save file is inspected on its own). Returns
  /// whether an inventory was shown.
  bool Visit(const fs::path& path) {
    std::error_code ec;
    if (fs::is_regular_file(path, ec) &&
        (LooksLikeTorchFile(path) || atoms::IsHdf5File(path)))
      return false;
    shown_ = false;
    open_error_ = nullptr;
    SourceOf(path);
    return shown_;
  }
  /// Why the checkpoint the last Visit found did not open (null if it did,
  /// or if none was found).
  std::exception_ptr open_error() const { return open_error_; }
  /// The archives of `file` according to the checkpoint of its folder.
  std::vector<formats::ArchiveSpan> Archives(const fs::path& file) {
    const formats::Source* s = SourceOf(file.parent_path());
    return s != nullptr ? s->Archives(file)
                        : std::vector<formats::ArchiveSpan>();
  }

 private:
  // The checkpoint the registry's driver finds in `dir`, opened (nullptr if
  // no driver or several equally sure recognise it, or if it does not open:
  // the files are then inspected on their own).
  const formats::Source* SourceOf(const fs::path& dir) {
    auto it = open_.find(dir);
    if (it != open_.end()) return it->second.get();
    std::unique_ptr<formats::Source> s;
    std::error_code ec;
    if (fs::is_directory(dir, ec) || fs::is_regular_file(dir, ec)) {
      // The registry's choice (formats::DetectDriver), if it makes one.
      const formats::Driver* best = nullptr;
      try {
        best = &formats::DetectDriver(dir);
      } catch (const Error&) {
      }
      if (best != nullptr) {
        try {
          s = best->Open(dir, {});
          const json::Value inv = s->Inventory();
          if (!inv.is_null()) {
            on_inventory_(inv);
            shown_ = true;
          }
        } catch (const Error&) {
          s.reset();
          open_error_ = std::current_exception();
        }
      }
    }
    return open_.emplace(dir, std::move(s)).first->second.get();
  }

  std::function<void(const json::Value&)> on_inventory_;
  std::map<fs::path, std::unique_ptr<formats::Source>> open_;
  bool shown_ = false;
  std::exception_ptr open_error_;
};

// The files one PATH argument names: itself, or the torch.save files found
// under a folder. Throws IoError / UsageError if there are none.
std::vector<fs::path> ExpandPath(const std::string& p) {
  std::error_code ec;
  if (fs::is_directory(p, ec)) {
    std::vector<fs::path> found;
    for (auto it = fs::recursive_directory_iterator(
             p, fs::directory_options::skip_permission_denied, ec);
         it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (ec) break;
      const std::string name = it->path().filename().string();
      if (name.find(".ucp-partial-") != std::string::npos ||
          name.find(".ucp-tmp-") != std::string::npos) {
        // Staging of a crashed run (reported as a leftover, not inspected).
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (it->is_regular_file(ec) && LooksLikeTorchFile(it->path())) {
        found.push_back(it->path());
      }
    }
    if (ec) throw IoError("cannot list ", p, ": ", ec.message());
    std::sort(found.begin(), found.end());
    if (found.empty()) throw UsageError("no torch.save files found under ", p);
    return found;
  }
  if (!fs::exists(p, ec)) {
    throw IoError("cannot open ", p, ": no such file or directory");
  }
  return {fs::path(p)};
}

// The Python class of a non-container, non-scalar value as Python would name
// it (type(obj).__module__ + "." + __qualname__).
std::string ClassOf(const Value* v) {
  switch (v->kind) {
    case Kind::kSet:
      return "builtins.set";
    case Kind::kFrozenSet:
      return "builtins.frozenset";
    case Kind::kByteArray:
      return "builtins.bytearray";
    case Kind::kGlobal:
      return v->module + "." + v->name;
    default: {
      std::string cls = v->ClassName();
      return cls.empty() ? "?" : cls;
    }
  }
}

bool IsContainer(const Value* v) {
  return v->kind == Kind::kDict || v->kind == Kind::kList ||
         v->kind == Kind::kTuple || v->IsDictLike();
}

// A dict key as a tree label: at most kMaxLabel bytes (a hostile pickle can
// share one huge key among many entries), control characters escaped (no
// terminal escape sequences from a file reach the terminal).
constexpr size_t kMaxLabel = 120;

std::string KeyString(const Value* key) {
  std::optional<std::string_view> s = key->AsStr();
  if (!s) return pickle::Repr(key, 60);
  if (s->size() <= kMaxLabel) return OneLine(*s);
  size_t cut = kMaxLabel - 3;
  while (cut > 0 && (static_cast<unsigned char>((*s)[cut]) & 0xc0) == 0x80) {
    --cut;  // do not split a UTF-8 sequence
  }
  return StrCat(OneLine(s->substr(0, cut)), "...");
}

std::string TensorLine(const TensorInfo& t) {
  std::string s = StrCat(DTypeName(t.dtype), " ", ShapeString(t.shape), " ",
                         HumanBytes(t.nbytes));
  std::vector<std::string> flags;
  if (t.is_parameter) flags.push_back("Parameter");
  if (t.requires_grad) flags.push_back("requires_grad");
  if (t.device() != "cpu")
    flags.push_back(StrCat("saved on ", OneLine(t.device())));
  if (!t.contiguous || t.storage_offset != 0 || t.storage->nbytes != t.nbytes) {
    std::string v =
        StrCat("view of storage ", OneLine(t.storage_key()), " (",
               HumanBytes(t.storage->nbytes), ") at offset ", t.storage_offset);
    if (!t.contiguous) v += ", stride " + ShapeString(t.stride);
    flags.push_back(v);
  }
  if (!flags.empty()) {
    s += "  (";
    for (size_t i = 0; i < flags.size(); ++i) s += (i ? ", " : "") + flags[i];
    s += ")";
  }
  return s;
}

class TreePrinter {
 public:
  TreePrinter(const TorchFile& file, size_t max_items)
      : file_(file), max_items_(max_items) {}

  // Containers nested deeper than this are not expanded (the recursion
  // stays shallow whatever the graph; real checkpoints nest a few levels).
  static constexpr int kMaxDepth = 64;

  void Print(const Value* v, const std::string& label, int depth) {
    std::string indent(2 * static_cast<size_t>(depth), ' ');
    std::string prefix = indent + (label.empty() ? "" : label + ": ");
    if (v == nullptr) {
      std::printf("%s<null>\n", prefix.c_str());
      return;
    }
    if (const TensorInfo* t = file_.FindTensor(v)) {
      std::printf("%s%s\n", prefix.c_str(), TensorLine(*t).c_str());
      return;
    }
    if (!IsContainer(v)) {
      std::string what;
      switch (v->kind) {
        case Kind::kNone:
        case Kind::kBool:
        case Kind::kInt:
        case Kind::kFloat:
        case Kind::kStr:
          what = pickle::Repr(v, 100);
          break;
        case Kind::kBytes:
          what = StrCat("bytes (", v->s.size(), ")");
          break;
        default:
          what = OneLine(ClassOf(v));
      }
      std::printf("%s%s\n", prefix.c_str(), what.c_str());
      return;
    }
    auto seen = seen_.find(v);
    if (seen != seen_.end()) {
      std::printf("%s(same object as %s)\n", prefix.c_str(),
                  seen->second.c_str());
      return;
    }
    if (depth > kMaxDepth) {
      std::printf("%s... (nested deeper than %d levels)\n", prefix.c_str(),
                  kMaxDepth);
      return;
    }
    seen_[v] = label.empty() ? "root" : label;
    const bool dict = v->kind == Kind::kDict || v->IsDictLike();
    std::string type = v->kind == Kind::kDict    ? "dict"
                       : v->kind == Kind::kList  ? "list"
                       : v->kind == Kind::kTuple ? "tuple"
                                                 : "OrderedDict";
    size_t n = dict ? v->entries.size() : v->items.size();
    std::printf(
        "%s%s (%zu %s)\n", prefix.c_str(), type.c_str(), n,
        dict ? (n == 1 ? "entry" : "entries") : (n == 1 ? "item" : "items"));
    if (dict) {
      for (const auto& [key, value] : v->entries)
        Print(value, KeyString(key), depth + 1);
      return;
    }
    size_t shown = 0;
    for (size_t i = 0; i < v->items.size(); ++i) {
      const Value* item = v->items[i];
      bool scalar = !IsContainer(item) && file_.FindTensor(item) == nullptr;
      if (scalar && shown >= max_items_) {
        std::printf("%s  ... (%zu more)\n", indent.c_str(),
                    v->items.size() - i);
        break;
      }
      if (scalar) ++shown;
      Print(item, std::to_string(i), depth + 1);
    }
  }

 private:
  const TorchFile& file_;
  size_t max_items_;
  std::unordered_map<const Value*, std::string> seen_;
};

// Visits every non-container value reachable from `root` through dict /
// OrderedDict / list / tuple containers, at every path (a container shared by
// two parents is walked under both, as Python's traversal does), in
// depth-first pre-order; dict entries whose key is neither str nor int are
// skipped. Iterative, and cycles are cut. What a hostile graph of shared
// containers can make of this is bounded: every node entered costs 1, every
// leaf kLeafCost plus the bytes of its path (kComponentCost per component
// plus its key) plus what `visit` returns; once `budget` is spent (or the
// current path alone would exceed what is left) the walk stops and returns
// false.
constexpr size_t kLeafCost = 1024;
constexpr size_t kComponentCost = 128;

bool ForEachLeaf(
    const Value* root,
    const std::function<size_t(const Value*, const torchfile::TensorPath&)>&
        visit,
    size_t budget) {
  struct Frame {
    const Value* container;
    size_t next = 0;  // next item / entry to visit
  };
  std::vector<Frame> stack;
  torchfile::TensorPath path;  // one component per frame below the root
  size_t path_bytes = 0;
  std::unordered_set<const Value*> on_path;
  size_t used = 0;
  auto component_bytes = [](const torchfile::PathComponent& c) {
    const std::string* s = std::get_if<std::string>(&c);
    return kComponentCost + (s != nullptr ? s->size() : 0);
  };
  // Enters `v` at `path`. Returns false when the budget is spent, and in
  // `entered` whether a frame was pushed (the path component then stays).
  auto enter = [&](const Value* v, bool& entered) {
    entered = false;
    if (++used > budget) return false;
    if (!IsContainer(v)) {
      used += kLeafCost + path_bytes;
      if (used > budget) return false;
      used += visit(v, path);
      return used <= budget;
    }
    if (!on_path.insert(v).second) return true;  // a cycle
    stack.push_back(Frame{v});
    entered = true;
    return true;
  };
  if (root == nullptr) return true;
  bool entered = false;
  if (!enter(root, entered)) return false;
  while (!stack.empty()) {
    Frame& f = stack.back();
    const Value* v = f.container;
    const bool dict = v->kind == Kind::kDict || v->IsDictLike();
    const size_t n = dict ? v->entries.size() : v->items.size();
    if (f.next >= n) {
      on_path.erase(v);
      stack.pop_back();
      if (!stack.empty()) {
        path_bytes -= component_bytes(path.back());
        path.pop_back();
      }
      continue;
    }
    const size_t i = f.next++;
    const Value* child;
    if (dict) {
      const auto& [key, value] = v->entries[i];
      if (key == nullptr || value == nullptr) continue;
      if (key->kind == Kind::kStr) {
        path.emplace_back(key->s);
      } else if (key->kind == Kind::kInt && key->big.empty()) {
        path.emplace_back(key->i);
      } else {
        continue;
      }
      child = value;
    } else {
      if (v->items[i] == nullptr) continue;
      path.emplace_back(static_cast<int64_t>(i));
      child = v->items[i];
    }
    path_bytes += component_bytes(path.back());
    if (path_bytes > budget - std::min(used, budget)) return false;
    if (!enter(child, entered)) return false;
    if (!entered) {
      path_bytes -= component_bytes(path.back());
      path.pop_back();
    }
  }
  return true;
}

json::Value PathJson(const torchfile::TensorPath& path) {
  json::Value a = json::Value::Array();
  for (const auto& c : path) {
    if (const std::string* s = std::get_if<std::string>(&c)) {
      a.Append(*s);
    } else {
      a.Append(std::get<int64_t>(c));
    }
  }
  return a;
}

json::Value ShapeJson(const std::vector<int64_t>& shape) {
  json::Value a = json::Value::Array();
  for (int64_t d : shape) a.Append(d);
  return a;
}

struct Summary {
  json::Value doc;   // --json document of the file
  std::string text;  // totals lines for the human output
};

// What --json reports per file may cost at most this much (see ForEachLeaf;
// roughly bytes of memory): room for several hundred thousand tensors, while
// a few hundred bytes of hostile pickle cannot make it unbounded.
constexpr size_t kLeafBudget = size_t{512} << 20;

// The summary of one file; the per-path lists (tensors, leaves, objects) only
// if `with_paths` (for --json).
Summary Summarise(const TorchFile& file, uint64_t file_bytes, bool with_paths) {
  json::Value doc;
  doc["path"] = file.path().string();
  doc["format"] = file.format() == TorchFile::Format::kZip ? "zip" : "legacy";
  doc["bytes"] = file_bytes;
  if (file.zip() != nullptr) {
    doc["archive_name"] = file.archive_name();
    json::Value records = json::Value::Array();
    const std::string prefix = file.archive_name() + "/";
    for (const auto& e : file.zip()->entries()) {
      records.Append(e.name.starts_with(prefix) ? e.name.substr(prefix.size())
                                                : e.name);
    }
    doc["records"] = std::move(records);
  }
  json::Value tensors = json::Value::Array();
  json::Value leaves = json::Value::Array();
  json::Value objects = json::Value::Array();
  std::map<std::string, std::pair<int64_t, uint64_t>> by_dtype;
  std::map<std::string, int64_t> by_class;
  std::set<const Value*> counted;
  uint64_t tensor_bytes = 0;
  auto visit = [&](const Value* v,
                   const torchfile::TensorPath& path) -> size_t {
    if (const TensorInfo* t = file.FindTensor(v)) {
      json::Value j;
      j["path"] = PathJson(path);
      j["dtype"] = std::string(DTypeName(t->dtype));
      j["shape"] = ShapeJson(t->shape);
      j["stride"] = ShapeJson(t->stride);
      j["storage_offset"] = t->storage_offset;
      j["nbytes"] = t->nbytes;
      j["storage_key"] = t->storage_key();
      j["storage_nbytes"] = t->storage->nbytes;
      j["device"] = t->device();
      j["requires_grad"] = t->requires_grad;
      j["is_parameter"] = t->is_parameter;
      tensors.Append(std::move(j));
      return kComponentCost * 2 * t->shape.size() + t->storage_key().size() +
             t->device().size();
    }
    json::Value j;
    j["path"] = PathJson(path);
    switch (v->kind) {
      case Kind::kNone:
      case Kind::kBool:
      case Kind::kInt:
      case Kind::kFloat:
      case Kind::kStr:
      case Kind::kBytes: {
        static const char* kTypes[] = {"NoneType", "bool", "int",
                                       "float",    "str",  "bytes"};
        j["type"] = kTypes[static_cast<int>(v->kind)];
        std::string repr = pickle::Repr(v, size_t{1} << 20);
        const size_t cost = repr.size();
        j["repr"] = std::move(repr);
        leaves.Append(std::move(j));
        return cost;
      }
      default: {
        std::string cls = ClassOf(v);
        const size_t cost = cls.size();
        j["class"] = std::move(cls);
        objects.Append(std::move(j));
        return cost;
      }
    }
  };
  const bool complete =
      !with_paths || ForEachLeaf(file.root(), visit, kLeafBudget);
  for (const TensorInfo& t : file.tensors()) {
    if (!counted.insert(t.node).second) continue;
    auto& d = by_dtype[std::string(DTypeName(t.dtype))];
    d.first += 1;
    d.second += t.nbytes;
    tensor_bytes += t.nbytes;
  }
  uint64_t storage_bytes = 0;
  for (const auto& s : file.storages()) storage_bytes += s.nbytes;
  for (const Value& node : file.arena().nodes()) {
    if (node.kind != Kind::kObject) continue;
    if (file.FindTensor(&node) != nullptr || node.IsDictLike()) continue;
    std::string cls = node.ClassName();
    if (cls.starts_with("torch._utils._rebuild") ||
        cls == "torch._tensor._rebuild_from_type_v2")
      continue;
    by_class[cls.empty() ? "?" : cls] += 1;
  }
  std::vector<std::string> suspicious = pickle::SuspiciousGlobals(file.arena());

  json::Value totals;
  totals["tensors"] = static_cast<int64_t>(counted.size());
  totals["tensor_bytes"] = tensor_bytes;
  totals["storages"] = static_cast<int64_t>(file.storages().size());
  totals["storage_bytes"] = storage_bytes;
  json::Value dt = json::Value::Object();
  for (const auto& [name, c] : by_dtype) {
    json::Value e;
    e["tensors"] = c.first;
    e["bytes"] = c.second;
    dt[name] = std::move(e);
  }
  totals["by_dtype"] = std::move(dt);
  json::Value cl = json::Value::Object();
  for (const auto& [name, c] : by_class) cl[name] = c;
  totals["objects_by_class"] = std::move(cl);
  doc["complete"] = complete;
  doc["tensors"] = std::move(tensors);
  doc["leaves"] = std::move(leaves);
  doc["objects"] = std::move(objects);
  doc["totals"] = std::move(totals);
  json::Value sus = json::Value::Array();
  for (const auto& s : suspicious) sus.Append(s);
  doc["suspicious_globals"] = std::move(sus);

  std::string text =
      StrCat("totals: ", counted.size(), " tensors, ", HumanBytes(tensor_bytes),
             " in ", file.storages().size(), " storages (",
             HumanBytes(storage_bytes), ")");
  for (const auto& [name, c] : by_dtype) {
    text +=
        StrCat("\n  ", name, ": ", c.first, " tensors, ", HumanBytes(c.second));
  }
  if (!by_class.empty()) {
    text += "\nobjects:";
    for (const auto& [name, c] : by_class)
      text += StrCat(" ", OneLine(name), " x", c, ";");
    text.pop_back();
  }
  if (suspicious.empty()) {
    text += "\nsuspicious globals: none";
  } else {
    text +=
        "\nWARNING: suspicious globals (would run code if loaded by Python's "
        "torch.load):";
    for (const auto& s : suspicious) text += StrCat(" ", OneLine(s));
  }
  return {std::move(doc), std::move(text)};
}

}  // namespace

int RunInspect(const std::vector<std::string>& args) {
  po::options_description desc(kInspectHelp);
  bool json_out = false;
  size_t max_items = 20;
  desc.add_options()("json", po::bool_switch(&json_out),
                     "print one JSON document instead of the tree")(
      "max-items", po::value<size_t>(&max_items)->default_value(20),
      "scalar items shown per list/tuple in the tree");
  po::variables_map vm;
  if (!Parse(args, desc, {"path"}, vm, /*last_repeats=*/true)) return 0;
  if (!vm.count("path"))
    throw UsageError("inspect needs a PATH (see: ucp inspect --help)");

  json::Value all_docs = json::Value::Array();
  json::Value inventories = json::Value::Array();
  json::Value errors = json::Value::Array();
  int exit_code = 0;
  // A PATH or file that fails is reported (stderr, and "errors" with --json)
  // and the others are still inspected; the exit code is the first failure's.
  auto report = [&](const std::string& path, const Error& e) {
    PrintError(e.kind(), e.what());
    if (exit_code == 0) exit_code = e.ExitCode();
    json::Value err;
    err["path"] = path;
    err["kind"] = e.kind();
    err["message"] = e.what();
    errors.Append(std::move(err));
  };
  json::Value leftovers = json::Value::Array();
  for (const std::string& arg : vm["path"].as<std::vector<std::string>>()) {
    for (const json::Value& l : ReportLeftovers(arg).items())
      leftovers.Append(l);
    // A checkpoint of a known format: its own index first, and the
    // archives each of its files holds.
    Checkpoints checkpoints([&](const json::Value& inv) {
      if (json_out) {
        inventories.Append(inv);
      } else if (const json::Value* t = inv.Find("text")) {
        std::printf("%s\n", t->AsString().c_str());
      }
    });
    const bool indexed = checkpoints.Visit(arg);
    // A checkpoint of another format that did not open: why, rather than
    // that its files are not torch.save files.
    auto report_open_error = [&]() {
      std::exception_ptr why = checkpoints.open_error();
      if (!why) return false;
      try {
        std::rethrow_exception(why);
      } catch (const Error& o) {
        report(arg, o);
      }
      return true;
    };
    std::vector<fs::path> files;
    try {
      files = ExpandPath(arg);
    } catch (const Error& e) {
      // (A checkpoint whose files are not torch.save files was shown by its
      // index alone.)
      if (!indexed && !report_open_error()) report(arg, e);
      continue;
    }
    std::error_code arg_ec;
    if (!indexed && fs::is_regular_file(arg, arg_ec) &&
        !LooksLikeTorchFile(arg) && !atoms::IsHdf5File(arg) &&
        report_open_error())
      continue;
    for (const fs::path& path : files) {
      if (indexed && !LooksLikeTorchFile(path) && !atoms::IsHdf5File(path))
        continue;
      try {
        if (atoms::IsHdf5File(path)) {
          json::Value doc = InspectUniversal(path, !json_out);
          if (json_out) all_docs.Append(std::move(doc));
          continue;
        }
        std::vector<formats::ArchiveSpan> spans = checkpoints.Archives(path);
        if (spans.empty()) spans.push_back({0, 0});
        for (const formats::ArchiveSpan& span : spans) {
          const bool whole = span.length == 0;
          const std::string name =
              whole ? path.string()
                    : StrCat(path.string(), "@", span.offset, "+", span.length);
          TorchFile file =
              whole ? TorchFile::Open(path)
                    : TorchFile::Open(path, span.offset, span.length);
          std::error_code ec;
          const uint64_t bytes = whole ? fs::file_size(path, ec) : span.length;
          Summary s = Summarise(file, bytes, json_out);
          if (json_out) {
            if (!whole) {
              s.doc["path"] = name;
              s.doc["archive_offset"] = span.offset;
              s.doc["archive_length"] = span.length;
            }
            all_docs.Append(std::move(s.doc));
          } else {
            std::string head =
                StrCat(OneLine(name), "  (",
                       file.format() == TorchFile::Format::kZip
                           ? StrCat("zip, archive '",
                                    OneLine(file.archive_name()), "'")
                           : std::string("legacy format"),
                       ", ", HumanBytes(bytes), ")");
            std::printf("%s\n", head.c_str());
            TreePrinter(file, max_items).Print(file.root(), "", 1);
            std::printf("%s\n\n", s.text.c_str());
          }
        }
      } catch (const Error& e) {
        report(path.string(), e);
      }
    }
  }
  if (json_out) {
    json::Value doc;
    doc["files"] = std::move(all_docs);
    if (!inventories.items().empty())
      doc["checkpoints"] = std::move(inventories);
    doc["errors"] = std::move(errors);
    doc["leftovers"] = std::move(leftovers);
    PrintJson(doc);
  }
  return exit_code;
}

}  // namespace ucp::cli
