// core/staging.h: output names, the staging token, leftovers of dead runs.
#include "engine/core/staging.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "tests/testutil/testutil.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;

TEST(StagingTest, OutputNameDropsTrailingSeparators) {
  EXPECT_EQ(OutputName("out/"), fs::path("out"));
  EXPECT_EQ(OutputName("a/out//"), fs::path("a/out"));
  EXPECT_EQ(OutputName("a/out.h5"), fs::path("a/out.h5"));
  EXPECT_EQ(OutputName("/"), fs::path("/"));
  EXPECT_EQ(OutputName(""), fs::path(""));
}

TEST(StagingTest, TokenNamesThisProcess) {
  const std::string& t = StagingToken();
  EXPECT_EQ(t.substr(0, t.find('-')), std::to_string(::getpid()));
  EXPECT_GT(t.size(), t.find('-') + 1);
}

TEST(StagingTest, ReclaimsOnlyStagingOfGoneProcesses) {
  testutil::TempDir dir;
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);  // a pid that no longer runs
  const fs::path dead = dir.path() / (".out.ucp-partial-" +
                                      std::to_string(child) + "-1-abcdef");
  const fs::path live =
      dir.path() / (".out.ucp-partial-" + StagingToken() + "-ghijkl");
  const fs::path other = dir.path() / (".other.ucp-tmp-" +
                                       std::to_string(child) + "-1-0");
  fs::create_directories(dead);
  std::ofstream(dead / "x") << "12345";
  fs::create_directories(live);
  std::ofstream(other) << "1";
  const std::vector<Leftover> found = FindLeftovers(dir.path() / "out/");
  ASSERT_EQ(found.size(), 2u);
  const std::vector<Leftover> removed = ReclaimLeftovers(dir.path() / "out");
  ASSERT_EQ(removed.size(), 1u);
  EXPECT_EQ(removed[0].path, dead);
  EXPECT_EQ(removed[0].bytes, 5u);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_EQ(FindLeftoversIn(dir.path()).size(), 2u);
}

}  // namespace
}  // namespace ucp
