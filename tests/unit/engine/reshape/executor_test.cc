#include "engine/reshape/executor.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/reshape/mem_io_testutil.h"

namespace ucp::reshape {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using testutil::MemSink;
using testutil::MemSource;

Shape RandomShape(std::mt19937_64& rng, size_t rank) {
  Shape s(rank);
  for (auto& d : s) d = 1 + static_cast<int64_t>(rng() % 7);
  return s;
}

// Oracle: element-by-element assembly with the scalar conversion helpers.
TEST(ExecutorProperty, AssemblesTargetsLikeNaiveElementCopy) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 150; ++iter) {
    size_t rank = rng() % 4;
    DType tdt = rng() % 2 ? DType::kFloat32 : DType::kBFloat16;
    Shape tshape = RandomShape(rng, rank);
    if (rank > 0) tshape[0] = 1 + static_cast<int64_t>(rng() % 40);
    // Split the target into a grid of blocks along dim 0 and (maybe) dim 1;
    // each block comes from its own source tensor, some blocks are left out.
    std::vector<std::unique_ptr<MemSource>> sources;
    TargetTensor t{"t" + std::to_string(iter), tdt, tshape, {}};
    std::vector<Box> blocks;
    if (rank == 0) {
      blocks.push_back(Box::Whole(tshape));
    } else {
      int64_t r = 0;
      while (r < tshape[0]) {
        int64_t h = 1 + static_cast<int64_t>(rng() % 5);
        h = std::min(h, tshape[0] - r);
        Box b = Box::Whole(tshape);
        b.offset[0] = r;
        b.size[0] = h;
        if (rank >= 2 && tshape[1] > 1 && rng() % 2) {
          int64_t cut = 1 + static_cast<int64_t>(rng() % (tshape[1] - 1));
          Box b2 = b;
          b.size[1] = cut;
          b2.offset[1] = cut;
          b2.size[1] = tshape[1] - cut;
          blocks.push_back(b2);
        }
        blocks.push_back(b);
        r += h;
      }
    }
    for (const Box& b : blocks) {
      if (rng() % 6 == 0) continue;  // uncovered -> zeros
      DType sdt = rng() % 2 ? DType::kFloat32 : DType::kBFloat16;
      // Source tensor larger than the block; the block sits at a random offset.
      Shape sshape = b.size;
      Box src_box{Shape(rank, 0), b.size};
      for (size_t d = 0; d < rank; ++d) {
        int64_t extra = static_cast<int64_t>(rng() % 3);
        src_box.offset[d] = static_cast<int64_t>(rng() % (extra + 1));
        sshape[d] += extra;
      }
      uint64_t lead = rng() % 64;
      std::string bytes(lead + NumElements(sshape) * ElementSize(sdt), '\0');
      for (auto& c : bytes) c = static_cast<char>(rng());
      if (sdt == DType::kFloat32) {  // avoid NaNs so conversion is comparable
        for (size_t k = lead; k + 4 <= bytes.size(); k += 4)
          bytes[k + 3] &= 0x3F;
      } else {
        for (size_t k = lead; k + 2 <= bytes.size(); k += 2)
          bytes[k + 1] &= 0x3F;
      }
      sources.push_back(std::make_unique<MemSource>(bytes));
      t.ops.push_back(
          CopyOp{SourceTensor{static_cast<uint32_t>(sources.size() - 1), lead,
                              sdt, sshape},
                 src_box, b});
    }
    // Naive expected bytes.
    const size_t tes = ElementSize(tdt);
    std::string want(NumElements(tshape) * tes, '\0');
    for (const CopyOp& op : t.ops) {
      const std::string& sb = sources[op.src.source]->bytes();
      int64_t n = op.dst_box.NumElements();
      std::vector<int64_t> idx(rank, 0);
      for (int64_t k = 0; k < n; ++k) {
        int64_t sf = 0, df = 0;
        for (size_t d = 0; d < rank; ++d) {
          sf = sf * op.src.shape[d] + op.src_box.offset[d] + idx[d];
          df = df * tshape[d] + op.dst_box.offset[d] + idx[d];
        }
        const char* from =
            sb.data() + op.src.byte_offset + sf * ElementSize(op.src.dtype);
        float v;
        if (op.src.dtype == DType::kFloat32) {
          std::memcpy(&v, from, 4);
        } else {
          uint16_t h;
          std::memcpy(&h, from, 2);
          v = BFloat16ToFloat32(h);
        }
        if (tdt == DType::kFloat32) {
          std::memcpy(want.data() + df * 4, &v, 4);
        } else {
          uint16_t h = op.src.dtype == DType::kBFloat16
                           ? *reinterpret_cast<const uint16_t*>(from)
                           : Float32ToBFloat16(v);
          std::memcpy(want.data() + df * 2, &h, 2);
        }
        for (size_t d = rank; d-- > 0;) {
          if (++idx[d] < op.dst_box.size[d]) break;
          idx[d] = 0;
        }
      }
    }
    MemSink sink(want.size());
    std::vector<Job> jobs(1);
    jobs[0].tensor = t;
    jobs[0].sink = &sink;
    jobs[0].hash = rng() % 2;
    std::vector<const ByteSource*> srcs;
    for (auto& s : sources) srcs.push_back(s.get());
    ExecutorOptions options;
    options.threads = 1 + static_cast<int>(rng() % 3);
    options.chunk_bytes = 1 + rng() % 200;  // force many chunks
    Execute(jobs, srcs, options);
    ASSERT_EQ(sink.bytes_, want) << "iteration " << iter;
    if (jobs[0].hash) {
      EXPECT_EQ(jobs[0].xxh3, Xxh3(want.data(), want.size()));
      EXPECT_TRUE(std::is_sorted(sink.offsets_.begin(), sink.offsets_.end()));
    }
  }
}

// Flat targets holding several row-major views (a distributed-optimizer
// buffer): each view is filled from boxes of source tensors; gaps stay zero.
TEST(ExecutorProperty, ViewsIntoFlatTargets) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 150; ++iter) {
    std::vector<std::unique_ptr<MemSource>> sources;
    TargetTensor t{"flat" + std::to_string(iter), DType::kFloat32, {0}, {}};
    std::vector<float> want;
    int nviews = 1 + static_cast<int>(rng() % 5);
    for (int v = 0; v < nviews; ++v) {
      int64_t gap = static_cast<int64_t>(rng() % 5);
      want.resize(want.size() + gap, 0.0f);
      size_t rank = 1 + rng() % 3;
      Shape view = RandomShape(rng, rank);
      const int64_t base = static_cast<int64_t>(want.size());
      want.resize(want.size() + NumElements(view), 0.0f);
      // The source: a larger tensor; the view equals a box of it (or two boxes
      // split along dim 0).
      Shape sshape = view;
      sshape[rank - 1] += static_cast<int64_t>(rng() % 3);
      std::vector<float> sdata(NumElements(sshape));
      for (auto& x : sdata) x = static_cast<float>(rng() % 1000) - 500.0f;
      sources.push_back(std::make_unique<MemSource>(std::string(
          reinterpret_cast<const char*>(sdata.data()), sdata.size() * 4)));
      int64_t col0 = sshape[rank - 1] - view[rank - 1];
      int64_t cut = view[0] > 1 && rng() % 2
                        ? 1 + static_cast<int64_t>(rng() % (view[0] - 1))
                        : view[0];
      for (int part = 0; part < 2; ++part) {
        Box dst = Box::Whole(view);
        if (part == 0) {
          dst.size[0] = cut;
        } else {
          dst.offset[0] = cut;
          dst.size[0] = view[0] - cut;
        }
        if (dst.empty()) continue;
        Box src = dst;
        src.offset[rank - 1] += col0;
        t.ops.push_back(
            CopyOp{SourceTensor{static_cast<uint32_t>(sources.size() - 1), 0,
                                DType::kFloat32, sshape},
                   src, dst, base, view});
      }
      // Expected: element (i0..) of the view = source element at +col0 in the
      // last dim.
      int64_t n = NumElements(view);
      std::vector<int64_t> idx(rank, 0);
      for (int64_t k = 0; k < n; ++k) {
        int64_t sf = 0;
        for (size_t d = 0; d < rank; ++d) {
          sf = sf * sshape[d] + idx[d] + (d == rank - 1 ? col0 : 0);
        }
        want[base + k] = sdata[sf];
        for (size_t d = rank; d-- > 0;) {
          if (++idx[d] < view[d]) break;
          idx[d] = 0;
        }
      }
    }
    want.resize(want.size() + rng() % 4, 0.0f);
    t.shape = {static_cast<int64_t>(want.size())};
    MemSink sink(want.size() * 4);
    std::vector<Job> jobs(1);
    jobs[0].tensor = t;
    jobs[0].sink = &sink;
    jobs[0].hash = rng() % 2;
    std::vector<const ByteSource*> srcs;
    for (auto& s : sources) srcs.push_back(s.get());
    ExecutorOptions options;
    options.threads = 1 + static_cast<int>(rng() % 3);
    options.chunk_bytes = 4 * (1 + rng() % 50);
    Execute(jobs, srcs, options);
    ASSERT_EQ(sink.bytes_,
              std::string(reinterpret_cast<const char*>(want.data()),
                          want.size() * 4))
        << "iteration " << iter;
  }
}

TEST(ExecutorTest, SourceErrorsCarryTheTensorName) {
  MemSource src(std::string(8, '\0'));
  MemSink sink(64);
  std::vector<Job> jobs(1);
  jobs[0].tensor =
      TargetTensor{"param w > exp_avg",
                   DType::kFloat32,
                   {16},
                   {CopyOp{SourceTensor{0, 0, DType::kFloat32, {16}},
                           Box{{0}, {16}}, Box{{0}, {16}}}}};
  jobs[0].sink = &sink;
  std::vector<const ByteSource*> srcs = {&src};
  EXPECT_THAT([&] { Execute(jobs, srcs, {}); },
              ThrowsMessage<FormatError>(
                  HasSubstr("param w > exp_avg > read past end")));
}

TEST(ExecutorTest, RejectsOverlappingOps) {
  MemSource src(std::string(64, '\0'));
  MemSink sink(64);
  std::vector<Job> jobs(1);
  SourceTensor s{0, 0, DType::kFloat32, {16}};
  jobs[0].tensor = TargetTensor{"x",
                                DType::kFloat32,
                                {16},
                                {CopyOp{s, Box{{0}, {8}}, Box{{0}, {8}}},
                                 CopyOp{s, Box{{0}, {8}}, Box{{4}, {8}}}}};
  jobs[0].sink = &sink;
  std::vector<const ByteSource*> srcs = {&src};
  EXPECT_THAT([&] { Execute(jobs, srcs, {}); },
              ThrowsMessage<InternalError>(HasSubstr("overlapping")));
}

// A TP reshape that splits dim 1 (TP2 -> TP4) takes half of every source
// row: the gaps between the runs are as large as the runs, and reading the
// covering range would read each byte of the source twice. Only the runs are
// read (read amplification <= 1/16 above the bytes the target needs).
TEST(ExecutorTest, HalfRowsReadOnlyTheirBytes) {
  for (const int64_t cols : {704, 1408, 5}) {  // 2816-byte runs; 20-byte runs
    SCOPED_TRACE(testing::Message() << "cols " << cols);
    const int64_t rows = 300;
    std::string bytes(static_cast<size_t>(rows * 2 * cols * 4), '\0');
    for (size_t i = 0; i < bytes.size(); ++i)
      bytes[i] = static_cast<char>(i * 7 + 3);
    MemSource src(bytes);
    for (int64_t half = 0; half < 2; ++half) {
      MemSink sink(static_cast<size_t>(rows * cols * 4));
      std::vector<Job> jobs(1);
      SourceTensor s{0, 0, DType::kFloat32, {rows, 2 * cols}};
      jobs[0].tensor =
          TargetTensor{"w",
                       DType::kFloat32,
                       {rows, cols},
                       {CopyOp{s, Box{{0, half * cols}, {rows, cols}},
                               Box{{0, 0}, {rows, cols}}}}};
      jobs[0].sink = &sink;
      std::vector<const ByteSource*> srcs = {&src};
      const ExecutorStats st = Execute(jobs, srcs, {.threads = 1});
      const uint64_t needed = static_cast<uint64_t>(rows * cols * 4);
      for (int64_t r = 0; r < rows; ++r) {
        ASSERT_EQ(sink.bytes_.substr(static_cast<size_t>(r * cols * 4),
                                     static_cast<size_t>(cols * 4)),
                  bytes.substr(static_cast<size_t>((r * 2 + half) * cols * 4),
                               static_cast<size_t>(cols * 4)));
      }
      if (cols * 4 >= 512) {
        EXPECT_LE(st.bytes_read, needed + needed / 16);
      } else {
        // Runs of 20 bytes: one read covers a chunk's rows (no pread each).
        EXPECT_LE(src.reads_.exchange(0), 2);
      }
      src.reads_ = 0;
    }
  }
}

// A source whose bytes are a file's (Locate), and a sink that takes copies
// from files: chunks that are one run of the target's dtype travel by Copy
// and are never read into memory; a refused copy falls back to a read and
// Write; hashed jobs and converted chunks are read and written.
class FileBackedSource : public MemSource {
 public:
  FileBackedSource(std::string bytes, const File& file, uint64_t base)
      : MemSource(std::move(bytes)), file_(file), base_(base) {}
  std::optional<FileLocation> Locate(uint64_t offset) const override {
    return FileLocation{&file_, base_ + offset};
  }

 private:
  const File& file_;
  uint64_t base_;
};

class CopyingSink : public MemSink {
 public:
  CopyingSink(size_t size, bool accept) : MemSink(size), accept_(accept) {}
  bool Copy(uint64_t offset, uint64_t n, const FileLocation& from) override {
    ++copies_;
    if (!accept_) return false;
    std::string got(n, '\0');
    from.file->ReadExact(got.data(), n, from.offset);
    std::lock_guard<std::mutex> lock(mu_);
    std::memcpy(bytes_.data() + offset, got.data(), n);
    return true;
  }
  std::atomic<int> copies_{0};

 private:
  bool accept_;
};

TEST(ExecutorTest, OneRunChunksAreCopiedFileToFile) {
  testutil::TempDir dir;
  std::string bytes(3 << 20, '\0');
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<char>(i * 13 + (i >> 9));
  testutil::WriteFile(dir / "src.bin", std::string(100, 'H') + bytes);
  const File file = File::OpenRead(dir / "src.bin");
  const int64_t n = static_cast<int64_t>(bytes.size() / 4);
  struct Case {
    bool accept, hash;
    DType dtype;
  };
  for (const Case c :
       {Case{true, false, DType::kFloat32}, Case{false, false, DType::kFloat32},
        Case{true, true, DType::kFloat32},
        Case{true, false, DType::kBFloat16}}) {
    SCOPED_TRACE(testing::Message()
                 << c.accept << c.hash << DTypeName(c.dtype));
    FileBackedSource src(bytes, file, 100);
    const size_t out_size = static_cast<size_t>(n / 2) * ElementSize(c.dtype);
    CopyingSink sink(out_size, c.accept);
    std::vector<Job> jobs(1);
    // The second half of the source, in 256 KiB chunks.
    jobs[0].tensor =
        TargetTensor{"w",
                     c.dtype,
                     {n / 2},
                     {CopyOp{SourceTensor{0, 0, DType::kFloat32, {n}},
                             Box{{n / 2}, {n / 2}}, Box{{0}, {n / 2}}}}};
    jobs[0].sink = &sink;
    jobs[0].hash = c.hash;
    std::vector<const ByteSource*> srcs = {&src};
    const ExecutorStats st =
        Execute(jobs, srcs, {.threads = 2, .chunk_bytes = 256 << 10});
    std::string want(out_size, '\0');
    ConvertElements(DType::kFloat32, bytes.data() + bytes.size() / 2, c.dtype,
                    want.data(), static_cast<size_t>(n / 2));
    ASSERT_EQ(sink.bytes_, want);
    EXPECT_EQ(st.bytes_read, bytes.size() / 2);
    const bool copied = c.accept && !c.hash && c.dtype == DType::kFloat32;
    const size_t chunks = out_size / (256 << 10);
    EXPECT_EQ(src.reads_ == 0, copied);
    EXPECT_EQ(sink.offsets_.size(), copied ? 0u : chunks);  // Write calls
    EXPECT_EQ(sink.copies_ > 0, !c.hash && c.dtype == DType::kFloat32);
    if (c.hash) {
      EXPECT_EQ(jobs[0].xxh3, Xxh3(want.data(), want.size()));
    }
  }
}

// Buffered writes to one file take turns on its inode lock: while another
// file has work, no two threads write the same one, and each file is written
// front to back.
TEST(ExecutorTest, ThreadsWriteDifferentFilesWhileTheyCan) {
  struct Tracked : public ByteSink {
    Tracked(std::atomic<int>& other_left, std::atomic<int>& violations)
        : other_left_(other_left), violations_(violations) {}
    void Write(uint64_t offset, std::span<const std::byte> data) override {
      if (++writers_ > 1 && other_left_ > 0) ++violations_;
      std::this_thread::sleep_for(std::chrono::microseconds(300));
      {
        std::lock_guard<std::mutex> lock(mu_);
        offsets_.push_back(offset);
      }
      --writers_;
      ++done_;
      (void)data;
    }
    std::atomic<int>& other_left_;
    std::atomic<int>& violations_;
    std::atomic<int> writers_{0};
    std::atomic<int> done_{0};
    std::mutex mu_;
    std::vector<uint64_t> offsets_;
  };
  MemSource src(std::string(1 << 20, '\x11'));
  std::atomic<int> big_left{0}, small_left{40}, violations{0};
  // "big" (two jobs, 120 chunks) and "small" (one job, 40 chunks): the
  // largest-first split of the old scheduler put both threads on "big".
  Tracked big(small_left, violations), small(big_left, violations);
  struct Counted : public ByteSink {
    Counted(Tracked& t, std::atomic<int>& left) : t_(t), left_(left) {}
    void Write(uint64_t offset, std::span<const std::byte> data) override {
      t_.Write(offset, data);
      --left_;
    }
    Tracked& t_;
    std::atomic<int>& left_;
  };
  Counted small_sink(small, small_left);
  std::vector<Job> jobs(3);
  const SourceTensor s{0, 0, DType::kFloat32, {1 << 18}};
  for (int j = 0; j < 3; ++j) {
    const int64_t n = j < 2 ? 60 * 1024 : 40 * 1024;  // 4 KiB chunks
    jobs[j].tensor = TargetTensor{"t" + std::to_string(j),
                                  DType::kFloat32,
                                  {n},
                                  {CopyOp{s, Box{{0}, {n}}, Box{{0}, {n}}}}};
    jobs[j].sink = j < 2 ? static_cast<ByteSink*>(&big) : &small_sink;
    jobs[j].stream = j < 2 ? static_cast<const void*>(&big) : &small;
  }
  std::vector<const ByteSource*> srcs = {&src};
  Execute(jobs, srcs, {.threads = 2, .chunk_bytes = 4096});
  EXPECT_EQ(big.done_ + small.done_, 160);
  EXPECT_EQ(violations, 0);
  // "small" is written by one thread at a time (big never runs out first):
  // front to back.
  EXPECT_TRUE(std::is_sorted(small.offsets_.begin(), small.offsets_.end()));
}

TEST(ExecutorTest, ParseByteSize) {
  EXPECT_EQ(ParseByteSize("2G"), 2ull << 30);
  EXPECT_EQ(ParseByteSize("512M"), 512ull << 20);
  EXPECT_EQ(ParseByteSize("1000"), 1000u);
  EXPECT_THROW(ParseByteSize("12X"), UsageError);
  EXPECT_THROW(ParseByteSize("G"), UsageError);
  EXPECT_THROW(ParseByteSize("99999999999999999999"), UsageError);
  EXPECT_THROW(ParseByteSize("16777216T"), UsageError);  // 2^64 bytes
}

TEST(ExecutorTest, ParseByteSizeSuffixesInAnyCase) {
  EXPECT_EQ(ParseByteSize("2g"), 2ull << 30);
  EXPECT_EQ(ParseByteSize("512m"), 512ull << 20);
  EXPECT_EQ(ParseByteSize("64k"), 64ull << 10);
  EXPECT_EQ(ParseByteSize("64KiB"), 64ull << 10);
  EXPECT_EQ(ParseByteSize("3GB"), 3ull << 30);
  EXPECT_EQ(ParseByteSize("1t"), 1ull << 40);
  EXPECT_EQ(ParseByteSize("1000B"), 1000u);
  EXPECT_THROW(ParseByteSize("5iB"), UsageError);
  EXPECT_THROW(ParseByteSize("5BB"), UsageError);
  EXPECT_THROW(ParseByteSize("1.5G"), UsageError);
  EXPECT_THROW(ParseByteSize(" 2G"), UsageError);
  EXPECT_THROW(ParseByteSize("2G "), UsageError);
}

}  // namespace
}  // namespace ucp::reshape
