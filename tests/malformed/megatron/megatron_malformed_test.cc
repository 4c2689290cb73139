// Malformed Megatron-LM legacy checkpoints through discovery, planning and
// verification under ASan + UBSan: the real Megatron-LM 23.06 checkpoint
// (../shared/fixtures/megatron-23.06/synth_tp2) with a rank file cut short at
// many lengths, seeded random bytes flipped anywhere in it, a rank file or
// the tracker missing or empty. Each must be read or end in one ucp::Error,
// never a crash, undefined behaviour, a hang or another exception.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "engine/core/error.h"
#include "engine/formats/megatron_legacy/megatron.h"
#include "engine/universal/write_universal.h"
#include "tests/testutil/testutil.h"

namespace ucp::megatron {
namespace {

namespace fs = std::filesystem;

fs::path Fixture() {
  return testutil::FixturesDir() / "megatron-23.06" / "synth_tp2";
}

// Reads the checkpoint in `dir` completely; "" if it reads, else the error.
std::string ReadAll(const fs::path& dir) {
  try {
    const Checkpoint c = Discover(dir);
    universal::SourcePlan plan = PlanSource(c, SourceOptions{});
    reshape::ExecutorOptions o;
    o.threads = 2;
    universal::VerifySource(plan, o);
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

class MegatronMalformedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::copy(Fixture(), dir_ / "c", fs::copy_options::recursive);
    for (const auto& e : fs::recursive_directory_iterator(dir_.path()))
      fs::permissions(e.path(), fs::perms::owner_write, fs::perm_options::add);
    rank_ = dir_ / "c" / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt";
    good_ = testutil::ReadFile(rank_);
  }
  testutil::TempDir dir_;
  fs::path rank_;
  std::string good_;
};

TEST_F(MegatronMalformedTest, TheFixtureReads) {
  EXPECT_EQ(ReadAll(dir_ / "c"), "");
}

TEST_F(MegatronMalformedTest, RankFileCutShort) {
  // Cut at 0..255 bytes, then every 997th length up to the whole file less
  // one: always refused, naming the file.
  for (size_t n = 0; n < good_.size(); n += n < 256 ? 1 : 997) {
    SCOPED_TRACE(n);
    testutil::WriteFile(rank_, good_.substr(0, n));
    EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("mp_rank_01"));
  }
}

TEST_F(MegatronMalformedTest, RankFileWithRandomDamage) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int refused = 0;
  for (int i = 0; i < 150; ++i) {
    std::string d = good_;
    for (int k = 0; k < 1 + static_cast<int>(rng() % 6); ++k) {
      const size_t at = rng() % d.size();
      d[at] = static_cast<char>(d[at] ^ (1 << (rng() % 8)));
    }
    testutil::WriteFile(rank_, d);
    const std::string error = ReadAll(dir_ / "c");
    // Zip CRC-32s cover every record: a flipped byte there is found. Flips
    // in the alignment padding of the zip headers (a large part of this
    // small file) change nothing that is read, and are accepted.
    if (!error.empty()) {
      ++refused;
      EXPECT_THAT(error, ::testing::HasSubstr("mp_rank_01")) << i;
    }
  }
  EXPECT_GT(refused, 20);
}

TEST_F(MegatronMalformedTest, MissingOrEmptyFiles) {
  fs::remove(rank_);
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("mp_rank_01"));
  testutil::WriteFile(rank_, "");
  EXPECT_THAT(ReadAll(dir_ / "c"), ::testing::HasSubstr("mp_rank_01"));
  testutil::WriteFile(rank_, good_);
  const fs::path tracker = dir_ / "c" / "latest_checkpointed_iteration.txt";
  for (const char* text : {"", "ten", "-3", "99999999999999999999", "11"}) {
    SCOPED_TRACE(text);
    testutil::WriteFile(tracker, text);
    EXPECT_NE(ReadAll(dir_ / "c"), "");
  }
}

}  // namespace
}  // namespace ucp::megatron
