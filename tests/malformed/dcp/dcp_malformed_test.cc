// Malformed PyTorch DCP checkpoints through discovery, planning and
// verification under ASan + UBSan: the real torch 2.6 checkpoint
// (../shared/fixtures/dcp-torch-2.6) with its .metadata cut short at every
// length, with seeded random bytes flipped, inserted and deleted, and its
// .distcp items cut and flipped. Each must be read or end in one ucp::Error,
// never a crash, undefined behaviour, a hang or another exception.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/dcp/metadata.h"
#include "engine/universal/write_universal.h"
#include "tests/testutil/testutil.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;

fs::path Fixture() {
  return testutil::FixturesDir() / "dcp-torch-2.6" / "dtensor_shard0_w2" /
         "ckpt";
}

// Reads the checkpoint in `dir` completely; "" if it reads, else the error.
std::string ReadAll(const fs::path& dir) {
  try {
    const Checkpoint c = Discover(dir, "");
    universal::SourcePlan plan = PlanSource(c);
    reshape::ExecutorOptions o;
    o.threads = 2;
    universal::VerifySource(plan, o);
    (void)Inventory(c);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

class DcpMalformedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::copy(Fixture(), dir_ / "c", fs::copy_options::recursive);
    for (const auto& e : fs::recursive_directory_iterator(dir_.path()))
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    metadata_ = testutil::ReadFile(dir_ / "c" / ".metadata");
  }
  testutil::TempDir dir_;
  std::string metadata_;
};

TEST_F(DcpMalformedTest, TheFixtureReads) {
  EXPECT_EQ(ReadAll(dir_ / "c"), "");
}

TEST_F(DcpMalformedTest, MetadataCutShortAnywhere) {
  // Every length up to 2 KiB, then every 97th: never read as a checkpoint.
  for (size_t n = 0; n < metadata_.size(); n += n < 2048 ? 1 : 97) {
    SCOPED_TRACE(n);
    EXPECT_THROW(
        ParseMetadata(std::string_view(metadata_).substr(0, n), "cut.metadata"),
        FormatError);
  }
}

TEST_F(DcpMalformedTest, MetadataWithRandomDamage) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int read = 0, refused = 0;
  for (int i = 0; i < 300; ++i) {
    std::string m = metadata_;
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
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
    testutil::WriteFile(dir_ / "c" / ".metadata", m);
    (ReadAll(dir_ / "c").empty() ? read : refused) += 1;
  }
  EXPECT_GT(refused, 0);
  testutil::WriteFile(dir_ / "c" / ".metadata", metadata_);
}

TEST_F(DcpMalformedTest, ItemsCutAndFlipped) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const fs::path f = dir_ / "c" / "__1_0.distcp";
  const std::string good = testutil::ReadFile(f);
  for (int i = 0; i < 120; ++i) {
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
      EXPECT_THAT(error, ::testing::HasSubstr("__1_0.distcp")) << i;
    }
  }
}

TEST_F(DcpMalformedTest, MissingAndEmptyFiles) {
  fs::remove(dir_ / "c" / "__0_0.distcp");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("__0_0.distcp"));
  testutil::WriteFile(dir_ / "c" / "__0_0.distcp", "");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("__0_0.distcp"));
  testutil::WriteFile(dir_ / "c" / ".metadata", "");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr(".metadata"));
  fs::remove(dir_ / "c" / ".metadata");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("no .metadata"));
}

}  // namespace
}  // namespace ucp::dcp
