#pragma once
// Helpers shared by the C++ tests: seeds, temporary folders, test data
// locations, running the Python oracle, SHA-256.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace ucp::testutil {

/// Seed for property tests: $UCP_TEST_SEED if set, else random. Tests print
/// it with SCOPED_TRACE so a failure can be replayed.
uint64_t Seed();

/// Generated test data ($UCP_TESTDATA, written by the ctest fixtures in
/// tests/tools). Fails the test if unset or missing.
std::filesystem::path TestDataDir();

/// ../shared/fixtures ($UCP_FIXTURES): checkpoints written by the real
/// frameworks. Read-only: copy before anything could write.
std::filesystem::path FixturesDir();

/// The repository root ($UCP_SOURCE_DIR).
std::filesystem::path SourceDir();

/// Debian's system python3 with torch and h5py ($UCP_PYTHON).
std::string Python();

/// A fresh folder under $TMPDIR, removed with everything in it on
/// destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(std::string_view name) const {
    return path_ / name;
  }

 private:
  std::filesystem::path path_;
};

/// Runs a shell command; returns its exit status and stores stdout+stderr.
int RunCommand(const std::string& command, std::string* output = nullptr);

/// Quotes a string for /bin/sh.
std::string ShellQuote(std::string_view s);

std::string ReadFile(const std::filesystem::path& path);
void WriteFile(const std::filesystem::path& path, std::string_view data);

/// Bytes this process has read through read(2) / pread(2) so far (rchar of
/// /proc/self/io; this reading of the file itself adds about 100).
uint64_t BytesRead();

/// Lower-case hex SHA-256 (FIPS 180-4) of `data`.
std::string Sha256Hex(std::string_view data);

}  // namespace ucp::testutil
