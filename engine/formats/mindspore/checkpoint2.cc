// MindFormers Checkpoint 2.0 folders and their safetensors files
// (checkpoint2.h).
#include "engine/formats/mindspore/checkpoint2.h"

#include <algorithm>
#include <charconv>
#include <cstring>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/safetensors.h"
#include "engine/json/json.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

constexpr const char* kIterPrefix = "iteration_";
constexpr const char* kTracker = "latest_checkpointed_iteration.txt";

std::optional<int64_t> Number(std::string_view s) {
  int64_t v = 0;
  const auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty())
    return std::nullopt;
  return v;
}

// "[<prefix>-]<kind>-RRRRRRR-WWWWWWW.safetensors" -> (kind, rank, world).
struct FileName {
  std::string kind;
  int64_t rank = 0, world = 0;
};
std::optional<FileName> ParseFileName(const std::string& name) {
  constexpr std::string_view kExt = ".safetensors";
  if (!name.ends_with(kExt)) return std::nullopt;
  std::string_view s(name);
  s.remove_suffix(kExt.size());
  const size_t b = s.rfind('-');
  if (b == std::string_view::npos || b == 0) return std::nullopt;
  const size_t a = s.rfind('-', b - 1);
  if (a == std::string_view::npos) return std::nullopt;
  const auto rank = Number(s.substr(a + 1, b - a - 1));
  const auto world = Number(s.substr(b + 1));
  if (!rank || !world || *world < 1 || *rank < 0 || *rank >= *world)
    return std::nullopt;
  std::string_view kind = s.substr(0, a);
  if (const size_t d = kind.rfind('-'); d != std::string_view::npos)
    kind.remove_prefix(d + 1);
  if (kind != "model" && kind != "opt") return std::nullopt;
  return FileName{std::string(kind), *rank, *world};
}

std::optional<int64_t> IterationOf(const fs::path& dir) {
  const std::string n = dir.filename().string();
  if (!n.starts_with(kIterPrefix)) return std::nullopt;
  return Number(std::string_view(n).substr(std::strlen(kIterPrefix)));
}

bool HoldsModelFile(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const auto f = ParseFileName(e.path().filename().string());
    if (f && f->kind == "model" && e.is_regular_file(ec)) return true;
  }
  return false;
}

std::vector<int64_t> IntList(const json::Value& v, const std::string& where) {
  if (!v.is_array()) throw FormatError(where, ": not a list of integers");
  std::vector<int64_t> out;
  for (const json::Value& x : v.items()) {
    if (!x.is_int() || x.AsInt() < 0)
      throw FormatError(where, ": not a list of integers >= 0");
    out.push_back(x.AsInt());
  }
  return out;
}

// "('name', (0, 16))" -> ("name", {0, 16}).
std::optional<std::pair<std::string, std::vector<int64_t>>> ParseShardId(
    std::string_view s) {
  if (!s.starts_with("(") || !s.ends_with(")")) return std::nullopt;
  s = s.substr(1, s.size() - 2);
  const char q = s.empty() ? '\0' : s[0];
  if (q != '\'' && q != '"') return std::nullopt;
  const std::string sep = std::string(1, q) + ", (";
  const size_t at = s.rfind(sep);
  if (at == std::string_view::npos || at == 0 || !s.ends_with(")"))
    return std::nullopt;
  std::string name(s.substr(1, at - 1));
  std::string_view offs = s.substr(at + sep.size());
  offs.remove_suffix(1);
  std::vector<int64_t> out;
  while (!offs.empty()) {
    const size_t c = offs.find(',');
    std::string_view part = offs.substr(0, c);
    while (!part.empty() && part.front() == ' ') part.remove_prefix(1);
    while (!part.empty() && part.back() == ' ') part.remove_suffix(1);
    if (!part.empty()) {
      const auto v = Number(part);
      if (!v) return std::nullopt;
      out.push_back(*v);
    }
    if (c == std::string_view::npos) break;
    offs.remove_prefix(c + 1);
  }
  return std::pair(std::move(name), std::move(out));
}

}  // namespace

std::string IterationFolderName(int64_t iteration) {
  std::string n = std::to_string(iteration);
  if (n.size() < 8) n.insert(0, 8 - n.size(), '0');
  return kIterPrefix + n;
}

std::string ShardId(const std::string& name,
                    const std::vector<int64_t>& offset) {
  const char q = name.find('\'') != std::string::npos &&
                         name.find('"') == std::string::npos
                     ? '"'
                     : '\'';
  std::string out =
      StrCat("(", std::string(1, q), name, std::string(1, q), ", (");
  for (size_t i = 0; i < offset.size(); ++i)
    out += StrCat(i ? ", " : "", offset[i]);
  if (offset.size() == 1) out += ",";
  return out + "))";
}

CkptIndex ReadSafetensorsIndex(const fs::path& path) {
  CkptIndex index;
  index.path = path;
  for (formats::SafetensorsTensor& t : formats::ReadSafetensorsHeader(path)) {
    CkptEntry e;
    e.tag = std::move(t.name);
    e.tensor_type = TensorTypeOf(t.dtype);
    e.dims = std::move(t.shape);  // 0-d: as MindSpore's records of a scalar
    e.slices.push_back({t.offset, t.bytes});
    e.nbytes = t.bytes;
    index.entries.push_back(std::move(e));
  }
  return index;
}

bool LooksLikeMsSafetensors(const fs::path& path) noexcept {
  try {
    std::error_code ec;
    if (!IsSafetensorsName(path) || !fs::is_regular_file(path, ec))
      return false;
    const json::Value meta = formats::SafetensorsMetadata(path);
    const json::Value* f = meta.is_object() ? meta.Find("format") : nullptr;
    return f != nullptr && f->is_string() && f->AsString() == "ms";
  } catch (...) {
    return false;
  }
}

bool LooksLikeCheckpointFile(const fs::path& path) noexcept {
  return IsSafetensorsName(path) ? LooksLikeMsSafetensors(path)
                                 : LooksLikeCkpt(path);
}

CkptIndex ReadCheckpointFile(const fs::path& path) {
  return IsSafetensorsName(path) ? ReadSafetensorsIndex(path)
                                 : ReadCkptIndex(path);
}

std::vector<std::pair<int64_t, fs::path>> Checkpoint2Iterations(
    const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(root, ec)) {
    const auto it = IterationOf(e.path());
    if (it && e.is_directory(ec) && HoldsModelFile(e.path()))
      found.emplace_back(*it, e.path());
  }
  std::sort(found.begin(), found.end());
  return found;
}

bool IsCheckpoint2Folder(const fs::path& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && HoldsModelFile(dir);
}

std::optional<int64_t> Checkpoint2Tracker(const fs::path& root) {
  std::error_code ec;
  if (!fs::is_regular_file(root / kTracker, ec)) return std::nullopt;
  const std::string t = ReadSmallFile(root / kTracker, 64);
  std::string_view s(t);
  while (!s.empty() && (s.back() == '\n' || s.back() == ' '))
    s.remove_suffix(1);
  const auto n = Number(s);
  if (!n) {
    throw FormatError((root / kTracker).string(), ": '", t,
                      "' is no iteration number");
  }
  return n;
}

std::optional<fs::path> Checkpoint2Dir(const fs::path& path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return std::nullopt;
  if (HoldsModelFile(path)) return path;
  const std::vector<std::pair<int64_t, fs::path>> its =
      Checkpoint2Iterations(path);
  if (its.empty()) return std::nullopt;
  if (const std::optional<int64_t> n = Checkpoint2Tracker(path)) {
    for (const auto& [i, p] : its)
      if (i == *n) return p;
    throw FormatError((path / kTracker).string(), ": iteration ", *n,
                      " has no complete iteration folder here");
  }
  return its.back().second;
}

Checkpoint2 ReadCheckpoint2(const fs::path& iter_dir) {
  Checkpoint2 c;
  c.iter_dir = iter_dir;
  // MindFormers writes the tracker last: a folder newer than it names is a
  // save that did not finish.
  if (const auto it = IterationOf(iter_dir)) {
    const std::optional<int64_t> tracked =
        Checkpoint2Tracker(iter_dir.parent_path());
    if (tracked && *it > *tracked) {
      throw FormatError(iter_dir.string(), ": newer than iteration ", *tracked,
                        " the tracker (latest_checkpointed_iteration.txt) "
                        "names: a save that did not finish");
    }
  }
  // Each kind's files: model-I-N for I < N, opt-I-M for I < M. One per rank
  // (N = M = the world), or, for a remove_redundancy (balanced) save, as
  // many as its plan made of each kind.
  std::map<int64_t, fs::path> model, opt;
  int64_t worlds[2] = {0, 0};
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(iter_dir, ec)) {
    const auto f = ParseFileName(e.path().filename().string());
    if (!f || !e.is_regular_file(ec)) continue;
    const int k = f->kind == "model" ? 0 : 1;
    if (worlds[k] != 0 && f->world != worlds[k]) {
      throw FormatError(e.path().string(), ": one of ", f->world, " ", f->kind,
                        " files beside one of ", worlds[k]);
    }
    worlds[k] = f->world;
    (k == 0 ? model : opt)[f->rank] = e.path();
  }
  if (ec) throw IoError("cannot list ", iter_dir.string(), ": ", ec.message());
  if (model.empty())
    throw FormatError(iter_dir.string(), ": no model-*.safetensors file");
  for (int k = 0; k < 2; ++k) {
    const auto& files = k == 0 ? model : opt;
    for (int64_t r = 0; r < worlds[k]; ++r) {
      if (!files.count(r)) {
        throw FormatError(iter_dir.string(), ": the ",
                          k == 0 ? "model" : "optimizer", " file of rank ", r,
                          " of ", worlds[k],
                          " is missing (an incomplete save)");
      }
    }
  }
  const int64_t world = std::max(worlds[0], worlds[1]);
  c.world = world;
  std::map<std::string, size_t> file_index;
  for (int64_t r = 0; r < world; ++r) {
    for (const auto* m : {&model, &opt}) {
      auto it = m->find(r);
      if (it == m->end()) continue;
      file_index[it->second.filename().string()] = c.files.size();
      c.files.push_back(ReadSafetensorsIndex(it->second));
      c.rank_of.push_back(r);
    }
  }
  // common.json: the counters.
  c.iteration = IterationOf(iter_dir).value_or(0);
  if (const fs::path cj = iter_dir / "common.json"; fs::exists(cj, ec)) {
    json::Value common;
    try {
      common = json::Value::Parse(ReadSmallFile(cj, 1 << 20));
    } catch (Error& e) {
      e.AddContext(cj.string());
      throw;
    }
    auto num = [&](const char* k) -> std::optional<int64_t> {
      const json::Value* v = common.Find(k);
      if (v == nullptr || v->is_null()) return std::nullopt;
      if (!v->is_int())
        throw FormatError(cj.string(), ": '", k, "' is not an integer");
      return v->AsInt();
    };
    if (const auto g = num("global_step")) c.iteration = *g;
    const auto consumed = num("consumed_samples");
    const auto step = num("step_num");
    const auto batch = num("global_batch_size");
    if (consumed && *consumed >= 0) {
      c.consumed_samples = *consumed;
    } else if (step && batch && *step >= 0 && *batch > 0) {
      c.consumed_samples = *step * *batch;
    }
  }
  // metadata.json: each file's slices placed.
  const fs::path mj = iter_dir / "metadata.json";
  if (!fs::exists(mj, ec)) {
    if (world > 1) {
      throw FormatError(iter_dir.string(), ": ", world,
                        " ranks but no metadata.json (it places their "
                        "slices; MindFormers writes it last)");
    }
    return c;
  }
  json::Value meta;
  try {
    meta = json::Value::Parse(ReadSmallFile(mj, uint64_t{1} << 30));
  } catch (Error& e) {
    e.AddContext(mj.string());
    throw;
  }
  const json::Value* sdm = meta.Find("state_dict_metadata");
  const json::Value* storage = meta.Find("storage_data");
  if (sdm == nullptr || !sdm->is_object() || storage == nullptr ||
      !storage->is_object()) {
    throw FormatError(mj.string(),
                      ": no state_dict_metadata and storage_data objects");
  }
  for (const auto& [id, files] : storage->members()) {
    const std::string w = StrCat(mj.string(), " > storage_data > ", id);
    const auto shard = ParseShardId(id);
    if (!shard) throw FormatError(w, ": not a ('<name>', (<offsets>)) key");
    const json::Value* m = sdm->Find(shard->first);
    if (m == nullptr) throw FormatError(w, ": no state_dict_metadata entry");
    const json::Value* gs = m->Find("global_shape");
    if (gs == nullptr) throw FormatError(w, ": no global_shape");
    Placed p;
    p.global_shape = IntList(*gs, w + " > global_shape");
    p.offset = shard->second;
    if (p.offset.size() != p.global_shape.size()) {
      throw FormatError(w, ": ", p.offset.size(), " offsets for a ",
                        p.global_shape.size(), "-d tensor");
    }
    if (!files.is_array()) throw FormatError(w, ": not a list of files");
    for (const json::Value& f : files.items()) {
      const json::Value* name = f.Find("file_name");
      if (name == nullptr || !name->is_string())
        throw FormatError(w, ": an entry without file_name");
      auto fi = file_index.find(name->AsString());
      if (fi == file_index.end()) {
        throw FormatError(w, ": names ", name->AsString(), ", which is not in ",
                          iter_dir.string());
      }
      c.placed[{fi->second, shard->first}] = p;
    }
  }
  return c;
}

}  // namespace ucp::mindspore
