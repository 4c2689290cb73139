// Universal files the fuzzer found (tests/fuzz/regressions/universal), opened
// under ASan + UBSan: each is a FormatError saying the file is corrupt, never
// a crash of ucp, an internal error or a hang.

#include <fcntl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"

namespace ucp::atoms {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

std::filesystem::path Regression(const std::string& name) {
  const char* dir = std::getenv("UCP_FUZZ_REGRESSIONS");
  return std::filesystem::path(dir != nullptr ? dir : "") / name;
}

// HDF5 copies past a global-heap buffer: a segfault in a release build, an
// ASan report and exit status 1 here. Either way the child dies, not ucp.
TEST(AtomsMalformedTest, HeapOverrunInHdf5IsAFormatError) {
  const auto path = Regression("hdf5-heap-overrun.h5");
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  EXPECT_THAT([&] { AtomStoreReader::Open(path); },
              ThrowsMessage<FormatError>(
                  AllOf(HasSubstr("HDF5"), HasSubstr("the file is corrupt"))));
}

TEST(AtomsMalformedTest, AbortInHdf5IsAFormatError) {
  const auto path = Regression("child-abort.h5");
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  EXPECT_THAT([&] { AtomStoreReader::Open(path); },
              ThrowsMessage<FormatError>(HasSubstr("the file is corrupt")));
}

// HDF5 loops on this file; the scan is stopped after the CPU limit, which
// may be a fraction of a second (fuzzing runs many such inputs).
TEST(AtomsMalformedTest, MetadataLoopStopsAtTheCpuLimit) {
  const auto path = Regression("metadata-loop.h5");
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  ASSERT_EQ(::setenv("UCP_H5_SCAN_CPU_SECONDS", "0.25", 1), 0);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_THAT([&] { AtomStoreReader::Open(path); },
              ThrowsMessage<FormatError>(HasSubstr(
                  "reading the HDF5 metadata took more than 0.25 s of CPU")));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_LT(seconds, 5.0);
  ::unsetenv("UCP_H5_SCAN_CPU_SECONDS");
}

// The processes this thread forked (the scan child is forked by the thread
// that opens the file).
std::vector<std::string> Children() {
  std::ifstream in("/proc/thread-self/children");
  std::vector<std::string> pids;
  for (std::string pid; in >> pid;) pids.push_back(pid);
  return pids;
}

// A valid universal file with one param.
std::filesystem::path WriteGoodFile(const std::filesystem::path& dir) {
  const auto path = dir / "good.h5";
  AtomStoreWriter w = AtomStoreWriter::Create(path);
  ParamInfo p;
  p.fqn = "w";
  p.shape = {4};
  w.AddParam(p);
  const DatasetId id = w.AddAtom("w", "fp32", DType::kFloat32, {4});
  w.Allocate();
  const std::byte data[16] = {};
  w.Write(id, 0, data);
  w.HashWritten(id);
  w.Commit();
  return path;
}

// UCP_H5_SCAN_REUSE (fuzzing): one child scans many files. It outlives a
// file HDF5 refuses cleanly, keeps none of the parent's descriptors open, and
// a file that kills it (or loops) is reported as with a fresh child, the
// next scan starting a new one.
TEST(AtomsMalformedTest,
     ReusedScanChildServesManyFilesAndIsReplacedAfterDeath) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("ucp-atoms-reuse-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto good = WriteGoodFile(dir);
  const auto not_hdf5 = dir / "not-hdf5.h5";
  std::ofstream(not_hdf5) << "this is not an HDF5 file";
  ASSERT_EQ(::setenv("UCP_H5_SCAN_REUSE", "1000", 1), 0);
  ASSERT_EQ(::setenv("UCP_H5_SCAN_CPU_SECONDS", "0.25", 1), 0);
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_NONBLOCK), 0);

  ASSERT_THAT(Children(), ::testing::IsEmpty());
  EXPECT_EQ(AtomStoreReader::Open(good).params().size(), 1u);
  const std::vector<std::string> first = Children();
  ASSERT_EQ(first.size(), 1u) << "the child lives on after its scan";
  // The child was forked while the pipe was open: only the socket stays,
  // beside stdin, stdout and stderr (/dev/null).
  ::close(fds[1]);
  char c;
  EXPECT_EQ(::read(fds[0], &c, 1), 0) << "the child holds the pipe open";
  ::close(fds[0]);
  std::vector<std::string> open_fds;
  for (const auto& e :
       std::filesystem::directory_iterator("/proc/" + first[0] + "/fd")) {
    open_fds.push_back(e.path().filename().string());
  }
  std::sort(open_fds.begin(), open_fds.end());
  EXPECT_EQ(open_fds, (std::vector<std::string>{"0", "1", "2", "3"}));

  EXPECT_THAT([&] { AtomStoreReader::Open(not_hdf5); },
              ThrowsMessage<FormatError>(HasSubstr("not a readable HDF5")));
  EXPECT_EQ(Children(), first) << "a clean HDF5 error keeps the child";
  EXPECT_EQ(AtomStoreReader::Open(good).params().size(), 1u);
  EXPECT_EQ(Children(), first);

  EXPECT_THAT(
      [&] { AtomStoreReader::Open(Regression("hdf5-heap-overrun.h5")); },
      ThrowsMessage<FormatError>(HasSubstr("the file is corrupt")));
  EXPECT_THAT(Children(), ::testing::IsEmpty()) << "the dead child is reaped";
  EXPECT_EQ(AtomStoreReader::Open(good).params().size(), 1u);
  const std::vector<std::string> second = Children();
  ASSERT_EQ(second.size(), 1u);
  EXPECT_NE(second, first);

  EXPECT_THAT([&] { AtomStoreReader::Open(Regression("metadata-loop.h5")); },
              ThrowsMessage<FormatError>(HasSubstr(
                  "reading the HDF5 metadata took more than 0.25 s of CPU")));
  EXPECT_THAT([&] { AtomStoreReader::Open(Regression("child-abort.h5")); },
              ThrowsMessage<FormatError>(HasSubstr("the file is corrupt")));
  EXPECT_EQ(AtomStoreReader::Open(good).params().size(), 1u);
  EXPECT_EQ(Children().size(), 1u);

  ::unsetenv("UCP_H5_SCAN_REUSE");
  ::unsetenv("UCP_H5_SCAN_CPU_SECONDS");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace ucp::atoms
