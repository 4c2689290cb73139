// LinkTree: a folder recreated with hard links, never copies.

#include "engine/core/file.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"

namespace ucp {
namespace {

namespace fs = std::filesystem;

ino_t Inode(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_ino;
}

TEST(LinkTreeTest, LinksEveryRegularFileAndKeepsTheTree) {
  testutil::TempDir dir;
  const fs::path src = dir / "iter_0000010";
  fs::create_directories(src / "mp_rank_00" / "deeper");
  std::ofstream(src / "a.pt") << "aaaa";
  std::ofstream(src / "mp_rank_00" / "model_optim_rng.pt") << "bb";
  std::ofstream(src / "mp_rank_00" / "deeper" / "c") << "c";
  fs::create_directories(src / "empty");
  const LinkCounts n = LinkTree(src, dir / "load");
  EXPECT_EQ(n.linked, 3);
  EXPECT_EQ(n.copied, 0);
  for (const char* f :
       {"a.pt", "mp_rank_00/model_optim_rng.pt", "mp_rank_00/deeper/c"}) {
    EXPECT_EQ(Inode(src / f), Inode(dir / "load" / f)) << f;
  }
  EXPECT_TRUE(fs::is_directory(dir / "load" / "empty"));
  EXPECT_EQ(fs::hard_link_count(src / "a.pt"), 2u);
}

TEST(LinkTreeTest, RefusesAnExistingTarget) {
  testutil::TempDir dir;
  fs::create_directories(dir / "src");
  std::ofstream(dir / "src" / "x") << "x";
  fs::create_directories(dir / "dst");
  std::ofstream(dir / "dst" / "x") << "other";
  EXPECT_THROW(LinkTree(dir / "src", dir / "dst"), IoError);
}

}  // namespace
}  // namespace ucp
