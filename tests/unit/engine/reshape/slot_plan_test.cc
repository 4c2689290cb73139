#include "engine/reshape/slot_plan.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"

namespace ucp::reshape {
namespace {

// Flat row-major index of `index` in `shape`.
int64_t Flat(const Shape& shape, const Shape& index) {
  int64_t f = 0;
  for (size_t i = 0; i < shape.size(); ++i) f = f * shape[i] + index[i];
  return f;
}

// Calls fn(index) for every element of a box in row-major order.
template <typename Fn>
void ForEachIndex(const Box& box, Fn&& fn) {
  if (box.empty()) return;
  Shape idx = box.offset;
  while (true) {
    fn(idx);
    size_t d = box.rank();
    while (d > 0) {
      --d;
      if (++idx[d] < box.offset[d] + box.size[d]) break;
      idx[d] = box.offset[d];
      if (d == 0) return;
    }
    if (box.rank() == 0) return;
  }
}

TEST(FlatRangeBoxesTest, CoversExactlyTheRangeInOrder) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 2000; ++iter) {
    const size_t rank = rng() % 5;
    Shape shape(rank);
    for (auto& d : shape) d = 1 + static_cast<int64_t>(rng() % 5);
    const int64_t n = NumElements(shape);
    int64_t b = static_cast<int64_t>(rng() % (n + 1));
    int64_t e = static_cast<int64_t>(rng() % (n + 1));
    if (b > e) std::swap(b, e);
    int64_t next = b;
    const std::vector<Box> boxes = FlatRangeBoxes(shape, b, e);
    EXPECT_LE(boxes.size(), rank == 0 ? 1 : 2 * rank - 1);
    for (const Box& box : boxes) {
      ASSERT_TRUE(BoxInside(box, shape)) << box.ToString();
      ForEachIndex(box, [&](const Shape& idx) {
        EXPECT_EQ(Flat(shape, idx), next)
            << ShapeString(shape) << " [" << b << ", " << e << ") "
            << box.ToString();
        ++next;
      });
    }
    EXPECT_EQ(next, e) << ShapeString(shape) << " [" << b << ", " << e << ")";
  }
}

TEST(FlatRangeBoxesTest, RejectsBadRanges) {
  EXPECT_THROW(FlatRangeBoxes(Shape{4, 3}, 5, 4), InternalError);
  EXPECT_THROW(FlatRangeBoxes(Shape{4, 3}, 0, 13), InternalError);
  EXPECT_TRUE(FlatRangeBoxes(Shape{4, 0}, 0, 0).empty());
  EXPECT_EQ(FlatRangeBoxes(Shape{}, 0, 1).size(), 1u);
}

// The oracle: element by element, the target value of slot element i (in
// [begin, end)) is the source element its piece maps it to, or zero.
TEST(PlanSlotProperty, MatchesElementwiseAssembly) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 500; ++iter) {
    const size_t rank = 1 + rng() % 3;
    Slot slot;
    slot.local_shape.resize(rank);
    for (auto& d : slot.local_shape) d = 1 + static_cast<int64_t>(rng() % 6);
    const int64_t n = NumElements(slot.local_shape);
    // Pieces: the local tensor cut along one dim into parts; a part may be
    // left uncovered (padding), each other part comes from its own source
    // tensor at a random offset.
    const size_t dim = rng() % rank;
    const int64_t len = slot.local_shape[dim];
    int64_t at = 0;
    uint32_t source = 0;
    while (at < len) {
      const int64_t size = 1 + static_cast<int64_t>(rng() % len);
      const int64_t take = std::min(size, len - at);
      Box local = Box::Whole(slot.local_shape);
      local.offset[dim] = at;
      local.size[dim] = take;
      at += take;
      if (rng() % 4 == 0) continue;  // uncovered
      SlotPiece p;
      p.local = local;
      p.src.source = source++;
      p.src.shape = local.size;
      p.src_box = Box::Whole(local.size);
      for (size_t i = 0; i < rank; ++i) {
        const int64_t extra = static_cast<int64_t>(rng() % 3);
        p.src.shape[i] += extra;
        p.src_box.offset[i] = static_cast<int64_t>(rng() % (extra + 1));
      }
      slot.pieces.push_back(p);
    }
    slot.begin = static_cast<int64_t>(rng() % (n + 1));
    slot.end = slot.begin + static_cast<int64_t>(rng() % (n - slot.begin + 1));
    slot.dst_offset = static_cast<int64_t>(rng() % 5);
    const int64_t target_n = slot.dst_offset + SlotElements(slot) + 3;

    // Expected: encode (source + 1) * 1e6 + source flat index.
    std::vector<int64_t> expected(static_cast<size_t>(target_n), 0);
    for (const SlotPiece& p : slot.pieces) {
      ForEachIndex(p.local, [&](const Shape& idx) {
        const int64_t li = Flat(slot.local_shape, idx);
        if (li < slot.begin || li >= slot.end) return;
        Shape si = idx;
        for (size_t i = 0; i < rank; ++i)
          si[i] = idx[i] - p.local.offset[i] + p.src_box.offset[i];
        expected[static_cast<size_t>(slot.dst_offset + li - slot.begin)] =
            (p.src.source + 1) * 1000000 + Flat(p.src.shape, si);
      });
    }
    TargetTensor t;
    t.name = "t";
    t.shape = {target_n};
    t.ops = PlanSlot(slot);
    ASSERT_NO_THROW(ValidateTarget(t));
    std::vector<int64_t> got(static_cast<size_t>(target_n), 0);
    for (const CopyOp& op : t.ops) {
      for (const reshape::Run& r : OpRuns(t, op)) {
        for (int64_t k = 0; k < r.n; ++k)
          got[static_cast<size_t>(r.dst + k)] =
              (op.src.source + 1) * 1000000 + r.src + k;
      }
    }
    ASSERT_EQ(got, expected)
        << "shape " << ShapeString(slot.local_shape) << " range [" << slot.begin
        << ", " << slot.end << ") at " << slot.dst_offset;
  }
}

TEST(PlanSlotTest, AdjacentSlotsFormOneFlatBuffer) {
  // Two params packed into one flat buffer (a ZeRO partition of [2, 3] then
  // [4]), cut at element 4: the partition holds elements 4..5 of the first
  // and 0..2 of the second.
  auto whole = [](uint32_t source, const Shape& shape) {
    SlotPiece p;
    p.local = Box::Whole(shape);
    p.src.source = source;
    p.src.shape = shape;
    p.src_box = p.local;
    return p;
  };
  Slot a;
  a.local_shape = {2, 3};
  a.pieces.push_back(whole(0, a.local_shape));
  a.begin = 4;
  a.end = 6;
  a.dst_offset = 0;
  Slot b;
  b.local_shape = {4};
  b.pieces.push_back(whole(1, b.local_shape));
  b.begin = 0;
  b.end = 3;
  b.dst_offset = 2;
  TargetTensor t;
  t.name = "partition";
  t.shape = {6};
  for (const Slot* s : {&a, &b})
    for (CopyOp& op : PlanSlot(*s)) t.ops.push_back(std::move(op));
  ValidateTarget(t);
  EXPECT_FALSE(FullyCovered(t));  // element 5 is padding
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const CopyOp& op : t.ops)
    for (const reshape::Run& r : OpRuns(t, op)) runs.emplace_back(r.dst, r.n);
  EXPECT_THAT(runs, ::testing::ElementsAre(std::pair<int64_t, int64_t>{0, 2},
                                           std::pair<int64_t, int64_t>{2, 3}));
}

}  // namespace
}  // namespace ucp::reshape
