#include "engine/core/box.h"

#include <gtest/gtest.h>

#include <map>
#include <random>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"

namespace ucp {
namespace {

Box RandomBoxIn(std::mt19937_64& rng, const Shape& shape) {
  Box b{Shape(shape.size()), Shape(shape.size())};
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t lo = static_cast<int64_t>(rng() % (shape[d] + 1));
    int64_t hi = lo + static_cast<int64_t>(rng() % (shape[d] - lo + 1));
    if (rng() % 3 == 0) {
      lo = 0;
      hi = shape[d];
    }
    b.offset[d] = lo;
    b.size[d] = hi - lo;
  }
  return b;
}

int64_t Flat(const Shape& shape, const std::vector<int64_t>& idx) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

// Oracle: enumerate every element of the box naively and map it.
TEST(BoxProperty, RunPairsVisitExactlyTheBoxElementsInOrder) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  for (int iter = 0; iter < 2000; ++iter) {
    size_t rank = rng() % 4;
    Shape src_shape(rank), dst_shape(rank);
    for (size_t d = 0; d < rank; ++d) {
      src_shape[d] = 1 + static_cast<int64_t>(rng() % 5);
      dst_shape[d] = 1 + static_cast<int64_t>(rng() % 5);
    }
    Box src = RandomBoxIn(rng, src_shape);
    Box dst{Shape(rank), src.size};
    for (size_t d = 0; d < rank; ++d) {
      if (dst_shape[d] < src.size[d]) dst_shape[d] = src.size[d];
      dst.offset[d] =
          static_cast<int64_t>(rng() % (dst_shape[d] - src.size[d] + 1));
    }
    std::vector<std::pair<int64_t, int64_t>> got;
    ForEachRunPair(src, src_shape, dst, dst_shape,
                   [&](int64_t s, int64_t t, int64_t n) {
                     for (int64_t k = 0; k < n; ++k)
                       got.emplace_back(s + k, t + k);
                   });
    std::vector<std::pair<int64_t, int64_t>> want;
    int64_t n = src.NumElements();
    std::vector<int64_t> idx(rank, 0);
    for (int64_t k = 0; k < n; ++k) {
      std::vector<int64_t> si(rank), di(rank);
      for (size_t d = 0; d < rank; ++d) {
        si[d] = src.offset[d] + idx[d];
        di[d] = dst.offset[d] + idx[d];
      }
      want.emplace_back(Flat(src_shape, si), Flat(dst_shape, di));
      for (size_t d = rank; d-- > 0;) {
        if (++idx[d] < src.size[d]) break;
        idx[d] = 0;
      }
    }
    ASSERT_EQ(got, want) << "src " << src.ToString() << " dst "
                         << dst.ToString();
  }
}

// Oracle: the boxes' elements, enumerated naively in row-major order of each
// box, are exactly begin, begin + 1, ..., end - 1.
TEST(BoxProperty, FlatRangeBoxesHoldExactlyTheRangeInOrder) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  int multi = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    const size_t rank = rng() % 5;
    Shape shape(rank);
    for (size_t d = 0; d < rank; ++d) {
      shape[d] = static_cast<int64_t>(rng() % 5) + (iter % 20 == 0 ? 0 : 1);
    }
    int64_t numel = 1;
    for (int64_t n : shape) numel *= n;
    const int64_t begin = static_cast<int64_t>(rng() % (numel + 1));
    const int64_t end =
        begin + static_cast<int64_t>(rng() % (numel - begin + 1));
    const std::vector<Box> boxes = FlatRangeBoxes(shape, begin, end);
    ASSERT_LE(boxes.size(), std::max<size_t>(1, 2 * rank - (rank > 0)));
    std::vector<int64_t> got;
    for (const Box& b : boxes) {
      ASSERT_TRUE(BoxInside(b, shape)) << b.ToString();
      ASSERT_FALSE(b.empty()) << b.ToString();
      std::vector<int64_t> idx(rank, 0);
      for (int64_t k = 0; k < b.NumElements(); ++k) {
        std::vector<int64_t> at(rank);
        for (size_t d = 0; d < rank; ++d) at[d] = b.offset[d] + idx[d];
        got.push_back(Flat(shape, at));
        for (size_t d = rank; d-- > 0;) {
          if (++idx[d] < b.size[d]) break;
          idx[d] = 0;
        }
      }
    }
    std::vector<int64_t> want(static_cast<size_t>(end - begin));
    for (int64_t k = begin; k < end; ++k) want[k - begin] = k;
    ASSERT_EQ(got, want) << "shape " << ShapeString(shape) << " [" << begin
                         << ", " << end << ")";
    if (boxes.size() > 2) ++multi;
  }
  EXPECT_GE(multi, 100);  // ranges that start and end inside rows were drawn
  EXPECT_THROW(FlatRangeBoxes(Shape{2, 3}, 4, 7), InternalError);
}

TEST(BoxTest, IntersectAndInside) {
  Box a{{0, 2}, {4, 4}};
  Box b{{3, 0}, {4, 3}};
  auto c = Intersect(a, b);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(*c, (Box{{3, 2}, {1, 1}}));
  EXPECT_FALSE(Intersect(a, Box{{4, 0}, {1, 1}}).has_value());
  EXPECT_TRUE(BoxInside(a, Shape{4, 6}));
  EXPECT_FALSE(BoxInside(a, Shape{4, 5}));
  EXPECT_EQ(a.ToString(), "[0:4, 2:6]");
  Runs r = ContiguousRuns(Box{{1, 0}, {2, 3}}, Shape{4, 3});
  EXPECT_EQ(r.length, 6);
  EXPECT_EQ(r.starts, std::vector<int64_t>{3});
}

}  // namespace
}  // namespace ucp
