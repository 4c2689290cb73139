// Universal files the fuzzer found (tests/fuzz/regressions/universal), opened
// under ASan + UBSan: each is a FormatError saying the file is corrupt, never
// a crash of ucp, an internal error or a hang.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <string>

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

}  // namespace
}  // namespace ucp::atoms
