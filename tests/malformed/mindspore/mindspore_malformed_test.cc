// Malformed MindSpore .ckpt files through the record reader, planning and a
// full read under ASan + UBSan: real MindSpore 2.10 saves
// (tests/fuzz/regressions/mindspore: with Adam's state; with the CRC
// trailer) cut short at every length and with seeded random bytes flipped,
// inserted and deleted. Each must be read or end in one ucp::Error naming
// the file, never a crash, undefined behaviour or another exception.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "engine/core/error.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/universal/write_universal.h"
#include "tests/testutil/testutil.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

fs::path Seeds() {
  return testutil::SourceDir() / "tests" / "fuzz" / "regressions" / "mindspore";
}

// Reads `path` completely; "" if it reads, else the error.
std::string ReadAll(const fs::path& path) {
  try {
    const Checkpoint c = Discover(path, "");
    universal::SourcePlan plan = PlanSource(c);
    reshape::ExecutorOptions o;
    o.threads = 2;
    universal::VerifySource(plan, o);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

class MindSporeMalformedTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { good_ = testutil::ReadFile(Seeds() / GetParam()); }
  testutil::TempDir dir_;
  std::string good_;
};

TEST_P(MindSporeMalformedTest, TheRealFileReads) {
  EXPECT_EQ(ReadAll(Seeds() / GetParam()), "");
}

TEST_P(MindSporeMalformedTest, CutShortAnywhere) {
  const fs::path f = dir_ / "cut.ckpt";
  for (size_t n = 0; n < good_.size(); ++n) {
    SCOPED_TRACE(n);
    testutil::WriteFile(f, good_.substr(0, n));
    // A cut at a record boundary is a shorter checkpoint (no trailer to
    // tell); anywhere else it is refused, naming the file.
    const std::string error = ReadAll(f);
    if (!error.empty()) {
      EXPECT_THAT(error, ::testing::HasSubstr("cut.ckpt"));
    }
  }
}

TEST_P(MindSporeMalformedTest, RandomDamage) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const fs::path f = dir_ / "damaged.ckpt";
  int refused = 0;
  for (int i = 0; i < 400; ++i) {
    std::string d = good_;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t at = rng() % d.size();
      switch (rng() % 3) {
        case 0:
          d[at] = static_cast<char>(d[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          d.insert(at, 1, static_cast<char>(rng() % 256));
          break;
        default:
          d.erase(at, 1 + rng() % 8);
      }
    }
    testutil::WriteFile(f, d);
    const std::string error = ReadAll(f);
    if (!error.empty()) {
      ++refused;
      EXPECT_THAT(error, ::testing::HasSubstr("damaged.ckpt")) << i;
    }
  }
  EXPECT_GT(refused, 50);
}

INSTANTIATE_TEST_SUITE_P(RealFiles, MindSporeMalformedTest,
                         ::testing::Values("adam-mindspore-2.10.ckpt",
                                           "crc-mindspore-2.10.ckpt"));

// A safetensors file MindSpore 2.10 wrote (save_checkpoint(format=
// "safetensors") of an nn.Adam: params, moments, scalars) as the model file
// of a one-rank Checkpoint 2.0 folder, cut and damaged: it reads, or the
// error names it.
TEST(MindSporeCheckpoint2Malformed, CutShortOrDamaged) {
  const std::string good = testutil::ReadFile(
      testutil::SourceDir() / "tests" / "fuzz" / "regressions" /
      "mindspore_safetensors" / "adam-mindspore-2.10.safetensors");
  testutil::TempDir dir;
  const fs::path it = dir / "iteration_00000001";
  fs::create_directories(it);
  const fs::path f = it / "model-0000000-0000001.safetensors";
  testutil::WriteFile(f, good);
  ASSERT_EQ(ReadAll(dir.path()), "");
  ASSERT_EQ(ReadSafetensorsIndex(f).entries.size(), 10u);
  int refused = 0;
  for (size_t n = 0; n < good.size(); n += 3) {
    SCOPED_TRACE(n);
    testutil::WriteFile(f, good.substr(0, n));
    const std::string error = ReadAll(dir.path());
    ASSERT_FALSE(error.empty());  // the data no longer tiles the file
    EXPECT_THAT(error, ::testing::HasSubstr("model-0000000-0000001"));
    ++refused;
  }
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int i = 0; i < 400; ++i) {
    std::string d = good;
    const int edits = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < edits; ++k) {
      const size_t at = rng() % d.size();
      if (rng() % 2 == 0) {
        d[at] = static_cast<char>(d[at] ^ (1 << (rng() % 8)));
      } else {
        d.erase(at, 1 + rng() % 8);
      }
    }
    testutil::WriteFile(f, d);
    const std::string error = ReadAll(dir.path());
    if (!error.empty()) {
      ++refused;
      EXPECT_THAT(error, ::testing::HasSubstr("model-0000000-0000001")) << i;
    }
  }
  EXPECT_GT(refused, 100);
}

// The same file as a rank file of MindSpore's own safetensors container
// (save_checkpoint(format="safetensors") in rank_0/), cut and damaged: read
// through the folder and as the file, it reads or the error names it.
TEST(MindSporeSafetensorsMalformed, CutShortOrDamaged) {
  const std::string good = testutil::ReadFile(
      testutil::SourceDir() / "tests" / "fuzz" / "regressions" /
      "mindspore_safetensors" / "adam-mindspore-2.10.safetensors");
  testutil::TempDir dir;
  const fs::path f = dir / "rank_0" / "net-1_4.safetensors";
  fs::create_directories(f.parent_path());
  testutil::WriteFile(f, good);
  ASSERT_TRUE(LooksLikeMsSafetensors(f));
  ASSERT_EQ(ReadAll(dir.path()), "");
  ASSERT_EQ(ReadAll(f), "");
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int refused = 0;
  for (int i = 0; i < 300; ++i) {
    std::string d = good;
    if (i % 3 == 0) {
      d.resize(rng() % d.size());
    } else {
      const size_t at = rng() % d.size();
      if (i % 3 == 1) {
        d[at] = static_cast<char>(d[at] ^ (1 << (rng() % 8)));
      } else {
        d.erase(at, 1 + rng() % 8);
      }
    }
    testutil::WriteFile(f, d);
    const std::string folder = ReadAll(dir.path());
    const std::string file = ReadAll(f);
    if (!file.empty()) {
      ++refused;
      EXPECT_THAT(file, ::testing::HasSubstr("net-1_4.safetensors")) << i;
    }
    if (!folder.empty()) {
      EXPECT_THAT(folder, ::testing::HasSubstr("rank_0/net-1_4.safetensors"))
          << i;
    }
  }
  EXPECT_GT(refused, 100);
}

}  // namespace
}  // namespace ucp::mindspore

namespace ucp::mindspore {
namespace {

// Strategy files written by MindSpore 2.10's own protobuf classes
// (mindspore.train.node_strategy_pb2) from the layouts of
// tests/cli/test_mindspore_sharded.py: "opt" (optimizer-parallel shards),
// "ext" (several device axes per dim), "pp" (two stages, "<stage>-" names).
fs::path StrategySeeds() {
  return testutil::SourceDir() / "tests" / "fuzz" / "regressions" /
         "mindspore_strategy";
}

// Reads strategy `path` and places every layout's slices on every rank of
// a tensor three times its part count; "" if all of that works.
std::string ReadStrategyAll(const fs::path& path) {
  try {
    const Strategy s = ReadStrategy(path);
    for (const auto& [name, stages] : s.layouts) {
      for (const auto& [stage, l] : stages) {
        const std::vector<int64_t> counts = SplitCounts(l, l.dims.size(), name);
        Shape shape;
        for (int64_t c : counts) shape.push_back(3 * c);
        for (int64_t r = 0; r < std::min<int64_t>(s.world(), 64); ++r)
          RankBox(l, shape, r, name);
      }
    }
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// The boxes the format's rules give (strategy.h), worked out by hand from
// the layouts the files were written from.
TEST(MindSporeStrategy, RealFilesPlaceSlicesAsTheFormatSays) {
  const Strategy opt =
      ReadStrategy(StrategySeeds() / "opt-mindspore-2.10.ckpt");
  EXPECT_EQ(opt.world(), 4);
  // fc1.weight (12, 8): dev [2, 2], dim 0 by axis 0 (coordinate c1 = r % 2),
  // then the optimizer shard over the free axis (c0 = r / 2): part c1*2+c0.
  const TensorLayout* w = opt.Find("fc1.weight", 1);
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(RankBox(*w, {12, 8}, 1, "w"), (Box{{6, 0}, {3, 8}}));
  EXPECT_EQ(RankBox(*w, {12, 8}, 2, "w"), (Box{{3, 0}, {3, 8}}));
  // The moments carry the same layout.
  EXPECT_EQ(*opt.Find("moment2.fc1.weight", 3), *w);
  // fc2.bias (4,): no model split, the optimizer shard over all 4 devices.
  EXPECT_EQ(RankBox(*opt.Find("fc2.bias", 3), {4}, 3, "b"), (Box{{3}, {1}}));

  const Strategy ext =
      ReadStrategy(StrategySeeds() / "ext-mindspore-2.10.ckpt");
  // fc1.weight: dim 0 by axes (1, 0): part c0*2+c1; rank 1 = (0, 1) -> 1.
  EXPECT_EQ(RankBox(*ext.Find("fc1.weight", 1), {12, 8}, 1, "w"),
            (Box{{3, 0}, {3, 8}}));
  // fc1.bias: 1-D with the filler map; dim 0 by axes (0, 1): c1*2+c0.
  EXPECT_EQ(RankBox(*ext.Find("fc1.bias", 1), {12}, 1, "b"), (Box{{6}, {3}}));

  const Strategy pp = ReadStrategy(StrategySeeds() / "pp-mindspore-2.10.ckpt");
  EXPECT_EQ(pp.stages, 2);
  EXPECT_EQ(pp.stage_devices, 2);
  EXPECT_TRUE(pp.Holds("fc1.weight", 1));
  EXPECT_FALSE(pp.Holds("fc1.weight", 2));
  // Rank 3 is device 1 of stage 1: fc2.weight (4, 12) split on dim 1.
  EXPECT_EQ(RankBox(*pp.Find("fc2.weight", 3), {4, 12}, 3, "w"),
            (Box{{0, 6}, {4, 6}}));
  EXPECT_THROW(pp.Find("fc2.weight", 0), FormatError);
}

class MindSporeStrategyMalformedTest
    : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    good_ = testutil::ReadFile(StrategySeeds() / GetParam());
  }
  testutil::TempDir dir_;
  std::string good_;
};

TEST_P(MindSporeStrategyMalformedTest, TheRealFileReads) {
  EXPECT_EQ(ReadStrategyAll(StrategySeeds() / GetParam()), "");
}

TEST_P(MindSporeStrategyMalformedTest, CutShortOrDamaged) {
  const fs::path f = dir_ / "strategy.ckpt";
  for (size_t n = 0; n < good_.size(); ++n) {
    SCOPED_TRACE(n);
    testutil::WriteFile(f, good_.substr(0, n));
    const std::string error = ReadStrategyAll(f);
    if (!error.empty()) {
      EXPECT_THAT(error, ::testing::HasSubstr("strategy"));
    }
  }
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int refused = 0;
  for (int i = 0; i < 2000; ++i) {
    std::string d = good_;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const size_t at = rng() % d.size();
      switch (rng() % 3) {
        case 0:
          d[at] = static_cast<char>(d[at] ^ (1 << (rng() % 8)));
          break;
        case 1:
          d.insert(at, 1, static_cast<char>(rng() % 256));
          break;
        default:
          d.erase(at, 1 + rng() % 8);
      }
    }
    testutil::WriteFile(f, d);
    if (!ReadStrategyAll(f).empty()) ++refused;
  }
  EXPECT_GT(refused, 100);
}

INSTANTIATE_TEST_SUITE_P(RealFiles, MindSporeStrategyMalformedTest,
                         ::testing::Values("opt-mindspore-2.10.ckpt",
                                           "ext-mindspore-2.10.ckpt",
                                           "pp-mindspore-2.10.ckpt"));

}  // namespace
}  // namespace ucp::mindspore
