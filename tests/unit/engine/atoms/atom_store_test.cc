#include "engine/atoms/atom_store.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "tests/testutil/testutil.h"

namespace ucp::atoms {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::ThrowsMessage;

// ---- Test data ------------------------------------------------------------

std::string RandomBytes(std::mt19937_64& rng, size_t n) {
  std::string out(n, '\0');
  for (size_t i = 0; i < n; i += 8) {
    uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<size_t>(8, n - i));
  }
  return out;
}

std::span<const std::byte> Bytes(const std::string& s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

uint64_t NumBytes(DType dtype, const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return static_cast<uint64_t>(n) * ElementSize(dtype);
}

// The numpy dtype h5py must report for each stored dtype (schema in
// atom_store.h).
std::string NumpyDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return "<f8";
    case DType::kFloat32:
      return "<f4";
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kUInt16:
      return "<u2";
    case DType::kInt64:
      return "<i8";
    case DType::kInt32:
      return "<i4";
    case DType::kInt16:
      return "<i2";
    case DType::kInt8:
      return "|i1";
    case DType::kUInt8:
    case DType::kBool:
    case DType::kFloat8E4M3Fn:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3Fnuz:
    case DType::kFloat8E5M2Fnuz:
      return "|u1";
    case DType::kComplex64:
      return "<c8";
    case DType::kComplex128:
      return "<c16";
    case DType::kUInt32:
      return "<u4";
    case DType::kUInt64:
      return "<u8";
  }
  return "?";
}

struct ExpectedDataset {
  DatasetKind kind;
  std::string fqn;
  std::string state_kind;
  std::string path;  // HDF5 path by the schema's escaping rules
  DType dtype;
  Shape shape;
  std::string bytes;
  DatasetId id = 0;  // writer id
};

struct Sample {
  RootInfo root;
  std::vector<ParamInfo> params;
  std::vector<std::string> param_paths;
  std::vector<ExpectedDataset> datasets;
};

// A store exercising every feature: all dtypes and shapes (0-d, empty),
// pad atoms, a state kind named "pad", fqns with "/", "%", "." and unicode,
// buffers, nested opaque keys, large string attributes.
Sample MakeSample(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Sample s;
  s.root.iteration = 1234;
  s.root.consumed_samples = 98765;
  s.root.source = R"({"framework": "megatron", "tp": 2, "名": "值"})";
  s.root.model = R"({"num_layers": 2})";
  s.root.layout = "name: test\nrules:\n  - match: \"*\"\n    tp: replicated\n";
  s.root.optimizer = R"({"type": "adam", "groups": []})";
  s.root.scheduler = "{}";
  s.root.args = "{\"big\": \"" + std::string(200000, 'x') + "\"}";
  s.root.training = R"({"dtype": "bfloat16", "step": 7})";
  s.root.extra_strings["note"] = "héllo wörld";
  s.root.extra_ints["schema_minor"] = -7;

  auto add_param = [&](std::string fqn, std::string link, Shape shape,
                       DType dtype) -> ParamInfo& {
    ParamInfo p;
    p.fqn = std::move(fqn);
    p.shape = std::move(shape);
    p.dtype = dtype;
    p.rule = "rule-" + std::to_string(s.params.size());
    p.kind = s.params.size() % 5 == 4 ? ParamKind::kBuffer : ParamKind::kParam;
    p.group = static_cast<int64_t>(s.params.size() % 3) - 1;
    // Orders run backwards so that name order and order differ.
    p.order = 1000 - static_cast<int64_t>(s.params.size());
    if (s.params.empty()) p.tied_copies = {"output_layer.weight"};
    p.frozen = s.params.size() % 4 == 2;
    s.params.push_back(p);
    s.param_paths.push_back("/params/" + link);
    return s.params.back();
  };
  auto add = [&](DatasetKind kind, std::string fqn, std::string state_kind,
                 std::string path, DType dtype, Shape shape) {
    ExpectedDataset d{kind,
                      std::move(fqn),
                      std::move(state_kind),
                      path,
                      dtype,
                      std::move(shape),
                      {},
                      0};
    d.bytes = RandomBytes(rng, NumBytes(d.dtype, d.shape));
    s.datasets.push_back(std::move(d));
  };

  add_param("embedding.word_embeddings.weight",
            "embedding.word_embeddings.weight", {13, 8}, DType::kBFloat16);
  for (const char* kind : {"fp32", "exp_avg", "exp_avg_sq"}) {
    add(DatasetKind::kAtom, "embedding.word_embeddings.weight", kind,
        std::string("/params/embedding.word_embeddings.weight/") + kind,
        DType::kFloat32, {13, 8});
    add(DatasetKind::kPad, "embedding.word_embeddings.weight", kind,
        std::string("/params/embedding.word_embeddings.weight/pad/") + kind,
        DType::kFloat32, {3, 8});
  }
  add(DatasetKind::kAtom, "embedding.word_embeddings.weight", "step",
      "/params/embedding.word_embeddings.weight/step", DType::kInt64, {});
  add(DatasetKind::kAtom, "embedding.word_embeddings.weight", "pad",
      "/params/embedding.word_embeddings.weight/%70ad", DType::kBFloat16,
      {13, 8});

  add_param("odd/name%with.slash", "odd%2Fname%25with.slash", {4},
            DType::kFloat16);
  add(DatasetKind::kAtom, "odd/name%with.slash", "exp/avg",
      "/params/odd%2Fname%25with.slash/exp%2Favg", DType::kFloat32, {4});
  add_param("层.权重", "层.权重", {2, 3}, DType::kFloat32);
  add(DatasetKind::kAtom, "层.权重", "fp32", "/params/层.权重/fp32",
      DType::kFloat32, {2, 3});
  add_param("..", "%2E.", {1}, DType::kFloat32);
  add(DatasetKind::kAtom, "..", ".", "/params/%2E./%2E", DType::kFloat32, {1});
  add_param("large", "large", {64, 33}, DType::kFloat32);
  add(DatasetKind::kAtom, "large", "fp32", "/params/large/fp32",
      DType::kFloat32, {64, 33});
  add(DatasetKind::kAtom, "large", "exp_avg", "/params/large/exp_avg",
      DType::kFloat32, {64, 33});

  const std::vector<Shape> shapes = {{}, {0}, {3, 5}, {2, 0, 3}, {1, 1, 7}};
  for (int t = 0; t < kNumDTypes; ++t) {
    DType dtype = static_cast<DType>(t);
    for (size_t k = 0; k < shapes.size(); ++k) {
      std::string fqn =
          "dtypes." + std::string(DTypeName(dtype)) + "." + std::to_string(k);
      add_param(fqn, fqn, shapes[k], dtype);
      add(DatasetKind::kAtom, fqn, "value", "/params/" + fqn + "/value", dtype,
          shapes[k]);
    }
  }
  for (int i = 0; i < 40; ++i) {
    std::string fqn = "decoder.layers." + std::to_string(i) +
                      ".self_attention.linear_qkv.weight";
    Shape shape = {4 + i % 3, 16};
    add_param(fqn, fqn, shape, DType::kBFloat16);
    for (const char* kind : {"fp32", "exp_avg", "exp_avg_sq"}) {
      add(DatasetKind::kAtom, fqn, kind, "/params/" + fqn + "/" + kind,
          DType::kFloat32, shape);
    }
  }
  add_param("no.datasets", "no.datasets", {5, 5}, DType::kFloat32);

  add(DatasetKind::kBuffer, "rotary/inv_freq", "", "/buffers/rotary%2Finv_freq",
      DType::kFloat32, {8});
  add(DatasetKind::kBuffer, "position_ids", "", "/buffers/position_ids",
      DType::kInt64, {2, 5});
  add(DatasetKind::kBuffer, "empty", "", "/buffers/empty", DType::kBool, {0});

  auto opaque = [&](std::string key, std::string path, size_t n) {
    add(DatasetKind::kOpaque, std::move(key), "", std::move(path),
        DType::kUInt8, {static_cast<int64_t>(n)});
  };
  opaque("args", "/opaque/args", 100);
  opaque("rng_state/tp00_pp000", "/opaque/rng_state/tp00_pp000", 333);
  opaque("rng_state/tp01_pp000", "/opaque/rng_state/tp01_pp000", 0);
  opaque("te/a.b/_extra_state", "/opaque/te/a.b/_extra_state", 17);
  opaque("üñí/ключ%", "/opaque/üñí/ключ%25", 5000);
  return s;
}

DatasetId Declare(AtomStoreWriter& w, const ExpectedDataset& d) {
  switch (d.kind) {
    case DatasetKind::kAtom:
      return w.AddAtom(d.fqn, d.state_kind, d.dtype, d.shape);
    case DatasetKind::kPad:
      return w.AddPadAtom(d.fqn, d.state_kind, d.dtype, d.shape);
    case DatasetKind::kBuffer:
      return w.AddBuffer(d.fqn, d.dtype, d.shape);
    case DatasetKind::kOpaque:
      return w.AddOpaque(d.fqn, d.bytes.size());
  }
  return 0;
}

// Writes `s` to `path` (each dataset in two pieces, hashes via SetHash).
void WriteSample(Sample& s, const fs::path& path) {
  AtomStoreWriter w = AtomStoreWriter::Create(path);
  w.SetRoot(s.root);
  for (const ParamInfo& p : s.params) w.AddParam(p);
  for (ExpectedDataset& d : s.datasets) d.id = Declare(w, d);
  w.Allocate();
  for (const ExpectedDataset& d : s.datasets) {
    size_t half = d.bytes.size() / 2;
    w.Write(d.id, half, Bytes(d.bytes).subspan(half));
    w.Write(d.id, 0, Bytes(d.bytes).subspan(0, half));
    w.SetHash(d.id, Xxh3(d.bytes.data(), d.bytes.size()));
  }
  w.Commit();
}

const DatasetInfo* Find(const AtomStoreReader& r, const ExpectedDataset& d) {
  switch (d.kind) {
    case DatasetKind::kAtom:
      return r.FindAtom(d.fqn, d.state_kind);
    case DatasetKind::kPad:
      return r.FindPadAtom(d.fqn, d.state_kind);
    case DatasetKind::kBuffer:
      return r.FindBuffer(d.fqn);
    case DatasetKind::kOpaque:
      return r.FindOpaque(d.fqn);
  }
  return nullptr;
}

std::string ReadAll(const AtomStoreReader& r, const DatasetInfo& d) {
  std::string out(d.nbytes, '\0');
  r.Read(d.id, 0, std::as_writable_bytes(std::span(out.data(), out.size())));
  return out;
}

// ---- Round trips ----------------------------------------------------------

TEST(AtomStoreTest, RoundTripsEverything) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  testutil::TempDir dir;
  const fs::path file = dir / "universal.h5";
  Sample s = MakeSample(seed);
  WriteSample(s, file);
  ASSERT_TRUE(fs::exists(file));
  // Only the committed file remains in the folder.
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()),
                          fs::directory_iterator()),
            1);

  AtomStoreReader r = AtomStoreReader::Open(file);
  EXPECT_EQ(r.root().iteration, 1234);
  EXPECT_EQ(r.root().consumed_samples, 98765);
  EXPECT_EQ(r.root().source, s.root.source);
  EXPECT_EQ(r.root().model, s.root.model);
  EXPECT_EQ(r.root().layout, s.root.layout);
  EXPECT_EQ(r.root().optimizer, s.root.optimizer);
  EXPECT_EQ(r.root().scheduler, s.root.scheduler);
  EXPECT_EQ(r.root().args, s.root.args);
  EXPECT_EQ(r.root().extra_strings, s.root.extra_strings);
  EXPECT_EQ(r.root().extra_ints, s.root.extra_ints);

  ASSERT_EQ(r.params().size(), s.params.size());
  for (size_t i = 1; i < r.params().size(); ++i) {
    EXPECT_LT(r.params()[i - 1].info.order, r.params()[i].info.order);
  }
  for (const ParamInfo& p : s.params) {
    SCOPED_TRACE(p.fqn);
    const StoredParam* got = r.FindParam(p.fqn);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(got->info.fqn, p.fqn);
    EXPECT_EQ(got->info.shape, p.shape);
    EXPECT_EQ(got->info.dtype, p.dtype);
    EXPECT_EQ(got->info.rule, p.rule);
    EXPECT_EQ(got->info.kind, p.kind);
    EXPECT_EQ(got->info.group, p.group);
    EXPECT_EQ(got->info.order, p.order);
    EXPECT_EQ(got->info.tied_copies, p.tied_copies);
    EXPECT_EQ(got->info.frozen, p.frozen);
    size_t atoms = 0, pads = 0;
    for (const ExpectedDataset& d : s.datasets) {
      if (d.fqn != p.fqn) continue;
      atoms += d.kind == DatasetKind::kAtom;
      pads += d.kind == DatasetKind::kPad;
    }
    EXPECT_EQ(got->atoms.size(), atoms);
    EXPECT_EQ(got->pads.size(), pads);
  }
  EXPECT_EQ(r.FindParam("missing"), nullptr);
  EXPECT_EQ(r.FindAtom("large", "missing"), nullptr);
  EXPECT_EQ(r.FindAtom("missing", "fp32"), nullptr);
  EXPECT_EQ(r.FindPadAtom("large", "fp32"), nullptr);
  EXPECT_EQ(r.FindBuffer("missing"), nullptr);
  EXPECT_EQ(r.FindOpaque("rng_state"), nullptr);
  EXPECT_EQ(r.FindOpaque(""), nullptr);

  ASSERT_EQ(r.datasets().size(), s.datasets.size());
  for (const ExpectedDataset& d : s.datasets) {
    SCOPED_TRACE(d.path);
    const DatasetInfo* got = Find(r, d);
    ASSERT_NE(got, nullptr);
    EXPECT_EQ(got->path, d.path);
    EXPECT_EQ(got->kind, d.kind);
    EXPECT_EQ(got->fqn, d.fqn);
    EXPECT_EQ(got->state_kind, d.state_kind);
    EXPECT_EQ(got->dtype, d.dtype);
    EXPECT_EQ(got->shape, d.shape);
    EXPECT_EQ(got->nbytes, d.bytes.size());
    EXPECT_EQ(got->xxh3, Xxh3(d.bytes.data(), d.bytes.size()));
    if (got->nbytes >= kAlignmentThreshold) {
      EXPECT_EQ(got->offset % kAlignment, 0u);
    }
    EXPECT_TRUE(ReadAll(r, *got) == d.bytes);
    EXPECT_EQ(&r.dataset(got->id), got);
  }
  for (size_t i = 1; i < r.datasets().size(); ++i) {
    const DatasetInfo& a = r.datasets()[i - 1];
    const DatasetInfo& b = r.datasets()[i];
    if (a.nbytes > 0) {
      EXPECT_LE(a.offset + a.nbytes, b.offset);
    }
  }
  EXPECT_THAT(r.Verify(), IsEmpty());
}

TEST(AtomStoreTest, H5pyReadsTheFile) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  testutil::TempDir dir;
  const fs::path file = dir / "universal.h5";
  Sample s = MakeSample(seed);
  WriteSample(s, file);
  AtomStoreReader r = AtomStoreReader::Open(file);

  nlohmann::json exp;
  exp["root"] = {{"ucp_format", "universal"},
                 {"ucp_version", 2},
                 {"iteration", s.root.iteration},
                 {"consumed_samples", s.root.consumed_samples},
                 {"source", s.root.source},
                 {"model", s.root.model},
                 {"layout", s.root.layout},
                 {"optimizer", s.root.optimizer},
                 {"scheduler", s.root.scheduler},
                 {"args", s.root.args},
                 {"training", s.root.training}};
  for (const auto& [k, v] : s.root.extra_strings) exp["root"][k] = v;
  for (const auto& [k, v] : s.root.extra_ints) exp["root"][k] = v;
  exp["params"] = nlohmann::json::array();
  for (size_t i = 0; i < s.params.size(); ++i) {
    const ParamInfo& p = s.params[i];
    exp["params"].push_back(
        {{"path", s.param_paths[i]},
         {"attrs",
          {{"shape", p.shape},
           {"dtype", std::string(DTypeName(p.dtype))},
           {"rule", p.rule},
           {"kind", p.kind == ParamKind::kParam ? "param" : "buffer"},
           {"group", p.group},
           {"order", p.order},
           // The schema's JSON list of names, spelled by nlohmann.
           {"tied_copies", nlohmann::json(p.tied_copies).dump()},
           {"frozen", p.frozen ? 1 : 0}}}});
  }
  exp["datasets"] = nlohmann::json::array();
  for (const ExpectedDataset& d : s.datasets) {
    const DatasetInfo* got = Find(r, d);
    ASSERT_NE(got, nullptr) << d.path;
    exp["datasets"].push_back(
        {{"path", d.path},
         {"dtype", std::string(DTypeName(d.dtype))},
         {"numpy", NumpyDType(d.dtype)},
         {"shape", d.shape},
         {"sha256", testutil::Sha256Hex(d.bytes)},
         {"xxh3", std::to_string(Xxh3(d.bytes.data(), d.bytes.size()))},
         {"offset", got->offset}});
  }
  testutil::WriteFile(dir / "expected.json", exp.dump(1));

  const fs::path script =
      testutil::SourceDir() / "tests/unit/engine/atoms/h5py_oracle.py";
  std::string out;
  int rc = testutil::RunCommand(
      testutil::Python() + " " + testutil::ShellQuote(script.string()) +
          " check " + testutil::ShellQuote(file.string()) + " " +
          testutil::ShellQuote((dir / "expected.json").string()),
      &out);
  EXPECT_EQ(rc, 0) << out.substr(0, 4000);
  EXPECT_NE(out.find("OK "), std::string::npos) << out.substr(0, 4000);

  rc = testutil::RunCommand("h5dump -H " + testutil::ShellQuote(file.string()),
                            &out);
  EXPECT_EQ(rc, 0) << out.substr(0, 4000);
  EXPECT_NE(out.find("ATTRIBUTE \"ucp_format\""), std::string::npos);
  EXPECT_NE(out.find("GROUP \"embedding.word_embeddings.weight\""),
            std::string::npos);
  EXPECT_NE(out.find("DATASET \"tp00_pp000\""), std::string::npos);
}

TEST(AtomStoreTest, SameContentsGiveIdenticalFiles) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  testutil::TempDir dir;
  Sample a = MakeSample(seed);
  Sample b = MakeSample(seed);
  WriteSample(a, dir / "a.h5");
  WriteSample(b, dir / "b.h5");
  EXPECT_TRUE(testutil::ReadFile(dir / "a.h5") ==
              testutil::ReadFile(dir / "b.h5"));
}

TEST(AtomStoreTest, ParallelWritesIntoOneDataset) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const fs::path file = dir / "parallel.h5";
  constexpr int64_t kRows = 1024, kCols = 1000;  // 4 MB of float32
  const std::string data =
      RandomBytes(rng, NumBytes(DType::kFloat32, {kRows, kCols}));
  AtomStoreWriter w = AtomStoreWriter::Create(file);
  ParamInfo p;
  p.fqn = "w";
  p.shape = {kRows, kCols};
  w.AddParam(p);
  DatasetId id = w.AddAtom("w", "fp32", DType::kFloat32, {kRows, kCols});
  DatasetId other = w.AddAtom("w", "exp_avg", DType::kFloat32, {kRows, kCols});
  w.Allocate();
  constexpr int kThreads = 8;
  constexpr size_t kBlock = 40000;  // not a multiple of the row size
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t off = t * kBlock; off < data.size();
           off += kThreads * kBlock) {
        size_t n = std::min(kBlock, data.size() - off);
        w.Write(id, off, Bytes(data).subspan(off, n));
        w.Write(other, off, Bytes(data).subspan(off, n));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  w.SetHash(id, Xxh3(data.data(), data.size()));
  EXPECT_EQ(w.HashWritten(other), Xxh3(data.data(), data.size()));
  w.Commit();

  AtomStoreReader r = AtomStoreReader::Open(file);
  const DatasetInfo* d = r.FindAtom("w", "fp32");
  ASSERT_NE(d, nullptr);
  // Parallel preads of interleaved pieces.
  std::string back(data.size(), '\0');
  threads.clear();
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (size_t off = t * 4096; off < back.size(); off += kThreads * 4096) {
        size_t n = std::min<size_t>(4096, back.size() - off);
        r.Read(d->id, off,
               std::as_writable_bytes(std::span(back.data() + off, n)));
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_TRUE(back == data);
  EXPECT_THAT(r.Verify(), IsEmpty());
}

// Two writers of one file, as the processes of a job: the allocating one
// and one attached at its offsets, each writing a dataset; the file is the
// one a single writer makes of the same contents.
TEST(AtomStoreTest, AttachedWriterWritesIntoTheAllocatedFile) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const std::string a = RandomBytes(rng, NumBytes(DType::kFloat32, {64, 80}));
  const std::string b = RandomBytes(rng, NumBytes(DType::kFloat32, {64, 80}));
  auto declare = [](AtomStoreWriter& w) {
    ParamInfo p;
    p.fqn = "w";
    p.shape = {64, 80};
    w.AddParam(p);
    return std::pair(w.AddAtom("w", "fp32", DType::kFloat32, {64, 80}),
                     w.AddAtom("w", "exp_avg", DType::kFloat32, {64, 80}));
  };
  {
    AtomStoreWriter one = AtomStoreWriter::Create(dir / "one.h5");
    const auto [fp32, exp_avg] = declare(one);
    one.Allocate();
    one.Write(fp32, 0, Bytes(a));
    one.Write(exp_avg, 0, Bytes(b));
    one.HashWritten(fp32);
    one.HashWritten(exp_avg);
    one.Commit();
  }
  AtomStoreWriter owner = AtomStoreWriter::Create(dir / "two.h5");
  AtomStoreWriter other = AtomStoreWriter::CreateShared(dir / "two.h5");
  const auto [fp32, exp_avg] = declare(owner);
  declare(other);
  EXPECT_THROW(other.Allocate(), InternalError);
  owner.Allocate();
  std::vector<uint64_t> offsets;
  for (DatasetId id = 0; id < owner.num_datasets(); ++id)
    offsets.push_back(owner.dataset(id).offset);
  EXPECT_THROW(other.Attach(owner.temp_path(), std::span(offsets).first(1)),
               InternalError);
  EXPECT_THROW(other.Attach(dir / "missing", offsets), IoError);
  EXPECT_THROW(owner.Attach(owner.temp_path(), offsets), InternalError);
  other.Attach(owner.temp_path(), offsets);
  EXPECT_EQ(other.temp_path(), owner.temp_path());
  other.Write(fp32, 0, Bytes(a));
  other.SyncWrites();
  owner.Write(exp_avg, 0, Bytes(b));
  owner.SetHash(fp32, other.HashWritten(fp32));
  owner.HashWritten(exp_avg);
  EXPECT_THROW(other.Commit(), InternalError);
  owner.Commit();
  EXPECT_TRUE(testutil::ReadFile(dir / "one.h5") ==
              testutil::ReadFile(dir / "two.h5"));
  // Negative control: a byte of the attached writer's dataset counts.
  std::string changed = testutil::ReadFile(dir / "two.h5");
  changed[owner.dataset(fp32).offset + 5] ^= 1;
  EXPECT_FALSE(testutil::ReadFile(dir / "one.h5") == changed);
  AtomStoreReader r = AtomStoreReader::Open(dir / "two.h5");
  EXPECT_EQ(ReadAll(r, *r.FindAtom("w", "fp32")), a);
  EXPECT_THAT(r.Verify(), IsEmpty());
}

TEST(AtomStoreTest, UncommittedWriterLeavesNoFile) {
  testutil::TempDir dir;
  const fs::path file = dir / "u.h5";
  {
    AtomStoreWriter w = AtomStoreWriter::Create(file);
    EXPECT_EQ(w.final_path(), file);
    EXPECT_EQ(w.temp_path().parent_path(), dir.path());
    EXPECT_TRUE(fs::exists(w.temp_path()));
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
  {
    AtomStoreWriter w = AtomStoreWriter::Create(file);
    DatasetId id = w.AddOpaque("blob", 10000);
    w.Allocate();
    EXPECT_GE(fs::file_size(w.temp_path()), 10000u);
    w.Write(id, 0, Bytes(std::string(10000, 'a')));
    EXPECT_FALSE(fs::exists(file));
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
  {
    AtomStoreWriter w = AtomStoreWriter::Create(file);
    w.AddOpaque("blob", 10);
    w.Allocate();
    // Commit fails (no hash): the temporary file goes with the writer.
    EXPECT_THROW(w.Commit(), InternalError);
    EXPECT_FALSE(fs::exists(file));
  }
  EXPECT_TRUE(fs::is_empty(dir.path()));
}

TEST(AtomStoreTest, CommitReplacesExistingFileAtomically) {
  testutil::TempDir dir;
  const fs::path file = dir / "x.h5";
  testutil::WriteFile(file, "old contents");
  AtomStoreWriter w = AtomStoreWriter::Create(file);
  DatasetId id = w.AddOpaque("blob", 3);
  w.Allocate();
  w.Write(id, 0, Bytes(std::string("abc")));
  w.HashWritten(id);
  EXPECT_EQ(testutil::ReadFile(file), "old contents");
  w.Commit();
  AtomStoreReader r = AtomStoreReader::Open(file);
  EXPECT_EQ(ReadAll(r, *r.FindOpaque("blob")), "abc");
  EXPECT_EQ(r.FindOpaque("blob")->xxh3, Xxh3("abc", 3));
}

TEST(AtomStoreTest, RejectsMisuse) {
  testutil::TempDir dir;
  AtomStoreWriter w = AtomStoreWriter::Create(dir / "m.h5");
  ParamInfo p;
  p.fqn = "p";
  p.shape = {2, 3};
  w.AddParam(p);
  EXPECT_THROW(w.AddParam(p), InternalError);
  EXPECT_THROW(w.AddAtom("q", "fp32", DType::kFloat32, {2, 3}), InternalError);
  EXPECT_THROW(w.AddAtom("p", "fp32", DType::kFloat32, {3, 2}), InternalError);
  EXPECT_THROW(w.AddAtom("p", "", DType::kFloat32, {2, 3}), InternalError);
  EXPECT_THROW(w.AddPadAtom("p", "fp32", DType::kFloat32, {2}), InternalError);
  DatasetId id = w.AddAtom("p", "fp32", DType::kFloat32, {2, 3});
  EXPECT_THROW(w.AddAtom("p", "fp32", DType::kFloat32, {2, 3}), InternalError);
  w.AddOpaque("a/b", 1);
  EXPECT_THROW(w.AddOpaque("a", 1), InternalError);
  EXPECT_THROW(w.AddOpaque("a/b/c", 1), InternalError);
  EXPECT_THROW(w.AddOpaque("a//c", 1), InternalError);
  EXPECT_THROW(w.AddOpaque("", 1), InternalError);
  EXPECT_THROW(w.Write(id, 0, Bytes(std::string(4, 'x'))), InternalError);
  RootInfo root;
  root.extra_strings["iteration"] = "x";
  EXPECT_THROW(w.SetRoot(root), InternalError);
  w.Allocate();
  EXPECT_THROW(w.AddOpaque("late", 1), InternalError);
  EXPECT_THROW(w.Write(id, 20, Bytes(std::string(5, 'x'))), InternalError);
  EXPECT_THROW(w.Write(id, 25, {}), InternalError);
  EXPECT_THROW(w.Write(99, 0, {}), InternalError);
  w.Write(id, 20, Bytes(std::string(4, 'x')));
}

TEST(AtomStoreTest, VerifyFindsFlippedByte) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  testutil::TempDir dir;
  const fs::path file = dir / "v.h5";
  Sample s = MakeSample(seed);
  WriteSample(s, file);
  const DatasetInfo target = *AtomStoreReader::Open(file).FindAtom(
      "decoder.layers.7.self_attention.linear_qkv.weight", "exp_avg");
  std::string all = testutil::ReadFile(file);
  all[target.offset + target.nbytes / 2] ^= 0x10;
  testutil::WriteFile(dir / "flipped.h5", all);
  AtomStoreReader r = AtomStoreReader::Open(dir / "flipped.h5");
  uint64_t progressed = 0;
  std::vector<HashMismatch> bad =
      r.Verify([&](uint64_t n) { progressed += n; });
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_EQ(bad[0].path, target.path);
  EXPECT_EQ(bad[0].stored, target.xxh3);
  EXPECT_NE(bad[0].actual, target.xxh3);
  uint64_t total = 0;
  for (const DatasetInfo& d : r.datasets()) total += d.nbytes;
  EXPECT_EQ(progressed, total);
}

// ---- Malformed inputs -----------------------------------------------------

template <typename E>
void ExpectOpenFails(const fs::path& file, const std::string& what) {
  SCOPED_TRACE(file.string());
  EXPECT_THAT([&] { AtomStoreReader::Open(file); },
              ThrowsMessage<E>(
                  testing::AllOf(HasSubstr(file.string()), HasSubstr(what))));
}

TEST(AtomStoreTest, RejectsMalformedFiles) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  testutil::TempDir dir;
  const fs::path valid = dir / "valid.h5";
  {
    AtomStoreWriter w = AtomStoreWriter::Create(valid);
    ParamInfo p;
    p.fqn = "layer.weight";
    p.shape = {64, 32};
    p.frozen = true;  // version1.h5 drops the attribute: reads as false
    w.AddParam(p);
    DatasetId id = w.AddAtom("layer.weight", "fp32", DType::kFloat32, {64, 32});
    DatasetId blob = w.AddOpaque("blob", 100);
    w.Allocate();
    w.Write(id, 0, Bytes(RandomBytes(rng, 64 * 32 * 4)));
    w.Write(blob, 0, Bytes(RandomBytes(rng, 100)));
    w.HashWritten(id);
    w.HashWritten(blob);
    w.Commit();
  }
  ASSERT_NO_THROW(AtomStoreReader::Open(valid));
  const std::string bytes = testutil::ReadFile(valid);

  ExpectOpenFails<IoError>(dir / "missing.h5", "cannot open");

  testutil::WriteFile(dir / "empty.h5", "");
  ExpectOpenFails<FormatError>(dir / "empty.h5", "not a readable HDF5 file");
  testutil::WriteFile(dir / "random.h5", RandomBytes(rng, 10000));
  ExpectOpenFails<FormatError>(dir / "random.h5", "not a readable HDF5 file");
  testutil::WriteFile(dir / "half.h5", bytes.substr(0, bytes.size() / 2));
  ExpectOpenFails<FormatError>(dir / "half.h5", "truncated");
  testutil::WriteFile(dir / "short.h5", bytes.substr(0, bytes.size() - 1));
  ExpectOpenFails<FormatError>(dir / "short.h5", "truncated");

  const fs::path script =
      testutil::SourceDir() / "tests/unit/engine/atoms/h5py_oracle.py";
  std::string out;
  int rc = testutil::RunCommand(
      testutil::Python() + " " + testutil::ShellQuote(script.string()) +
          " malform " + testutil::ShellQuote(valid.string()) + " " +
          testutil::ShellQuote(dir.path().string()) +
          " /params/layer.weight /params/layer.weight/fp32",
      &out);
  ASSERT_EQ(rc, 0) << out;
  ExpectOpenFails<FormatError>(dir / "no_attrs.h5", "ucp_format is missing");
  ExpectOpenFails<FormatError>(dir / "wrong_format.h5", "'zarr'");
  ExpectOpenFails<FormatError>(dir / "wrong_version.h5",
                               "unsupported ucp_version 3");
  {
    // Version-1 files still read: no frozen params, no training attribute.
    AtomStoreReader v1 = AtomStoreReader::Open(dir / "version1.h5");
    EXPECT_TRUE(v1.root().training.empty());
    EXPECT_FALSE(v1.params().empty());
    for (const StoredParam& p : v1.params()) EXPECT_FALSE(p.info.frozen);
  }
  ExpectOpenFails<FormatError>(dir / "missing_version.h5",
                               "ucp_version is missing");
  ExpectOpenFails<FormatError>(dir / "chunked.h5",
                               "/params/layer.weight/chunky: has chunked");
  ExpectOpenFails<FormatError>(dir / "unknown_dtype.h5",
                               "unknown dtype attribute 'float99'");
  ExpectOpenFails<FormatError>(dir / "type_mismatch.h5",
                               "dtype attribute says int32");
  ExpectOpenFails<FormatError>(dir / "shape_mismatch.h5",
                               "differs from the param's shape");
  ExpectOpenFails<FormatError>(dir / "missing_xxh3.h5",
                               "attribute xxh3 is missing");
  ExpectOpenFails<FormatError>(dir / "bad_kind.h5", "kind attribute is");
  ExpectOpenFails<FormatError>(dir / "soft_link.h5",
                               "link alias is a soft or external link");
  ExpectOpenFails<FormatError>(dir / "cycle.h5",
                               "/opaque/loop: a group linked more than once");
  ExpectOpenFails<FormatError>(dir / "fanout.h5", "linked more than once");
  ExpectOpenFails<FormatError>(dir / "deep.h5", "nested deeper than 32");
  ExpectOpenFails<FormatError>(
      dir / "pad_0d.h5", "/params/scalar/pad/fp32: padding rows of a 0-d");
  ExpectOpenFails<FormatError>(dir / "noncanonical_name.h5",
                               "malformed escaped name 'layer%2eweight'");
}

// libhdf5 1.10 trusts the object sizes in a global heap collection (where
// variable-length string attributes live): a damaged size makes H5Aread copy
// terabytes (SIGSEGV in H5HG_read). The reader must report a corrupt file,
// not crash.
TEST(AtomStoreTest, CorruptGlobalHeapIsAFormatErrorNotACrash) {
  testutil::TempDir dir;
  const fs::path file = dir / "heap.h5";
  {
    AtomStoreWriter w = AtomStoreWriter::Create(file);
    ParamInfo p;
    p.fqn = "w";
    p.shape = {4};
    w.AddParam(p);
    DatasetId id = w.AddAtom("w", "fp32", DType::kFloat32, {4});
    w.Allocate();
    w.Write(id, 0, Bytes(std::string(16, 'x')));
    w.HashWritten(id);
    w.Commit();
  }
  ASSERT_NO_THROW(AtomStoreReader::Open(file));
  std::string bytes = testutil::ReadFile(file);
  // Collection header: "GCOL", version, 3 reserved, u64 size; then the first
  // object: u16 index, u16 references, 4 reserved, u64 size, data.
  const size_t gcol = bytes.find("GCOL");
  ASSERT_NE(gcol, std::string::npos);
  bytes[gcol + 16 + 8 + 5] = '\x10';  // object size ~2^44
  testutil::WriteFile(file, bytes);
  ExpectOpenFails<FormatError>(file, "HDF5 crashed reading the metadata");
}

TEST(AtomStoreTest, RejectsDatasetBeyondEndOfFile) {
  // A store whose metadata survived but whose last dataset was cut off: HDF5
  // itself notices (its end-of-allocation mark lies past the end of file).
  testutil::TempDir dir;
  const fs::path file = dir / "cut.h5";
  {
    AtomStoreWriter w = AtomStoreWriter::Create(file);
    DatasetId id = w.AddOpaque("big", 1 << 20);
    w.Allocate();
    w.Write(id, 0, Bytes(std::string(1 << 20, 'z')));
    w.HashWritten(id);
    w.Commit();
  }
  fs::resize_file(file, fs::file_size(file) - 4096);
  ExpectOpenFails<FormatError>(file, "truncated");
}

}  // namespace
}  // namespace ucp::atoms
