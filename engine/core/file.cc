#include "engine/core/file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "engine/core/error.h"
#include "engine/core/staging.h"

namespace ucp {
namespace {

constexpr size_t kWritebackMin = size_t{64} << 10;

// Buffered writes go to the kernel in pieces of at most this size. A 4 MiB
// pwrite into a new file makes the page cache allocate large folios, and on
// a VM whose host reclaims guest memory (ballooning, free-page reporting)
// those allocations made writing 2.6 GB 2-5x slower than 256 KiB pieces (and
// than cp) in most runs; 256 KiB pieces were as fast as cp's in-kernel copy
// (bench/README.md, "Write pieces").
constexpr size_t kWritePiece = size_t{256} << 10;

std::string Errno() {
  if (errno == EMFILE) {  // ucp keeps the rank files of a checkpoint open
    return StrCat(
        std::strerror(errno),
        " (raise the open-file limit: ulimit -n, hard limit as root)");
  }
  return std::strerror(errno);
}

}  // namespace

File::File(File&& other) noexcept
    : fd_(other.fd_),
      writeback_(other.writeback_),
      path_(std::move(other.path_)) {
  other.fd_ = -1;
}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    Close();
    fd_ = other.fd_;
    writeback_ = other.writeback_;
    path_ = std::move(other.path_);
    other.fd_ = -1;
  }
  return *this;
}

File::~File() { Close(); }

void File::Close() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

File File::OpenRead(const std::filesystem::path& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is rejected
  // below like every other file that pread cannot serve.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw IoError("cannot open ", path.string(), ": ", Errno());
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const std::string error = Errno();
    ::close(fd);
    throw IoError("cannot stat ", path.string(), ": ", error);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw IoError(
        "cannot open ", path.string(), ": ",
        S_ISDIR(st.st_mode) ? "is a directory" : "not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return File(fd, path);
}

File File::Anonymous(std::string_view name) {
  const std::string n(name);
  int fd = ::memfd_create(n.c_str(), MFD_CLOEXEC);
  if (fd < 0) {
    throw IoError("cannot create the memory file ", n, ": ", Errno());
  }
  return File(fd, StrCat("memory:", n));
}

File File::Create(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw IoError("cannot create ", path.string(), ": ", Errno());
  return File(fd, path);
}

File File::OpenWrite(const std::filesystem::path& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw IoError("cannot open ", path.string(), ": ", Errno());
  File f(fd, path);
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    throw IoError("cannot write ", path.string(), ": not a regular file");
  }
  return f;
}

uint64_t File::Size() const {
  struct stat st;
  if (::fstat(fd_, &st) != 0) {
    throw IoError("cannot stat ", path_.string(), ": ", Errno());
  }
  return static_cast<uint64_t>(st.st_size);
}

size_t File::ReadSome(void* dst, size_t n, uint64_t offset) const {
  auto* out = static_cast<char*>(dst);
  size_t done = 0;
  while (done < n) {
    ssize_t r =
        ::pread(fd_, out + done, n - done, static_cast<off_t>(offset + done));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw IoError("read failed on ", path_.string(), " at offset ",
                    offset + done, ": ", Errno());
    }
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  return done;
}

void File::ReadExact(void* dst, size_t n, uint64_t offset) const {
  size_t got = ReadSome(dst, n, offset);
  if (got != n) {
    throw FormatError(path_.string(), ": unexpected end of file (wanted ", n,
                      " bytes at offset ", offset, ", file has ", Size(), ")");
  }
}

void File::WriteExact(const void* src, size_t n, uint64_t offset) {
  const auto* in = static_cast<const char*>(src);
  size_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd_, in + done, std::min(n - done, kWritePiece),
                         static_cast<off_t>(offset + done));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw IoError("write failed on ", path_.string(), " at offset ",
                    offset + done, ": ", Errno());
    }
    done += static_cast<size_t>(w);
  }
  if (writeback_ && n >= kWritebackMin) {
    // Only starts the writeback; errors surface at the fsync.
    ::sync_file_range(fd_, static_cast<off64_t>(offset),
                      static_cast<off64_t>(n), SYNC_FILE_RANGE_WRITE);
  }
}

bool File::CopyFrom(const File& src, uint64_t src_offset, uint64_t n,
                    uint64_t offset) {
  uint64_t done = 0;
  while (done < n) {
    loff_t in = static_cast<loff_t>(src_offset + done);
    loff_t out = static_cast<loff_t>(offset + done);
    const ssize_t c = ::copy_file_range(src.fd_, &in, fd_, &out, n - done, 0);
    if (c < 0) {
      if (errno == EINTR) continue;
      if (done == 0 &&
          (errno == EXDEV || errno == ENOSYS || errno == EOPNOTSUPP ||
           errno == EINVAL || errno == EBADF || errno == EPERM)) {
        return false;
      }
      throw IoError("copy from ", src.path_.string(), " to ", path_.string(),
                    " at offset ", offset + done, " failed: ", Errno());
    }
    if (c == 0) {
      throw FormatError(src.path_.string(), ": unexpected end of file (wanted ",
                        n, " bytes at offset ", src_offset, ", file has ",
                        src.Size(), ")");
    }
    done += static_cast<uint64_t>(c);
  }
  if (writeback_ && n >= kWritebackMin) {
    ::sync_file_range(fd_, static_cast<off64_t>(offset),
                      static_cast<off64_t>(n), SYNC_FILE_RANGE_WRITE);
  }
  return true;
}

void File::Allocate(uint64_t size) {
  if (size == 0) return;
  int rc = ::posix_fallocate(fd_, 0, static_cast<off_t>(size));
  if (rc == 0) return;
  if (rc == ENOSPC) {
    throw IoError("no space left to allocate ", size, " bytes for ",
                  path_.string());
  }
  Truncate(size);  // Filesystems without fallocate support.
}

void File::Truncate(uint64_t size) {
  if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
    throw IoError("cannot resize ", path_.string(), ": ", Errno());
  }
}

void File::Sync() {
  if (::fsync(fd_) != 0) {
    throw IoError("fsync failed on ", path_.string(), ": ", Errno());
  }
}

namespace {

std::filesystem::path TempNameFor(const std::filesystem::path& final_path) {
  static std::atomic<uint64_t> counter{0};
  std::filesystem::path dir = final_path.parent_path();
  // staging.h: the pid and start time name the writer, for reclaiming.
  std::string name = StrCat(".", final_path.filename().string(), ".ucp-tmp-",
                            StagingToken(), "-", counter.fetch_add(1));
  return dir.empty() ? std::filesystem::path(name) : dir / name;
}

}  // namespace

OutputFile::OutputFile(std::filesystem::path final_path)
    : final_(std::move(final_path)), temp_(TempNameFor(final_)) {
  // Name the user's path, not the temporary one, when its folder is missing.
  const std::filesystem::path dir = final_.parent_path();
  std::error_code ec;
  if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
    if (std::filesystem::exists(dir, ec)) {
      throw IoError("cannot write ", final_.string(), ": ", dir.string(),
                    " is not a folder");
    }
    throw IoError("cannot write ", final_.string(), ": folder ", dir.string(),
                  " does not exist");
  }
  ReclaimLeftovers(final_);  // staging of this name left by dead runs
  file_ = File::Create(temp_);
  file_.SetStreamingWriteback(DurableWrites());
}

OutputFile OutputFile::InMemory(std::filesystem::path name) {
  OutputFile out;
  out.file_ = File::Anonymous(name.filename().string());
  out.final_ = std::move(name);
  return out;  // temp_ empty: nothing to sync, rename or remove
}

OutputFile::~OutputFile() {
  if (!committed_ && !temp_.empty() && file_.is_open()) {
    file_.Close();
    std::error_code ignored;
    std::filesystem::remove(temp_, ignored);
  }
}

namespace {
std::atomic<bool> g_durable{true};

// UCP_NO_SYNC=1 (any value but empty or "0"): no fsync whatever the caller
// asks, for scratch output such as a test suite's.
bool NoSyncFromEnvironment() noexcept {
  static const bool no_sync = [] {
    const char* v = std::getenv("UCP_NO_SYNC");
    return v != nullptr && *v != '\0' && std::string_view(v) != "0";
  }();
  return no_sync;
}
}  // namespace

void SetDurableWrites(bool durable) noexcept { g_durable = durable; }
bool DurableWrites() noexcept { return g_durable && !NoSyncFromEnvironment(); }

void OutputFile::Commit() {
  if (temp_.empty()) {  // in memory
    committed_ = true;
    return;
  }
  if (DurableWrites()) file_.Sync();
  file_.Close();
  std::error_code ec;
  std::filesystem::rename(temp_, final_, ec);
  if (ec) {
    std::filesystem::remove(temp_, ec);
    throw IoError("cannot rename ", temp_.string(), " to ", final_.string(),
                  ": ", ec.message());
  }
  committed_ = true;
}

std::string_view TrimWhitespace(std::string_view s) noexcept {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front())))
    s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back())))
    s.remove_suffix(1);
  return s;
}

std::string ReadSmallFile(const std::filesystem::path& path, size_t max_bytes) {
  File f = File::OpenRead(path);
  uint64_t size = f.Size();
  if (size > max_bytes) {
    throw FormatError(path.string(), ": file is ", size,
                      " bytes, expected at most ", max_bytes);
  }
  std::string data(size, '\0');
  f.ReadExact(data.data(), data.size(), 0);
  return data;
}

void WriteFileAtomically(const std::filesystem::path& path,
                         std::string_view data) {
  OutputFile out(path);
  out.file().WriteExact(data.data(), data.size(), 0);
  out.Commit();
}

LinkCounts LinkTree(const std::filesystem::path& src,
                    const std::filesystem::path& dst) {
  namespace fs = std::filesystem;
  LinkCounts counts;
  std::error_code ec;
  if (fs::exists(dst, ec))
    throw IoError("cannot create ", dst.string(), ": it exists");
  fs::create_directory(dst, ec);
  if (ec) {
    throw IoError("cannot create ", dst.string(), ": ", ec.message());
  }
  for (fs::recursive_directory_iterator it(src, ec), end; !ec && it != end;
       it.increment(ec)) {
    const fs::path to = dst / it->path().lexically_relative(src);
    if (it->is_directory(ec)) {
      fs::create_directory(to, ec);
      if (ec) throw IoError("cannot create ", to.string(), ": ", ec.message());
      continue;
    }
    if (!it->is_regular_file(ec)) continue;
    if (::link(it->path().c_str(), to.c_str()) == 0) {
      ++counts.linked;
      continue;
    }
    if (errno != EXDEV && errno != EPERM && errno != EMLINK) {
      throw IoError("cannot hard-link ", it->path().string(), " as ",
                    to.string(), ": ", std::strerror(errno));
    }
    fs::copy_file(it->path(), to, ec);
    if (ec) {
      throw IoError("cannot copy ", it->path().string(), " to ", to.string(),
                    ": ", ec.message());
    }
    ++counts.copied;
  }
  if (ec) throw IoError("cannot list ", src.string(), ": ", ec.message());
  return counts;
}

}  // namespace ucp
