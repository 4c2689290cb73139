// TorchFile against descriptions computed by Python/torch
// (tests/tools/*.py) and against the truth files written with torch 2.6.

#include "engine/torchfile/torch_file.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <thread>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/torchfile/zip.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/torchfile/torchfile_testutil.h"

namespace ucp::torchfile {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

std::filesystem::path TorchData() { return testutil::TestDataDir() / "torch"; }

std::filesystem::path Fixture(std::string_view rel) {
  return testutil::FixturesDir() / std::string(rel);
}

TEST(TorchFileTest, GeneratedFixturesMatchTheirDescriptions) {
  const std::vector<std::filesystem::path> files =
      test::FindPtFiles(TorchData());
  EXPECT_GE(files.size(), 15u)
      << "too few generated fixtures in " << TorchData();
  for (const std::filesystem::path& pt : files) {
    SCOPED_TRACE(pt.string());
    std::filesystem::path json = pt;
    json.replace_extension(".expected.json");
    ASSERT_TRUE(std::filesystem::exists(json)) << json;
    try {
      TorchFile f = TorchFile::Open(pt);
      EXPECT_EQ(test::CompareWithDescription(f, json), "");
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

TEST(TorchFileTest, SharedFixturesMatchTheirDescriptions) {
  const std::filesystem::path root = testutil::FixturesDir();
  const std::vector<std::filesystem::path> files = test::FindPtFiles(root);
  EXPECT_GE(files.size(), 90u) << "too few fixtures in " << root;
  for (const std::filesystem::path& pt : files) {
    SCOPED_TRACE(pt.string());
    const std::filesystem::path json =
        testutil::TestDataDir() / "shared" /
        (std::filesystem::relative(pt, root).string() + ".expected.json");
    ASSERT_TRUE(std::filesystem::exists(json)) << json;
    try {
      TorchFile f = TorchFile::Open(pt);
      EXPECT_EQ(test::CompareWithDescription(f, json), "");
    } catch (const std::exception& e) {
      ADD_FAILURE() << e.what();
    }
  }
}

// The comparison above must be able to fail: a wrong description and
// single-field mutations of the right one are all reported.
TEST(TorchFileTest, DescriptionComparisonDetectsDifferences) {
  TorchFile f = TorchFile::Open(TorchData() / "views.pt");
  EXPECT_NE(
      test::CompareWithDescription(f, TorchData() / "params.expected.json"),
      "");
  const nlohmann::json good = nlohmann::json::parse(
      testutil::ReadFile(TorchData() / "views.expected.json"));
  testutil::TempDir dir;
  const std::filesystem::path mutated = dir / "m.json";
  testutil::WriteFile(mutated, good.dump());
  ASSERT_EQ(test::CompareWithDescription(f, mutated), "");
  std::vector<std::function<void(nlohmann::json&)>> mutations = {
      [](nlohmann::json& d) {
        d["tensors"][0]["sha256"] = std::string(64, '0');
      },
      [](nlohmann::json& d) { d["tensors"][1]["stride"][0] = 99; },
      [](nlohmann::json& d) { d["tensors"][2]["storage_offset"] = 77; },
      [](nlohmann::json& d) { d["tensors"][0]["storage_key"] = "x"; },
      [](nlohmann::json& d) { d["tensors"][0]["dtype"] = "int8"; },
      [](nlohmann::json& d) { d["tensors"][0]["path"][0] = "other"; },
      [](nlohmann::json& d) { d["tensors"].erase(0); },
      [](nlohmann::json& d) { d["records"].erase(1); },
      [](nlohmann::json& d) { d["archive_name"] = "zzz"; },
      [](nlohmann::json& d) { d["globals"].push_back("os.system"); },
      [](nlohmann::json& d) {
        d["leaves"].push_back(d["leaves"].empty()
                                  ? nlohmann::json{{"path", {"x"}},
                                                   {"type", "int"},
                                                   {"repr", "1"}}
                                  : d["leaves"][0]);
      },
  };
  for (size_t i = 0; i < mutations.size(); ++i) {
    nlohmann::json d = good;
    mutations[i](d);
    testutil::WriteFile(mutated, d.dump());
    EXPECT_NE(test::CompareWithDescription(f, mutated), "") << "mutation " << i;
  }
}

std::string Dotted(const TensorPath& path) {
  std::string out;
  for (const PathComponent& c : path) {
    if (!out.empty()) out += '.';
    if (const auto* s = std::get_if<std::string>(&c)) {
      out += *s;
    } else {
      out += std::to_string(std::get<int64_t>(c));
    }
  }
  return out;
}

// The torch 2.6 files come with truth files written inside the saving
// process: an oracle independent of our Python tools.
TEST(TorchFileTest, Torch26FilesMatchTheirTruthFiles) {
  const std::filesystem::path dir = Fixture("torch-2.6-save");
  int checked = 0;
  for (const std::filesystem::path& pt : test::FindPtFiles(dir)) {
    SCOPED_TRACE(pt.string());
    std::filesystem::path truth_path = pt;
    truth_path.replace_extension(".truth.json");
    nlohmann::json truth =
        nlohmann::json::parse(testutil::ReadFile(truth_path));
    TorchFile f = TorchFile::Open(pt);
    EXPECT_EQ(f.format() == TorchFile::Format::kZip,
              truth["format"].get<std::string>() == "zip");
    std::map<std::string, const TensorInfo*> by_path;
    for (const test::Reached& r : test::WalkContainers(f.root())) {
      if (const TensorInfo* t = f.FindTensor(r.node)) {
        by_path[Dotted(r.path)] = t;
      }
    }
    EXPECT_EQ(by_path.size(), truth["tensors"].size());
    for (const auto& [name, want] : truth["tensors"].items()) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(by_path.count(name)) << "no tensor at " << name;
      const TensorInfo& t = *by_path[name];
      EXPECT_EQ(DTypeName(t.dtype), want["dtype"].get<std::string>());
      EXPECT_EQ(t.shape, want["shape"].get<std::vector<int64_t>>());
      EXPECT_EQ(t.stride, want["stride"].get<std::vector<int64_t>>());
      EXPECT_EQ(t.storage_offset, want["storage_offset"].get<int64_t>());
      EXPECT_EQ(ElementSize(t.dtype), want["element_size"].get<size_t>());
      EXPECT_EQ(t.is_parameter, want["is_parameter"].get<bool>());
      EXPECT_EQ(t.requires_grad, want["requires_grad"].get<bool>());
      EXPECT_EQ(t.storage->nbytes, want["storage_nbytes"].get<uint64_t>());
      EXPECT_EQ(testutil::Sha256Hex(test::TensorBytes(f, t)),
                want["sha256_contiguous"].get<std::string>());
      std::string storage(t.storage->nbytes, '\0');
      f.ReadStorage(*t.storage, 0,
                    std::as_writable_bytes(std::span<char>(storage)));
      EXPECT_EQ(testutil::Sha256Hex(storage),
                want["storage_sha256"].get<std::string>());
      ++checked;
    }
    std::set<std::string> globals;
    for (const pickle::Value& v : f.arena().nodes()) {
      if (v.kind == pickle::Kind::kGlobal)
        globals.insert(v.module + "." + v.name);
    }
    if (truth.contains("data_pkl_globals")) {
      EXPECT_EQ(nlohmann::json(globals), truth["data_pkl_globals"]);
    }
    if (truth.contains("zip_entries")) {
      ASSERT_NE(f.zip(), nullptr);
      const auto& entries = f.zip()->entries();
      ASSERT_EQ(entries.size(), truth["zip_entries"].size());
      for (size_t i = 0; i < entries.size(); ++i) {
        EXPECT_EQ(entries[i].name, truth["zip_entries"][i]["name"]);
        EXPECT_EQ(entries[i].uncompressed_size,
                  truth["zip_entries"][i]["bytes"].get<uint64_t>());
        EXPECT_EQ(entries[i].local_header_offset,
                  truth["zip_entries"][i]["header_offset"].get<uint64_t>());
        EXPECT_EQ(entries[i].method,
                  truth["zip_entries"][i]["compress_type"].get<int>());
      }
    }
  }
  EXPECT_GE(checked, 40);
}

void ExpectSameTensors(const TorchFile& a, const TorchFile& b) {
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  EXPECT_TRUE(pickle::DeepEqual(a.root(), b.root()));
  for (size_t i = 0; i < a.tensors().size(); ++i) {
    const TensorInfo& x = a.tensors()[i];
    const TensorInfo& y = b.tensors()[i];
    EXPECT_EQ(x.dtype, y.dtype);
    EXPECT_EQ(x.shape, y.shape);
    EXPECT_EQ(x.path, y.path);
    EXPECT_EQ(test::TensorBytes(a, x), test::TensorBytes(b, y));
  }
}

TEST(TorchFileTest, ReadsAFileEmbeddedInALargerOne) {
  testutil::TempDir dir;
  for (const std::filesystem::path& src :
       {TorchData() / "views.pt", TorchData() / "rezip_deflated.pt",
        TorchData() / "legacy_views.pt",
        Fixture("torch-2.6-save/legacy_format_mixed.pt")}) {
    SCOPED_TRACE(src.string());
    const std::string bytes = testutil::ReadFile(src);
    const std::filesystem::path big = dir / "slice.bin";
    testutil::WriteFile(big,
                        std::string(1000, 'P') + bytes + std::string(333, 'K'));
    TorchFile whole = TorchFile::Open(src);
    TorchFile slice = TorchFile::Open(big, 1000, bytes.size());
    ExpectSameTensors(whole, slice);
    EXPECT_EQ(whole.archive_name(), slice.archive_name());
  }
}

// StorageLocation names where a storage's bytes lie verbatim: in a stored
// zip record, a legacy file, or such a file embedded in a larger one; never
// in a deflated record.
TEST(TorchFileTest, StorageLocationHoldsTheStorageBytes) {
  testutil::TempDir dir;
  for (const std::filesystem::path& src :
       {TorchData() / "views.pt", TorchData() / "rezip_deflated.pt",
        TorchData() / "legacy_views.pt"}) {
    SCOPED_TRACE(src.string());
    const std::string bytes = testutil::ReadFile(src);
    const std::filesystem::path big = dir / "slice.bin";
    testutil::WriteFile(big, std::string(777, 'P') + bytes);
    for (bool embedded : {false, true}) {
      TorchFile f = embedded ? TorchFile::Open(big, 777, bytes.size())
                             : TorchFile::Open(src);
      ASSERT_FALSE(f.storages().empty());
      for (const StorageInfo& st : f.storages()) {
        if (st.nbytes < 2) continue;
        const std::optional<FileLocation> at = f.StorageLocation(st, 1);
        if (src.filename() == "rezip_deflated.pt") {
          EXPECT_FALSE(at.has_value()) << st.key;
          continue;
        }
        ASSERT_TRUE(at.has_value()) << st.key;
        std::string want(st.nbytes - 1, '\0');
        f.ReadStorage(st, 1, std::as_writable_bytes(std::span(want)));
        std::string got(want.size(), '\0');
        at->file->ReadExact(got.data(), got.size(), at->offset);
        EXPECT_EQ(got, want) << st.key;
      }
      EXPECT_THROW(
          f.StorageLocation(f.storages()[0], f.storages()[0].nbytes + 1),
          UsageError);
    }
  }
}

TEST(TorchFileTest, ConcurrentReadsAgreeWithSequentialOnes) {
  TorchFile f = TorchFile::Open(TorchData() / "many_tensors.pt");
  ASSERT_GE(f.tensors().size(), 300u);
  std::vector<std::string> expected;
  for (const TensorInfo& t : f.tensors()) {
    expected.push_back(test::TensorBytes(f, t));
  }
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = k; i < f.tensors().size(); i += 3) {
          if (test::TensorBytes(f, f.tensors()[i]) != expected[i]) ++mismatches;
        }
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(mismatches.load(), 0);
}

// Any layout: a strided tensor's range is read element by element.
TEST(TorchFileTest, ReadTensorRangeSlicesAnyTensor) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int contiguous = 0;
  int strided = 0;
  for (const char* name : {"dtypes.pt", "views.pt", "legacy_dtypes.pt"}) {
    TorchFile f = TorchFile::Open(TorchData() / name);
    for (const TensorInfo& t : f.tensors()) {
      const std::string all = test::TensorBytes(f, t);
      const size_t esize = ElementSize(t.dtype);
      ++(t.contiguous ? contiguous : strided);
      for (int k = 0; k < 5; ++k) {
        const int64_t off = t.numel == 0 ? 0 : rng() % (t.numel + 1);
        const int64_t count = rng() % (t.numel - off + 1);
        std::string part(count * esize, '\0');
        f.ReadTensorRange(t, off, count,
                          std::as_writable_bytes(std::span<char>(part)));
        EXPECT_EQ(part, all.substr(off * esize, count * esize));
      }
      std::string one(esize, '\0');
      EXPECT_THROW(
          f.ReadTensorRange(t, t.numel, 1,
                            std::as_writable_bytes(std::span<char>(one))),
          UsageError);
      std::string wrong(t.nbytes + 1, '\0');
      EXPECT_THROW(
          f.ReadTensor(t, std::as_writable_bytes(std::span<char>(wrong))),
          UsageError);
    }
  }
  EXPECT_GT(contiguous, 20);
  EXPECT_GT(strided, 3);
}

TEST(TorchFileTest, TensorsListsEveryTensorOnceWithItsFirstPath) {
  TorchFile f = TorchFile::Open(TorchData() / "nested.pt");
  std::map<const pickle::Value*, TensorPath> first;
  for (const test::Reached& r : test::WalkContainers(f.root())) {
    if (f.FindTensor(r.node) != nullptr && !first.count(r.node)) {
      first[r.node] = r.path;
    }
  }
  ASSERT_FALSE(first.empty());
  std::set<const pickle::Value*> seen;
  for (const TensorInfo& t : f.tensors()) {
    EXPECT_TRUE(seen.insert(t.node).second);
    EXPECT_EQ(f.FindTensor(t.node), &t);
    if (first.count(t.node)) {
      ASSERT_TRUE(t.path.has_value());
      EXPECT_EQ(*t.path, first[t.node]);
      EXPECT_EQ(f.FindTensor(*t.path), &t);
    }
  }
  EXPECT_EQ(seen.size(), f.tensors().size());
}

// torch.save assigns storage keys in pickling order; tensors() follows it.
TEST(TorchFileTest, TensorsComeInStorageKeyOrderForCompactFiles) {
  TorchFile f = TorchFile::Open(TorchData() / "many_tensors.pt");
  int64_t expected = 0;
  for (const TensorInfo& t : f.tensors()) {
    EXPECT_EQ(t.storage_key(), std::to_string(expected++));
  }
}

TEST(TorchFileTest, RejectsFilesThatAreNotTorchSaveFiles) {
  testutil::TempDir dir;
  std::string out;
  ASSERT_EQ(
      test::RunPythonScript(R"PY(
import pickle, sys, torch, zipfile
d = sys.argv[1]
m = torch.jit.script(torch.nn.Linear(2, 2))
torch.jit.save(m, d + "/script.pt")
with open(d + "/plain.pkl", "wb") as f:
    pickle.dump({"a": 1}, f, protocol=2)
with zipfile.ZipFile(d + "/flat.zip", "w") as z:
    z.writestr("data.pkl", pickle.dumps(1))
with zipfile.ZipFile(d + "/nodata.zip", "w") as z:
    z.writestr("x/version", "3\n")
)PY",
                            testutil::ShellQuote(dir.path().string()), &out),
      0)
      << out;
  testutil::WriteFile(dir / "empty.pt", "");
  testutil::WriteFile(dir / "text.pt", "hello, world");
  for (const auto& [name, what] :
       std::vector<std::pair<std::string, std::string>>{
           {"script.pt", "TorchScript"},
           {"plain.pkl", "not a torch.save file"},
           {"flat.zip", "not a torch.save file"},
           {"nodata.zip", "no data.pkl"},
           {"empty.pt", "not a torch.save file"},
           {"text.pt", "not a torch.save file"}}) {
    SCOPED_TRACE(name);
    EXPECT_THAT([&] { TorchFile::Open(dir / name); },
                ThrowsMessage<FormatError>(
                    testing::AllOf(HasSubstr(what), HasSubstr(name))));
  }
  EXPECT_THROW(TorchFile::Open(dir / "missing.pt"), IoError);
}

// A legacy file whose object pickle is corrupt (not cut short) is rejected
// at once: the reader must not pull the rest of a multi-gigabyte file into
// memory looking for the pickle's end. Checked in a child process whose
// address space is limited to far less than the (sparse) file.
TEST(TorchFileTest, CorruptLegacyPickleDoesNotReadTheWholeFile) {
  testutil::TempDir dir;
  const std::filesystem::path path = dir / "legacy_corrupt.pt";
  using namespace std::string_literals;
  const std::string head =
      "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19."s  // magic
      "\x80\x02M\xe9\x03."s                             // protocol version 1001
      "\x80\x02}X\x0d\x00\x00\x00little_endian\x88s."s  // sys_info
      "\x80\x02\xff"s;  // object pickle: unknown opcode 0xff
  testutil::WriteFile(path, head);
  std::filesystem::resize_file(path, uint64_t{6} << 30);  // sparse
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        long pages = 0;
        if (FILE* f = std::fopen("/proc/self/statm", "r")) {
          if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
          std::fclose(f);
        }
        struct rlimit limit;
        getrlimit(RLIMIT_AS, &limit);
        limit.rlim_cur = static_cast<rlim_t>(pages) * 4096 + (rlim_t{1} << 30);
        setrlimit(RLIMIT_AS, &limit);
        int code = 3;
        try {
          TorchFile::Open(path);
        } catch (const FormatError& e) {
          code = std::string(e.what()).find("unknown opcode 0xff") !=
                         std::string::npos
                     ? 0
                     : 1;
        } catch (...) {
          code = 2;
        }
        // The "threadsafe" child re-ran this test from its start, with a
        // temporary folder of its own that _Exit would leave behind.
        std::error_code ec;
        std::filesystem::remove_all(dir.path(), ec);
        std::_Exit(code);
      },
      testing::ExitedWithCode(0), "");
}

TEST(TorchFileTest, ReportsStoragesAndDevices) {
  TorchFile f = TorchFile::Open(TorchData() / "fake_cuda.pt");
  std::set<std::string> devices;
  for (const TensorInfo& t : f.tensors()) devices.insert(t.device());
  EXPECT_TRUE(devices.count("cuda:0")) << testing::PrintToString(devices);
  for (const StorageInfo& s : f.storages()) {
    EXPECT_EQ(f.FindStorage(s.key), &s);
    EXPECT_EQ(s.nbytes, s.numel * ElementSize(s.dtype));
  }
  EXPECT_EQ(f.FindStorage("no such key"), nullptr);
}

}  // namespace
}  // namespace ucp::torchfile
