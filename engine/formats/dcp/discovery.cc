// Finding DCP checkpoints, merging rank-local metadata, checking that chunks
// tile their tensors, and opening items (dcp.h).

#include <zstd.h>

#include <algorithm>
#include <cstring>
#include <set>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/dcp/experts.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;

// "__3.metadata" -> 3.
std::optional<int64_t> RankOfMetadata(const std::string& name) {
  if (!name.starts_with("__") || !name.ends_with(".metadata")) {
    return std::nullopt;
  }
  const std::string digits = name.substr(2, name.size() - 2 - 9);
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return std::nullopt;
  return std::stoll(digits);
}

// "__3_0.distcp" -> 3.
std::optional<int64_t> RankOfDistcp(const std::string& name) {
  if (!name.starts_with("__") || !name.ends_with(".distcp")) {
    return std::nullopt;
  }
  const size_t us = name.find('_', 2);
  if (us == std::string::npos) return std::nullopt;
  const std::string digits = name.substr(2, us - 2);
  if (digits.empty() || digits.size() > 9 ||
      !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return std::nullopt;
  return std::stoll(digits);
}

std::vector<fs::path> RankMetadataFiles(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (auto r = RankOfMetadata(it->path().filename().string()))
      found.emplace_back(*r, it->path());
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [r, p] : found) out.push_back(std::move(p));
  return out;
}

bool HoldsDistcp(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->path().extension() == ".distcp") return true;
  }
  return false;
}

int64_t TrailingNumber(const std::string& name) {
  size_t i = name.size();
  while (i > 0 && std::isdigit(static_cast<unsigned char>(name[i - 1]))) --i;
  if (i == name.size() || name.size() - i > 18) return -1;
  return std::stoll(name.substr(i));
}

int64_t Volume(const Shape& sizes) {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  return n;
}

bool Overlap(const Chunk& a, const Chunk& b) {
  for (size_t d = 0; d < a.offsets.size(); ++d) {
    if (a.offsets[d] >= b.offsets[d] + b.sizes[d] ||
        b.offsets[d] >= a.offsets[d] + a.sizes[d])
      return false;
  }
  return true;
}

// For a stacked expert tensor (experts.h): the global experts a tiling
// problem touches, for the message; empty otherwise.
std::string ExpertsNamed(const Entry& e, bool twice) {
  if (e.size.size() != 3 || !FindStacked(e.fqn)) return "";
  std::vector<int64_t> missing, doubled;
  ExpertCoverage(e.size, e.chunks, missing, doubled);
  const std::vector<int64_t>& v = twice ? doubled : missing;
  if (v.empty()) return "";
  return StrCat(" (global experts ", IndexList(v),
                twice ? " stored more than once" : " missing or incomplete",
                ", of ", e.size[0], ")");
}

// Every element of the tensor in exactly one chunk (empty chunks, as
// torch writes for ranks past the end, ignored).
void CheckTiling(const Entry& e, const fs::path& where) {
  if (!e.tensor) return;
  if (e.size.empty()) {
    if (e.chunks.size() != 1 || !e.chunks[0].offsets.empty()) {
      throw FormatError(where.string(), " > ", e.fqn, ": a 0-d tensor with ",
                        e.chunks.size(), " chunks");
    }
    return;
  }
  if (!CheckedNumElements(e.size)) {
    throw FormatError(where.string(), " > ", e.fqn, ": shape ",
                      ShapeString(e.size), " has more elements than int64");
  }
  std::vector<const Chunk*> boxes;
  int64_t total = 0;
  for (const Chunk& c : e.chunks) {
    if (c.offsets.size() != e.size.size() || c.sizes.size() != e.size.size()) {
      throw FormatError(where.string(), " > ", e.fqn, ": chunk ", BoxString(c),
                        " has ", c.offsets.size(), " dims, the tensor ",
                        e.size.size());
    }
    // (offsets and sizes are >= 0: ParseMetadata refuses negative ones; the
    // test cannot overflow, unlike offset + size)
    for (size_t d = 0; d < c.offsets.size(); ++d) {
      if (c.sizes[d] > e.size[d] || c.offsets[d] > e.size[d] - c.sizes[d]) {
        throw FormatError(where.string(), " > ", e.fqn, ": chunk ",
                          BoxString(c), " lies outside the tensor's ",
                          ShapeString(e.size));
      }
    }
    if (Volume(c.sizes) == 0) continue;
    boxes.push_back(&c);
    total += Volume(c.sizes);
  }
  // Overlaps: sweep by the first dim's start.
  std::sort(boxes.begin(), boxes.end(), [](const Chunk* a, const Chunk* b) {
    return a->offsets < b->offsets;
  });
  for (size_t i = 0; i < boxes.size(); ++i) {
    for (size_t j = i + 1; j < boxes.size(); ++j) {
      if (boxes[j]->offsets[0] >= boxes[i]->offsets[0] + boxes[i]->sizes[0])
        break;
      if (Overlap(*boxes[i], *boxes[j])) {
        throw FormatError(where.string(), " > ", e.fqn, ": chunks ",
                          BoxString(*boxes[i]), " and ", BoxString(*boxes[j]),
                          " overlap", ExpertsNamed(e, true));
      }
    }
  }
  if (total != Volume(e.size)) {
    // Find a hole to name: the first element of dim 0 rows no chunk starts
    // covering, else the count.
    throw FormatError(where.string(), " > ", e.fqn, ": the chunks cover ",
                      total, " of the ", Volume(e.size), " elements of ",
                      ShapeString(e.size),
                      " (a hole: loading would keep stale values there)",
                      ExpertsNamed(e, false));
  }
}

// Merges `m` (of metadata file `file`, rank `rank`) into the checkpoint; the
// first file merged gives the version and the extra attributes.
void Merge(Checkpoint& c, Metadata m, const fs::path& file, int64_t rank,
           bool first) {
  Metadata& all = c.metadata;
  if (first) {
    all.version = m.version;
    all.extra = m.extra;
    all.planner_data = m.planner_data;
  } else {
    std::set<std::string> known;
    for (const auto& [k, v] : all.planner_data) known.insert(k);
    for (auto& [k, v] : m.planner_data)
      if (!known.count(k)) all.planner_data.emplace_back(k, std::move(v));
  }
  for (Entry& e : m.entries) {
    Entry* have = nullptr;
    for (Entry& x : all.entries)
      if (x.fqn == e.fqn) have = &x;
    if (have == nullptr) {
      all.entries.push_back(std::move(e));
      continue;
    }
    if (have->tensor != e.tensor ||
        (e.tensor && (have->dtype != e.dtype || have->size != e.size))) {
      throw FormatError(file.string(), " > ", e.fqn,
                        ": another rank's metadata gives it another dtype, "
                        "shape or kind");
    }
    for (Chunk& k : e.chunks) {
      const bool dup = std::any_of(
          have->chunks.begin(), have->chunks.end(), [&](const Chunk& x) {
            return x.offsets == k.offsets && x.sizes == k.sizes;
          });
      if (!dup) have->chunks.push_back(std::move(k));
    }
  }
  for (auto& [key, info] : m.storage) {
    Item item;
    item.file = c.path / info.relative_path;
    item.info = info;
    item.rank = rank;
    c.items[key].push_back(std::move(item));
    all.storage.emplace(key, std::move(info));
  }
}

// The optimizer step a checkpoint's state holds: the first 0-d
// optimizer.state.<fqn>.step tensor's value (torch's Adam keeps the same
// step for every param); absent if it has none.
std::optional<int64_t> StateStep(const Checkpoint& c) {
  for (const Entry& e : c.metadata.entries) {
    if (!e.tensor || !e.size.empty() || e.chunks.empty() ||
        !e.fqn.starts_with("optimizer.state.") || !e.fqn.ends_with(".step"))
      continue;
    const ItemKey key{e.fqn, e.chunks.front().offsets};
    const auto it = c.items.find(key);
    if (it == c.items.end() || it->second.empty()) continue;
    FileCache files;
    const std::shared_ptr<const torchfile::TorchFile> f =
        OpenItem(it->second.front(), key, files);
    const torchfile::TensorInfo* t = f->FindTensor(f->root());
    if (t == nullptr || !t->shape.empty()) continue;
    std::byte bytes[8] = {};
    if (t->dtype == DType::kFloat32) {
      f->ReadTensor(*t, std::span(bytes, 4));
      float v = 0;
      std::memcpy(&v, bytes, 4);
      return static_cast<int64_t>(v);
    }
    if (t->dtype == DType::kFloat64 || t->dtype == DType::kInt64) {
      f->ReadTensor(*t, std::span(bytes, 8));
      if (t->dtype == DType::kInt64) {
        int64_t v = 0;
        std::memcpy(&v, bytes, 8);
        return v;
      }
      double v = 0;
      std::memcpy(&v, bytes, 8);
      return static_cast<int64_t>(v);
    }
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

bool IsCheckpointFolder(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kMetadataFile, ec) ||
         !RankMetadataFiles(dir).empty();
}

std::vector<formats::SavedCheckpoint> ListCheckpoints(const fs::path& dir) {
  std::vector<formats::SavedCheckpoint> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!it->is_directory(ec)) continue;
    if (!IsCheckpointFolder(it->path()) && !HoldsDistcp(it->path())) continue;
    formats::SavedCheckpoint c;
    c.name = it->path().filename().string();
    c.iteration = TrailingNumber(c.name);
    c.selector.Set(kCheckpointOption, c.name);
    out.push_back(std::move(c));
  }
  return out;
}

Checkpoint Discover(const fs::path& path, const std::string& name) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("checkpoint folder ", path.string(),
                  " does not exist or is not a folder");
  }
  Checkpoint c;
  if (!name.empty()) {
    c.path = path / name;
    if (!fs::is_directory(c.path, ec)) {
      std::string have;
      for (const formats::SavedCheckpoint& s : ListCheckpoints(path))
        have += (have.empty() ? "" : ", ") + s.name;
      throw UsageError("no checkpoint '", name, "' in ", path.string(),
                       have.empty() ? std::string(" (none there)")
                                    : StrCat(" (there: ", have, ")"));
    }
  } else if (IsCheckpointFolder(path) || HoldsDistcp(path)) {
    c.path = path;
  } else {
    // A save folder: its newest complete checkpoint.
    std::vector<formats::SavedCheckpoint> list = ListCheckpoints(path);
    std::sort(list.begin(), list.end(), [](const auto& a, const auto& b) {
      return a.iteration != b.iteration ? a.iteration > b.iteration
                                        : a.name > b.name;
    });
    for (const formats::SavedCheckpoint& s : list) {
      if (IsCheckpointFolder(path / s.name)) {
        c.path = path / s.name;
        break;
      }
    }
    if (c.path.empty()) {
      throw FormatError(
          path.string(),
          list.empty() ? std::string(": no DCP checkpoint folder (.metadata "
                                     "and __R_I.distcp files) in it")
                       : StrCat(": none of its ", list.size(),
                                " checkpoint folders is complete (no "
                                ".metadata: a save did not finish)"));
    }
  }
  c.path = fs::absolute(c.path).lexically_normal();
  if (c.path.filename().empty()) c.path = c.path.parent_path();
  c.dir = c.path.parent_path();
  c.name = c.path.filename().string();
  c.iteration = std::max<int64_t>(0, TrailingNumber(c.name));
  if (fs::is_regular_file(c.path / kMetadataFile, ec)) {
    c.metadata_files = {c.path / kMetadataFile};
  } else {
    c.metadata_files = RankMetadataFiles(c.path);
    c.rank_local = !c.metadata_files.empty();
  }
  if (c.metadata_files.empty()) {
    throw FormatError(c.path.string(),
                      ": no .metadata (the save did not finish: DCP writes it "
                      "last)");
  }
  for (size_t i = 0; i < c.metadata_files.size(); ++i) {
    const fs::path& f = c.metadata_files[i];
    const std::string bytes = ReadSmallFile(f, size_t{1} << 31);
    const int64_t rank =
        c.rank_local ? *RankOfMetadata(f.filename().string()) : 0;
    Merge(c, ParseMetadata(bytes, f), f, rank, i == 0);
  }
  // Every chunk has an item, every item a file.
  std::set<fs::path> files;
  std::set<int64_t> ranks;
  for (const Entry& e : c.metadata.entries) {
    CheckTiling(e, c.metadata_files.front());
    if (!e.tensor) {
      if (!c.items.count({e.fqn, std::nullopt})) {
        throw FormatError(c.metadata_files.front().string(), " > ", e.fqn,
                          ": no item in storage_data");
      }
      continue;
    }
    for (const Chunk& k : e.chunks) {
      if (Volume(k.sizes) == 0 && !e.size.empty()) continue;
      if (!c.items.count({e.fqn, k.offsets})) {
        throw FormatError(c.metadata_files.front().string(), " > ", e.fqn,
                          ": chunk ", BoxString(k),
                          " has no item in storage_data");
      }
    }
  }
  for (const auto& [key, items] : c.items) {
    for (const Item& it : items) {
      if (!fs::is_regular_file(it.file, ec)) {
        throw FormatError(c.path.string(), " > ", key.fqn, ": its file ",
                          it.info.relative_path, " is missing");
      }
      const uint64_t size = fs::file_size(it.file, ec);
      if (it.info.offset + it.info.length > size) {
        throw FormatError(it.file.string(), " > ", key.fqn, ": the item at ",
                          it.info.offset, "+", it.info.length,
                          " runs past the file's ", size,
                          " bytes (truncated?)");
      }
      files.insert(it.file);
      if (auto r = RankOfDistcp(it.file.filename().string())) ranks.insert(*r);
    }
  }
  c.files = c.metadata_files;
  c.files.insert(c.files.end(), files.begin(), files.end());
  c.world = std::max<int64_t>(1, static_cast<int64_t>(ranks.size()));
  // A folder whose name tells no step (ucp's output, say): the optimizer's.
  if (TrailingNumber(c.name) < 0)
    if (std::optional<int64_t> step = StateStep(c)) c.iteration = *step;
  return c;
}

std::shared_ptr<const File> FileCache::Get(const fs::path& path) {
  auto it = open_.find(path);
  if (it != open_.end()) return it->second;
  auto f = std::make_shared<const File>(File::OpenRead(path));
  open_.emplace(path, f);
  return f;
}

std::string ItemBytes(const Item& item, const ItemKey& key, FileCache& files) {
  try {
    const std::shared_ptr<const File> f = files.Get(item.file);
    std::string raw(item.info.length, '\0');
    f->ReadExact(raw.data(), raw.size(), item.info.offset);
    for (auto t = item.info.transforms.rbegin();
         t != item.info.transforms.rend(); ++t) {
      if (!t->starts_with("stream.zstd/")) {
        throw FormatError("transform '", *t,
                          "' is not supported (stream.zstd is)");
      }
      const unsigned long long n =
          ZSTD_getFrameContentSize(raw.data(), raw.size());
      std::string out;
      if (n != ZSTD_CONTENTSIZE_UNKNOWN && n != ZSTD_CONTENTSIZE_ERROR &&
          n < (1ull << 40)) {
        out.resize(n);
        const size_t got =
            ZSTD_decompress(out.data(), out.size(), raw.data(), raw.size());
        if (ZSTD_isError(got) || got != n) {
          throw FormatError("zstd: ", ZSTD_isError(got) ? ZSTD_getErrorName(got)
                                                        : "short frame");
        }
      } else {
        // Streamed frames without a content size.
        ZSTD_DStream* ds = ZSTD_createDStream();
        ZSTD_initDStream(ds);
        ZSTD_inBuffer in{raw.data(), raw.size(), 0};
        std::vector<char> buf(ZSTD_DStreamOutSize());
        size_t r = 1;
        while (in.pos < in.size) {
          ZSTD_outBuffer o{buf.data(), buf.size(), 0};
          r = ZSTD_decompressStream(ds, &o, &in);
          if (ZSTD_isError(r)) {
            ZSTD_freeDStream(ds);
            throw FormatError("zstd: ", ZSTD_getErrorName(r));
          }
          out.append(buf.data(), o.pos);
        }
        ZSTD_freeDStream(ds);
        if (r != 0) throw FormatError("zstd: truncated stream");
      }
      raw = std::move(out);
    }
    return raw;
  } catch (Error& e) {
    e.AddContext(item.file.string(), " > item ", key.fqn);
    throw;
  }
}

std::shared_ptr<const torchfile::TorchFile> OpenItem(const Item& item,
                                                     const ItemKey& key,
                                                     FileCache& files) {
  try {
    if (item.info.transforms.empty()) {
      return std::make_shared<const torchfile::TorchFile>(
          torchfile::TorchFile::Open(files.Get(item.file), item.info.offset,
                                     item.info.length));
    }
    // Compressed whole: decompressed into a memory file.
    const std::string bytes = ItemBytes(item, key, files);
    auto mem = std::make_shared<File>(File::Anonymous("dcp-item"));
    mem->WriteExact(bytes.data(), bytes.size(), 0);
    return std::make_shared<const torchfile::TorchFile>(
        torchfile::TorchFile::Open(std::shared_ptr<const File>(mem)));
  } catch (Error& e) {
    if (std::string_view(e.what()).find(item.file.string()) ==
        std::string_view::npos)
      e.AddContext(item.file.string(), " > item ", key.fqn);
    throw;
  }
}

}  // namespace ucp::dcp
