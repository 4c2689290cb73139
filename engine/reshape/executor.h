#pragma once
// The parallel executor: runs plans (plan.h) with oneTBB under a memory
// budget. Each target tensor is produced in chunks of consecutive elements
// (flat, row-major; a chunk may start and end inside a row); each chunk reads
// only the source bytes it needs (a pread per contiguous run; runs are read
// with one pread of their covering range only when that reads at most 1/16
// more, or when they are too short for a read each; a strided source's runs,
// in no particular source order, are read in windows of its storage chosen
// by the same rule, each window once, and are computed for a slice of the
// chunk at a time: at most 2 x the chunk size of them), converts dtypes,
// zero-fills what no op covers, and is handed to the target's sink (a chunk
// that is one run of a file-backed source in the target's dtype is offered
// to the sink as an in-kernel copy first: ByteSink::Copy). Threads take
// chunks of different files (Job::stream) while there are enough. Chunk size
// = memory_budget / (2 x threads), clamped to [1 MiB, 4 MiB] (cache-sized:
// faster than larger chunks); peak buffer memory is about 2 x threads x chunk
// size (at most memory_budget unless the 1 MiB floor applies; twice that with
// strided sources), independent of checkpoint size.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/file.h"
#include "engine/reshape/plan.h"

namespace ucp {
class Progress;
}

namespace ucp::reshape {

/// Where source bytes come from. Read must be thread-safe.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  /// Reads exactly dst.size() bytes at `offset`. Throws ucp::Error.
  virtual void Read(uint64_t offset, std::span<std::byte> dst) const = 0;
  /// For messages: "rank file .../mp_rank_01/model_optim_rng.pt".
  virtual std::string Describe() const = 0;
  /// Where byte `offset` lies in a file, when the source's bytes from there
  /// on are that file's, verbatim (the executor then lets sinks copy them in
  /// the kernel). Default: nullopt. Throws ucp::Error.
  virtual std::optional<FileLocation> Locate(uint64_t offset) const {
    (void)offset;
    return std::nullopt;
  }
};

/// Where target bytes go. Write must be thread-safe; byte ranges of one
/// target never overlap, and chunks of one target may arrive in any order
/// unless the job asks for a hash.
class ByteSink {
 public:
  virtual ~ByteSink() = default;
  virtual void Write(uint64_t offset, std::span<const std::byte> data) = 0;
  /// Writes bytes [offset, offset + n) equal to the n bytes at `from` by an
  /// in-kernel copy (File::CopyFrom), for sinks that store bytes as they
  /// are (no checksum to compute); returns false, having written nothing,
  /// when it cannot, and the executor then reads the bytes and calls Write.
  /// Default: false.
  virtual bool Copy(uint64_t offset, uint64_t n, const FileLocation& from) {
    (void)offset, (void)n, (void)from;
    return false;
  }
};

struct Job {
  TargetTensor tensor;
  ByteSink* sink = nullptr;
  /// The file the sink writes (any pointer naming it; null: the sink). The
  /// executor keeps threads on different streams while it can: buffered
  /// writes to one file serialize on its inode lock, so two threads writing
  /// one file take turns while other files wait. Within a stream, chunks
  /// are written in job order, front to back.
  const void* stream = nullptr;
  /// Compute the XXH3-64 of the tensor's bytes (chunks then run in order).
  bool hash = false;
  uint64_t xxh3 = 0;  // result when hash is set
};

struct ExecutorOptions {
  int threads = 0;                      // 0: all hardware threads
  uint64_t memory_budget = 2ull << 30;  // bytes for chunk and staging buffers
  Progress* progress = nullptr;         // receives bytes produced
  uint64_t chunk_bytes = 0;             // 0: derived from the budget (tests)
};

struct ExecutorStats {
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
  uint64_t chunk_bytes = 0;  // chunk size used
  int threads = 0;
};

/// Runs every job. The first failure cancels the rest and is rethrown with
/// the job's name as context. Throws what sources and sinks throw, and
/// InternalError for invalid plans.
ExecutorStats Execute(std::span<Job> jobs,
                      std::span<const ByteSource* const> sources,
                      const ExecutorOptions& options);

/// Parses a byte count: digits, then optionally K, M, G or T (any case,
/// powers of 1024) optionally followed by "B" or "iB": "2G", "512m", "64KiB",
/// "1000", "1000B". Throws UsageError for anything else or on overflow.
uint64_t ParseByteSize(std::string_view text);

}  // namespace ucp::reshape
