#include "engine/reshape/executor.h"

#include <tbb/enumerable_thread_specific.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for_each.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstring>
#include <thread>

#include "engine/core/aligned_buffer.h"
#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/core/progress.h"

namespace ucp::reshape {
namespace {

constexpr uint64_t kMinChunk = 1ull << 20;
constexpr uint64_t kMaxChunk = 256ull << 20;

struct WorkerBuffers {
  AlignedBuffer chunk;
  AlignedBuffer staging;
};

// A unit of work: one chunk of a job, or (for hashed jobs) all its chunks.
struct Unit {
  Job* job;
  int64_t first_slice;  // dim-0 slices [first, last)
  int64_t last_slice;
  bool whole_job;  // iterate all chunks in order (hashing)
};

class Runner {
 public:
  Runner(std::span<const ByteSource* const> sources, uint64_t chunk_bytes,
         Progress* progress)
      : sources_(sources), chunk_bytes_(chunk_bytes), progress_(progress) {}

  void RunUnit(const Unit& unit) {
    Job& job = *unit.job;
    try {
      if (unit.whole_job) {
        Xxh3Hasher hasher;
        const int64_t slices = Slices(job.tensor);
        const int64_t per = SlicesPerChunk(job.tensor);
        for (int64_t s = 0; s < slices; s += per) {
          RunChunk(job, s, std::min(slices, s + per), &hasher);
        }
        job.xxh3 = hasher.Digest();
      } else {
        RunChunk(job, unit.first_slice, unit.last_slice, nullptr);
      }
    } catch (Error& e) {
      e.AddContext(job.tensor.name);
      throw;
    }
  }

  static int64_t Slices(const TargetTensor& t) {
    if (t.shape.empty()) return 1;
    return t.shape[0];
  }

  int64_t SlicesPerChunk(const TargetTensor& t) const {
    uint64_t slice_bytes = SliceBytes(t);
    if (slice_bytes == 0) return std::max<int64_t>(1, Slices(t));
    return std::max<int64_t>(1,
                             static_cast<int64_t>(chunk_bytes_ / slice_bytes));
  }

  static uint64_t SliceBytes(const TargetTensor& t) {
    uint64_t n = ElementSize(t.dtype);
    for (size_t d = 1; d < t.shape.size(); ++d)
      n *= static_cast<uint64_t>(t.shape[d]);
    return n;
  }

  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t bytes_written() const { return bytes_written_.load(); }

 private:
  void RunChunk(Job& job, int64_t s0, int64_t s1, Xxh3Hasher* hasher) {
    const TargetTensor& t = job.tensor;
    const size_t esize = ElementSize(t.dtype);
    // The chunk as a box and as a tensor of its own.
    Box chunk_box = Box::Whole(t.shape);
    Shape chunk_shape = t.shape;
    if (!t.shape.empty()) {
      chunk_box.offset[0] = s0;
      chunk_box.size[0] = s1 - s0;
      chunk_shape[0] = s1 - s0;
    }
    const uint64_t bytes =
        static_cast<uint64_t>(NumElements(chunk_shape)) * esize;
    if (bytes == 0) return;
    WorkerBuffers& buf = buffers_.local();
    buf.chunk.Reserve(bytes);
    std::byte* out = buf.chunk.data();

    int64_t covered = 0;
    std::vector<std::pair<const CopyOp*, Box>> parts;
    for (const CopyOp& op : t.ops) {
      if (op.dst_box.empty()) continue;
      std::optional<Box> sub = t.shape.empty()
                                   ? std::optional<Box>(op.dst_box)
                                   : Intersect(op.dst_box, chunk_box);
      if (!sub) continue;
      covered += sub->NumElements();
      parts.emplace_back(&op, *sub);
    }
    if (covered != NumElements(chunk_shape)) std::memset(out, 0, bytes);

    for (const auto& [op, sub] : parts) {
      Shape src_delta(sub.rank()), chunk_delta(sub.rank());
      for (size_t d = 0; d < sub.rank(); ++d) {
        src_delta[d] = op->src_box.offset[d] - op->dst_box.offset[d];
        chunk_delta[d] = -chunk_box.offset[d];
      }
      Box src_sub = Shifted(sub, src_delta);
      Box dst_sub = Shifted(sub, chunk_delta);
      CopyBox(*op, src_sub, dst_sub, chunk_shape, t.dtype, out, buf);
    }

    const uint64_t byte_offset =
        static_cast<uint64_t>(s0) * (t.shape.empty() ? 0 : SliceBytes(t));
    job.sink->Write(byte_offset, std::span<const std::byte>(out, bytes));
    if (hasher != nullptr) hasher->Update(out, bytes);
    bytes_written_.fetch_add(bytes, std::memory_order_relaxed);
    if (progress_ != nullptr) progress_->Add(bytes);
  }

  void CopyBox(const CopyOp& op, const Box& src_sub, const Box& dst_sub,
               const Shape& chunk_shape, DType dst_dtype, std::byte* out,
               WorkerBuffers& buf) {
    const ByteSource* source = sources_[op.src.source];
    const size_t src_es = ElementSize(op.src.dtype);
    const size_t dst_es = ElementSize(dst_dtype);
    const bool same = op.src.dtype == dst_dtype;
    struct Run {
      int64_t src;
      int64_t dst;
      int64_t n;
    };
    std::vector<Run> runs;
    ForEachRunPair(src_sub, op.src.shape, dst_sub, chunk_shape,
                   [&](int64_t s, int64_t d, int64_t n) {
                     runs.push_back({s, d, n});
                   });
    if (runs.empty()) return;
    const int64_t needed = static_cast<int64_t>(runs.size()) * runs[0].n;
    const int64_t span_elems =
        runs.back().src + runs.back().n - runs.front().src;
    const uint64_t span_bytes = static_cast<uint64_t>(span_elems) * src_es;
    if (runs.size() > 1 && span_elems <= 2 * needed &&
        span_bytes <= chunk_bytes_) {
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
        // Convert through the staging buffer, in pieces if the run is long.
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

  std::span<const ByteSource* const> sources_;
  uint64_t chunk_bytes_;
  Progress* progress_;
  tbb::enumerable_thread_specific<WorkerBuffers> buffers_;
  std::atomic<uint64_t> bytes_read_{0};
  std::atomic<uint64_t> bytes_written_{0};
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

  Runner runner(sources, chunk, options.progress);
  std::vector<Unit> units;
  for (Job& job : jobs) {
    if (job.hash) {
      units.push_back({&job, 0, 0, true});
      continue;
    }
    const int64_t slices = Runner::Slices(job.tensor);
    const int64_t per = runner.SlicesPerChunk(job.tensor);
    for (int64_t s = 0; s < slices; s += per) {
      units.push_back({&job, s, std::min(slices, s + per), false});
    }
  }
  // Largest first for better balance.
  std::stable_sort(
      units.begin(), units.end(), [](const Unit& a, const Unit& b) {
        auto size = [](const Unit& u) {
          return u.whole_job
                     ? NumBytes(u.job->tensor)
                     : static_cast<uint64_t>(u.last_slice - u.first_slice) *
                           Runner::SliceBytes(u.job->tensor);
        };
        return size(a) > size(b);
      });

  tbb::task_arena arena(threads);
  arena.execute([&] {
    tbb::parallel_for_each(units.begin(), units.end(),
                           [&](const Unit& u) { runner.RunUnit(u); });
  });
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
  std::string_view suffix = text.substr(i);
  uint64_t mult = 1;
  if (suffix.empty() || suffix == "B") {
    mult = 1;
  } else if (suffix == "K" || suffix == "KiB" || suffix == "k") {
    mult = 1ull << 10;
  } else if (suffix == "M" || suffix == "MiB") {
    mult = 1ull << 20;
  } else if (suffix == "G" || suffix == "GiB") {
    mult = 1ull << 30;
  } else if (suffix == "T" || suffix == "TiB") {
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
