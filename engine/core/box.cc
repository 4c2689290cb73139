#include "engine/core/box.h"

#include <algorithm>

namespace ucp {

Box Box::Whole(std::span<const int64_t> shape) {
  return Box{Shape(shape.size(), 0), Shape(shape.begin(), shape.end())};
}

int64_t Box::NumElements() const noexcept {
  int64_t n = 1;
  for (int64_t d : size) n *= d;
  return n;
}

std::string Box::ToString() const {
  std::string s = "[";
  for (size_t i = 0; i < size.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(offset[i]) + ":" + std::to_string(offset[i] + size[i]);
  }
  return s + "]";
}

bool BoxInside(const Box& box, std::span<const int64_t> shape) noexcept {
  if (box.offset.size() != shape.size() || box.size.size() != shape.size()) {
    return false;
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t end = 0;
    if (box.offset[d] < 0 || box.size[d] < 0 ||
        __builtin_add_overflow(box.offset[d], box.size[d], &end) ||
        end > shape[d]) {
      return false;
    }
  }
  return true;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  UCP_CHECK(a.rank() == b.rank());
  Box r{Shape(a.rank()), Shape(a.rank())};
  for (size_t d = 0; d < a.rank(); ++d) {
    int64_t lo = std::max(a.offset[d], b.offset[d]);
    int64_t hi = std::min(a.offset[d] + a.size[d], b.offset[d] + b.size[d]);
    if (hi <= lo) return std::nullopt;
    r.offset[d] = lo;
    r.size[d] = hi - lo;
  }
  return r;
}

Box Shifted(const Box& box, std::span<const int64_t> delta) {
  Box r = box;
  for (size_t d = 0; d < r.rank(); ++d) r.offset[d] += delta[d];
  return r;
}

namespace {

// Appends the boxes of elements [begin, end) of the block that fixes dims
// [0, d) at `prefix` and spans dims [d, rank) whole (row-major flat offsets
// relative to the block's first element).
void AppendFlatRange(std::span<const int64_t> shape, size_t d, Shape& prefix,
                     int64_t begin, int64_t end, std::vector<Box>& out) {
  const size_t rank = shape.size();
  if (begin >= end) return;
  int64_t inner = 1;  // elements of one index of dim d
  for (size_t k = d + 1; k < rank; ++k) inner *= shape[k];
  const auto box_of = [&](int64_t lo, int64_t n) {
    Box b;
    b.offset = prefix;
    b.size.assign(d, 1);
    b.offset.push_back(lo);
    b.size.push_back(n);
    for (size_t k = d + 1; k < rank; ++k) {
      b.offset.push_back(0);
      b.size.push_back(shape[k]);
    }
    return b;
  };
  const int64_t first = begin / inner, last = (end - 1) / inner;
  if (begin % inner == 0 && end % inner == 0) {
    out.push_back(box_of(first, last - first + 1));  // whole indices of dim d
    return;
  }
  if (first == last) {  // inside one index of dim d
    prefix.push_back(first);
    AppendFlatRange(shape, d + 1, prefix, begin - first * inner,
                    end - first * inner, out);
    prefix.pop_back();
    return;
  }
  // A head within index `first`, whole indices between, a tail in `last`.
  int64_t mid_lo = first, mid_hi = last + 1;
  if (begin % inner != 0) {
    prefix.push_back(first);
    AppendFlatRange(shape, d + 1, prefix, begin - first * inner, inner, out);
    prefix.pop_back();
    mid_lo = first + 1;
  }
  if (end % inner != 0) mid_hi = last;
  if (mid_lo < mid_hi) out.push_back(box_of(mid_lo, mid_hi - mid_lo));
  if (end % inner != 0) {
    prefix.push_back(last);
    AppendFlatRange(shape, d + 1, prefix, 0, end - last * inner, out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Box> FlatRangeBoxes(std::span<const int64_t> shape, int64_t begin,
                                int64_t end) {
  const int64_t numel = NumElements(shape);
  UCP_CHECK(0 <= begin && begin <= end && end <= numel, "flat range [", begin,
            ", ", end, ") of ", numel, " elements");
  std::vector<Box> out;
  if (begin == end) return out;
  if (shape.empty()) {
    out.push_back(Box{});
    return out;
  }
  Shape prefix;
  AppendFlatRange(shape, 0, prefix, begin, end, out);
  return out;
}

Runs ContiguousRuns(const Box& box, std::span<const int64_t> shape) {
  Runs runs;
  ForEachRunPair(box, shape, box, shape,
                 [&](int64_t start, int64_t, int64_t length) {
                   runs.length = length;
                   runs.starts.push_back(start);
                 });
  return runs;
}

}  // namespace ucp
