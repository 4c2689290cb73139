#pragma once
// Positional file I/O (pread/pwrite) and atomically published output files.
// All functions are safe to call from several threads on one File.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace ucp {

class File;

/// Bytes of a file at an offset: where a source's bytes lie verbatim.
struct FileLocation {
  const File* file = nullptr;
  uint64_t offset = 0;
};

class File {
 public:
  File() noexcept = default;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  ~File();

  /// Opens an existing regular file read-only. Throws IoError naming the
  /// file if it cannot be opened or is not a regular file (a directory, FIFO
  /// or device: opening a FIFO does not wait for a writer).
  static File OpenRead(const std::filesystem::path& path);
  /// Creates (or truncates) a file for writing. Throws IoError.
  static File Create(const std::filesystem::path& path);
  /// Opens an existing regular file for reading and writing, without
  /// truncating it (a file another process created). Throws IoError.
  static File OpenWrite(const std::filesystem::path& path);
  /// A new empty read-write file in memory (memfd) that no folder names:
  /// nothing is left on disk however the process ends. path() is
  /// "memory:<name>" (for messages). Throws IoError.
  static File Anonymous(std::string_view name);

  bool is_open() const noexcept { return fd_ >= 0; }
  int fd() const noexcept { return fd_; }
  const std::filesystem::path& path() const noexcept { return path_; }

  /// Current size in bytes. Throws IoError.
  uint64_t Size() const;
  /// Reads exactly `n` bytes at `offset`. Throws FormatError ("unexpected end
  /// of file") if the file ends first, IoError on a read failure.
  void ReadExact(void* dst, size_t n, uint64_t offset) const;
  /// Reads up to `n` bytes; returns fewer only at end of file. Throws IoError.
  size_t ReadSome(void* dst, size_t n, uint64_t offset) const;
  /// Writes exactly `n` bytes at `offset` (in pieces of at most 256 KiB:
  /// file.cc says why). Throws IoError (e.g. disk full).
  /// With streaming writeback on, starts writing the bytes to disk (without
  /// waiting) once they are in the page cache.
  void WriteExact(const void* src, size_t n, uint64_t offset);
  /// Streaming writeback: each write of at least 64 KiB starts the disk
  /// write of its range at once (sync_file_range SYNC_FILE_RANGE_WRITE), so
  /// a file that will be fsynced reaches the disk while the rest is being
  /// produced, and Sync() has little left to wait for. Off by default.
  void SetStreamingWriteback(bool on) noexcept { writeback_ = on; }
  /// Writes the `n` bytes at `src_offset` of `src` at `offset` by an
  /// in-kernel copy (copy_file_range: no trip through user memory; a shared
  /// extent on filesystems that reflink). Returns false, having written
  /// nothing, when the kernel cannot copy between these files (another
  /// filesystem, no support): write the bytes instead. Throws FormatError
  /// if `src` ends first, IoError on failure. Streaming writeback as
  /// WriteExact.
  bool CopyFrom(const File& src, uint64_t src_offset, uint64_t n,
                uint64_t offset);
  /// Reserves disk blocks for [0, size) (posix_fallocate, else ftruncate).
  void Allocate(uint64_t size);
  /// Sets the file size. Throws IoError.
  void Truncate(uint64_t size);
  /// fsync. Throws IoError.
  void Sync();
  /// Closes the descriptor; errors are ignored (use Sync first).
  void Close() noexcept;

 private:
  File(int fd, std::filesystem::path path) noexcept
      : fd_(fd), path_(std::move(path)) {}
  int fd_ = -1;
  bool writeback_ = false;
  std::filesystem::path path_;
};

/// Whether OutputFile::Commit fsyncs before renaming (default true). False
/// (`--no-sync`) is like `cp`: faster, but a power loss can leave a
/// renamed file with missing data. Process-wide; set it before writing.
/// The environment variable UCP_NO_SYNC=1 makes it false whatever is set
/// here (scratch output: test suites, CI).
void SetDurableWrites(bool durable) noexcept;
bool DurableWrites() noexcept;

/// A file written under a temporary name in the destination folder and renamed
/// to its final name only by Commit(); destroyed uncommitted, it is removed, so
/// a failed run never leaves a partial file under the final name.
class OutputFile {
 public:
  /// Removes staging of `final_path` left by runs that no longer exist
  /// (staging.h). Throws IoError naming `final_path` if its folder does not
  /// exist, or if the temporary file cannot be created.
  explicit OutputFile(std::filesystem::path final_path);
  /// An output written to an anonymous memory file (File::Anonymous) instead
  /// of the disk: Commit() only marks it done; nothing is ever created under
  /// `name`.
  static OutputFile InMemory(std::filesystem::path name);
  OutputFile(OutputFile&&) noexcept = default;
  OutputFile& operator=(OutputFile&&) noexcept = default;
  ~OutputFile();

  File& file() noexcept { return file_; }
  const File& file() const noexcept { return file_; }
  const std::filesystem::path& final_path() const noexcept { return final_; }
  const std::filesystem::path& temp_path() const noexcept { return temp_; }

  /// fsync (unless SetDurableWrites(false)) + rename onto the final name
  /// (nothing for an output in memory). Throws IoError.
  void Commit();

 private:
  OutputFile() = default;
  std::filesystem::path final_;
  std::filesystem::path temp_;
  File file_;
  bool committed_ = false;
};

/// Reads a whole small file. Throws IoError, or FormatError if it is larger
/// than `max_bytes`.
std::string ReadSmallFile(const std::filesystem::path& path,
                          size_t max_bytes = 1 << 20);

/// `s` without leading and trailing whitespace (marker files: Megatron's
/// tracker, DeepSpeed's `latest`).
std::string_view TrimWhitespace(std::string_view s) noexcept;

/// Writes `data` to `path` atomically (temporary name + rename). Throws
/// IoError.
void WriteFileAtomically(const std::filesystem::path& path,
                         std::string_view data);

/// Recreates folder `src` as `dst` (which must not exist) with hard links to
/// its regular files, never copying data; files on another filesystem than
/// `dst` (EXDEV) are copied instead. Returns how many files were linked and
/// copied. Throws IoError naming the file.
struct LinkCounts {
  int64_t linked = 0;
  int64_t copied = 0;
};
LinkCounts LinkTree(const std::filesystem::path& src,
                    const std::filesystem::path& dst);

}  // namespace ucp
