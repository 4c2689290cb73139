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

}  // namespace
}  // namespace ucp::mindspore
