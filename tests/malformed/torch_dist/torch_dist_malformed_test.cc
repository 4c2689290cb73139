// Malformed Megatron-core torch_dist checkpoints through discovery, planning
// and verification under ASan + UBSan: the real fixture
// (../shared/fixtures/megatron-core-torch-dist: megatron-core with torch 2.6,
// the common state as a DCP item, fully_reshardable optimizer state) with its
// metadata.json replaced, its .metadata damaged with seeded random bytes
// flipped, inserted and deleted, and its rank files cut and flipped. Each
// must be read or end in one ucp::Error naming the damaged file, never a
// crash, undefined behaviour, a hang or another exception.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "engine/core/error.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"
#include "engine/universal/write_universal.h"
#include "tests/testutil/testutil.h"

namespace ucp::torch_dist {
namespace {

namespace fs = std::filesystem;

fs::path Fixture() {
  return testutil::FixturesDir() / "megatron-core-torch-dist" / "tp2pp1dp1" /
         "ckpt";
}

// Reads the save folder `dir` completely; "" if it reads, else the error.
std::string ReadAll(const fs::path& dir) {
  try {
    const Checkpoint c = Discover(dir, std::nullopt);
    universal::SourcePlan plan = PlanSource(c, SourceOptions{});
    reshape::ExecutorOptions o;
    o.threads = 2;
    universal::VerifySource(plan, o);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

class TorchDistMalformedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::copy(Fixture(), dir_ / "c", fs::copy_options::recursive);
    for (const auto& e : fs::recursive_directory_iterator(dir_.path()))
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    iter_ = dir_ / "c" / "iter_0000010";
  }
  testutil::TempDir dir_;
  fs::path iter_;
};

TEST_F(TorchDistMalformedTest, TheFixtureReads) {
  EXPECT_EQ(ReadAll(dir_ / "c"), "");
}

TEST_F(TorchDistMalformedTest, MetadataJsonReplaced) {
  for (const char* text : {"", "{", "[]", "{\"sharded_backend\": \"zarr\"}",
                           "{\"sharded_backend\": 7}"}) {
    SCOPED_TRACE(text);
    testutil::WriteFile(iter_ / "metadata.json", text);
    EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("metadata.json"));
  }
}

TEST_F(TorchDistMalformedTest, DotMetadataWithRandomDamage) {
  const std::string good = testutil::ReadFile(iter_ / ".metadata");
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int refused = 0;
  for (int i = 0; i < 100; ++i) {
    std::string m = good;
    if (i % 5 == 0) {
      m.resize(rng() % m.size());
    } else {
      for (int k = 0; k < 1 + static_cast<int>(rng() % 4); ++k) {
        const size_t at = rng() % m.size();
        switch (rng() % 3) {
          case 0:
            m[at] = static_cast<char>(m[at] ^ (1 << (rng() % 8)));
            break;
          case 1:
            m.insert(at, 1, static_cast<char>(rng() % 256));
            break;
          default:
            m.erase(at, 1 + rng() % 8);
        }
      }
    }
    testutil::WriteFile(iter_ / ".metadata", m);
    const std::string error = ReadAll(dir_ / "c");
    if (!error.empty()) ++refused;
    if (i % 5 == 0) {
      EXPECT_THAT(error, ::testing::HasSubstr(".metadata")) << i;
    }
  }
  EXPECT_GT(refused, 20);
}

TEST_F(TorchDistMalformedTest, RankFilesCutAndFlipped) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (const char* name : {"__0_0.distcp", "__1_0.distcp"}) {
    const fs::path f = iter_ / name;
    const std::string good = testutil::ReadFile(f);
    for (int i = 0; i < 40; ++i) {
      std::string d = good;
      if (i % 4 == 0) {
        d.resize(rng() % d.size());
      } else {
        for (int k = 0; k < 1 + static_cast<int>(rng() % 6); ++k) {
          const size_t at = rng() % d.size();
          d[at] = static_cast<char>(d[at] ^ (1 << (rng() % 8)));
        }
      }
      testutil::WriteFile(f, d);
      const std::string error = ReadAll(dir_ / "c");
      if (i % 4 == 0) {
        // Cut short: refused, naming the file.
        EXPECT_THAT(error, ::testing::HasSubstr(name)) << i;
      }
    }
    testutil::WriteFile(f, good);
  }
}

TEST_F(TorchDistMalformedTest, MissingFilesAndTracker) {
  testutil::WriteFile(dir_ / "c" / "latest_checkpointed_iteration.txt", "30");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("iteration 30"));
  testutil::WriteFile(dir_ / "c" / "latest_checkpointed_iteration.txt", "10");
  fs::remove(iter_ / "__1_0.distcp");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("__1_0.distcp"));
  fs::remove(iter_ / "metadata.json");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("metadata.json"));
}

}  // namespace
}  // namespace ucp::torch_dist
