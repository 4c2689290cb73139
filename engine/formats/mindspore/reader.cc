// Finding a MindSpore checkpoint and reading it into a universal SourcePlan
// (mindspore.h).

#include <algorithm>
#include <charconv>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/json/json.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

// Records that are not parameters larger than this are refused (they are
// kept verbatim, hex in a JSON attribute).
constexpr uint64_t kMaxOtherBytes = 1 << 20;

// The bytes of one .ckpt file (tensor contents at their file offsets).
class CkptSource : public reshape::ByteSource {
 public:
  explicit CkptSource(fs::path path)
      : path_(std::move(path)), file_(File::OpenRead(path_)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    file_.ReadExact(dst.data(), dst.size(), offset);
  }
  std::string Describe() const override {
    return StrCat("checkpoint file ", path_.string());
  }

 private:
  fs::path path_;
  File file_;
};

// <prefix>-<epoch>_<step>.ckpt -> (epoch, step).
std::optional<std::pair<int64_t, int64_t>> EpochStep(const std::string& name) {
  if (!name.ends_with(".ckpt")) return std::nullopt;
  const std::string stem = name.substr(0, name.size() - 5);
  const size_t dash = stem.rfind('-');
  const size_t under = stem.rfind('_');
  if (dash == std::string::npos || under == std::string::npos || under < dash)
    return std::nullopt;
  int64_t e = 0, s = 0;
  const char* b = stem.data();
  auto r1 = std::from_chars(b + dash + 1, b + under, e);
  auto r2 = std::from_chars(b + under + 1, b + stem.size(), s);
  if (r1.ec != std::errc() || r1.ptr != b + under || r2.ec != std::errc() ||
      r2.ptr != b + stem.size())
    return std::nullopt;
  return std::pair(e, s);
}

fs::path FilesFolder(const fs::path& dir) {
  std::error_code ec;
  if (fs::is_directory(dir / "rank_0", ec)) return dir / "rank_0";
  return dir;
}

std::vector<fs::path> CkptFiles(const fs::path& folder) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator it(folder, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().extension() == ".ckpt" && LooksLikeCkpt(it->path()))
      out.push_back(it->path());
  }
  std::sort(out.begin(), out.end(), [](const fs::path& a, const fs::path& b) {
    const auto x = EpochStep(a.filename().string());
    const auto y = EpochStep(b.filename().string());
    if (x && y && *x != *y) return *x < *y;
    return a.filename() < b.filename();
  });
  return out;
}

}  // namespace

std::vector<formats::SavedCheckpoint> ListCheckpoints(const fs::path& dir) {
  std::vector<formats::SavedCheckpoint> out;
  for (const fs::path& f : CkptFiles(FilesFolder(dir))) {
    formats::SavedCheckpoint c;
    c.name = f.filename().string();
    // (<epoch>_<step> counts steps of an epoch: the iteration is the
    // file's global_step, known once it is read.)
    c.selector.Set(kCheckpointOption, c.name);
    out.push_back(std::move(c));
  }
  return out;
}

Checkpoint Discover(const fs::path& path, const std::string& file) {
  std::error_code ec;
  Checkpoint c;
  if (fs::is_regular_file(path, ec)) {
    c.path = path;
    c.dir = path.parent_path();
  } else if (fs::is_directory(path, ec)) {
    if (fs::is_directory(path / "rank_1", ec)) {
      throw FormatError(path.string(),
                        ": a sharded MindSpore save (rank_0, rank_1, ...: "
                        "its parameters are split by a strategy file) is not "
                        "supported yet; merge it with transform_checkpoints, "
                        "or pass one rank's .ckpt file");
    }
    const fs::path folder = FilesFolder(path);
    const std::vector<fs::path> files = CkptFiles(folder);
    c.dir = path;
    if (!file.empty()) {
      for (const fs::path& f : files)
        if (f.filename() == file) c.path = f;
      if (c.path.empty()) {
        std::string have;
        for (const fs::path& f : files)
          have += (have.empty() ? "" : ", ") + f.filename().string();
        throw UsageError("--checkpoint ", file, ": no such .ckpt file in ",
                         folder.string(),
                         " (files: ", have.empty() ? "none" : have, ")");
      }
    } else if (fs::exists(folder / "meta.json", ec)) {
      // MindFormers' record of its last save.
      const json::Value meta =
          json::Value::Parse(ReadSmallFile(folder / "meta.json", 1 << 20));
      const json::Value* last = meta.Find("last_ckpt_file");
      if (last == nullptr || !last->is_string())
        throw FormatError((folder / "meta.json").string(),
                          ": no last_ckpt_file");
      c.path = folder / last->AsString();
      if (!fs::is_regular_file(c.path, ec)) {
        throw FormatError((folder / "meta.json").string(), ": names ",
                          last->AsString(), ", which is missing");
      }
    } else if (!files.empty()) {
      c.path = files.back();
    } else {
      throw FormatError(path.string(), ": no MindSpore .ckpt file");
    }
  } else {
    throw IoError("checkpoint ", path.string(), " does not exist");
  }
  c.index = ReadCkptIndex(c.path);
  if (auto es = EpochStep(c.path.filename().string())) c.iteration = es->second;
  // The optimizer's global_step, when saved, is the iteration.
  for (const CkptEntry& e : c.index.entries) {
    if (e.tag != "global_step" || e.slices.size() != 1) continue;
    const File f = File::OpenRead(c.path);
    if (e.tensor_type == "Int32" && e.nbytes == 4) {
      int32_t x = 0;
      f.ReadExact(&x, 4, e.slices[0].offset);
      c.iteration = x;
    } else if (e.tensor_type == "Int64" && e.nbytes == 8) {
      f.ReadExact(&c.iteration, 8, e.slices[0].offset);
    }
  }
  return c;
}

universal::SourcePlan PlanSource(const Checkpoint& c) {
  universal::SourcePlan plan;
  plan.sources.push_back(std::make_unique<CkptSource>(c.path));
  const std::string where0 = StrCat("checkpoint file ", c.path.string());
  // Which tags are parameters and which are Adam moments of one.
  std::set<std::string> tags;
  for (const CkptEntry& e : c.index.entries) tags.insert(e.tag);
  static const std::pair<const char*, const char*> kMoments[] = {
      {"moment1.", "exp_avg"},
      {"moment2.", "exp_avg_sq"},
      {"adam_m.", "exp_avg"},
      {"adam_v.", "exp_avg_sq"}};
  auto moment_of = [&](const std::string& tag)
      -> std::optional<std::pair<std::string, std::string>> {
    for (const auto& [prefix, kind] : kMoments) {
      if (tag.starts_with(prefix) &&
          tags.count(tag.substr(std::strlen(prefix))))
        return std::pair(tag.substr(std::strlen(prefix)), std::string(kind));
    }
    return std::nullopt;
  };
  std::set<std::string> with_moments;
  for (const CkptEntry& e : c.index.entries)
    if (auto m = moment_of(e.tag)) with_moments.insert(m->first);
  const bool has_optimizer = !with_moments.empty();
  static const std::set<std::string> kOptimizerScalars = {
      "global_step",
      "learning_rate",
      "beta1_power",
      "beta2_power",
      "current_iterator_step",
      "last_overflow_iterator_step",
      "scale_sense",
      "epoch_num",
      "step_num",
      "loss_scale",
      "global_batch_size"};

  json::Value others = json::Value::Array();
  json::Value param_order = json::Value::Array();
  json::Value group_params = json::Value::Array();
  DType model_dtype = DType::kFloat32;
  bool model_dtype_known = false;
  int64_t order = 0;
  std::map<std::string, size_t> atom_of;
  auto plan_atom = [&](const CkptEntry& e, DType dtype,
                       const std::string& param, const std::string& kind) {
    const std::string where = StrCat(where0, " > ", e.tag);
    universal::AtomPlan atom;
    atom.param = param;
    atom.state_kind = kind;
    atom.dtype = dtype;
    const bool scalar =
        e.dims.empty() || (e.dims.size() == 1 && e.dims[0] == 0);
    atom.shape = scalar ? Shape{} : Shape(e.dims.begin(), e.dims.end());
    const uint64_t want =
        static_cast<uint64_t>(NumElements(atom.shape)) * ElementSize(dtype);
    if (e.nbytes != want) {
      throw FormatError(where, ": ", e.nbytes, " bytes of content, ",
                        ShapeString(atom.shape), " ", e.tensor_type, " needs ",
                        want);
    }
    // Slices split dim 0 into whole rows.
    const uint64_t row = atom.shape.empty() || atom.shape[0] == 0
                             ? want
                             : want / static_cast<uint64_t>(atom.shape[0]);
    int64_t at = 0;
    for (const CkptSlice& s : e.slices) {
      if (s.length == 0) continue;
      if (atom.shape.empty() ? e.slices.size() != 1 : s.length % row != 0) {
        throw FormatError(where, ": a slice of ", s.length,
                          " bytes is not whole rows of ", row,
                          " (byte-sliced tensors are not supported)");
      }
      universal::Fragment f;
      Shape shape = atom.shape;
      if (!shape.empty()) shape[0] = static_cast<int64_t>(s.length / row);
      f.src = reshape::SourceTensor{0, s.offset, dtype, shape};
      f.src_box = Box::Whole(shape);
      Box box = Box::Whole(shape);
      if (!box.offset.empty()) box.offset[0] = at;
      f.atom_box = box;
      f.where = where;
      if (!shape.empty()) at += shape[0];
      atom.fragments.push_back(std::move(f));
    }
    atom_of[param + "/" + kind] = plan.atoms.size();
    plan.atoms.push_back(std::move(atom));
  };
  // Parameters first, in file order; then their moments.
  for (const CkptEntry& e : c.index.entries) {
    if (e.map_tensor || moment_of(e.tag) || kOptimizerScalars.count(e.tag))
      continue;
    const std::optional<DType> dtype = DTypeOfTensorType(e.tensor_type);
    if (!dtype) continue;  // kept verbatim below
    const bool trainable = !has_optimizer || with_moments.count(e.tag) > 0;
    const bool floating =
        *dtype == DType::kFloat32 || *dtype == DType::kFloat16 ||
        *dtype == DType::kBFloat16 || *dtype == DType::kFloat64;
    const bool buffer = !trainable || !floating;
    plan_atom(e, *dtype, e.tag,
              *dtype == DType::kFloat32 && !buffer ? "fp32" : "param");
    if (trainable && floating && !model_dtype_known) {
      model_dtype = *dtype;
      model_dtype_known = true;
    }
    param_order.Append(e.tag);
    if (!buffer) group_params.Append(e.tag);
    plan.params.push_back(formats::ParamRow({.fqn = e.tag,
                                             .shape = plan.atoms.back().shape,
                                             .dtype = *dtype,
                                             .rule = "mindspore",
                                             .buffer = buffer,
                                             .group = buffer ? -1 : 0,
                                             .order = order++,
                                             .frozen = false,
                                             .tied_copies = {}}));
  }
  std::set<std::string> state_kinds;
  for (const CkptEntry& e : c.index.entries) {
    const auto m = moment_of(e.tag);
    if (!m) continue;
    const std::optional<DType> dtype = DTypeOfTensorType(e.tensor_type);
    if (!dtype || atom_of.count(m->first + "/" + m->second)) {
      throw FormatError(where0, " > ", e.tag, ": ",
                        dtype ? "a second " + m->second + " of " + m->first
                              : "tensor type " + e.tensor_type);
    }
    plan_atom(e, *dtype, m->first, m->second);
    state_kinds.insert(m->second);
  }
  // Everything else verbatim: tag, type, dims, content (read through the
  // plan's source of the file).
  const reshape::ByteSource& file = *plan.sources.front();
  for (const CkptEntry& e : c.index.entries) {
    const bool tensor = DTypeOfTensorType(e.tensor_type).has_value();
    if (!e.map_tensor && tensor && !kOptimizerScalars.count(e.tag)) continue;
    if (e.map_tensor) {
      throw FormatError(where0, " > ", e.tag,
                        ": a map tensor (MapParameter): not supported");
    }
    if (e.nbytes > kMaxOtherBytes) {
      throw FormatError(where0, " > ", e.tag, ": a ", e.tensor_type,
                        " record of ", e.nbytes,
                        " bytes that is no parameter: not supported");
    }
    std::string bytes;
    for (const CkptSlice& s : e.slices) {
      const size_t at = bytes.size();
      bytes.resize(at + s.length);
      file.Read(s.offset,
                std::as_writable_bytes(std::span(bytes.data() + at, s.length)));
    }
    json::Value j = json::Value::Object();
    j["tag"] = e.tag;
    j["type"] = e.tensor_type;
    json::Value dims = json::Value::Array();
    for (int64_t d : e.dims) dims.Append(d);
    j["dims"] = std::move(dims);
    static const char* kHex = "0123456789abcdef";
    std::string hex;
    for (unsigned char ch : bytes) {
      hex.push_back(kHex[ch >> 4]);
      hex.push_back(kHex[ch & 15]);
    }
    j["hex"] = hex;
    others.Append(std::move(j));
  }
  if (plan.params.empty())
    throw FormatError(where0, ": no parameter tensor in it");

  atoms::RootInfo& root = plan.root;
  root.iteration = c.iteration;  // global_step (Discover), else the name's
  root.consumed_samples = -1;
  json::Value src = json::Value::Object();
  src["framework"] = "mindspore";
  src["driver"] = "mindspore";
  src["tp"] = 1;
  src["pp"] = 1;
  src["vpp"] = 1;
  src["dp"] = 1;
  src["dtype"] = std::string(DTypeName(model_dtype));
  src["checkpoint"] = c.path.filename().string();
  root.source = src.Dump();
  root.model = "{}";
  root.layout = "";
  root.args = "{}";
  json::Value opt = json::Value::Object();
  opt["type"] = "mindspore.nn.Adam";
  json::Value groups = json::Value::Array();
  json::Value g = json::Value::Object();
  g["params"] = std::move(group_params);
  groups.Append(std::move(g));
  opt["groups"] = std::move(groups);
  json::Value kinds = json::Value::Array();
  for (const std::string& k : state_kinds) kinds.Append(k);
  opt["state_kinds"] = std::move(kinds);
  opt["step"] = root.iteration;
  root.optimizer = has_optimizer ? opt.Dump() : std::string("{}");
  root.scheduler = "{}";
  json::Value training = json::Value::Object();
  training["dtype"] = std::string(DTypeName(model_dtype));
  training["step"] = root.iteration;
  training["frozen"] = json::Value::Array();
  training["shared"] = json::Value::Object();
  training["param_order"] = std::move(param_order);
  root.training = training.Dump();
  json::Value meta = json::Value::Object();
  meta["records"] = std::move(others);
  // The file's record order and moment names, which a rewrite keeps.
  json::Value tag_order = json::Value::Array();
  std::string m1 = "moment1.", m2 = "moment2.";
  for (const CkptEntry& e : c.index.entries) {
    tag_order.Append(e.tag);
    if (e.tag.starts_with("adam_m.") && moment_of(e.tag)) m1 = "adam_m.";
    if (e.tag.starts_with("adam_v.") && moment_of(e.tag)) m2 = "adam_v.";
  }
  meta["order"] = std::move(tag_order);
  meta["exp_avg_prefix"] = m1;
  meta["exp_avg_sq_prefix"] = m2;
  meta["file"] = c.path.filename().string();
  meta["rank_folder"] = c.path.parent_path().filename() == "rank_0";
  meta["crc"] = c.index.crc;
  root.extra_strings[kMetaAttr] = meta.Dump();
  return plan;
}

}  // namespace ucp::mindspore
