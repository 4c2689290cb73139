// Corrupted torch.save files (run under ASan + UBSan): every one is either
// read correctly or rejected with ucp::FormatError / IoError naming the file;
// never a crash, a hang, a huge allocation or another exception type.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <typeinfo>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/torchfile/zip.h"
#include "tests/testutil/testutil.h"

namespace ucp::torchfile {
namespace {

using pickle::Arena;
using pickle::ObjectOp;
using pickle::Value;
using ::testing::HasSubstr;

enum class Outcome { kOk, kFormatError, kIoError, kOther };

std::span<const std::byte> Bytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

// Opens `path` and reads every tensor (up to a sane size: a view may declare
// many elements over a tiny storage through stride 0).
Outcome Attempt(const std::filesystem::path& path, std::string* message) {
  try {
    TorchFile f = TorchFile::Open(path);
    for (const TensorInfo& t : f.tensors()) {
      if (t.nbytes > (uint64_t{64} << 20)) continue;
      std::vector<std::byte> buf(t.nbytes);
      f.ReadTensor(t, buf);
    }
    for (const StorageInfo& s : f.storages()) {
      if (s.nbytes > (uint64_t{64} << 20)) continue;
      std::vector<std::byte> buf(s.nbytes);
      f.ReadStorage(s, 0, buf);
    }
    return Outcome::kOk;
  } catch (const FormatError& e) {
    *message = e.what();
    return Outcome::kFormatError;
  } catch (const IoError& e) {
    *message = e.what();
    return Outcome::kIoError;
  } catch (const std::exception& e) {
    *message = std::string(typeid(e).name()) + ": " + e.what();
    return Outcome::kOther;
  }
}

// Success, or FormatError/IoError whose message names the file.
void ExpectCleanOutcome(const std::filesystem::path& path,
                        const std::string& what) {
  std::string message;
  Outcome o = Attempt(path, &message);
  if (o == Outcome::kOther) {
    ADD_FAILURE() << what << ": unexpected exception " << message;
  } else if (o != Outcome::kOk) {
    EXPECT_THAT(message, HasSubstr(path.filename().string())) << what;
  }
}

void ExpectFormatError(const std::filesystem::path& path,
                       const std::string& contains) {
  std::string message;
  Outcome o = Attempt(path, &message);
  EXPECT_EQ(o, Outcome::kFormatError) << message;
  EXPECT_THAT(message, HasSubstr(path.filename().string()));
  EXPECT_THAT(message, HasSubstr(contains));
}

uint64_t SeedAndPrint() {
  const uint64_t seed = testutil::Seed();
  std::printf("UCP_TEST_SEED=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

// A small valid file written by TorchWriter: several dtypes, a parameter,
// a 0-d tensor, nested containers, a Namespace-like object.
std::string ValidZip(const testutil::TempDir& dir) {
  const std::filesystem::path p = dir / "base.pt";
  TorchWriter w(p);
  Arena& a = w.arena();
  Value* t0 = w.NewTensor({DType::kFloat32, {2, 3}});
  Value* t1 = w.NewTensor({DType::kBFloat16, {5}, true, true});
  Value* t2 = w.NewTensor({DType::kInt64, {}});
  Value* t3 = w.NewTensor({DType::kUInt16, {3}});
  Value* ns = a.Object(ObjectOp::kNewObj, a.Global("argparse", "Namespace"),
                       a.Tuple({}));
  ns->state = a.Dict({{a.Str("lr"), a.Float(0.5)}});
  Value* root = a.Dict({{a.Str("w"), t0},
                        {a.Str("p"), t1},
                        {a.Str("list"), a.List({t2, a.Tuple({t3, t0})})},
                        {a.Str("args"), ns}});
  w.Begin(root);
  for (Value* t : {t0, t1, t2, t3}) {
    std::string data(w.TensorBytes(t), '\0');
    for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7);
    w.WriteTensorData(t, 0, Bytes(data));
  }
  w.Commit();
  return testutil::ReadFile(p);
}

TEST(TorchFileMalformedTest, TruncatedZipAtEveryCutPoint) {
  testutil::TempDir dir;
  const std::string good = ValidZip(dir);
  const std::filesystem::path victim = dir / "victim.pt";
  testutil::WriteFile(victim, good);
  std::string message;
  ASSERT_EQ(Attempt(victim, &message), Outcome::kOk) << message;
  for (size_t cut = 0; cut < good.size(); ++cut) {
    testutil::WriteFile(victim, good.substr(0, cut));
    std::string msg;
    EXPECT_EQ(Attempt(victim, &msg), Outcome::kFormatError)
        << "cut at " << cut << ": " << msg;
    EXPECT_THAT(msg, HasSubstr("victim.pt")) << "cut at " << cut;
  }
}

TEST(TorchFileMalformedTest, TruncatedLegacyStreamAtEveryCutPoint) {
  const std::string good = testutil::ReadFile(
      testutil::FixturesDir() / "torch-2.6-save/legacy_format_mixed.pt");
  ASSERT_GT(good.size(), 1000u);
  testutil::TempDir dir;
  const std::filesystem::path victim = dir / "legacy.pt";
  for (size_t cut = 0; cut < good.size(); ++cut) {
    testutil::WriteFile(victim, good.substr(0, cut));
    std::string msg;
    EXPECT_EQ(Attempt(victim, &msg), Outcome::kFormatError)
        << "cut at " << cut << ": " << msg;
    EXPECT_THAT(msg, HasSubstr("legacy.pt")) << "cut at " << cut;
  }
}

TEST(TorchFileMalformedTest, CorruptedDirectoryAndHeaders) {
  const uint64_t seed = SeedAndPrint();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const std::string good = ValidZip(dir);
  ZipReader reader = ZipReader::Open(dir / "base.pt");
  struct Region {
    const char* name;
    size_t begin;
    size_t end;
  };
  std::vector<Region> regions;
  const size_t eocd = good.size() - 22;
  regions.push_back({"eocd", eocd, good.size()});
  regions.push_back({"zip64 locator", eocd - 20, eocd});
  regions.push_back({"zip64 eocd", eocd - 76, eocd - 20});
  for (const ZipEntry& e : reader.entries()) {
    regions.push_back({"local header", e.local_header_offset,
                       e.local_header_offset + 30 + e.name.size()});
  }
  uint32_t cd = 0;  // the classic EOCD's directory offset
  std::memcpy(&cd, good.data() + eocd + 16, 4);
  ASSERT_EQ(good.compare(cd, 4, "PK\x01\x02"), 0);
  regions.push_back({"central directory", cd, eocd - 76});
  const std::filesystem::path victim = dir / "victim.pt";
  int failures = 0;
  for (int i = 0; i < 3000; ++i) {
    const Region& r = regions[rng() % regions.size()];
    std::string bad = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < flips; ++k) {
      const size_t pos = r.begin + rng() % (r.end - r.begin);
      // Mostly random bytes, sometimes the all-ones value that zip uses as a
      // zip64 marker.
      bad[pos] = (rng() % 4 == 0) ? '\xFF' : static_cast<char>(rng());
    }
    testutil::WriteFile(victim, bad);
    std::string msg;
    const Outcome o = Attempt(victim, &msg);
    if (o == Outcome::kFormatError) ++failures;
    ASSERT_NE(o, Outcome::kOther)
        << r.name << " iteration " << i << ": " << msg;
    if (o != Outcome::kOk) {
      ASSERT_THAT(msg, HasSubstr("victim.pt")) << r.name << " iteration " << i;
    }
  }
  EXPECT_GT(failures, 1000);  // most corruptions are noticed
}

// A zip with the given records, written with our ZipWriter.
void WriteZip(const std::filesystem::path& path,
              const std::vector<std::pair<std::string, std::string>>& records) {
  std::vector<ZipRecordSpec> specs;
  for (const auto& [name, data] : records) specs.push_back({name, data.size()});
  ZipWriter w(path, specs);
  for (size_t i = 0; i < records.size(); ++i) {
    w.Write(i, 0, Bytes(records[i].second));
  }
  w.Commit();
}

// _rebuild_tensor_v2(persid(pid), offset, size, stride, False, OrderedDict())
Value* TensorNode(Arena& a, Value* pid, int64_t offset,
                  const std::vector<int64_t>& size,
                  const std::vector<int64_t>& stride) {
  std::vector<Value*> sz, st;
  for (int64_t x : size) sz.push_back(a.Int(x));
  for (int64_t x : stride) st.push_back(a.Int(x));
  return a.Object(
      ObjectOp::kReduce, a.Global("torch._utils", "_rebuild_tensor_v2"),
      a.Tuple({a.PersId(pid), a.Int(offset), a.Tuple(sz), a.Tuple(st),
               a.Bool(false),
               a.Object(ObjectOp::kReduce,
                        a.Global("collections", "OrderedDict"), a.Tuple({}))}));
}

Value* Pid(Arena& a, const char* cls, const char* key, int64_t numel) {
  return a.Tuple({a.Str("storage"), a.Global("torch", cls), a.Str(key),
                  a.Str("cpu"), a.Int(numel)});
}

// A zip whose data.pkl holds `root` and whose data/0 has `storage_bytes`.
void WriteTensorZip(const std::filesystem::path& path, const Value* root,
                    size_t storage_bytes, bool with_storage = true) {
  std::vector<std::pair<std::string, std::string>> records = {
      {"x/data.pkl", pickle::Pickle(root)}};
  if (with_storage)
    records.push_back({"x/data/0", std::string(storage_bytes, 'd')});
  records.push_back({"x/version", "3\n"});
  WriteZip(path, records);
}

TEST(TorchFileMalformedTest, BadTensorsAndStorages) {
  testutil::TempDir dir;
  const std::filesystem::path victim = dir / "bad.pt";
  {  // The reference case is fine.
    Arena a;
    WriteTensorZip(
        victim, TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {1}), 16);
    std::string msg;
    ASSERT_EQ(Attempt(victim, &msg), Outcome::kOk) << msg;
  }
  {
    Arena a;
    WriteTensorZip(
        victim, TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {1}), 16,
        /*with_storage=*/false);
    ExpectFormatError(victim, "missing record data/0");
  }
  {
    Arena a;
    WriteTensorZip(
        victim, TensorNode(a, Pid(a, "FloatStorage", "0", 4), 2, {3}, {1}), 16);
    ExpectFormatError(victim, "reaches");
  }
  {
    Arena a;
    WriteTensorZip(
        victim,
        TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {2, 2}, {3, 1}), 16);
    ExpectFormatError(victim, "reaches");
  }
  {
    Arena a;
    WriteTensorZip(
        victim, TensorNode(a, Pid(a, "FloatStorage", "0", 8), 0, {4}, {1}), 16);
    ExpectFormatError(victim, "has 16 bytes");
  }
  {
    Arena a;
    WriteTensorZip(victim,
                   TensorNode(a, Pid(a, "FloatStorage", "0", int64_t{1} << 60),
                              0, {4}, {1}),
                   16);
    ExpectFormatError(victim, "data/0");
  }
  {
    Arena a;
    WriteTensorZip(victim,
                   TensorNode(a, Pid(a, "DoubleStorage", "0", int64_t{1} << 62),
                              0, {4}, {1}),
                   16);
    ExpectFormatError(victim, "absurd");
  }
  {
    Arena a;
    WriteTensorZip(victim,
                   TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0,
                              {int64_t{1} << 40, int64_t{1} << 40}, {0, 0}),
                   16);
    ExpectFormatError(victim, "absurd shape");
  }
  {
    Arena a;
    WriteTensorZip(victim,
                   TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {-1}),
                   16);
    ExpectFormatError(victim, "stride");
  }
  {
    Arena a;
    WriteTensorZip(
        victim, TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {1, 1}),
        16);
    ExpectFormatError(victim, "strides");
  }
  {
    Arena a;
    WriteTensorZip(
        victim, TensorNode(a, Pid(a, "QInt8Storage", "0", 4), 0, {4}, {1}), 16);
    ExpectFormatError(victim, "unknown storage class torch.QInt8Storage");
  }
  {
    Arena a;
    Value* pid = a.Tuple({a.Str("storage"), a.Global("torch", "FloatStorage"),
                          a.Str("0"), a.Str("cpu")});
    WriteTensorZip(victim, TensorNode(a, pid, 0, {4}, {1}), 16);
    ExpectFormatError(victim, "4 fields");
  }
  {
    Arena a;
    Value* pid = a.Tuple({a.Str("storage"), a.Global("torch", "FloatStorage"),
                          a.Int(0), a.Str("cpu"), a.Int(4)});
    WriteTensorZip(victim, TensorNode(a, pid, 0, {4}, {1}), 16);
    ExpectFormatError(victim, "not a string");
  }
  {
    Arena a;
    WriteTensorZip(victim, a.PersId(a.Str("storage")), 16);
    ExpectFormatError(victim, "not a tuple");
  }
  {  // v3 with an unknown dtype global.
    Arena a;
    Value* t = TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {1});
    t->callable = a.Global("torch._utils", "_rebuild_tensor_v3");
    t->args->items.push_back(a.Global("torch", "no_such_dtype"));
    WriteTensorZip(victim, t, 16);
    ExpectFormatError(victim, "unknown tensor dtype");
  }
  {  // Parameter of something that is not a tensor.
    Arena a;
    Value* p = a.Object(ObjectOp::kReduce,
                        a.Global("torch._utils", "_rebuild_parameter"),
                        a.Tuple({a.Int(1), a.Bool(true), a.Dict()}));
    WriteTensorZip(victim, p, 16);
    ExpectFormatError(victim, "not a tensor");
  }
  {  // The same key declared with two storage classes.
    Arena a;
    Value* root =
        a.List({TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {1}),
                TensorNode(a, Pid(a, "IntStorage", "0", 4), 0, {4}, {1})});
    WriteTensorZip(victim, root, 16);
    ExpectFormatError(victim, "declared both");
  }
  {  // Big-endian files are refused.
    Arena a;
    WriteZip(victim, {{"x/data.pkl", pickle::Pickle(a.Int(1))},
                      {"x/byteorder", "big"},
                      {"x/version", "3\n"}});
    ExpectFormatError(victim, "byteorder");
  }
}

TEST(TorchFileMalformedTest, BadDataPkl) {
  const uint64_t seed = SeedAndPrint();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const std::filesystem::path victim = dir / "pkl.pt";
  Arena a;
  const std::string good = pickle::Pickle(
      TensorNode(a, Pid(a, "FloatStorage", "0", 4), 0, {4}, {1}));
  for (size_t cut = 0; cut < good.size(); ++cut) {
    WriteZip(victim, {{"x/data.pkl", good.substr(0, cut)},
                      {"x/data/0", std::string(16, 'd')}});
    ExpectFormatError(victim, "data.pkl");
  }
  std::string unknown = good;
  unknown[2] = '\xFE';  // not an opcode
  WriteZip(victim,
           {{"x/data.pkl", unknown}, {"x/data/0", std::string(16, 'd')}});
  ExpectFormatError(victim, "data.pkl");
  for (int i = 0; i < 500; ++i) {
    std::string bad = good;
    bad[rng() % bad.size()] = static_cast<char>(rng());
    WriteZip(victim, {{"x/data.pkl", bad}, {"x/data/0", std::string(16, 'd')}});
    ExpectCleanOutcome(victim, "random data.pkl byte");
  }
}

TEST(TorchFileMalformedTest, RecursionBombsInsideAZip) {
  testutil::TempDir dir;
  const std::filesystem::path victim = dir / "bomb.pt";
  // Nesting 200000 lists deep.
  std::string nested = "\x80\x02";
  for (int i = 0; i < 200000; ++i) nested += ']';
  for (int i = 0; i < 199999; ++i) nested += 'a';
  nested += '.';
  WriteZip(victim, {{"x/data.pkl", nested}});
  ExpectCleanOutcome(victim, "nested lists");
  // A 200000-long chain of lists built through the memo: shallow while
  // unpickling, deep as a graph. Must not overflow any recursive walk.
  std::string chain = "\x80\x02]r\x00\x00\x00\x00";
  for (uint32_t i = 1; i < 200000; ++i) {
    chain += ']';  // new list
    chain += 'j';  // LONG_BINGET i - 1
    uint32_t prev = i - 1;
    chain.append(reinterpret_cast<const char*>(&prev), 4);
    chain += 'a';  // APPEND
    chain += 'r';  // LONG_BINPUT i
    chain.append(reinterpret_cast<const char*>(&i), 4);
  }
  chain += '.';
  WriteZip(victim, {{"x/data.pkl", chain}});
  ExpectCleanOutcome(victim, "memo chain");
  // A dict nested 100000 deep through SETITEM.
  std::string dicts = "\x80\x02";
  for (int i = 0; i < 100000; ++i) dicts += "}K\x01";
  dicts += "N";
  for (int i = 0; i < 100000; ++i) dicts += 's';
  dicts += '.';
  WriteZip(victim, {{"x/data.pkl", dicts}});
  ExpectCleanOutcome(victim, "nested dicts");
}

// A directory size far beyond what its entry count can need (a damaged
// size or offset in the end records) is rejected before it is read: here
// the "directory" would be the whole 4 MiB archive.
TEST(TorchFileMalformedTest, DirectoryLargerThanItsEntriesCanBe) {
  testutil::TempDir dir;
  const std::filesystem::path victim = dir / "bigdir.pt";
  WriteZip(victim, {{"x/data.pkl", pickle::Pickle(Arena().Int(1))},
                    {"x/data/0", std::string(4 << 20, 'd')}});
  std::string bytes = testutil::ReadFile(victim);
  const size_t z64 = bytes.rfind("PK\x06\x06");
  ASSERT_NE(z64, std::string::npos);
  const uint64_t cd_size = z64;  // offset 0 .. the zip64 EOCD
  const uint64_t cd_offset = 0;
  std::memcpy(bytes.data() + z64 + 40, &cd_size, 8);
  std::memcpy(bytes.data() + z64 + 48, &cd_offset, 8);
  testutil::WriteFile(victim, bytes);
  ExpectFormatError(victim, "cannot hold 2 entries");
}

// One long key object shared (BINGET) by every level of a deep nesting:
// every tensor's path repeats it hundreds of times, so paths would be far
// larger than the file (here ~900 x 256 KiB per tensor).
TEST(TorchFileMalformedTest, SharedKeysAlongADeepNestingDoNotMultiplyPaths) {
  testutil::TempDir dir;
  auto write = [&](const std::filesystem::path& p, size_t key_len) {
    TorchWriter w(p);
    Arena& a = w.arena();
    Value* key = a.Str(std::string(key_len, 'k'));
    std::vector<Value*> tensors;
    for (int i = 0; i < 4; ++i) {
      tensors.push_back(w.NewTensor({DType::kFloat32, {1}}));
    }
    Value* node = a.List(tensors);
    for (int level = 0; level < 900; ++level) node = a.Dict({{key, node}});
    w.Begin(node);
    for (Value* t : tensors) w.WriteTensorData(t, 0, Bytes("abcd"));
    w.Commit();
  };
  const std::filesystem::path shortkeys = dir / "short_keys.pt";
  write(shortkeys, 1);
  TorchFile f = TorchFile::Open(shortkeys);
  ASSERT_EQ(f.tensors().size(), 4u);
  ASSERT_TRUE(f.tensors()[3].path.has_value());
  EXPECT_EQ(f.tensors()[3].path->size(), 901u);
  EXPECT_EQ(f.tensors()[3].path->back(), PathComponent(int64_t{3}));

  const std::filesystem::path longkeys = dir / "long_keys.pt";
  write(longkeys, 256 << 10);
  ExpectFormatError(longkeys, "paths of the tensors exceed");
}

// Random byte flips over whole files of every kind we read.
TEST(TorchFileMalformedTest, RandomByteFlips) {
  const uint64_t seed = SeedAndPrint();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  std::vector<std::pair<std::string, std::string>> seeds = {
      {"ours", ValidZip(dir)}};
  for (const char* rel :
       {"torch-2.6-save/legacy_format_mixed.pt",
        "torch-2.6-save/views_shared_storage.pt",
        "torch-2.6-save/mixed_dtypes.pt", "torch-2.6-save/params.pt",
        "deepspeed-0.14.5/ds0145_z2_bf16_w2_mlp/global_step2/"
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"}) {
    seeds.emplace_back(rel, testutil::ReadFile(testutil::FixturesDir() / rel));
  }
  const char* testdata = std::getenv("UCP_TESTDATA");
  if (testdata != nullptr) {
    for (const char* name :
         {"rezip_deflated.pt", "legacy_views.pt", "protocol4.pt"}) {
      const std::filesystem::path p =
          std::filesystem::path(testdata) / "torch" / name;
      if (std::filesystem::exists(p))
        seeds.emplace_back(name, testutil::ReadFile(p));
    }
  }
  const std::filesystem::path victim = dir / "flipped.pt";
  for (const auto& [name, good] : seeds) {
    SCOPED_TRACE(name);
    ASSERT_FALSE(good.empty());
    testutil::WriteFile(victim, good);
    std::string msg;
    ASSERT_EQ(Attempt(victim, &msg), Outcome::kOk) << msg;
    for (int i = 0; i < 400; ++i) {
      std::string bad = good;
      const int flips = 1 + static_cast<int>(rng() % 8);
      for (int k = 0; k < flips; ++k) {
        bad[rng() % bad.size()] ^= static_cast<char>(1 + rng() % 255);
      }
      testutil::WriteFile(victim, bad);
      ExpectCleanOutcome(victim, name + " flip round " + std::to_string(i));
    }
  }
}

TEST(TorchFileMalformedTest, SlicesOutsideTheFile) {
  testutil::TempDir dir;
  const std::string good = ValidZip(dir);
  const std::filesystem::path p = dir / "base.pt";
  EXPECT_THAT([&] { TorchFile::Open(p, 10, good.size()); },
              testing::ThrowsMessage<FormatError>(HasSubstr("base.pt")));
  EXPECT_THAT([&] { TorchFile::Open(p, 1, good.size() - 1); },
              testing::ThrowsMessage<FormatError>(HasSubstr("base.pt")));
}

TEST(TorchFileMalformedTest, WriterFailuresLeaveNoFinalFile) {
  testutil::TempDir dir;
  const std::filesystem::path out = dir / "out.pt";
  {
    TorchWriter w(out);
    Value* t = w.NewTensor({DType::kFloat32, {4}});
    w.Begin(t);
    w.WriteTensorData(t, 0, Bytes("12345678"));
    EXPECT_THROW(w.Commit(), UsageError);
  }
  EXPECT_FALSE(std::filesystem::exists(out));
  try {
    TorchWriter w(out);
    Value* t = w.NewTensor({DType::kFloat32, {4}});
    w.Begin(t);
    throw std::runtime_error("mid-way");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(std::filesystem::exists(out));
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

}  // namespace
}  // namespace ucp::torchfile
