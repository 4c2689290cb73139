// Source tensors of any layout torch writes: transposed, sliced with a
// storage offset and steps, sharing a storage, expanded (stride 0), 0-d,
// empty. The expected bytes come from a naive loop over the strides.

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <numeric>
#include <random>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/reshape/executor.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/reshape/mem_io_testutil.h"

namespace ucp::reshape {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

using testutil::MemSink;
using testutil::MemSource;

// Float32 values 1, 2, 3, ... (element k of the storage holds k + 1).
std::string Iota(int64_t n, uint64_t lead = 0) {
  std::string s(lead + static_cast<uint64_t>(n) * 4, '\x5A');
  for (int64_t k = 0; k < n; ++k) {
    const float v = static_cast<float>(k + 1);
    std::memcpy(s.data() + lead + static_cast<uint64_t>(k) * 4, &v, 4);
  }
  return s;
}

// The naive oracle: the float32 value of each element of `box` of a source
// tensor (shape, stride) whose first element is at byte `first` of `bytes`,
// in row-major order of the box.
std::vector<float> Naive(const std::string& bytes, uint64_t first,
                         const Shape& stride, const Box& box) {
  std::vector<float> out;
  const int64_t n = box.NumElements();
  std::vector<int64_t> idx(box.rank(), 0);
  for (int64_t k = 0; k < n; ++k) {
    int64_t at = 0;
    for (size_t d = 0; d < box.rank(); ++d) {
      at += (box.offset[d] + idx[d]) * stride[d];
    }
    float v;
    std::memcpy(&v, bytes.data() + first + static_cast<uint64_t>(at) * 4, 4);
    out.push_back(v);
    for (size_t d = box.rank(); d-- > 0;) {
      if (++idx[d] < box.size[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

std::vector<float> Floats(const std::string& bytes) {
  std::vector<float> v(bytes.size() / 4);
  std::memcpy(v.data(), bytes.data(), v.size() * 4);
  return v;
}

// Runs one job of `t` over `sources`; returns the target's bytes.
std::string RunJob(const TargetTensor& t,
                   const std::vector<const ByteSource*>& sources,
                   uint64_t chunk_bytes, int threads = 1, bool hash = false) {
  MemSink sink(static_cast<size_t>(NumBytes(t)));
  std::vector<Job> jobs(1);
  jobs[0].tensor = t;
  jobs[0].sink = &sink;
  jobs[0].hash = hash;
  ExecutorOptions options;
  options.threads = threads;
  options.chunk_bytes = chunk_bytes;
  Execute(jobs, sources, options);
  return sink.bytes_;
}

// The strides torch gives x.t() of a contiguous [rows, cols] x.
TEST(StridedSourceTest, TransposedTensorReadsLikeTorch) {
  // x = arange(1, 13).view(3, 4); y = x.t(): shape [4, 3], stride [1, 4].
  MemSource src(Iota(12));
  const Shape shape{4, 3}, stride{1, 4};
  TargetTensor t{"transposed", DType::kFloat32, shape, {}};
  t.ops.push_back({SourceTensor{0, 0, DType::kFloat32, shape, stride},
                   Box::Whole(shape), Box::Whole(shape)});
  for (uint64_t chunk : {4u, 12u, 20u, 1024u}) {
    const std::vector<float> got = Floats(RunJob(t, {&src}, chunk));
    // y[i][j] = x[j][i] = 4 j + i + 1, written out independently.
    EXPECT_EQ(got, (std::vector<float>{1, 5, 9, 2, 6, 10, 3, 7, 11, 4, 8, 12}))
        << "chunk " << chunk;
  }
  // A box of it into a box of a larger target.
  TargetTensor u{"box", DType::kFloat32, {3, 3}, {}};
  u.ops.push_back({SourceTensor{0, 0, DType::kFloat32, shape, stride},
                   Box{{1, 1}, {2, 2}}, Box{{0, 1}, {2, 2}}});
  EXPECT_EQ(Floats(RunJob(u, {&src}, 8)),
            (std::vector<float>{0, 6, 10, 0, 7, 11, 0, 0, 0}));
}

TEST(StridedSourceTest, SlicedViewWithOffsetAndSharedStorage) {
  // One storage of 30 floats (behind 8 bytes of something else); a =
  // base.view(5, 6)[1:4, 2:5] (offset 8, stride [6, 1]); b = base.view(5,
  // 6)[:, ::2] (stride [6, 2]), both views of the same storage.
  MemSource src(Iota(30, 8));
  TargetTensor t{"two views", DType::kFloat32, {2, 15}, {}};
  t.ops.push_back({SourceTensor{0, 8 + 8 * 4, DType::kFloat32, {3, 3}, {6, 1}},
                   Box::Whole(Shape{3, 3}),
                   Box::Whole(Shape{3, 3}),
                   0,
                   {3, 3}});
  t.ops.push_back({SourceTensor{0, 8, DType::kFloat32, {5, 3}, {6, 2}},
                   Box::Whole(Shape{5, 3}),
                   Box::Whole(Shape{5, 3}),
                   15,
                   {5, 3}});
  for (uint64_t chunk : {4u, 28u, 4096u}) {
    const std::vector<float> got = Floats(RunJob(t, {&src}, chunk));
    std::vector<float> want = {9,  10, 11, 15, 16, 17, 21, 22, 23, 0,
                               0,  0,  0,  0,  0,  1,  3,  5,  7,  9,
                               11, 13, 15, 17, 19, 21, 23, 25, 27, 29};
    EXPECT_EQ(got, want) << "chunk " << chunk;
  }
}

TEST(StridedSourceTest, ZeroDimEmptyAndExpanded) {
  MemSource src(Iota(10, 4));
  // 0-d: base[7] (offset 7, no strides; torch records stride ()).
  TargetTensor s{"scalar", DType::kFloat32, {}, {}};
  s.ops.push_back({SourceTensor{0, 4 + 7 * 4, DType::kFloat32, {}, {}},
                   Box::Whole(Shape{}), Box::Whole(Shape{})});
  EXPECT_EQ(Floats(RunJob(s, {&src}, 4)), std::vector<float>{8});
  // Empty: shape [0, 3] with strides [1, 0] reads nothing.
  TargetTensor e{"empty", DType::kFloat32, {0, 3}, {}};
  e.ops.push_back({SourceTensor{0, 4, DType::kFloat32, {0, 3}, {1, 0}},
                   Box::Whole(Shape{0, 3}), Box::Whole(Shape{0, 3})});
  EXPECT_TRUE(RunJob(e, {&src}, 4).empty());
  // Expanded: base[2:5].unsqueeze(0).expand(2, 3): stride [0, 1].
  TargetTensor x{"expanded", DType::kFloat32, {2, 3}, {}};
  x.ops.push_back({SourceTensor{0, 4 + 2 * 4, DType::kFloat32, {2, 3}, {0, 1}},
                   Box::Whole(Shape{2, 3}), Box::Whole(Shape{2, 3})});
  EXPECT_EQ(Floats(RunJob(x, {&src}, 8)),
            (std::vector<float>{3, 4, 5, 3, 4, 5}));
}

// A transposed tensor is read with a read per stretch of storage, not one
// per element.
TEST(StridedSourceTest, TransposedTensorTakesFewReads) {
  const int64_t n = 256;
  MemSource src(Iota(n * n));
  const Shape shape{n, n}, stride{1, n};
  TargetTensor t{"t", DType::kFloat32, shape, {}};
  t.ops.push_back({SourceTensor{0, 0, DType::kFloat32, shape, stride},
                   Box::Whole(shape), Box::Whole(shape)});
  const std::vector<float> got = Floats(RunJob(t, {&src}, 64 << 10, 2));
  ASSERT_EQ(got.size(), static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      ASSERT_EQ(got[static_cast<size_t>(i * n + j)],
                static_cast<float>(j * n + i + 1));
    }
  }
  EXPECT_LT(src.reads_.load(), n * n / 16);
}

// Random views of random storages, as torch makes them (a permutation of a
// larger contiguous base's dims, a start and a step per dim, sometimes an
// expanded dim), random boxes, dtype conversion, chunk sizes and threads.
TEST(StridedSourceProperty, AssemblesLikeNaiveStrideLoop) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int nonempty = 0;
  for (int iter = 0; iter < 300; ++iter) {
    const size_t rank = rng() % 4;
    Shape shape(rank), stride(rank), base(rank);
    std::vector<size_t> perm(rank);
    std::iota(perm.begin(), perm.end(), size_t{0});
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<int64_t> start(rank), step(rank);
    for (size_t d = 0; d < rank; ++d) {
      shape[d] = static_cast<int64_t>(rng() % 6) + (iter % 10 == 0 ? 0 : 1);
      step[d] = 1 + static_cast<int64_t>(rng() % 2);
      start[d] = static_cast<int64_t>(rng() % 3);
      base[d] = start[d] + std::max<int64_t>(1, shape[d]) * step[d];
    }
    // The base is contiguous with its dims in the order `perm` gives.
    std::vector<int64_t> base_stride(rank);
    int64_t s = 1;
    for (size_t k = rank; k-- > 0;) {
      base_stride[perm[k]] = s;
      s *= base[perm[k]];
    }
    const int64_t storage = s;
    int64_t offset = 0;
    for (size_t d = 0; d < rank; ++d) {
      offset += start[d] * base_stride[d];
      stride[d] = rng() % 8 == 0 ? 0 : step[d] * base_stride[d];
    }
    const uint64_t lead = rng() % 16;
    MemSource src(Iota(storage, lead));
    // A random box of the view into the same box of a target of the view's
    // shape, converted to bf16 sometimes.
    Box box = Box::Whole(shape);
    for (size_t d = 0; d < rank; ++d) {
      if (shape[d] == 0) continue;
      box.offset[d] = static_cast<int64_t>(rng() % shape[d]);
      box.size[d] =
          1 + static_cast<int64_t>(rng() % (shape[d] - box.offset[d]));
    }
    const DType tdt = rng() % 3 == 0 ? DType::kBFloat16 : DType::kFloat32;
    TargetTensor t{"t", tdt, shape, {}};
    const SourceTensor st{0, lead + static_cast<uint64_t>(offset) * 4,
                          DType::kFloat32, shape, stride};
    t.ops.push_back({st, box, box});
    const std::vector<float> vals =
        Naive(src.bytes(), st.byte_offset, stride, box);
    // The expected target: zeros outside the box.
    std::vector<float> want(static_cast<size_t>(NumElements(shape)), 0.0f);
    {
      std::vector<int64_t> idx(rank, 0);
      for (size_t k = 0; k < vals.size(); ++k) {
        int64_t flat = 0;
        for (size_t d = 0; d < rank; ++d) {
          flat = flat * shape[d] + box.offset[d] + idx[d];
        }
        want[static_cast<size_t>(flat)] = vals[k];
        for (size_t d = rank; d-- > 0;) {
          if (++idx[d] < box.size[d]) break;
          idx[d] = 0;
        }
      }
    }
    const std::string got =
        RunJob(t, {&src}, 1 + rng() % 64, 1 + static_cast<int>(rng() % 2),
               rng() % 2 == 0);
    if (tdt == DType::kFloat32) {
      ASSERT_EQ(Floats(got), want) << "iteration " << iter;
    } else {
      ASSERT_EQ(got.size(), want.size() * 2);
      for (size_t k = 0; k < want.size(); ++k) {
        uint16_t h;
        std::memcpy(&h, got.data() + k * 2, 2);
        ASSERT_EQ(h, Float32ToBFloat16(want[k])) << "iteration " << iter;
      }
    }
    if (!vals.empty()) ++nonempty;
  }
  EXPECT_GE(nonempty, 200);
}

// OpRunsIn maps the same target elements to the same source elements as
// OpRuns restricted to the range (element by element: the two may cut runs
// differently).
TEST(StridedSourceProperty, RunsOfARangeAreTheOpsRunsInIt) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const auto elements = [](const std::vector<reshape::Run>& runs, int64_t lo,
                           int64_t hi) {
    std::vector<std::pair<int64_t, int64_t>> out;  // (dst, src)
    for (const reshape::Run& r : runs) {
      for (int64_t k = 0; k < r.n; ++k) {
        if (r.dst + k >= lo && r.dst + k < hi)
          out.emplace_back(r.dst + k, r.src + k);
      }
    }
    return out;
  };
  int compared = 0;
  for (int iter = 0; iter < 500; ++iter) {
    const size_t rank = 1 + rng() % 3;
    Shape shape(rank), stride(rank);
    for (size_t d = 0; d < rank; ++d) {
      shape[d] = 1 + static_cast<int64_t>(rng() % 6);
      stride[d] = static_cast<int64_t>(rng() % 9);
    }
    Box src_box = Box::Whole(shape), dst_box = Box::Whole(shape);
    Shape view(rank);
    for (size_t d = 0; d < rank; ++d) {
      src_box.offset[d] = static_cast<int64_t>(rng() % shape[d]);
      src_box.size[d] =
          1 + static_cast<int64_t>(rng() % (shape[d] - src_box.offset[d]));
      view[d] = src_box.size[d] + static_cast<int64_t>(rng() % 3);
      dst_box.offset[d] = static_cast<int64_t>(
          rng() % static_cast<uint64_t>(view[d] - src_box.size[d] + 1));
      dst_box.size[d] = src_box.size[d];
    }
    const int64_t lead = static_cast<int64_t>(rng() % 5);
    TargetTensor t{"t", DType::kFloat32, Shape{lead + NumElements(view)}, {}};
    const SourceTensor st{0, 0, DType::kFloat32, shape,
                          rng() % 4 == 0 ? Shape{} : stride};
    t.ops.push_back({st, src_box, dst_box, lead, view});
    const std::vector<reshape::Run> all = OpRuns(t, t.ops[0]);
    const int64_t numel = NumElements(t.shape);
    const int64_t lo = static_cast<int64_t>(rng() % (numel + 1));
    const int64_t hi = lo + static_cast<int64_t>(rng() % (numel - lo + 1));
    const std::vector<reshape::Run> some = OpRunsIn(t, t.ops[0], lo, hi);
    for (size_t k = 1; k < some.size(); ++k) {
      ASSERT_GE(some[k].dst, some[k - 1].dst + some[k - 1].n);
    }
    for (const reshape::Run& r : some)
      ASSERT_TRUE(r.dst >= lo && r.dst + r.n <= hi);
    const auto want = elements(all, lo, hi);
    ASSERT_EQ(elements(some, lo, hi), want) << "iteration " << iter;
    compared += static_cast<int>(want.size());
  }
  EXPECT_GE(compared, 200);
}

// A transposed source takes memory per chunk, not per element: its
// one-element runs are computed chunk by chunk (once they were 24 bytes per
// element of the tensor, here 100 MB for 4M elements, and the target's check
// 64 MB more).
TEST(StridedSourceTest, TransposedTensorRunsTakeMemoryPerChunk) {
  const int64_t n = 2048;
  MemSource src(Iota(n * n));
  TargetTensor t{"t", DType::kFloat32, {n, n}, {}};
  const SourceTensor st{0, 0, DType::kFloat32, {n, n}, {1, n}};
  t.ops.push_back({st, Box::Whole(t.shape), Box::Whole(t.shape)});
  MemSink sink(static_cast<size_t>(NumBytes(t)));  // written: in the baseline
  const std::vector<const ByteSource*> sources = {&src};
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  std::vector<Job> jobs(1);
  jobs[0].tensor = t;
  jobs[0].sink = &sink;
  ExecutorOptions options;
  options.threads = 1;
  options.memory_budget = 8 << 20;
  Execute(jobs, sources, options);
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  const long grown_kib = after.ru_maxrss - before.ru_maxrss;
  EXPECT_LT(grown_kib, 48 << 10) << "peak RSS grew by " << grown_kib << " KiB";
  // Element (i, j) of the target is storage element j * n + i (value + 1).
  float v;
  std::memcpy(&v, sink.bytes_.data() + (3 * n + 5) * 4, 4);
  EXPECT_EQ(v, static_cast<float>(5 * n + 3 + 1));
}

TEST(FlatViewTest, ViewsContiguousAndEquallySpacedTensors) {
  const SourceTensor flat{3, 100, DType::kFloat32, {12}, {}};
  const SourceTensor v = FlatView(flat, 4, {2, 3}, "w");
  EXPECT_EQ(v.byte_offset, 116u);
  EXPECT_EQ(v.shape, (Shape{2, 3}));
  EXPECT_TRUE(v.stride.empty());
  // base[::3] of a 1-D storage: stride 3; elements 2.. as [2, 2].
  const SourceTensor every3{0, 0, DType::kFloat32, {6}, {3}};
  const SourceTensor w = FlatView(every3, 2, {2, 2}, "w");
  EXPECT_EQ(w.byte_offset, 2u * 3 * 4);
  EXPECT_EQ(w.stride, (Shape{6, 3}));
  // A [1, 6] tensor whose size-1 dim carries any stride is still flat.
  const SourceTensor row{0, 0, DType::kFloat32, {1, 6}, {99, 1}};
  EXPECT_TRUE(FlatView(row, 1, {5}, "w").stride.empty());
}

TEST(FlatViewTest, RefusesTransposedAndOutOfRange) {
  const SourceTensor tr{0, 0, DType::kFloat32, {4, 3}, {1, 4}};
  EXPECT_THAT([&] { FlatView(tr, 0, {12}, "rank file r > exp_avg"); },
              ThrowsMessage<FormatError>(
                  AllOf(HasSubstr("rank file r > exp_avg"), HasSubstr("[1, 4]"),
                        HasSubstr("flat buffer"))));
  const SourceTensor flat{0, 0, DType::kFloat32, {12}, {}};
  EXPECT_THAT([&] { FlatView(flat, 10, {3}, "buf"); },
              ThrowsMessage<FormatError>(HasSubstr("outside")));
}

TEST(StridedSourceTest, ValidateTargetChecksStrides) {
  TargetTensor t{"bad strides", DType::kFloat32, {2, 2}, {}};
  t.ops.push_back({SourceTensor{0, 0, DType::kFloat32, {2, 2}, {1}},
                   Box::Whole(Shape{2, 2}), Box::Whole(Shape{2, 2})});
  EXPECT_THAT([&] { ValidateTarget(t); },
              ThrowsMessage<InternalError>(HasSubstr("bad strides")));
  t.ops[0].src.stride = {-1, 1};
  EXPECT_THAT([&] { ValidateTarget(t); },
              ThrowsMessage<InternalError>(HasSubstr("strides")));
  t.ops[0].src.stride = {1, 2};
  EXPECT_NO_THROW(ValidateTarget(t));
}

}  // namespace
}  // namespace ucp::reshape
