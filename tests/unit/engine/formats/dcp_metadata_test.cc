// DCP `.metadata` parsing (engine/formats/dcp/metadata.h) against two
// independent sources:
// - pickles written here opcode by opcode from the format (torch/distributed/
//   checkpoint/metadata.py, filesystem.py: which classes, which attributes,
//   how dataclasses, torch.Size, dtypes and enums pickle), not by ucp's
//   pickler (checked once by hand: torch 2.15's pickle.load of MdParts'
//   bytes gives torch's Metadata classes with exactly the values expected
//   below);
// - real files whose content torch itself reports: the shared fixtures
//   (torch 2.6 under Python 3.13; Megatron-core 0.20's torch_dist save with
//   its saved plans) and data/dcp_torch2.15_*.metadata (written by
//   tests/tools/make_dcp_ckpts.py, cases zstd_w2 and nopg, with the venv's
//   torch 2.15: version "1.0.0", zstd transform descriptors). The expected
//   digests below are what dump_dcp_metadata.py prints for them (torch's
//   FileSystemReader.read_metadata() as canonical text).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/dcp/metadata.h"
#include "engine/pickle/pickle.h"
#include "tests/testutil/testutil.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// ---- A pickle (protocol 2) written opcode by opcode. ----
namespace pk {

std::string Le32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}
std::string Global(const std::string& module, const std::string& name) {
  return "c" + module + "\n" + name + "\n";
}
std::string Str(const std::string& s) {
  return "X" + Le32(static_cast<uint32_t>(s.size())) + s;
}
// BININT (4-byte signed) or LONG1 (8 bytes, little-endian two's complement).
std::string Int(int64_t v) {
  if (v >= INT32_MIN && v <= INT32_MAX)
    return "J" + Le32(static_cast<uint32_t>(static_cast<int32_t>(v)));
  std::string s = "\x8a\x08";
  for (int i = 0; i < 8; ++i)
    s.push_back(
        static_cast<char>((static_cast<uint64_t>(v) >> (8 * i)) & 0xff));
  return s;
}
std::string Bool(bool b) { return b ? "\x88" : "\x89"; }
std::string None() { return "N"; }
std::string Tuple(const std::vector<std::string>& items) {
  std::string s = "(";
  for (const std::string& i : items) s += i;
  return s + "t";
}
std::string List(const std::vector<std::string>& items) {
  if (items.empty()) return "]";
  std::string s = "](";
  for (const std::string& i : items) s += i;
  return s + "e";
}
std::string Dict(const std::vector<std::pair<std::string, std::string>>& kv) {
  if (kv.empty()) return "}";
  std::string s = "}(";
  for (const auto& [k, v] : kv) s += k + v;
  return s + "u";
}
std::string Reduce(const std::string& callable, const std::string& args) {
  return callable + args + "R";
}
// A dataclass instance: copyreg.__newobj__ (NEWOBJ of cls, ()) and BUILD of
// its state (its __dict__, or what __getstate__ returns); no state: none.
std::string Obj(const std::string& module, const std::string& cls,
                const std::string& state) {
  std::string s = Global(module, cls) + ")\x81";
  if (!state.empty()) s += state + "b";
  return s;
}
std::string Size(const std::vector<int64_t>& dims) {
  std::vector<std::string> items;
  for (int64_t d : dims) items.push_back(Int(d));
  return Reduce(Global("torch", "Size"), Tuple({Tuple(items)}));
}
std::string Program(const std::string& root) {
  return std::string("\x80\x02", 2) + root + ".";
}

}  // namespace pk

constexpr const char* kMd = "torch.distributed.checkpoint.metadata";
constexpr const char* kFs = "torch.distributed.checkpoint.filesystem";

// The parts of a hand-written .metadata; a test changes one to break it.
struct MdParts {
  std::string w_props = pk::Obj(
      kMd, "TensorProperties",
      pk::Tuple({pk::Global("torch", "bfloat16"),
                 pk::Reduce(pk::Global("torch.serialization", "_get_layout"),
                            pk::Tuple({pk::Str("torch.strided")})),
                 pk::Bool(true),
                 pk::Reduce(pk::Global(kMd, "_MEM_FORMAT_ENCODING"),
                            pk::Tuple({pk::Int(0)})),
                 pk::Bool(false)}));
  std::string w_size = pk::Size({4, 3});
  std::string w_chunk0_offsets = pk::Size({0, 0});
  std::string w_chunk0_sizes = pk::Size({3, 3});
  std::string w_chunks_list;  // empty: the two chunks
  std::string w_item1_path = pk::Str("__1_0.distcp");
  std::string w_item1_length = pk::Int(700);
  std::string w_item1_value;  // empty: a _StorageInfo
  std::string second_key = "optimizer.state.w.step";
  std::string lr_entry = pk::Obj(kMd, "BytesStorageMetadata", "");
  std::string checkpoint_id = pk::None();
  bool storage_data = true;

  std::string Chunk(const std::string& offsets,
                    const std::string& sizes) const {
    return pk::Obj(
        kMd, "ChunkStorageMetadata",
        pk::Dict({{pk::Str("offsets"), offsets}, {pk::Str("sizes"), sizes}}));
  }
  std::string Index(const std::string& fqn, const std::string& offset,
                    const std::string& index) const {
    return pk::Obj(kMd, "MetadataIndex",
                   pk::Dict({{pk::Str("fqn"), pk::Str(fqn)},
                             {pk::Str("offset"), offset},
                             {pk::Str("index"), index}}));
  }
  std::string Info(const std::string& path, int64_t offset,
                   const std::string& length,
                   const std::string& transforms = "") const {
    std::vector<std::pair<std::string, std::string>> kv = {
        {pk::Str("relative_path"), path},
        {pk::Str("offset"), pk::Int(offset)},
        {pk::Str("length"), length}};
    if (!transforms.empty())
      kv.emplace_back(pk::Str("transform_descriptors"), transforms);
    return pk::Obj(kFs, "_StorageInfo", pk::Dict(kv));
  }

  std::string Bytes() const {
    const std::string w = pk::Obj(
        kMd, "TensorStorageMetadata",
        pk::Dict(
            {{pk::Str("properties"), w_props},
             {pk::Str("size"), w_size},
             {pk::Str("chunks"),
              !w_chunks_list.empty()
                  ? w_chunks_list
                  : pk::List({Chunk(w_chunk0_offsets, w_chunk0_sizes),
                              Chunk(pk::Size({3, 0}), pk::Size({1, 3}))})}}));
    // TensorProperties of torch.distributed._shard (torch 2.0-2.2 pickled
    // it from there): the 6-tuple with strides, the enum member as
    // getattr(class, name) as Python >= 3.11 pickles it.
    const std::string shard =
        "torch.distributed._shard.sharded_tensor.metadata";
    const std::string step = pk::Obj(
        kMd, "TensorStorageMetadata",
        pk::Dict(
            {{pk::Str("properties"),
              pk::Obj(
                  shard, "TensorProperties",
                  pk::Tuple(
                      {pk::Global("torch", "float32"),
                       pk::Reduce(
                           pk::Global("torch.serialization", "_get_layout"),
                           pk::Tuple({pk::Str("torch.strided")})),
                       pk::Bool(false),
                       pk::Reduce(
                           pk::Global("builtins", "getattr"),
                           pk::Tuple({pk::Global(shard, "MEM_FORMAT_ENCODING"),
                                      pk::Str("TORCH_CONTIGUOUS_FORMAT")})),
                       pk::Bool(false), pk::None()}))},
             {pk::Str("size"), pk::Size({})},
             {pk::Str("chunks"),
              pk::List({Chunk(pk::Size({}), pk::Size({}))})}}));
    const std::string sdm =
        pk::Dict({{pk::Str("model.w"), w},
                  {pk::Str(second_key), step},
                  {pk::Str("optimizer.param_groups.0.lr"), lr_entry}});
    const std::string planner = pk::Dict(
        {{pk::Str("model.w"), pk::Tuple({pk::Str("model"), pk::Str("w")})},
         {pk::Str("optimizer.state.w.step"),
          pk::Tuple({pk::Str("optimizer"), pk::Str("state"), pk::Str("w"),
                     pk::Str("step")})},
         {pk::Str("optimizer.param_groups.0.lr"),
          pk::Tuple({pk::Str("optimizer"), pk::Str("param_groups"), pk::Int(0),
                     pk::Str("lr")})}});
    const std::string storage = pk::Dict(
        {{Index("model.w", pk::Size({0, 0}), pk::Int(0)),
          Info(pk::Str("__0_0.distcp"), 0, pk::Int(1180))},
         {Index("model.w", pk::Size({3, 0}), pk::Int(1)),
          !w_item1_value.empty() ? w_item1_value
                                 : Info(w_item1_path, 512, w_item1_length,
                                        pk::List({pk::Str("stream.zstd/1")}))},
         {Index("optimizer.state.w.step", pk::Size({}), pk::Int(0)),
          Info(pk::Str("__0_0.distcp"), 1180, pk::Int(64))},
         {Index("optimizer.param_groups.0.lr", pk::None(), pk::None()),
          Info(pk::Str("__0_0.distcp"), int64_t{5'000'000'000},
               pk::Int(864))}});
    const std::string storage_meta =
        pk::Obj(kMd, "StorageMeta",
                pk::Dict({{pk::Str("checkpoint_id"), checkpoint_id},
                          {pk::Str("save_id"), pk::Str("abc")},
                          {pk::Str("load_id"), pk::None()}}));
    std::vector<std::pair<std::string, std::string>> attrs = {
        {pk::Str("state_dict_metadata"), sdm},
        {pk::Str("planner_data"), planner}};
    if (storage_data) attrs.emplace_back(pk::Str("storage_data"), storage);
    attrs.emplace_back(pk::Str("storage_meta"), storage_meta);
    attrs.emplace_back(pk::Str("version"), pk::Str("1.0.0"));
    attrs.emplace_back(
        pk::Str("mcore_data"),
        pk::Dict({{pk::Str("model.w"),
                   pk::Dict({{pk::Str("nd_reformulated_orig_global_shape"),
                              pk::None()}})}}));
    return pk::Program(pk::Obj(kMd, "Metadata", pk::Dict(attrs)));
  }
};

const fs::path kWhere = "ckpt/.metadata";

TEST(DcpMetadataTest, EveryEntryKindOfAHandWrittenPickle) {
  const Metadata m = ParseMetadata(MdParts().Bytes(), kWhere);
  int compared = 0;
  auto eq = [&](const auto& got, const auto& want) {
    EXPECT_EQ(got, want);
    ++compared;
  };
  ASSERT_EQ(m.entries.size(), 3u);
  // A tensor with two chunks (the current TensorProperties tuple).
  const Entry& w = m.entries[0];
  eq(w.fqn, std::string("model.w"));
  eq(w.tensor, true);
  eq(w.dtype, DType::kBFloat16);
  eq(w.requires_grad, true);
  eq(w.size, Shape({4, 3}));
  ASSERT_EQ(w.chunks.size(), 2u);
  eq(w.chunks[0].offsets, Shape({0, 0}));
  eq(w.chunks[0].sizes, Shape({3, 3}));
  eq(w.chunks[1].offsets, Shape({3, 0}));
  eq(w.chunks[1].sizes, Shape({1, 3}));
  // A 0-d tensor: one chunk with empty offsets and sizes (torch._shard's
  // TensorProperties).
  const Entry& step = m.entries[1];
  eq(step.fqn, std::string("optimizer.state.w.step"));
  eq(step.tensor, true);
  eq(step.dtype, DType::kFloat32);
  eq(step.size, Shape{});
  ASSERT_EQ(step.chunks.size(), 1u);
  eq(step.chunks[0].offsets, Shape{});
  eq(step.chunks[0].sizes, Shape{});
  // A bytes item.
  eq(m.entries[2].fqn, std::string("optimizer.param_groups.0.lr"));
  eq(m.entries[2].tensor, false);
  // Storage: relative paths, offsets (one beyond 2^32), lengths,
  // transforms; a bytes item's key has no offset.
  ASSERT_EQ(m.storage.size(), 4u);
  const StorageInfo& a = m.storage.at({"model.w", Shape({0, 0})});
  eq(a.relative_path, std::string("__0_0.distcp"));
  eq(a.offset, uint64_t{0});
  eq(a.length, uint64_t{1180});
  eq(a.transforms.size(), size_t{0});
  const StorageInfo& b = m.storage.at({"model.w", Shape({3, 0})});
  eq(b.relative_path, std::string("__1_0.distcp"));
  eq(b.offset, uint64_t{512});
  eq(b.length, uint64_t{700});
  eq(b.transforms, std::vector<std::string>{"stream.zstd/1"});
  const StorageInfo& s = m.storage.at({"optimizer.state.w.step", Shape{}});
  eq(s.offset, uint64_t{1180});
  eq(s.length, uint64_t{64});
  const StorageInfo& lr =
      m.storage.at({"optimizer.param_groups.0.lr", std::nullopt});
  eq(lr.offset, uint64_t{5'000'000'000});
  eq(lr.length, uint64_t{864});
  // Planner data in the file's order, an int list index as an int.
  ASSERT_EQ(m.planner_data.size(), 3u);
  eq(m.planner_data[0].first, std::string("model.w"));
  eq(m.planner_data[0].second,
     (std::vector<PathComponent>{std::string("model"), std::string("w")}));
  eq(m.planner_data[2].second,
     (std::vector<PathComponent>{std::string("optimizer"),
                                 std::string("param_groups"), int64_t{0},
                                 std::string("lr")}));
  eq(m.version, std::string("1.0.0"));
  // Attributes torch does not define are kept (Megatron-core's mcore_data);
  // storage_meta is torch's own.
  ASSERT_EQ(m.extra.size(), 1u);
  eq(m.extra[0].first, std::string("mcore_data"));
  pickle::Arena extra_arena;
  const pickle::Value* mcore = pickle::Unpickle(m.extra[0].second, extra_arena);
  ASSERT_NE(mcore, nullptr);
  // The hand-written value: {"model.w": {"nd_reformulated_orig_global_shape":
  // None}}.
  ASSERT_TRUE(mcore->IsDictLike());
  ASSERT_EQ(mcore->entries.size(), 1u);
  eq(mcore->entries[0].first->AsStr(),
     std::optional<std::string_view>("model.w"));
  const pickle::Value* inner = mcore->entries[0].second;
  ASSERT_TRUE(inner != nullptr && inner->IsDictLike() &&
              inner->entries.size() == 1u);
  eq(inner->entries[0].first->AsStr(),
     std::optional<std::string_view>("nd_reformulated_orig_global_shape"));
  eq(inner->entries[0].second->kind, pickle::Kind::kNone);
  eq(m.Find("optimizer.state.w.step"), &m.entries[1]);
  eq(m.Find("model.nosuch"), static_cast<const Entry*>(nullptr));
  EXPECT_GE(compared, 35);
}

// Negative control: the comparison above sees a changed byte.
TEST(DcpMetadataTest, AChangedSizeIsSeen) {
  MdParts p;
  p.w_chunk0_sizes = pk::Size({2, 3});
  const Metadata m = ParseMetadata(p.Bytes(), kWhere);
  EXPECT_NE(m.entries[0].chunks[0].sizes, Shape({3, 3}));
  p = MdParts();
  p.w_item1_length = pk::Int(701);
  EXPECT_NE(ParseMetadata(p.Bytes(), kWhere)
                .storage.at({"model.w", Shape({3, 0})})
                .length,
            700u);
}

TEST(DcpMetadataTest, MalformedMetadataNamesTheKey) {
  struct Case {
    const char* what;
    void (*change)(MdParts&);
    const char* message;
  };
  const Case cases[] = {
      {"offsets and sizes of different ranks",
       [](MdParts& p) { p.w_chunk0_offsets = pk::Size({0}); },
       "model.w > chunk: 1 offsets but 2 sizes"},
      {"an unknown dtype",
       [](MdParts& p) {
         p.w_props = pk::Obj(kMd, "TensorProperties",
                             pk::Tuple({pk::Global("torch", "nosuch")}));
       },
       "unknown global torch.nosuch"},
      {"a dtype that is not a global",
       [](MdParts& p) {
         p.w_props =
             pk::Obj(kMd, "TensorProperties", pk::Tuple({pk::Str("float32")}));
       },
       "model.w > properties: dtype is not a torch dtype"},
      {"a negative size",
       [](MdParts& p) {
         p.w_size = pk::Size({-4, 3});
       },
       "model.w > size: negative size -4"},
      {"a size that is not a torch.Size",
       [](MdParts& p) { p.w_size = pk::Str("4x3"); },
       "model.w > size: not a torch.Size"},
      {"chunks that are not a list",
       [](MdParts& p) { p.w_chunks_list = pk::Int(2); },
       "model.w > chunks: not a list"},
      {"an unknown global (nothing executed)",
       [](MdParts& p) {
         p.checkpoint_id = pk::Reduce(pk::Global("os", "system"),
                                      pk::Tuple({pk::Str("true")}));
       },
       "unknown global os.system"},
      {"a relative path leaving the folder",
       [](MdParts& p) { p.w_item1_path = pk::Str("../x.distcp"); },
       "storage_data > model.w: relative_path '../x.distcp' is not a file"},
      {"a negative length", [](MdParts& p) { p.w_item1_length = pk::Int(-1); },
       "storage_data > model.w: negative offset or length"},
      {"a length that is not an int",
       [](MdParts& p) { p.w_item1_length = pk::Str("700"); },
       "storage_data > model.w > length: not an int"},
      {"an item that is not a _StorageInfo",
       [](MdParts& p) { p.w_item1_value = pk::Dict({}); },
       "storage_data > model.w: not a _StorageInfo"},
      {"a key twice", [](MdParts& p) { p.second_key = "model.w"; },
       "key model.w twice"},
      {"an entry of another class",
       [](MdParts& p) { p.lr_entry = pk::Str("bytes"); },
       "optimizer.param_groups.0.lr: a "},
      {"no storage_data", [](MdParts& p) { p.storage_data = false; },
       "no storage_data dict"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    MdParts p;
    c.change(p);
    const std::string bytes = p.Bytes();
    EXPECT_THAT([&] { ParseMetadata(bytes, kWhere); },
                ThrowsMessage<FormatError>(::testing::AllOf(
                    HasSubstr("ckpt/.metadata"), HasSubstr(c.message))));
  }
  // Not a Metadata object; not a pickle at all; a truncated one.
  EXPECT_THAT([] { ParseMetadata(pk::Program(pk::Dict({})), kWhere); },
              ThrowsMessage<FormatError>(HasSubstr("not a DCP Metadata")));
  EXPECT_THAT([] { ParseMetadata("PK\x03\x04 not a pickle", kWhere); },
              ThrowsMessage<FormatError>(HasSubstr("ckpt/.metadata")));
  const std::string whole = MdParts().Bytes();
  EXPECT_THAT([&] { ParseMetadata(whole.substr(0, whole.size() / 2), kWhere); },
              ThrowsMessage<FormatError>(HasSubstr("ckpt/.metadata")));
}

// ---- Real files: the canonical text dump_dcp_metadata.py makes of what
// torch reads, built here from ucp's parse. ----

std::string Dims(const Shape& s) {
  if (s.empty()) return "()";
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += StrCat(i ? "," : "", s[i]);
  return out;
}

struct Canonical {
  std::string text;
  int64_t values = 0;
};

Canonical CanonicalOf(const Metadata& m) {
  Canonical c;
  for (const Entry& e : m.entries) {
    if (e.tensor) {
      std::string chunks;
      for (size_t i = 0; i < e.chunks.size(); ++i) {
        chunks += StrCat(i ? ";" : "", Dims(e.chunks[i].offsets), ":",
                         Dims(e.chunks[i].sizes));
        c.values += 2 * static_cast<int64_t>(e.chunks[i].offsets.size());
      }
      c.text += StrCat("T ", e.fqn, " ", DTypeName(e.dtype), " ", Dims(e.size),
                       " ", chunks, "\n");
      c.values += 2 + static_cast<int64_t>(e.size.size());
    } else {
      c.text += StrCat("B ", e.fqn, "\n");
      c.values += 1;
    }
  }
  for (const auto& [fqn, path] : m.planner_data) {
    std::string p;
    for (size_t i = 0; i < path.size(); ++i) {
      p += i ? "/" : "";
      p += std::holds_alternative<std::string>(path[i])
               ? std::get<std::string>(path[i])
               : StrCat("#", std::get<int64_t>(path[i]));
    }
    c.text += StrCat("P ", fqn, " ", p, "\n");
    c.values += 1 + static_cast<int64_t>(path.size());
  }
  std::vector<std::string> storage;
  for (const auto& [key, info] : m.storage) {
    std::string tr;
    for (size_t i = 0; i < info.transforms.size(); ++i)
      tr += StrCat(i ? "," : "", info.transforms[i]);
    storage.push_back(StrCat("S ", key.fqn, " ",
                             key.offset ? Dims(*key.offset) : "-", " ",
                             info.relative_path, " ", info.offset, " ",
                             info.length, " ", tr.empty() ? "-" : tr, "\n"));
    c.values += 6;
  }
  std::sort(storage.begin(), storage.end());
  for (const std::string& s : storage) c.text += s;
  c.text += StrCat("V ", m.version.empty() ? "-" : m.version, "\n");
  return c;
}

struct RealFile {
  const char* what;
  fs::path file;
  size_t keys;
  size_t items;
  int64_t values;
  const char* sha256;  // dump_dcp_metadata.py, torch 2.15 reading the file
};

std::vector<RealFile> RealFiles() {
  const fs::path fx = testutil::FixturesDir();
  const fs::path data =
      testutil::SourceDir() / "tests/unit/engine/formats/data";
  return {
      {"torch 2.6, Python 3.13 (pathlib._local), FSDP2 Shard(0) and "
       "param_groups items",
       fx / "dcp-torch-2.6/dtensor_shard0_w2/ckpt/.metadata", 81, 138, 1787,
       "81fe7f5cb87efe186d4fd378fd986aa32606fb9b453320f505f0eceb42138fdf"},
      {"Megatron-core 0.20 torch_dist (torch 2.6): no planner_data, "
       "all_local_plans of SavePlan / WriteItem",
       fx / "megatron-core-torch-dist/tp2pp1dp1/ckpt/iter_0000010/.metadata",
       55, 231, 2721,
       "a718eeadaf97387acd60a0cafa2b07d84d4bb4ac7a6c2c5b0b79d02f1a286ce6"},
      {"torch 2.15, zstd items, version 1.0.0",
       data / "dcp_torch2.15_zstd_w2.metadata", 3, 4, 51,
       "259217aa80e09cffa336a712da3a97f5eb656b6483c081d5543a5117f13a0d33"},
      {"torch 2.15, no process group, bytes items and an fp16 tensor",
       data / "dcp_torch2.15_nopg.metadata", 8, 8, 107,
       "9ee7720a06ed9880987c7e615f567d831a9a037c4a605724b56ec0ad3a759087"},
  };
}

TEST(DcpMetadataTest, RealFilesReadAsTorchReadsThem) {
  int64_t total = 0;
  for (const RealFile& f : RealFiles()) {
    SCOPED_TRACE(f.what);
    const Metadata m = ParseMetadata(testutil::ReadFile(f.file), f.file);
    EXPECT_EQ(m.entries.size(), f.keys);
    EXPECT_EQ(m.storage.size(), f.items);
    const Canonical c = CanonicalOf(m);
    EXPECT_EQ(c.values, f.values);
    EXPECT_EQ(testutil::Sha256Hex(c.text), f.sha256) << c.text;
    total += c.values;
    // Negative control: one changed length changes the digest.
    Metadata changed = ParseMetadata(testutil::ReadFile(f.file), f.file);
    ++changed.storage.rbegin()->second.length;
    EXPECT_NE(testutil::Sha256Hex(CanonicalOf(changed).text), f.sha256);
  }
  EXPECT_GE(total, 4600);
}

TEST(DcpMetadataTest, RealFilesFacts) {
  const std::vector<RealFile> files = RealFiles();
  // torch 2.6 (as torch reports it): wte.weight [50, 24] Shard(0) in two
  // chunks of 25 rows, its item on rank 0 at 0 + 3548 bytes; a 0-d step;
  // 5 param_groups bytes items on rank 1.
  const Metadata a =
      ParseMetadata(testutil::ReadFile(files[0].file), files[0].file);
  const Entry* wte = a.Find("model.wte.weight");
  ASSERT_NE(wte, nullptr);
  EXPECT_EQ(wte->size, Shape({50, 24}));
  EXPECT_EQ(wte->chunks[1].offsets, Shape({25, 0}));
  const StorageInfo& i = a.storage.at({"model.wte.weight", Shape({0, 0})});
  EXPECT_EQ(i.relative_path, "__0_0.distcp");
  EXPECT_EQ(i.length, 3548u);
  EXPECT_EQ(
      a.storage.at({"optimizer.param_groups.0.params", std::nullopt}).offset,
      3456u);
  EXPECT_TRUE(a.version.empty());
  EXPECT_TRUE(a.extra.empty());
  // Megatron-core: all_local_plans kept as an extra attribute; bf16 keys.
  const Metadata b =
      ParseMetadata(testutil::ReadFile(files[1].file), files[1].file);
  ASSERT_EQ(b.extra.size(), 1u);
  EXPECT_EQ(b.extra[0].first, "all_local_plans");
  EXPECT_TRUE(b.planner_data.empty());
  EXPECT_EQ(b.Find("embedding.word_embeddings.weight")->dtype,
            DType::kBFloat16);
  // torch 2.15: zstd transforms, version.
  const Metadata c =
      ParseMetadata(testutil::ReadFile(files[2].file), files[2].file);
  EXPECT_EQ(c.version, "1.0.0");
  EXPECT_EQ(c.storage.at({"meta.tokens", std::nullopt}).transforms,
            std::vector<std::string>{"stream.zstd/1"});
}

// What ucp writes reads back to the same content (torch reading it is
// tests/cli/test_dcp_cli.py's): the torch-checked canonical text but for
// the version ucp writes.
TEST(DcpMetadataTest, PickleMetadataReadsBackToWhatWasParsed) {
  for (const RealFile& f : RealFiles()) {
    SCOPED_TRACE(f.what);
    const Metadata m = ParseMetadata(testutil::ReadFile(f.file), f.file);
    const Metadata again = ParseMetadata(PickleMetadata(m, "s"), "again");
    std::string want = CanonicalOf(m).text;
    want = want.substr(0, want.rfind("V ")) + "V 1.0.0\n";
    EXPECT_EQ(CanonicalOf(again).text, want);
    EXPECT_EQ(again.extra, m.extra);  // names and pickled values
  }
}

}  // namespace
}  // namespace ucp::dcp
