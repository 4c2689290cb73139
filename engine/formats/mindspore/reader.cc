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
#include "engine/formats/common/train_state.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/formats/mindspore/records.h"
#include "engine/json/json.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

// Records that are not parameters larger than this are refused (they are
// kept verbatim, hex in a JSON attribute).
constexpr uint64_t kMaxOtherBytes = 1 << 20;
// Map tensors (MapParameter) are kept opaque, in memory while read.
constexpr uint64_t kMaxMapBytes = 256 << 20;

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

// <prefix>-<epoch>_<step>.ckpt (or .safetensors) -> (epoch, step).
std::optional<std::pair<int64_t, int64_t>> EpochStep(const std::string& name) {
  const fs::path p(name);
  if (!IsCheckpointFileName(p)) return std::nullopt;
  const std::string stem = p.stem().string();
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
    if (IsCheckpointFileName(it->path()) && LooksLikeCheckpointFile(it->path()))
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

// The rank_K folders of a sharded save: rank_0 .. rank_{N-1} (N >= 2), or
// empty if `dir` is not one.
std::vector<fs::path> RankFolders(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  while (fs::is_directory(dir / StrCat("rank_", out.size()), ec))
    out.push_back(dir / StrCat("rank_", out.size()));
  return out;
}

using Step = std::pair<int64_t, int64_t>;  // (epoch, step)

// Of every rank folder, the files by (epoch, step); the steps all have.
std::vector<Step> CommonSteps(const std::vector<fs::path>& ranks) {
  std::vector<Step> common;
  for (size_t r = 0; r < ranks.size(); ++r) {
    std::set<Step> have;
    for (const fs::path& f : CkptFiles(ranks[r]))
      if (auto es = EpochStep(f.filename().string())) have.insert(*es);
    if (r == 0) {
      common.assign(have.begin(), have.end());
    } else {
      std::erase_if(common, [&](const Step& s) { return !have.count(s); });
    }
  }
  return common;
}

// The file of `step` in rank folder `folder`: the one whose name is rank
// 0's `name0` with rank_0 -> rank_<r>, else the first of that step.
std::optional<fs::path> FileOfStep(const fs::path& folder, size_t r,
                                   const std::string& name0, const Step& step) {
  std::optional<fs::path> first;
  std::string want = name0;
  if (const size_t at = want.find("rank_0"); at != std::string::npos)
    want.replace(at, 6, StrCat("rank_", r));
  for (const fs::path& f : CkptFiles(folder)) {
    if (EpochStep(f.filename().string()) != step) continue;
    if (f.filename() == want) return f;
    if (!first) first = f;
  }
  return first;
}

}  // namespace

std::vector<formats::SavedCheckpoint> ListCheckpoints(const fs::path& dir) {
  std::vector<formats::SavedCheckpoint> out;
  // A Checkpoint 2.0 save folder: its iteration_N/ folders.
  for (const auto& [n, it] : Checkpoint2Iterations(dir)) {
    formats::SavedCheckpoint c;
    c.name = it.filename().string();
    c.iteration = n;
    c.selector.Set(kCheckpointOption, c.name);
    out.push_back(std::move(c));
  }
  if (!out.empty()) return out;
  const std::vector<fs::path> ranks = RankFolders(dir);
  std::vector<fs::path> files;
  if (ranks.size() >= 2) {
    for (const Step& s : CommonSteps(ranks))
      if (auto f = FileOfStep(ranks[0], 0, "", s)) files.push_back(*f);
    if (files.empty()) {  // names without <epoch>_<step>: one file each
      bool one = true;
      for (const fs::path& r : ranks) one = one && CkptFiles(r).size() == 1;
      if (one) files = CkptFiles(ranks[0]);
    }
  } else {
    files = CkptFiles(FilesFolder(dir));
  }
  for (const fs::path& f : files) {
    formats::SavedCheckpoint c;
    c.name = f.filename().string();
    // (<epoch>_<step> counts steps of an epoch: the iteration is the
    // file's global_step, known once it is read.)
    c.selector.Set(kCheckpointOption, c.name);
    out.push_back(std::move(c));
  }
  return out;
}

bool LooksSharded(const fs::path& dir) {
  const std::vector<fs::path> ranks = RankFolders(dir);
  return ranks.size() >= 2 && !CkptFiles(ranks[0]).empty();
}

namespace {

// The strategy of sharded save `dir`: `given`, else the first found of
// strategy.ckpt, strategy.json, strategy/ and ../strategy/.
Strategy FindStrategy(const fs::path& dir, const std::string& given) {
  if (!given.empty()) return ReadStrategy(given);
  std::error_code ec;
  const fs::path abs = fs::absolute(dir, ec);
  for (const fs::path& p : {dir / "strategy.ckpt", dir / "strategy.json",
                            dir / "strategy", abs.parent_path() / "strategy"}) {
    if (fs::exists(p, ec)) return ReadStrategy(p);
  }
  throw FormatError(dir.string(),
                    ": a sharded MindSpore save (rank_0, rank_1, ...) needs "
                    "its strategy file, and none is beside it "
                    "(strategy.ckpt, strategy/, ../strategy/): pass "
                    "--strategy FILE (the merged strategy, or the folder of "
                    "per-rank ones)");
}

// A meta.json's (last_epoch, last_step); absent if it has none.
std::optional<Step> MetaStep(const fs::path& folder) {
  std::error_code ec;
  if (!fs::exists(folder / "meta.json", ec)) return std::nullopt;
  const json::Value meta =
      json::Value::Parse(ReadSmallFile(folder / "meta.json", 1 << 20));
  const json::Value* e = meta.Find("last_epoch");
  const json::Value* s = meta.Find("last_step");
  if (e == nullptr || s == nullptr || !e->is_number() || !s->is_number())
    throw FormatError((folder / "meta.json").string(),
                      ": no last_epoch / last_step");
  return Step(e->AsInt(), s->AsInt());
}

// Rank by rank, the files of one step of sharded save `dir`.
std::vector<fs::path> ShardFiles(const fs::path& dir,
                                 const std::vector<fs::path>& ranks,
                                 const std::string& file) {
  std::vector<fs::path> out;
  const std::vector<fs::path> files0 = CkptFiles(ranks[0]);
  std::optional<Step> step;
  std::string name0;
  if (!file.empty()) {
    for (const fs::path& f : files0)
      if (f.filename() == file) name0 = file;
    if (name0.empty()) {
      std::string have;
      for (const fs::path& f : files0)
        have += (have.empty() ? "" : ", ") + f.filename().string();
      throw UsageError("--checkpoint ", file, ": no such .ckpt file in ",
                       ranks[0].string(),
                       " (files: ", have.empty() ? "none" : have, ")");
    }
    step = EpochStep(name0);
  } else {
    // MindFormers' rule: the newest step every rank has, not newer than
    // the oldest any rank's meta.json claims.
    std::optional<Step> limit;
    for (const fs::path& r : ranks) {
      if (auto m = MetaStep(r)) limit = limit ? std::min(*limit, *m) : *m;
    }
    const std::vector<Step> common = CommonSteps(ranks);
    for (const Step& s : common)
      if (!limit || s <= *limit) step = s;
    if (!step) {
      for (const fs::path& r : ranks) {
        const std::vector<fs::path> fs_ = CkptFiles(r);
        if (fs_.empty())
          throw FormatError(r.string(), ": no MindSpore .ckpt file");
        if (!common.empty() || fs_.size() != 1) {
          throw FormatError(
              dir.string(),
              ": no <epoch>_<step> that every rank folder has "
              "a .ckpt file of",
              limit ? " (up to the step the meta.json files name)" : "");
        }
        out.push_back(fs_.back());
      }
      return out;
    }
  }
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (r == 0 && !name0.empty()) {
      out.push_back(ranks[0] / name0);
      continue;
    }
    std::optional<fs::path> f;
    if (step) {
      f = FileOfStep(ranks[r], r, name0, *step);
    } else {  // no step in the name: the rank's only file
      const std::vector<fs::path> fs_ = CkptFiles(ranks[r]);
      if (fs_.size() == 1) f = fs_[0];
    }
    if (!f) {
      throw FormatError(
          ranks[r].string(), ": no .ckpt file of ",
          step ? StrCat("epoch ", step->first, " step ", step->second)
               : StrCat("the step of ", name0),
          " (a rank's save is missing)");
    }
    out.push_back(*f);
  }
  return out;
}

// A scalar integer record of `index` (append_dict's ints are Int64,
// nn.Adam's global_step Int32), read from `f`; absent if there is none.
std::optional<int64_t> IntRecord(const CkptIndex& index, const File& f,
                                 std::string_view tag) {
  for (const CkptEntry& e : index.entries) {
    if (e.tag != tag || e.slices.size() != 1) continue;
    if (e.tensor_type == "Int32" && e.nbytes == 4) {
      int32_t x = 0;
      f.ReadExact(&x, 4, e.slices[0].offset);
      return x;
    }
    if (e.tensor_type == "Int64" && e.nbytes == 8) {
      int64_t x = 0;
      f.ReadExact(&x, 8, e.slices[0].offset);
      return x;
    }
  }
  return std::nullopt;
}

// The iteration: the optimizer's global_step, else MindFormers' step_num,
// else `fallback` (the step in the file name); the samples consumed:
// step_num x global_batch_size when both are saved (MindFormers'
// append_dict), as its data-skip scaling computes them.
void Counters(Checkpoint& c, int64_t fallback) {
  const File f = File::OpenRead(c.index.path);
  const auto global_step = IntRecord(c.index, f, "global_step");
  const auto step_num = IntRecord(c.index, f, "step_num");
  const auto batch = IntRecord(c.index, f, "global_batch_size");
  c.iteration = global_step ? *global_step : step_num ? *step_num : fallback;
  c.consumed_samples = step_num && batch && *step_num >= 0 && *batch > 0
                           ? *step_num * *batch
                           : -1;
}

// A float32 scalar record of `index` (nn.Adam's learning_rate, beta1_power,
// beta2_power: 0-d, or of one element), read from `f`; absent if none.
std::optional<float> FloatRecord(const CkptIndex& index, const File& f,
                                 std::string_view tag) {
  for (const CkptEntry& e : index.entries) {
    if (e.tag != tag || e.slices.size() != 1 || e.map_tensor) continue;
    if (e.tensor_type != "Float32" || e.nbytes != 4) return std::nullopt;
    float x = 0;
    f.ReadExact(&x, 4, e.slices[0].offset);
    return x;
  }
  return std::nullopt;
}

// The hyper-parameters of nn.Adam that its records tell, into its group
// object `g`: lr (a fixed learning_rate, as the shortest decimal of its
// float32) and the betas, derived from
// beta1_power / beta2_power (beta^step in float32) and the step. eps and
// weight_decay are not saved.
void AdamHyperparams(const CkptIndex& index, int64_t step,
                     universal::ParamGroup& g) {
  const File f = File::OpenRead(index.path);
  if (auto lr = FloatRecord(index, f, "learning_rate"))
    g.lr = formats::ShortestDecimal(*lr);
  const auto p1 = FloatRecord(index, f, "beta1_power");
  const auto p2 = FloatRecord(index, f, "beta2_power");
  const auto b1 = p1 ? formats::BetaOfPower(*p1, step) : std::nullopt;
  const auto b2 = p2 ? formats::BetaOfPower(*p2, step) : std::nullopt;
  if (b1 && b2) g.betas = {*b1, *b2};
}

}  // namespace

Checkpoint Discover(const fs::path& path, const std::string& file,
                    const std::string& strategy) {
  std::error_code ec;
  Checkpoint c;
  if (fs::is_regular_file(path, ec)) {
    if (!strategy.empty()) {
      throw UsageError(
          "--strategy reads a sharded save (a folder of rank_0, "
          "rank_1, ...), not one file: ",
          path.string());
    }
    c.path = path;
    c.dir = path.parent_path();
  } else if (fs::is_directory(path, ec)) {
    // A MindFormers Checkpoint 2.0 folder (iteration_N/ or its save
    // folder; --checkpoint names an iteration folder of it).
    std::optional<fs::path> v2;
    if (const std::vector<std::pair<int64_t, fs::path>> its =
            Checkpoint2Iterations(path);
        !its.empty() && !file.empty()) {
      for (const auto& [n, p] : its)
        if (p.filename() == file) v2 = p;
      if (!v2) {
        std::string have;
        for (const auto& [n, p] : its)
          have += (have.empty() ? "" : ", ") + p.filename().string();
        throw UsageError("--checkpoint ", file,
                         ": no such iteration folder in ", path.string(),
                         " (folders: ", have, ")");
      }
    } else {
      v2 = Checkpoint2Dir(path);
    }
    if (v2) {
      if (!strategy.empty()) {
        throw UsageError("--strategy: ", v2->string(),
                         " is a Checkpoint 2.0 folder, whose metadata.json "
                         "places every rank's slices");
      }
      c.dir = path;
      c.v2 = ReadCheckpoint2(*v2);
      c.index = c.v2->files[0];
      c.path = c.index.path;
      c.iteration = c.v2->iteration;
      c.consumed_samples = c.v2->consumed_samples;
      return c;
    }
    const std::vector<fs::path> ranks = RankFolders(path);
    if (ranks.size() >= 2 ||
        (!strategy.empty() && fs::is_directory(path / "rank_0", ec))) {
      c.dir = path;
      std::vector<fs::path> files = ranks.size() >= 2
                                        ? ShardFiles(path, ranks, file)
                                        : std::vector<fs::path>{};
      if (files.empty()) {  // rank_0 alone, with a strategy
        const Checkpoint one = Discover(path, file);
        files.push_back(one.path);
      }
      c.strategy = FindStrategy(path, strategy);
      if (c.strategy->world() != static_cast<int64_t>(files.size())) {
        throw FormatError(path.string(), ": ", files.size(),
                          " rank folders, but the strategy ",
                          c.strategy->path.string(), " lays out ",
                          c.strategy->world(), " ranks (", c.strategy->stages,
                          " stage(s) of ", c.strategy->stage_devices, ")");
      }
      for (const fs::path& f : files) c.ranks.push_back(ReadCheckpointFile(f));
      c.index = c.ranks[0];
      c.path = files[0];
      const auto es = EpochStep(c.path.filename().string());
      Counters(c, es ? es->second : 0);
      return c;
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
        throw UsageError("--checkpoint ", file, ": no such checkpoint file in ",
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
      // Files of those names that are not MindSpore's: said, not skipped
      // silently (a damaged file, or another framework's).
      std::string foreign;
      for (fs::directory_iterator it(folder, ec), end; !ec && it != end;
           it.increment(ec)) {
        if (IsCheckpointFileName(it->path())) {
          foreign = StrCat(" (", it->path().string(),
                           !IsSafetensorsName(it->path())
                               ? " is no Checkpoint record stream)"
                               : " has no MindSpore safetensors header: "
                                 "__metadata__ format \"ms\")");
          break;
        }
      }
      throw FormatError(path.string(),
                        ": no MindSpore .ckpt or .safetensors file", foreign);
    }
  } else {
    throw IoError("checkpoint ", path.string(), " does not exist");
  }
  c.index = ReadCheckpointFile(c.path);
  const auto es = EpochStep(c.path.filename().string());
  Counters(c, es ? es->second : 0);
  return c;
}

std::vector<const CkptIndex*> Files(const Checkpoint& c) {
  std::vector<const CkptIndex*> files;
  if (c.v2) {
    for (const CkptIndex& i : c.v2->files) files.push_back(&i);
  } else if (c.strategy) {
    for (const CkptIndex& i : c.ranks) files.push_back(&i);
  } else {
    files.push_back(&c.index);
  }
  return files;
}

json::Value Inventory(const Checkpoint& c) {
  const std::vector<const CkptIndex*> files = Files(c);
  struct Row {
    const CkptEntry* first = nullptr;
    std::vector<size_t> ranks;
    uint64_t bytes = 0;
  };
  std::vector<std::string> order;
  std::map<std::string, Row> rows;
  for (size_t r = 0; r < files.size(); ++r) {
    for (const CkptEntry& e : files[r]->entries) {
      Row& row = rows[e.tag];
      if (row.first == nullptr) {
        row.first = &e;
        order.push_back(e.tag);
      }
      row.ranks.push_back(r);
      row.bytes += e.nbytes;
    }
  }
  json::Value j = json::Value::Object();
  const fs::path shown = c.v2 ? c.v2->iter_dir : c.strategy ? c.dir : c.path;
  j["format"] = "mindspore";
  j["path"] = shown.string();
  j["ranks"] = c.v2 ? c.v2->world : static_cast<int64_t>(files.size());
  if (c.strategy) j["strategy"] = c.strategy->path.string();
  j["container"] = c.v2                        ? "Checkpoint 2.0"
                   : IsSafetensorsName(c.path) ? "safetensors"
                                               : "ckpt";
  j["iteration"] = c.iteration;
  std::string text = StrCat(
      shown.string(),
      c.v2 ? StrCat("  (MindFormers Checkpoint 2.0, ", files.size(),
                    " safetensors files of ", c.v2->world, " ranks, ")
      : IsSafetensorsName(c.path) ? std::string("  (MindSpore safetensors, ")
                                  : std::string("  (MindSpore .ckpt, "),
      order.size(), " records",
      c.strategy ? StrCat(", ", files.size(), " ranks laid out by ",
                          c.strategy->path.string())
                 : std::string(),
      c.index.crc ? ", CRC trailer checked" : "", ")\n");
  json::Value records = json::Value::Array();
  for (const std::string& tag : order) {
    const Row& row = rows.at(tag);
    const CkptEntry& e = *row.first;
    json::Value x = json::Value::Object();
    x["tag"] = tag;
    x["type"] = e.map_tensor ? std::string("map tensor") : e.tensor_type;
    json::Value dims = json::Value::Array();
    for (int64_t d : e.dims) dims.Append(d);
    x["dims"] = std::move(dims);
    x["bytes"] = row.bytes;
    json::Value ranks = json::Value::Array();
    for (size_t r : row.ranks) ranks.Append(static_cast<int64_t>(r));
    x["ranks"] = std::move(ranks);
    if (e.slices.size() > 1)
      x["slices"] = static_cast<int64_t>(e.slices.size());
    text += StrCat("  ", tag, "  ",
                   e.map_tensor ? std::string("map tensor") : e.tensor_type,
                   e.map_tensor ? std::string() : " " + ShapeString(e.dims),
                   "  ", row.bytes, " B");
    if (c.strategy) {
      text += row.ranks.size() == files.size()
                  ? std::string("  (every rank)")
                  : StrCat("  (", row.ranks.size(), " of ", files.size(),
                           " ranks)");
    }
    text += "\n";
    records.Append(std::move(x));
  }
  j["records"] = std::move(records);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  j["text"] = text;
  return j;
}

std::optional<std::pair<std::string, std::string>> RecordIndex::Moment(
    const std::string& tag) const {
  return MomentOf(tag, [&](std::string_view param) {
    return held.count(std::string(param)) > 0;
  });
}

RecordIndex IndexRecords(std::span<const CkptIndex* const> files) {
  RecordIndex x;
  for (size_t r = 0; r < files.size(); ++r) {
    for (const CkptEntry& e : files[r]->entries) {
      auto& h = x.held[e.tag];
      if (h.empty()) x.entries.push_back(&e);
      h.push_back({r, &e});
    }
  }
  for (const CkptEntry* e : x.entries)
    if (auto m = x.Moment(e->tag)) x.with_moments.insert(m->first);
  return x;
}

std::vector<RecordRole> ClassifyRecords(const RecordIndex& index) {
  static const std::set<std::string, std::less<>> kOptimizerScalars = {
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
  std::vector<RecordRole> roles;
  for (const CkptEntry* e : index.entries) {
    RecordRole r;
    r.dtype = DTypeOfTensorType(e->tensor_type);
    const bool scalar = kOptimizerScalars.count(e->tag) > 0;
    r.verbatim = e->map_tensor || !r.dtype || scalar;
    if (auto m = index.Moment(e->tag)) {
      r.kind = RecordRole::kMoment;
      r.param = std::move(m->first);
      r.state_kind = std::move(m->second);
    } else if (!e->map_tensor && !scalar && r.dtype) {
      const DType d = *r.dtype;
      const bool trainable =
          !index.has_optimizer() || index.with_moments.count(e->tag) > 0;
      const bool floating = d == DType::kFloat32 || d == DType::kFloat16 ||
                            d == DType::kBFloat16 || d == DType::kFloat64;
      r.kind = RecordRole::kParam;
      r.param = e->tag;
      r.buffer = !trainable || !floating;
      r.state_kind = d == DType::kFloat32 && !r.buffer ? "fp32" : "param";
    }
    roles.push_back(std::move(r));
  }
  return roles;
}

namespace {

// The atoms of a checkpoint's params and moments, one from every rank's
// record of a tag: each rank's slice placed by the strategy's layout of the
// tag (else of its param, whose shape a moment has) or by a Checkpoint
// 2.0's metadata.json, the record's own slices (save_checkpoint's, along
// dim 0) inside it.
class AtomPlanner {
 public:
  AtomPlanner(const Checkpoint& c, std::span<const CkptIndex* const> files,
              const RecordIndex& records, universal::SourcePlan& plan)
      : c_(c), files_(files), records_(records), plan_(plan) {}

  // Plans the atom (`param`, `kind`) of the records of `tag`.
  void Add(const std::string& tag, DType dtype, const std::string& param,
           const std::string& kind) {
    universal::AtomPlan atom;
    atom.param = param;
    atom.state_kind = kind;
    atom.dtype = dtype;
    bool first = true;
    for (const RecordIndex::Held& h : records_.held.at(tag)) {
      const CkptEntry& e = *h.entry;
      const std::string where =
          StrCat("checkpoint file ", files_[h.rank]->path.string(), " > ", tag);
      if (DTypeOfTensorType(e.tensor_type) != dtype) {
        throw FormatError(where, ": tensor type ", e.tensor_type, ", rank 0's ",
                          TensorTypeOf(dtype));
      }
      const bool scalar =
          e.dims.empty() || (e.dims.size() == 1 && e.dims[0] == 0);
      const Shape local =
          scalar ? Shape{} : Shape(e.dims.begin(), e.dims.end());
      const uint64_t want =
          static_cast<uint64_t>(NumElements(local)) * ElementSize(dtype);
      if (e.nbytes != want) {
        throw FormatError(where, ": ", e.nbytes, " bytes of content, ",
                          ShapeString(local), " ", e.tensor_type, " needs ",
                          want);
      }
      const Box at_box =
          SliceBox(h.rank, tag, param, local, where, first, atom.shape);
      first = false;
      AddFragments(e, h.rank, local, want, at_box, where, atom);
    }
    has_[param + "/" + kind] = plan_.atoms.size();
    plan_.atoms.push_back(std::move(atom));
  }

  // Whether the atom (`param`, `kind`) is planned.
  bool Has(const std::string& param, const std::string& kind) const {
    return has_.count(param + "/" + kind) > 0;
  }

 private:
  // Where rank `rank`'s slice `local` of `tag` lies in the whole atom, whose
  // shape it sets (`first`) or must agree with.
  Box SliceBox(size_t rank, const std::string& tag, const std::string& param,
               const Shape& local, const std::string& where, bool first,
               Shape& atom_shape) const {
    const TensorLayout* layout = nullptr;
    if (c_.strategy && !local.empty()) {
      const auto r = static_cast<int64_t>(rank);
      layout = c_.strategy->Find(tag, r);
      // A moment the strategy does not name is whole (MindSpore's rule),
      // unless its shape says it is sliced as its param is.
      const auto w = has_.find(param + "/fp32");
      const auto p = w != has_.end() ? w : has_.find(param + "/param");
      if (layout == nullptr && tag != param && p != has_.end() &&
          plan_.atoms[p->second].shape != local)
        layout = c_.strategy->Find(param, r);
    }
    // Checkpoint 2.0: the file's slice where metadata.json places it.
    const Placed* placed = nullptr;
    if (c_.v2 && !local.empty()) {
      auto it = c_.v2->placed.find({rank, tag});
      if (it != c_.v2->placed.end()) placed = &it->second;
    }
    Shape full = local;
    if (placed != nullptr) {
      full = Shape(placed->global_shape.begin(), placed->global_shape.end());
      bool inside = full.size() == local.size();
      for (size_t d = 0; inside && d < full.size(); ++d)
        inside = placed->offset[d] + local[d] <= full[d];
      if (!inside) {
        throw FormatError(where, ": a slice of ", ShapeString(local),
                          " that metadata.json places outside ",
                          ShapeString(full));
      }
    } else if (layout != nullptr) {
      const std::vector<int64_t> counts =
          SplitCounts(*layout, local.size(), where);
      for (size_t d = 0; d < full.size(); ++d) full[d] *= counts[d];
    }
    if (first) {
      atom_shape = full;
    } else if (full != atom_shape) {
      throw FormatError(where, ": a slice of ", ShapeString(local),
                        " makes the parameter ", ShapeString(full),
                        ", another rank's makes it ", ShapeString(atom_shape));
    }
    const Box at_box =
        placed != nullptr
            ? Box{Shape(placed->offset.begin(), placed->offset.end()), local}
        : layout != nullptr
            ? RankBox(*layout, full, static_cast<int64_t>(rank), where)
            : Box::Whole(full);
    if (at_box.size != local) {
      throw FormatError(where, ": a slice of ", ShapeString(local),
                        " where the strategy places ", ShapeString(at_box.size),
                        " on rank ", rank);
    }
    return at_box;
  }

  // The fragments of record `e` (its slices split dim 0 into whole rows),
  // at `at_box` of the atom.
  static void AddFragments(const CkptEntry& e, size_t rank, const Shape& local,
                           uint64_t want, const Box& at_box,
                           const std::string& where,
                           universal::AtomPlan& atom) {
    const DType dtype = atom.dtype;
    const uint64_t row = local.empty() || local[0] == 0
                             ? want
                             : want / static_cast<uint64_t>(local[0]);
    int64_t at = 0;
    for (const CkptSlice& s : e.slices) {
      if (s.length == 0) continue;
      if (local.empty() ? e.slices.size() != 1 : s.length % row != 0) {
        throw FormatError(where, ": a slice of ", s.length,
                          " bytes is not whole rows of ", row,
                          " (byte-sliced tensors are not supported)");
      }
      universal::Fragment f;
      Shape shape = local;
      if (!shape.empty()) shape[0] = static_cast<int64_t>(s.length / row);
      f.src = reshape::SourceTensor{static_cast<uint32_t>(rank), s.offset,
                                    dtype, shape};
      f.src_box = Box::Whole(shape);
      Box box = Box::Whole(shape);
      if (!box.offset.empty()) box.offset[0] = at;
      f.atom_box = Shifted(box, at_box.offset);
      f.where = where;
      if (!shape.empty()) at += shape[0];
      atom.fragments.push_back(std::move(f));
    }
  }

  const Checkpoint& c_;
  std::span<const CkptIndex* const> files_;
  const RecordIndex& records_;
  universal::SourcePlan& plan_;
  std::map<std::string, size_t> has_;  // "<param>/<kind>" -> plan_.atoms
};

// What the params tell the model: their order, the trained ones (the
// optimizer's group), the model's dtype (the first trained floating one's).
struct ParamsRead {
  std::vector<std::string> order;
  std::vector<std::string> trained;
  DType dtype = DType::kFloat32;
};

// The params, in file order: their atoms and rows.
ParamsRead PlanParams(const RecordIndex& records,
                      std::span<const RecordRole> roles, AtomPlanner& atoms,
                      universal::SourcePlan& plan) {
  ParamsRead out;
  bool dtype_known = false;
  int64_t order = 0;
  for (size_t i = 0; i < records.entries.size(); ++i) {
    const RecordRole& r = roles[i];
    if (r.kind != RecordRole::kParam) continue;
    const std::string& tag = records.entries[i]->tag;
    atoms.Add(tag, *r.dtype, tag, r.state_kind);
    if (!r.buffer && !dtype_known) {
      out.dtype = *r.dtype;
      dtype_known = true;
    }
    out.order.push_back(tag);
    if (!r.buffer) out.trained.push_back(tag);
    plan.params.push_back(formats::ParamRow({.fqn = tag,
                                             .shape = plan.atoms.back().shape,
                                             .dtype = *r.dtype,
                                             .rule = "mindspore",
                                             .buffer = r.buffer,
                                             .group = r.buffer ? -1 : 0,
                                             .order = order++,
                                             .frozen = false,
                                             .tied_copies = {}}));
  }
  return out;
}

// The moments' atoms (after every param's: a moment's slices are placed by
// its param's shape); their state kinds.
std::set<std::string> PlanMoments(const RecordIndex& records,
                                  std::span<const RecordRole> roles,
                                  AtomPlanner& atoms,
                                  const std::string& where0) {
  std::set<std::string> state_kinds;
  for (size_t i = 0; i < records.entries.size(); ++i) {
    const RecordRole& r = roles[i];
    if (r.kind != RecordRole::kMoment) continue;
    const CkptEntry& e = *records.entries[i];
    if (!r.dtype || atoms.Has(r.param, r.state_kind)) {
      throw FormatError(where0, " > ", e.tag, ": ",
                        r.dtype ? "a second " + r.state_kind + " of " + r.param
                                : "tensor type " + e.tensor_type);
    }
    atoms.Add(e.tag, *r.dtype, r.param, r.state_kind);
    state_kinds.insert(r.state_kind);
  }
  return state_kinds;
}

// Everything else verbatim: tag, type, dims, content (read through the
// plan's source of the file); map tensors as opaque blobs of their raw
// records.
std::vector<OtherRecord> KeepOthers(const Checkpoint& c,
                                    const RecordIndex& records,
                                    std::span<const RecordRole> roles,
                                    const std::string& where0,
                                    universal::SourcePlan& plan) {
  std::vector<OtherRecord> others;
  for (size_t i = 0; i < records.entries.size(); ++i) {
    if (!roles[i].verbatim) continue;
    const CkptEntry& e = *records.entries[i];
    const reshape::ByteSource& file =
        *plan.sources[records.held.at(e.tag)[0].rank];
    if (e.map_tensor) {
      // Kept opaque: its raw records, written back verbatim.
      if (c.strategy) {
        throw FormatError(where0, " > ", e.tag,
                          ": a map tensor (MapParameter) in a sharded save: "
                          "not supported");
      }
      if (e.nbytes > kMaxMapBytes) {
        throw FormatError(where0, " > ", e.tag, ": a map tensor of ", e.nbytes,
                          " bytes (ucp keeps map tensors of up to ",
                          kMaxMapBytes >> 20, " MiB)");
      }
      std::string raw;
      for (const CkptSlice& s : e.slices) {
        const size_t at = raw.size();
        raw.resize(at + s.length);
        file.Read(s.offset,
                  std::as_writable_bytes(std::span(raw.data() + at, s.length)));
      }
      plan.opaque.push_back({StrCat(kMapTensorKey, e.tag), std::move(raw)});
      continue;
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
    others.push_back({e.tag, e.tensor_type, e.dims, std::move(bytes)});
  }
  return others;
}

// The model's source, optimizer and training records.
void DescribeModel(const Checkpoint& c, std::span<const CkptIndex* const> files,
                   ParamsRead params, const std::set<std::string>& state_kinds,
                   bool has_optimizer, universal::Model& model) {
  model.iteration = c.iteration;  // global_step (Discover), else the name's
  model.consumed_samples = c.consumed_samples;
  universal::SourceInfo& src = model.source;
  src.framework = "mindspore";
  src.driver = "mindspore";
  src.tp = 1;
  src.pp = 1;
  src.vpp = 1;
  src.dp = 1;
  src.dtype = std::string(DTypeName(params.dtype));
  src.other["checkpoint"] = c.path.filename().string();
  if (c.strategy) {
    src.world = static_cast<int64_t>(files.size());
    src.other["strategy"] = c.strategy->path.string();
  }
  if (c.v2) {
    src.world = c.v2->world;
    src.other["checkpoint2"] = c.v2->iter_dir.filename().string();
  }
  if (has_optimizer) {
    universal::OptimizerInfo& opt = model.optimizer;
    opt.type = "mindspore.nn.Adam";
    universal::ParamGroup& g = opt.groups.emplace().emplace_back();
    g.params = std::move(params.trained);
    for (const CkptIndex* f : files) {  // (the file holding the records)
      if (std::any_of(
              f->entries.begin(), f->entries.end(),
              [](const CkptEntry& e) { return e.tag == "beta1_power"; })) {
        AdamHyperparams(*f, model.iteration, g);
        break;
      }
    }
    opt.state_kinds =
        std::vector<std::string>(state_kinds.begin(), state_kinds.end());
    opt.step = model.iteration;
  }
  universal::TrainingInfo& training =
      universal::NewTraining(model, std::string(DTypeName(params.dtype)));
  training.param_order = std::move(params.order);
}

// The "mindspore" record: the other records, the file's record order and
// moment names and its files' names, which a rewrite keeps.
MindSporeExtras ReaderExtras(const Checkpoint& c,
                             std::span<const CkptIndex* const> files,
                             const RecordIndex& records,
                             std::vector<OtherRecord> others) {
  MindSporeExtras meta;
  meta.records = std::move(others);
  meta.order.emplace();
  std::string m1 = "moment1.", m2 = "moment2.";
  for (const CkptEntry* e : records.entries) {
    meta.order->push_back(e->tag);
    if (e->tag.starts_with("adam_m.") && records.Moment(e->tag)) m1 = "adam_m.";
    if (e->tag.starts_with("adam_v.") && records.Moment(e->tag)) m2 = "adam_v.";
  }
  meta.exp_avg_prefix = m1;
  meta.exp_avg_sq_prefix = m2;
  if (!c.v2) {  // (a Checkpoint 2.0 source gets MindFormers' .ckpt names)
    meta.file = c.path.filename().string();
    meta.rank_folder = c.path.parent_path().filename() == "rank_0";
  }
  meta.crc = c.index.crc;
  if (c.strategy) {
    // The rank files' names, which a target of as many ranks keeps.
    meta.files.emplace();
    for (const CkptIndex* f : files)
      meta.files->push_back(f->path.filename().string());
  }
  return meta;
}

}  // namespace

universal::SourcePlan PlanSource(const Checkpoint& c) {
  universal::SourcePlan plan;
  const std::vector<const CkptIndex*> files = Files(c);
  for (const CkptIndex* f : files)
    plan.sources.push_back(std::make_unique<CkptSource>(f->path));
  const std::string where0 = StrCat("checkpoint file ", c.path.string());
  const RecordIndex records = IndexRecords(files);
  const std::vector<RecordRole> roles = ClassifyRecords(records);
  AtomPlanner atoms(c, files, records, plan);
  ParamsRead params = PlanParams(records, roles, atoms, plan);
  const std::set<std::string> state_kinds =
      PlanMoments(records, roles, atoms, where0);
  std::vector<OtherRecord> others = KeepOthers(c, records, roles, where0, plan);
  if (plan.params.empty())
    throw FormatError(where0, ": no parameter tensor in it");
  DescribeModel(c, files, std::move(params), state_kinds,
                records.has_optimizer(), plan.model);
  WriteMindSporeExtras(ReaderExtras(c, files, records, std::move(others)),
                       plan.model);
  return plan;
}

}  // namespace ucp::mindspore
