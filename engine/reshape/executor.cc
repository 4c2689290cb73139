#include "engine/reshape/executor.h"

#include <tbb/enumerable_thread_specific.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <exception>
#include <map>
#include <mutex>
#include <thread>

#include "engine/core/aligned_buffer.h"
#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/core/progress.h"

namespace ucp::reshape {
namespace {

constexpr uint64_t kMinChunk = 1ull << 20;
// Small chunks keep a chunk in the CPU caches between its read, its write
// and its hash: with 256 MiB chunks every stage streamed through DRAM and
// fresh buffer pages, 2-3x slower than 4 MiB ones (bench/README.md).
constexpr uint64_t kMaxChunk = 4ull << 20;

// Whether the runs of one op in a chunk are read with one pread of the range
// covering them (then gathered) rather than one pread each. One read is
// taken when it costs at most 1/16 more bytes than the runs (read
// amplification stays <= 1.0625: the TP reshapes that split dim 1 read half
// rows, whose gaps are as large as the runs), or when the runs are so short
// (under kShortRun bytes on average) that a system call each would cost more
// than reading the gaps, as long as the gaps are at most the runs' size.
// bench/README.md ("Reading half rows") has the measurements.
constexpr uint64_t kShortRun = 512;

bool ReadCovering(uint64_t needed_bytes, uint64_t span_bytes, size_t runs) {
  const uint64_t gaps = span_bytes - needed_bytes;
  if (gaps * 16 <= needed_bytes) return true;
  return needed_bytes < kShortRun * runs && gaps <= needed_bytes;
}

struct WorkerBuffers {
  AlignedBuffer chunk;
  AlignedBuffer staging;
};

// A job with its ops' runs computed once (shared by all its chunks), except a
// strided source's: its runs (one element each unless the innermost stride is
// 1) are computed per chunk, so that they take memory per chunk, not per
// element of the tensor.
struct Prepared {
  Job* job = nullptr;
  std::vector<std::vector<Run>> runs;  // per op, increasing target order
  std::vector<bool> per_chunk;         // per op: runs computed per chunk
  int64_t numel = 0;
};

// A unit of work: one chunk (flat element range) of a job, or (for hashed
// jobs) all its chunks in order.
struct Unit {
  Prepared* prepared;
  int64_t begin;  // elements [begin, end)
  int64_t end;
  bool whole_job;
};

class Runner {
 public:
  Runner(std::span<const ByteSource* const> sources, uint64_t chunk_bytes,
         Progress* progress)
      : sources_(sources), chunk_bytes_(chunk_bytes), progress_(progress) {}

  int64_t ChunkElements(const TargetTensor& t) const {
    return std::max<int64_t>(
        1, static_cast<int64_t>(chunk_bytes_ / ElementSize(t.dtype)));
  }

  void RunUnit(const Unit& unit) {
    Prepared& p = *unit.prepared;
    Job& job = *p.job;
    try {
      if (unit.whole_job) {
        Xxh3Hasher hasher;
        const int64_t per = ChunkElements(job.tensor);
        for (int64_t e = 0; e < p.numel; e += per) {
          RunChunk(p, e, std::min(p.numel, e + per), &hasher);
        }
        job.xxh3 = hasher.Digest();
      } else {
        RunChunk(p, unit.begin, unit.end, nullptr);
      }
    } catch (Error& e) {
      e.AddContext(job.tensor.name);
      throw;
    }
  }

  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t bytes_written() const { return bytes_written_.load(); }

 private:
  void RunChunk(Prepared& p, int64_t e0, int64_t e1, Xxh3Hasher* hasher) {
    const TargetTensor& t = p.job->tensor;
    const size_t esize = ElementSize(t.dtype);
    const uint64_t bytes = static_cast<uint64_t>(e1 - e0) * esize;
    if (bytes == 0) return;
    WorkerBuffers& buf = buffers_.local();
    buf.chunk.Reserve(bytes);
    std::byte* out = buf.chunk.data();

    // Clip every op's runs to the chunk.
    std::vector<std::pair<size_t, std::vector<Run>>> parts;
    std::vector<size_t> strided;  // ops whose runs are computed here
    int64_t covered = 0;
    for (size_t i = 0; i < t.ops.size(); ++i) {
      if (p.per_chunk[i]) {
        strided.push_back(i);
        continue;
      }
      const std::vector<Run>& runs = p.runs[i];
      auto it =
          std::partition_point(runs.begin(), runs.end(),
                               [&](const Run& r) { return r.dst + r.n <= e0; });
      std::vector<Run> clipped;
      for (; it != runs.end() && it->dst < e1; ++it) {
        int64_t lo = std::max(it->dst, e0);
        int64_t hi = std::min(it->dst + it->n, e1);
        clipped.push_back({it->src + (lo - it->dst), lo - e0, hi - lo});
        covered += hi - lo;
      }
      if (!clipped.empty()) parts.emplace_back(i, std::move(clipped));
    }
    const uint64_t at = static_cast<uint64_t>(e0) * esize;
    const std::span<std::byte> chunk(out, bytes);
    if (hasher == nullptr && strided.empty() && parts.size() == 1 &&
        covered == e1 - e0 && parts[0].second.size() == 1 &&
        t.ops[parts[0].first].src.dtype == t.dtype) {
      // One run of the target's dtype: a sink that stores bytes as they are
      // may copy them from the source's file in the kernel.
      const CopyOp& op = t.ops[parts[0].first];
      const uint64_t from_offset =
          op.src.byte_offset +
          static_cast<uint64_t>(parts[0].second[0].src) * esize;
      const ByteSource* source = sources_[op.src.source];
      const std::optional<FileLocation> from = source->Locate(from_offset);
      if (from && p.job->sink->Copy(at, bytes, *from)) {
        bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
        Finish(bytes, nullptr, nullptr);
        return;
      }
    }
    if (covered != e1 - e0 || !strided.empty()) std::memset(out, 0, bytes);
    for (const auto& [i, runs] : parts) {
      CopyRuns(t.ops[i], runs, t.dtype, out, buf);
    }
    // A strided op's runs (24 bytes each, often one element long) for a
    // slice of the chunk at a time: they take at most twice what the chunk
    // does (a transposed tensor's slice of k target rows reads stretches of k
    // elements of its storage).
    const int64_t slice = std::max<int64_t>(
        1, static_cast<int64_t>(2 * chunk_bytes_ / sizeof(Run)));
    for (size_t i : strided) {
      for (int64_t s0 = e0; s0 < e1; s0 += slice) {
        std::vector<Run> runs =
            OpRunsIn(t, t.ops[i], s0, std::min(e1, s0 + slice));
        if (runs.empty()) continue;
        for (Run& r : runs) r.dst -= e0;
        CopyRuns(t.ops[i], runs, t.dtype, out, buf);
      }
    }
    p.job->sink->Write(at, chunk);
    Finish(bytes, out, hasher);
  }

  void Finish(uint64_t bytes, const std::byte* data, Xxh3Hasher* hasher) {
    if (hasher != nullptr) hasher->Update(data, bytes);
    bytes_written_.fetch_add(bytes, std::memory_order_relaxed);
    if (progress_ != nullptr) progress_->Add(bytes);
  }

  // Copies runs (dst relative to the chunk) of one op into `out`.
  void CopyRuns(const CopyOp& op, const std::vector<Run>& runs, DType dst_dtype,
                std::byte* out, WorkerBuffers& buf) {
    if (!op.src.stride.empty()) {
      CopyStridedRuns(op, runs, dst_dtype, out, buf);
      return;
    }
    const ByteSource* source = sources_[op.src.source];
    const size_t src_es = ElementSize(op.src.dtype);
    const size_t dst_es = ElementSize(dst_dtype);
    const bool same = op.src.dtype == dst_dtype;
    int64_t needed = 0;
    for (const Run& r : runs) needed += r.n;
    const int64_t span_elems =
        runs.back().src + runs.back().n - runs.front().src;
    const uint64_t span_bytes = static_cast<uint64_t>(span_elems) * src_es;
    if (runs.size() > 1 && span_bytes <= chunk_bytes_ &&
        ReadCovering(static_cast<uint64_t>(needed) * src_es, span_bytes,
                     runs.size())) {
      // Dense: one read of the covering range, then gather.
      buf.staging.Reserve(span_bytes);
      source->Read(
          op.src.byte_offset + static_cast<uint64_t>(runs.front().src) * src_es,
          std::span<std::byte>(buf.staging.data(), span_bytes));
      bytes_read_.fetch_add(span_bytes, std::memory_order_relaxed);
      for (const Run& r : runs) {
        const std::byte* from =
            buf.staging.data() +
            static_cast<uint64_t>(r.src - runs.front().src) * src_es;
        ConvertElements(op.src.dtype, from, dst_dtype,
                        out + static_cast<uint64_t>(r.dst) * dst_es,
                        static_cast<size_t>(r.n));
      }
      return;
    }
    for (const Run& r : runs) {
      const uint64_t src_off =
          op.src.byte_offset + static_cast<uint64_t>(r.src) * src_es;
      std::byte* to = out + static_cast<uint64_t>(r.dst) * dst_es;
      const uint64_t run_bytes = static_cast<uint64_t>(r.n) * src_es;
      if (same) {
        source->Read(src_off, std::span<std::byte>(to, run_bytes));
      } else {
        const uint64_t max_elems = std::max<uint64_t>(1, chunk_bytes_ / src_es);
        for (uint64_t done = 0; done < static_cast<uint64_t>(r.n);) {
          uint64_t n = std::min<uint64_t>(max_elems, r.n - done);
          buf.staging.Reserve(n * src_es);
          source->Read(src_off + done * src_es,
                       std::span<std::byte>(buf.staging.data(), n * src_es));
          ConvertElements(op.src.dtype, buf.staging.data(), dst_dtype,
                          to + done * dst_es, n);
          done += n;
        }
      }
      bytes_read_.fetch_add(run_bytes, std::memory_order_relaxed);
    }
  }

  // CopyRuns for a strided source, whose runs (often one element each) do
  // not lie in increasing source order: the runs, taken in source order, are
  // grouped into windows that one read covers (as ReadCovering decides for
  // contiguous sources, each at most a chunk), and each window is read once
  // and gathered (a transposed tensor costs a read per stretch of storage,
  // not one per element).
  void CopyStridedRuns(const CopyOp& op, const std::vector<Run>& runs,
                       DType dst_dtype, std::byte* out, WorkerBuffers& buf) {
    const ByteSource* source = sources_[op.src.source];
    const uint64_t src_es = ElementSize(op.src.dtype);
    const size_t dst_es = ElementSize(dst_dtype);
    const uint64_t max_elems = std::max<uint64_t>(1, chunk_bytes_ / src_es);
    std::vector<uint32_t> order(runs.size());
    for (size_t i = 0; i < order.size(); ++i) {
      order[i] = static_cast<uint32_t>(i);
    }
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) {
      return runs[a].src < runs[b].src;
    });
    size_t i = 0;
    while (i < order.size()) {
      if (static_cast<uint64_t>(runs[order[i]].n) > max_elems) {
        // One long run: read it in chunk-sized pieces.
        const Run& r = runs[order[i]];
        for (int64_t done = 0; done < r.n;) {
          const int64_t n =
              std::min<int64_t>(static_cast<int64_t>(max_elems), r.n - done);
          ReadWindow(op, source, r.src + done, n, buf);
          ConvertElements(op.src.dtype, buf.staging.data(), dst_dtype,
                          out + static_cast<uint64_t>(r.dst + done) * dst_es,
                          static_cast<size_t>(n));
          done += n;
        }
        ++i;
        continue;
      }
      // The window [lo, hi) of elements: runs i..j-1 in source order.
      const int64_t lo = runs[order[i]].src;
      int64_t hi = lo + runs[order[i]].n;
      int64_t needed = runs[order[i]].n;
      size_t j = i + 1;
      for (; j < order.size(); ++j) {
        const Run& r = runs[order[j]];
        const int64_t new_hi = std::max(hi, r.src + r.n);
        if (static_cast<uint64_t>(new_hi - lo) > max_elems ||
            !ReadCovering(static_cast<uint64_t>(needed + r.n) * src_es,
                          static_cast<uint64_t>(new_hi - lo) * src_es,
                          j - i + 1)) {
          // Overlapping runs (views sharing elements) cost nothing more.
          if (r.src + r.n > hi) break;
        }
        hi = new_hi;
        needed += r.n;
      }
      ReadWindow(op, source, lo, hi - lo, buf);
      for (size_t k = i; k < j; ++k) {
        const Run& r = runs[order[k]];
        ConvertElements(
            op.src.dtype,
            buf.staging.data() + static_cast<uint64_t>(r.src - lo) * src_es,
            dst_dtype, out + static_cast<uint64_t>(r.dst) * dst_es,
            static_cast<size_t>(r.n));
      }
      i = j;
    }
  }

  // Reads `n` elements from element `at` of a source tensor into staging.
  void ReadWindow(const CopyOp& op, const ByteSource* source, int64_t at,
                  int64_t n, WorkerBuffers& buf) {
    const uint64_t es = ElementSize(op.src.dtype);
    const uint64_t bytes = static_cast<uint64_t>(n) * es;
    buf.staging.Reserve(bytes);
    source->Read(op.src.byte_offset + static_cast<uint64_t>(at) * es,
                 std::span<std::byte>(buf.staging.data(), bytes));
    bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
  }

  std::span<const ByteSource* const> sources_;
  uint64_t chunk_bytes_;
  Progress* progress_;
  tbb::enumerable_thread_specific<WorkerBuffers> buffers_;
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
};

// Hands out units to the workers. Units of one stream (a file) are taken in
// order; a worker takes from the stream with the most bytes left among those
// no worker is writing, or, when every stream with work left is being
// written, from the one with the fewest writers. The first failure stops
// handing out work.
class Scheduler {
 public:
  explicit Scheduler(std::vector<Unit> units) : units_(std::move(units)) {
    std::map<const void*, size_t> index;
    for (size_t i = 0; i < units_.size(); ++i) {
      const Job& job = *units_[i].prepared->job;
      const void* key = job.stream != nullptr ? job.stream : job.sink;
      auto [it, added] = index.emplace(key, streams_.size());
      if (added) streams_.emplace_back();
      Stream& s = streams_[it->second];
      s.units.push_back(i);
      s.bytes_left += Bytes(units_[i]);
      stream_of_.push_back(it->second);
    }
  }

  // The next unit to run, or null when there is none (or after a failure).
  const Unit* Take() {
    std::lock_guard lock(mu_);
    if (failure_) return nullptr;
    Stream* best = nullptr;
    for (Stream& s : streams_) {
      if (s.next == s.units.size()) continue;
      if (best == nullptr || s.writers < best->writers ||
          (s.writers == best->writers && s.bytes_left > best->bytes_left)) {
        best = &s;
      }
    }
    if (best == nullptr) return nullptr;
    const Unit& u = units_[best->units[best->next++]];
    best->bytes_left -= Bytes(u);
    ++best->writers;
    return &u;
  }

  void Done(const Unit& u) {
    std::lock_guard lock(mu_);
    --streams_[stream_of_[static_cast<size_t>(&u - units_.data())]].writers;
  }

  void Fail(std::exception_ptr e) {
    std::lock_guard lock(mu_);
    if (!failure_) failure_ = std::move(e);
  }

  void Rethrow() {
    if (failure_) std::rethrow_exception(failure_);
  }

 private:
  struct Stream {
    std::vector<size_t> units;
    size_t next = 0;
    uint64_t bytes_left = 0;
    int writers = 0;
  };

  static uint64_t Bytes(const Unit& u) {
    return static_cast<uint64_t>(u.end - u.begin) *
           ElementSize(u.prepared->job->tensor.dtype);
  }

  std::vector<Unit> units_;
  std::vector<Stream> streams_;
  std::vector<size_t> stream_of_;
  std::mutex mu_;
  std::exception_ptr failure_;
};

}  // namespace

ExecutorStats Execute(std::span<Job> jobs,
                      std::span<const ByteSource* const> sources,
                      const ExecutorOptions& options) {
  int threads =
      options.threads > 0
          ? options.threads
          : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  uint64_t chunk = options.memory_budget / (2 * static_cast<uint64_t>(threads));
  chunk = std::clamp(chunk, kMinChunk, kMaxChunk);
  if (options.chunk_bytes > 0) chunk = options.chunk_bytes;

  for (Job& job : jobs) {
    UCP_CHECK(job.sink != nullptr, job.tensor.name, ": job without sink");
    ValidateTarget(job.tensor);
    for (const CopyOp& op : job.tensor.ops) {
      UCP_CHECK(op.src.source < sources.size(), job.tensor.name,
                ": op names source ", op.src.source, " of ", sources.size());
    }
  }

  std::vector<Prepared> prepared(jobs.size());
  for (size_t j = 0; j < jobs.size(); ++j) {
    prepared[j].job = &jobs[j];
    prepared[j].numel = NumElements(jobs[j].tensor.shape);
    for (const CopyOp& op : jobs[j].tensor.ops) {
      const bool per_chunk = !op.src.stride.empty();
      prepared[j].per_chunk.push_back(per_chunk);
      prepared[j].runs.push_back(per_chunk ? std::vector<Run>{}
                                           : OpRuns(jobs[j].tensor, op));
    }
  }
  Runner runner(sources, chunk, options.progress);
  std::vector<Unit> units;
  for (Prepared& p : prepared) {
    if (p.job->hash) {
      units.push_back({&p, 0, p.numel, true});
      continue;
    }
    const int64_t per = runner.ChunkElements(p.job->tensor);
    for (int64_t e = 0; e < p.numel; e += per) {
      units.push_back({&p, e, std::min(p.numel, e + per), false});
    }
  }
  Scheduler scheduler(std::move(units));
  tbb::task_arena arena(threads);
  arena.execute([&] {
    tbb::parallel_for(0, threads, [&](int) {
      while (const Unit* u = scheduler.Take()) {
        try {
          runner.RunUnit(*u);
        } catch (...) {
          scheduler.Fail(std::current_exception());
        }
        scheduler.Done(*u);
      }
    });
  });
  scheduler.Rethrow();
  ExecutorStats stats;
  stats.bytes_read = runner.bytes_read();
  stats.bytes_written = runner.bytes_written();
  stats.chunk_bytes = chunk;
  stats.threads = threads;
  return stats;
}

uint64_t ParseByteSize(std::string_view text) {
  if (text.empty()) throw UsageError("empty size");
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    if (__builtin_mul_overflow(value, 10u, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(text[i] - '0'),
                               &value)) {
      throw UsageError("size too large: ", text);
    }
    ++i;
  }
  if (i == 0) throw UsageError("not a size: '", text, "' (use e.g. 2G, 512M)");
  // K, M, G, T in any case, optionally followed by "B" or "iB": all binary.
  std::string suffix;
  for (char c : text.substr(i)) {
    suffix += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  }
  if (suffix.ends_with("IB") && suffix.size() == 3) {
    suffix.resize(1);
  } else if (suffix.ends_with("B")) {
    suffix.pop_back();
  }
  uint64_t mult = 1;
  if (suffix.empty()) {
    mult = 1;
  } else if (suffix == "K") {
    mult = 1ull << 10;
  } else if (suffix == "M") {
    mult = 1ull << 20;
  } else if (suffix == "G") {
    mult = 1ull << 30;
  } else if (suffix == "T") {
    mult = 1ull << 40;
  } else {
    throw UsageError("unknown size suffix in '", text, "' (use K, M, G or T)");
  }
  uint64_t out;
  if (__builtin_mul_overflow(value, mult, &out)) {
    throw UsageError("size too large: ", text);
  }
  return out;
}

}  // namespace ucp::reshape
