// TorchWriter against torch itself: files written from scratch load in
// torch 1.13 with the expected values, their data.pkl equals torch.save's
// byte for byte, and every fixture survives a compact round trip.

#include "engine/torchfile/torch_writer.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/pickle/pickle.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/zip.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/torchfile/torchfile_testutil.h"

namespace ucp::torchfile {
namespace {

using test::Bytes;

using pickle::Arena;
using pickle::ObjectOp;
using pickle::Value;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

template <typename T>
std::string Raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()),
                     v.size() * sizeof(T));
}

std::string Q(const std::filesystem::path& p) {
  return testutil::ShellQuote(p.string());
}

// The data.pkl record of a torch.save file.
std::string DataPkl(const std::filesystem::path& file) {
  TorchFile f = TorchFile::Open(file);
  return std::string(f.pickle_bytes());
}

TEST(TorchWriterTest, FromScratchFileLoadsInTorchWithExactValues) {
  testutil::TempDir dir;
  const std::filesystem::path ours = dir / "ours.pt";
  TorchWriter w(ours);
  Arena& a = w.arena();
  Value* tw = w.NewTensor({DType::kFloat32, {2, 3}});
  Value* th = w.NewTensor({DType::kBFloat16, {4}});
  Value* root = a.Dict({{a.Str("w"), tw},
                        {a.Str("h"), th},
                        {a.Str("meta"), a.Dict({{a.Str("step"), a.Int(5)}})}});
  w.Begin(root);
  EXPECT_FALSE(std::filesystem::exists(ours));
  EXPECT_EQ(w.StorageKey(tw), "0");
  EXPECT_EQ(w.StorageKey(th), "1");
  EXPECT_EQ(w.TensorBytes(th), 8u);
  w.WriteTensorData(
      th, 0, Bytes(Raw(std::vector<uint16_t>{0x3F80, 0x4000, 0x4040, 0xBF80})));
  w.WriteTensorData(tw, 12, Bytes(Raw(std::vector<float>{4, 5, 6})));
  w.WriteTensorData(tw, 0, Bytes(Raw(std::vector<float>{1, 2, 3})));
  w.Commit();
  ASSERT_TRUE(std::filesystem::exists(ours));

  testutil::WriteFile(dir / "spec.json", R"({
    "top_type": "dict", "exact_tensors": true,
    "tensors": [
      {"path": ["w"], "dtype": "float32", "shape": [2, 3],
       "values": [1, 2, 3, 4, 5, 6], "requires_grad": false, "is_parameter": false},
      {"path": ["h"], "dtype": "bfloat16", "shape": [4],
       "bits": [16256, 16384, 16448, 49024], "requires_grad": false,
       "is_parameter": false}],
    "leaves": [{"path": ["meta", "step"], "value": 5}]})");
  std::string out;
  EXPECT_EQ(test::CheckTorchFiles(
                "expect " + Q(dir / "spec.json") + " " + Q(ours), &out),
            0)
      << out;
  EXPECT_EQ(test::CheckTorchFiles("zipcheck " + Q(ours), &out), 0) << out;

  // torch.save of the same objects: identical data.pkl and storages.
  ASSERT_EQ(test::RunPythonScript(R"PY(
import sys, torch
w = torch.tensor([[1, 2, 3], [4, 5, 6]], dtype=torch.float32)
h = torch.tensor([1, 2, 3, -1], dtype=torch.bfloat16)
torch.save({"w": w, "h": h, "meta": {"step": 5}}, sys.argv[1])
)PY",
                                  Q(dir / "ours_py.pt"), &out),
            0)
      << out;
  EXPECT_EQ(DataPkl(dir / "ours_py.pt"), w.pickle_bytes());
  TorchFile py = TorchFile::Open(dir / "ours_py.pt");
  TorchFile mine = TorchFile::Open(ours);
  ASSERT_EQ(py.tensors().size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(test::TensorBytes(py, py.tensors()[i]),
              test::TensorBytes(mine, mine.tensors()[i]));
  }
  // Same record names as torch 2.x minus its optional extras.
  std::vector<std::string> names;
  for (const ZipEntry& e : mine.zip()->entries()) names.push_back(e.name);
  EXPECT_THAT(names, testing::ElementsAre("ours/data.pkl", "ours/byteorder",
                                          "ours/data/0", "ours/data/1",
                                          "ours/version"));
}

// Values k * 0.25 (k = 0, 1, ...) in `dtype`, as the Python side makes them
// with torch.arange(n, dtype=float64) * 0.25 -> dtype.
std::string Pattern(DType dtype, int64_t n) {
  std::string out;
  for (int64_t k = 0; k < n; ++k) {
    const float f = static_cast<float>(k) * 0.25f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    switch (dtype) {
      case DType::kFloat32:
        out.append(reinterpret_cast<const char*>(&f), 4);
        break;
      case DType::kBFloat16: {
        const uint16_t b = static_cast<uint16_t>(bits >> 16);  // exact here
        out.append(reinterpret_cast<const char*>(&b), 2);
        break;
      }
      case DType::kInt64: {
        const int64_t v = static_cast<int64_t>(f);
        out.append(reinterpret_cast<const char*>(&v), 8);
        break;
      }
      default:
        ADD_FAILURE() << "no pattern for " << DTypeName(dtype);
    }
  }
  return out;
}

constexpr std::string_view kMegatronLikePy = R"PY(
import argparse, collections, sys, torch
def pat(shape, dtype):
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64) * 0.25).reshape(shape).to(dtype)
sd = collections.OrderedDict()
sd["embedding.word_embeddings.weight"] = pat([4, 3], torch.bfloat16)
sd["layers.0.input_layernorm.weight"] = pat([3], torch.float32)
sd["layers.0.mlp.dense_h_to_4h.bias"] = pat([5], torch.bfloat16)
shared = pat([2], torch.float32)
param = torch.nn.Parameter(pat([2, 2], torch.float32), requires_grad=True)
frozen = torch.nn.Parameter(pat([3], torch.bfloat16), requires_grad=False)
obj = {
    "args": argparse.Namespace(tensor_model_parallel_size=2, lr_value=0.5, name_str="gpt"),
    "checkpoint_version": 3.0,
    "iteration": 10,
    "model": {"language_model": sd},
    "optimizer": {"state": {0: {"exp_avg": pat([4, 3], torch.float32), "step_count": 3,
                                "shared_ref": shared}},
                  "param_groups": [{"params": [0], "learning_rate": 1e-3}]},
    "extras": [shared, (param, frozen), pat([], torch.int64), pat([0, 4], torch.float32)],
    "rng_tuple": ("MT19937", 623, 0),
}
torch.save(obj, sys.argv[1])
)PY";

TEST(TorchWriterTest, MegatronLikeFileEqualsTorchSaveByteForByte) {
  testutil::TempDir dir;
  const std::filesystem::path ours = dir / "rank.pt";
  TorchWriter w(ours);
  Arena& a = w.arena();
  // Created in an order unrelated to where they sit: keys must still follow
  // the order in which the pickler meets them.
  Value* empty = w.NewTensor({DType::kFloat32, {0, 4}});
  Value* scalar = w.NewTensor({DType::kInt64, {}});
  Value* frozen = w.NewTensor({DType::kBFloat16, {3}, false, true});
  Value* param = w.NewTensor({DType::kFloat32, {2, 2}, true, true});
  Value* shared = w.NewTensor({DType::kFloat32, {2}});
  Value* exp_avg = w.NewTensor({DType::kFloat32, {4, 3}});
  Value* bias = w.NewTensor({DType::kBFloat16, {5}});
  Value* norm = w.NewTensor({DType::kFloat32, {3}});
  Value* emb = w.NewTensor({DType::kBFloat16, {4, 3}});
  Value* unused = w.NewTensor({DType::kFloat32, {7}});

  Value* sd = a.Object(ObjectOp::kReduce,
                       a.Global("collections", "OrderedDict"), a.Tuple({}));
  sd->entries = {{a.Str("embedding.word_embeddings.weight"), emb},
                 {a.Str("layers.0.input_layernorm.weight"), norm},
                 {a.Str("layers.0.mlp.dense_h_to_4h.bias"), bias}};
  Value* ns = a.Object(ObjectOp::kNewObj, a.Global("argparse", "Namespace"),
                       a.Tuple({}));
  ns->state = a.Dict({{a.Str("tensor_model_parallel_size"), a.Int(2)},
                      {a.Str("lr_value"), a.Float(0.5)},
                      {a.Str("name_str"), a.Str("gpt")}});
  Value* root = a.Dict({
      {a.Str("args"), ns},
      {a.Str("checkpoint_version"), a.Float(3.0)},
      {a.Str("iteration"), a.Int(10)},
      {a.Str("model"), a.Dict({{a.Str("language_model"), sd}})},
      {a.Str("optimizer"),
       a.Dict({{a.Str("state"),
                a.Dict({{a.Int(0), a.Dict({{a.Str("exp_avg"), exp_avg},
                                           {a.Str("step_count"), a.Int(3)},
                                           {a.Str("shared_ref"), shared}})}})},
               {a.Str("param_groups"),
                a.List({a.Dict({{a.Str("params"), a.List({a.Int(0)})},
                                {a.Str("learning_rate"), a.Float(1e-3)}})})}})},
      {a.Str("extras"),
       a.List({shared, a.Tuple({param, frozen}), scalar, empty})},
      {a.Str("rng_tuple"), a.Tuple({a.Str("MT19937"), a.Int(623), a.Int(0)})},
  });
  w.Begin(root);
  const std::vector<Value*> in_order = {emb,   norm,   bias,   exp_avg, shared,
                                        param, frozen, scalar, empty};
  ASSERT_EQ(w.planned_tensors().size(), in_order.size());
  for (size_t k = 0; k < in_order.size(); ++k) {
    EXPECT_EQ(w.planned_tensors()[k], in_order[k]);
    EXPECT_EQ(w.StorageKey(in_order[k]), std::to_string(k));
  }
  EXPECT_THROW(w.TensorBytes(unused), UsageError);
  EXPECT_THROW(w.WriteTensorData(unused, 0, Bytes("x")), UsageError);
  // Fill in reverse order from several threads.
  std::vector<std::thread> threads;
  for (size_t k = 0; k < in_order.size(); ++k) {
    threads.emplace_back([&, k] {
      Value* t = in_order[in_order.size() - 1 - k];
      const TensorSpec& spec = *w.FindSpec(t);
      w.WriteTensorData(t, 0,
                        Bytes(Pattern(spec.dtype, NumElements(spec.shape))));
    });
  }
  for (std::thread& t : threads) t.join();
  w.Commit();

  std::string out;
  ASSERT_EQ(test::RunPythonScript(kMegatronLikePy, Q(dir / "torch.pt"), &out),
            0)
      << out;
  EXPECT_EQ(DataPkl(dir / "torch.pt"), w.pickle_bytes());
  EXPECT_EQ(test::CheckTorchFiles(
                "compare " + Q(dir / "torch.pt") + " " + Q(ours), &out),
            0)
      << out;
  EXPECT_EQ(test::CheckTorchFiles("zipcheck " + Q(ours), &out), 0) << out;
}

TEST(TorchWriterTest, ArchiveNameAndZip64Options) {
  testutil::TempDir dir;
  const std::filesystem::path ours = dir / "model.v1.pt";
  for (bool force : {false, true}) {
    TorchWriterOptions options;
    options.zip.force_zip64 = force;
    if (force) options.archive_name = "archive";
    TorchWriter w(ours, options);
    Value* t = w.NewTensor({DType::kFloat32, {3}});
    w.Begin(w.arena().List({t, w.arena().Str("x")}));
    w.WriteTensorData(t, 0, Bytes(Raw(std::vector<float>{1.5f, -2, 0})));
    w.Commit();
    TorchFile f = TorchFile::Open(ours);
    EXPECT_EQ(f.archive_name(), force ? "archive" : "model.v1");
    testutil::WriteFile(dir / "spec.json", R"({"top_type": "builtins.list",
      "tensors": [{"path": [0], "dtype": "float32", "shape": [3],
                   "values": [1.5, -2, 0]}],
      "leaves": [{"path": [1], "value": "x"}]})");
    std::string out;
    EXPECT_EQ(test::CheckTorchFiles(
                  "expect " + Q(dir / "spec.json") + " " + Q(ours), &out),
              0)
        << out;
    EXPECT_EQ(test::CheckTorchFiles("zipcheck " + Q(ours), &out), 0) << out;
  }
}

// In memory: the same bytes as on disk, nothing created under the path (a
// crash could not leave anything behind), and the bytes open as a TorchFile
// from an anonymous memory file.
TEST(TorchWriterTest, InMemoryFileEqualsTheOneOnDiskAndTouchesNoDisk) {
  testutil::TempDir dir;
  std::string bytes[2];
  for (bool in_memory : {false, true}) {
    TorchWriterOptions options;
    options.in_memory = in_memory;
    options.archive_name = "archive";
    const std::filesystem::path path = dir / (in_memory ? "mem.pt" : "disk.pt");
    TorchWriter w(path, options);
    Value* t = w.NewTensor({DType::kFloat32, {3}});
    w.Begin(w.arena().Dict({{w.arena().Str("t"), t}}));
    EXPECT_THROW(w.Contents(), UsageError);  // not committed yet
    w.WriteTensorData(t, 0, Bytes(Raw(std::vector<float>{1.5f, -2, 0})));
    w.Commit();
    if (in_memory) {
      bytes[1] = w.Contents();
    } else {
      EXPECT_THROW(w.Contents(), UsageError);  // on disk
      File f = File::OpenRead(path);
      bytes[0].resize(static_cast<size_t>(f.Size()));
      f.ReadExact(bytes[0].data(), bytes[0].size(), 0);
    }
  }
  EXPECT_EQ(bytes[0], bytes[1]);
  EXPECT_EQ(std::filesystem::directory_iterator(dir.path())->path().filename(),
            "disk.pt");
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir.path()),
                          std::filesystem::directory_iterator()),
            1);
  auto mem = std::make_shared<File>(File::Anonymous("blob"));
  mem->WriteExact(bytes[1].data(), bytes[1].size(), 0);
  TorchFile f = TorchFile::Open(std::move(mem));
  EXPECT_EQ(f.archive_name(), "archive");
  EXPECT_EQ(f.path().string(), "memory:blob");
  ASSERT_EQ(f.tensors().size(), 1u);
  std::vector<float> back(3);
  f.ReadTensor(f.tensors()[0], std::as_writable_bytes(std::span<float>(back)));
  EXPECT_EQ(back, (std::vector<float>{1.5f, -2, 0}));
}

TEST(TorchWriterTest, StreamedAndParallelWritesReadBack) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const std::filesystem::path ours = dir / "big.pt";
  TorchWriter w(ours);
  Value* a = w.NewTensor({DType::kFloat32, {300, 1001}});
  Value* b = w.NewTensor({DType::kInt16, {777, 13}});
  w.Begin(w.arena().Tuple({a, b}));
  std::string expect_a(w.TensorBytes(a), '\0');
  for (char& c : expect_a) c = static_cast<char>(rng());
  std::string expect_b(w.TensorBytes(b), '\0');
  for (char& c : expect_b) c = static_cast<char>(rng());
  // a: through the bounded-buffer callback with an odd buffer size.
  w.WriteTensor(
      a,
      [&](uint64_t off, std::span<std::byte> chunk) {
        std::memcpy(chunk.data(), expect_a.data() + off, chunk.size());
      },
      4093);
  // b: shuffled chunks from 4 threads.
  std::vector<std::pair<uint64_t, uint64_t>> chunks;
  for (uint64_t off = 0; off < expect_b.size();) {
    const uint64_t len =
        std::min<uint64_t>(1 + rng() % 999, expect_b.size() - off);
    chunks.emplace_back(off, len);
    off += len;
  }
  std::shuffle(chunks.begin(), chunks.end(), rng);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (size_t i = k; i < chunks.size(); i += 4) {
        w.WriteTensorData(b, chunks[i].first,
                          Bytes(std::string_view(expect_b).substr(
                              chunks[i].first, chunks[i].second)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  w.Commit();
  TorchFile f = TorchFile::Open(ours);
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(test::TensorBytes(f, f.tensors()[0]), expect_a);
  EXPECT_EQ(test::TensorBytes(f, f.tensors()[1]), expect_b);
  std::string out;
  EXPECT_EQ(test::CheckTorchFiles("zipcheck " + Q(ours), &out), 0) << out;
}

TEST(TorchWriterTest, FailuresLeaveNoFileUnderTheFinalName) {
  testutil::TempDir dir;
  const std::filesystem::path ours = dir / "fail.pt";
  auto dir_is_empty = [&] {
    return std::filesystem::directory_iterator(dir.path()) ==
           std::filesystem::directory_iterator();
  };
  {  // Commit with a tensor not (fully) written.
    TorchWriter w(ours);
    Value* t = w.NewTensor({DType::kFloat32, {4}});
    Value* u = w.NewTensor({DType::kFloat32, {2}});
    w.Begin(w.arena().List({t, u}));
    w.WriteTensorData(t, 0, Bytes(std::string(16, 'a')));
    w.WriteTensorData(u, 0, Bytes(std::string(4, 'b')));
    EXPECT_THAT([&] { w.Commit(); },
                ThrowsMessage<UsageError>(HasSubstr("data/1")));
    EXPECT_FALSE(std::filesystem::exists(ours));
    EXPECT_TRUE(dir_is_empty());
  }
  {  // An exception while filling: the writer is abandoned.
    try {
      TorchWriter w(ours);
      Value* t = w.NewTensor({DType::kFloat32, {1000}});
      w.Begin(t);
      w.WriteTensor(
          t,
          [](uint64_t off, std::span<std::byte>) {
            if (off > 0) throw IoError("source went away");
          },
          1024);
      FAIL() << "no exception";
    } catch (const IoError& e) {
      EXPECT_THAT(e.what(), HasSubstr("source went away"));
    }
    EXPECT_FALSE(std::filesystem::exists(ours));
    EXPECT_TRUE(dir_is_empty());
  }
  {  // Overlapping writes fail the writer.
    TorchWriter w(ours);
    Value* t = w.NewTensor({DType::kUInt8, {8}});
    w.Begin(t);
    w.WriteTensorData(t, 0, Bytes("abcde"));
    EXPECT_THROW(w.WriteTensorData(t, 4, Bytes("efgh")), UsageError);
    EXPECT_THROW(w.Commit(), UsageError);
    EXPECT_FALSE(std::filesystem::exists(ours));
  }
  {  // Misuse.
    TorchWriter w(ours);
    EXPECT_THROW(w.Commit(), UsageError);
    EXPECT_THROW(w.NewTensor({DType::kFloat32, {-1}}), UsageError);
    EXPECT_THROW(w.NewTensor({DType::kFloat32, {int64_t{1} << 40, 1 << 30}}),
                 UsageError);
    Arena& a = w.arena();
    Value* foreign = a.PersId(a.Tuple({a.Str("storage")}));
    EXPECT_THAT([&] { w.Begin(a.List({foreign})); },
                ThrowsMessage<UsageError>(HasSubstr("persistent id")));
  }
  {
    TorchWriter w(ours);
    Value* t = w.NewTensor({DType::kFloat32, {1}});
    w.Begin(t);
    EXPECT_THROW(w.Begin(t), UsageError);
    EXPECT_THROW(w.NewTensor({DType::kFloat32, {1}}), UsageError);
    EXPECT_THROW(w.WriteTensorData(t, 2, Bytes("xxxx")), UsageError);
  }
  EXPECT_FALSE(std::filesystem::exists(ours));
  EXPECT_TRUE(dir_is_empty());
}

TEST(TorchWriterTest, WritesTorch2OnlyDtypesLikeTorch26) {
  // torch 2.6 pickles these through _rebuild_tensor_v3 + UntypedStorage; the
  // fixture is the oracle for the encoding (torch 1.13 cannot load them).
  TorchFile fixture = TorchFile::Open(testutil::FixturesDir() /
                                      "torch-2.6-save/mixed_dtypes.pt");
  testutil::TempDir dir;
  const std::filesystem::path ours = dir / "mixed_dtypes.pt";
  WriteCompactCopy(fixture, ours);
  TorchFile f = TorchFile::Open(ours);
  // Every tensor of that file is compact, so the pickle must be identical.
  EXPECT_EQ(f.pickle_bytes(), fixture.pickle_bytes());
  ASSERT_EQ(f.tensors().size(), fixture.tensors().size());
  std::set<std::string> v3;
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    EXPECT_EQ(t.dtype, fixture.tensors()[i].dtype);
    EXPECT_EQ(test::TensorBytes(f, t),
              test::TensorBytes(fixture, fixture.tensors()[i]));
    if (t.storage->untyped) v3.insert(std::string(DTypeName(t.dtype)));
  }
  EXPECT_THAT(v3, testing::IsSupersetOf({"uint16", "uint32", "uint64",
                                         "float8_e4m3fn", "float8_e5m2"}));
}

TEST(TorchWriterTest, TensorSubclassesAndParameterStateRoundTrip) {
  testutil::TempDir dir;
  std::string out;
  ASSERT_EQ(test::RunPythonScript(R"PY(
import sys, torch
class MyT(torch.Tensor):
    pass
p = torch.nn.Parameter(torch.ones(2, 3))
t = torch.arange(4.).as_subclass(MyT)
torch.save({"p": p, "t": t}, sys.argv[1])
)PY",
                                  Q(dir / "wrap.pt"), &out),
            0)
      << out;
  TorchFile src = TorchFile::Open(dir / "wrap.pt");
  ASSERT_EQ(src.tensors().size(), 2u);
  const TensorInfo& sub = src.tensors()[1];
  EXPECT_EQ(sub.wrapper, TensorWrapper::kSubclass);
  EXPECT_FALSE(sub.is_parameter);
  EXPECT_EQ(test::TensorBytes(src, sub),
            Raw(std::vector<float>{0.0f, 1.0f, 2.0f, 3.0f}));
  WriteCompactCopy(src, dir / "copy.pt");
  TorchFile copy = TorchFile::Open(dir / "copy.pt");
  EXPECT_EQ(copy.pickle_bytes(), src.pickle_bytes());
  EXPECT_EQ(copy.tensors()[1].wrapper, TensorWrapper::kSubclass);

  // torch 2.x's _rebuild_parameter_with_state (torch 1.13 does not write it):
  // built by hand, read, copied with its state.
  Arena a;
  Value* inner = a.Object(
      ObjectOp::kReduce, a.Global("torch._utils", "_rebuild_tensor_v2"),
      a.Tuple({a.PersId(
                   a.Tuple({a.Str("storage"), a.Global("torch", "FloatStorage"),
                            a.Str("0"), a.Str("cpu"), a.Int(2)})),
               a.Int(0), a.Tuple({a.Int(2)}), a.Tuple({a.Int(1)}),
               a.Bool(false),
               a.Object(ObjectOp::kReduce,
                        a.Global("collections", "OrderedDict"), a.Tuple({}))}));
  Value* state = a.Dict({{a.Str("extra_attr"), a.Int(7)}});
  Value* param =
      a.Object(ObjectOp::kReduce,
               a.Global("torch._utils", "_rebuild_parameter_with_state"),
               a.Tuple({inner, a.Bool(true), a.Dict(), state}));
  {
    const std::string pkl = pickle::Pickle(a.Dict({{a.Str("w"), param}}));
    std::vector<ZipRecordSpec> specs = {{"s/data.pkl", pkl.size()},
                                        {"s/data/0", 8}};
    ZipWriter zw(dir / "state.pt", specs);
    zw.Write(0, 0, Bytes(pkl));
    zw.Write(1, 0, Bytes(Raw(std::vector<float>{0.5f, -1.0f})));
    zw.Commit();
  }
  TorchFile with_state = TorchFile::Open(dir / "state.pt");
  ASSERT_EQ(with_state.tensors().size(), 1u);
  const TensorInfo& ws = with_state.tensors()[0];
  EXPECT_EQ(ws.wrapper, TensorWrapper::kParameterWithState);
  EXPECT_TRUE(ws.is_parameter);
  EXPECT_TRUE(ws.requires_grad);
  WriteCompactCopy(with_state, dir / "state_copy.pt");
  TorchFile back = TorchFile::Open(dir / "state_copy.pt");
  ASSERT_EQ(back.tensors().size(), 1u);
  const TensorInfo& bs = back.tensors()[0];
  EXPECT_EQ(bs.wrapper, TensorWrapper::kParameterWithState);
  EXPECT_TRUE(bs.is_parameter);
  EXPECT_TRUE(bs.requires_grad);
  EXPECT_TRUE(pickle::DeepEqual(bs.node->args->items[3], state));
  EXPECT_EQ(test::TensorBytes(back, bs), Raw(std::vector<float>{0.5f, -1.0f}));
}

// Replaces each tensor node by a marker with its index, so that two graphs
// compare equal when they differ only in how tensors are stored.
Value* Canonical(const TorchFile& f, Arena& arena) {
  return arena.Copy(f.root(), [&](const Value* v) -> Value* {
    const TensorInfo* t = f.FindTensor(v);
    if (t == nullptr) return nullptr;
    return arena.Str("<tensor " + std::to_string(t - f.tensors().data()) + ">");
  });
}

bool NeedsTorch2(const TorchFile& f) {
  for (const TensorInfo& t : f.tensors()) {
    if (t.storage->untyped) return true;
  }
  return false;
}

// True if torch.save would write `f` exactly as is: one compact storage per
// tensor, in key order, and the zip format.
bool IsCompact(const TorchFile& f) {
  if (f.format() != TorchFile::Format::kZip) return false;
  if (f.storages().size() != f.tensors().size()) return false;
  for (size_t i = 0; i < f.tensors().size(); ++i) {
    const TensorInfo& t = f.tensors()[i];
    if (t.storage != &f.storages()[i] || t.storage_key() != std::to_string(i) ||
        t.storage_offset != 0 || !t.contiguous ||
        t.storage->nbytes != t.nbytes ||
        t.stride != ContiguousStrides(t.shape) ||
        t.wrapper == TensorWrapper::kSubclass) {
      return false;
    }
  }
  return true;
}

constexpr std::string_view kBatchCheck = R"PY(
import json, sys
sys.path.insert(0, sys.argv[1])
import check_torch_files
failures = []
for job in json.load(open(sys.argv[2])):
    rc = check_torch_files.main(job)
    if rc != 0:
        failures.append(job)
print("FAILED JOBS: " + json.dumps(failures))
sys.exit(1 if failures else 0)
)PY";

// Non-contiguous views are gathered block by block through a small buffer
// (one slice of dim 0 larger than the buffer recurses into dim 1); torch
// itself checks that the compact copy holds the view's values.
TEST(TorchWriterTest, StridedViewsStreamThroughASmallBuffer) {
  testutil::TempDir dir;
  std::string out;
  ASSERT_EQ(test::RunPythonScript(R"PY(
import sys, torch
g = torch.Generator().manual_seed(5)
base = torch.randn(3, 40, 50, generator=g)
views = {
    "transposed": torch.randn(64, 200, generator=g).t(),
    "expanded": torch.randn(1, 300, generator=g).expand(100, 300),
    "permuted": base.permute(0, 2, 1),   # slice of 8000 B > 4096 B buffer
    "sliced": base[:, 3:37:2, 5:45],
    "every_other": torch.randn(10000, generator=g)[::2],
    "scalar_view": torch.randn(7, generator=g)[3],
    "bf16_cols": torch.randn(30, 80, generator=g).bfloat16()[:, 1:77],
    "contiguous": torch.randn(5000, generator=g),
}
torch.save(views, sys.argv[1])
)PY",
                                  Q(dir / "views.pt"), &out),
            0)
      << out;
  TorchFile src = TorchFile::Open(dir / "views.pt");
  int non_contiguous = 0;
  for (const TensorInfo& t : src.tensors()) non_contiguous += !t.contiguous;
  EXPECT_EQ(non_contiguous, 6);  // a 0-d view is contiguous
  WriteCompactCopy(src, dir / "copy.pt", {}, /*buffer_bytes=*/4096);
  TorchFile copy = TorchFile::Open(dir / "copy.pt");
  ASSERT_EQ(copy.tensors().size(), src.tensors().size());
  for (size_t k = 0; k < src.tensors().size(); ++k) {
    EXPECT_EQ(test::TensorBytes(src, src.tensors()[k]),
              test::TensorBytes(copy, copy.tensors()[k]))
        << k;
  }
  ASSERT_EQ(test::RunPythonScript(
                R"PY(
import sys, torch
a = torch.load(sys.argv[1]); b = torch.load(sys.argv[2])
assert list(a) == list(b)
for k in a:
    assert b[k].is_contiguous() and b[k].dtype == a[k].dtype, k
    assert torch.equal(a[k], b[k]), k
print("ok")
)PY",
                Q(dir / "views.pt") + " " + Q(dir / "copy.pt"), &out),
            0)
      << out;
}

TEST(TorchWriterTest, EveryFixtureSurvivesACompactRoundTrip) {
  std::vector<std::filesystem::path> files =
      test::FindPtFiles(testutil::TestDataDir() / "torch");
  for (const auto& p : test::FindPtFiles(testutil::FixturesDir())) {
    files.push_back(p);
  }
  ASSERT_GE(files.size(), 100u);
  testutil::TempDir dir;
  nlohmann::json jobs = nlohmann::json::array();
  int identical_pickles = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    SCOPED_TRACE(files[i].string());
    const std::filesystem::path ours =
        dir / (std::to_string(i) + "_" + files[i].filename().string());
    try {
      TorchFile src = TorchFile::Open(files[i]);
      WriteCompactCopy(src, ours);
      TorchFile back = TorchFile::Open(ours);
      ASSERT_EQ(back.tensors().size(), src.tensors().size());
      for (size_t k = 0; k < src.tensors().size(); ++k) {
        const TensorInfo& x = src.tensors()[k];
        const TensorInfo& y = back.tensors()[k];
        EXPECT_EQ(x.dtype, y.dtype);
        EXPECT_EQ(x.shape, y.shape);
        EXPECT_EQ(x.requires_grad, y.requires_grad);
        EXPECT_EQ(x.is_parameter, y.is_parameter);
        EXPECT_EQ(x.wrapper, y.wrapper);
        EXPECT_EQ(x.device(), y.device());
        EXPECT_EQ(x.path, y.path);
        EXPECT_TRUE(y.contiguous);
        EXPECT_EQ(y.storage_offset, 0);
        EXPECT_EQ(y.storage->nbytes, y.nbytes);
        EXPECT_EQ(y.storage_key(), std::to_string(k));
        EXPECT_EQ(test::TensorBytes(src, x), test::TensorBytes(back, y));
      }
      Arena arena;
      EXPECT_TRUE(
          pickle::DeepEqual(Canonical(src, arena), Canonical(back, arena)));
      // Where torch.save would have written exactly this file and the pickle
      // module reproduces its data.pkl (it cannot always: e.g. a str shared
      // with the latin-1 text of a bytes object), ours must be identical.
      if (IsCompact(src) && pickle::Pickle(src.root()) == src.pickle_bytes()) {
        EXPECT_EQ(back.pickle_bytes(), src.pickle_bytes());
        ++identical_pickles;
      }
      if (!NeedsTorch2(src)) {
        jobs.push_back({"compare", files[i].string(), ours.string()});
        jobs.push_back(
            {"zipcheck", ours.string(), "--like", files[i].string()});
      }
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
  EXPECT_GE(identical_pickles, 20);
  testutil::WriteFile(dir / "jobs.json", jobs.dump());
  std::string out;
  EXPECT_EQ(test::RunPythonScript(kBatchCheck,
                                  Q(testutil::SourceDir() / "tests/tools") +
                                      " " + Q(dir / "jobs.json"),
                                  &out),
            0)
      << out;
  EXPECT_GE(jobs.size(), 150u);
}

}  // namespace
}  // namespace ucp::torchfile
