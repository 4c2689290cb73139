// LinkTree: a folder recreated with hard links, never copies. File::CopyFrom:
// in-kernel copies between files.

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

std::string Contents(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

TEST(FileCopyTest, CopiesTheRangeToTheOffset) {
  testutil::TempDir dir;
  std::string bytes;
  for (int i = 0; i < 300000; ++i) bytes.push_back(static_cast<char>(i * 7));
  std::ofstream(dir / "src", std::ios::binary) << bytes;
  File src = File::OpenRead(dir / "src");
  File dst = File::Create(dir / "dst");
  dst.Truncate(200000);
  dst.SetStreamingWriteback(true);  // ranges >= 64 KiB start their writeback
  ASSERT_TRUE(dst.CopyFrom(src, 12345, 150000, 40000));
  dst.Sync();
  const std::string got = Contents(dir / "dst");
  ASSERT_EQ(got.size(), 200000u);
  EXPECT_EQ(got.substr(40000, 150000), bytes.substr(12345, 150000));
  EXPECT_EQ(got.substr(0, 40000), std::string(40000, '\0'));
}

TEST(FileCopyTest, ASourceEndingFirstIsAFormatError) {
  testutil::TempDir dir;
  std::ofstream(dir / "src", std::ios::binary) << std::string(100, 'x');
  File src = File::OpenRead(dir / "src");
  File dst = File::Create(dir / "dst");
  try {
    dst.CopyFrom(src, 50, 100, 0);
    FAIL() << "no error";
  } catch (const FormatError& e) {
    EXPECT_NE(std::string(e.what()).find("unexpected end of file"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("src"), std::string::npos);
  }
}

TEST(FileCopyTest, AMemoryFileIsNotCopiedInto) {
  // copy_file_range between a disk file and a memfd: the kernel refuses (or
  // copies); CopyFrom says which, and never leaves a partial result.
  testutil::TempDir dir;
  std::ofstream(dir / "src", std::ios::binary) << std::string(4096, 'y');
  File src = File::OpenRead(dir / "src");
  File mem = File::Anonymous("x");
  mem.Truncate(4096);
  if (mem.CopyFrom(src, 0, 4096, 0)) {
    std::string back(4096, '\0');
    mem.ReadExact(back.data(), back.size(), 0);
    EXPECT_EQ(back, std::string(4096, 'y'));
  }
}

}  // namespace
}  // namespace ucp
