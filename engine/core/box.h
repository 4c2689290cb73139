#pragma once
// Hyperslabs ("boxes") of row-major tensors: an offset and a size per
// dimension, in elements. Dimensions are named by number, never row/column.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/strided.h"

namespace ucp {

struct Box {
  Shape offset;
  Shape size;

  /// The whole of a tensor of this shape.
  static Box Whole(std::span<const int64_t> shape);
  size_t rank() const noexcept { return size.size(); }
  int64_t NumElements() const noexcept;
  bool empty() const noexcept { return NumElements() == 0; }
  std::string ToString() const;  // "[0:4, 2:6]"
  friend bool operator==(const Box&, const Box&) = default;
};

/// True if `box` lies inside a tensor of `shape` (same rank, no overflow).
bool BoxInside(const Box& box, std::span<const int64_t> shape) noexcept;

/// The common part of two boxes of equal rank; absent if empty.
std::optional<Box> Intersect(const Box& a, const Box& b);

/// Moves `box` by `delta` (added per dim).
Box Shifted(const Box& box, std::span<const int64_t> delta);

/// Contiguous runs of a box inside a row-major tensor: every run is `length`
/// consecutive elements starting at one of `starts` (element offsets from the
/// tensor's first element), in row-major order of the box.
struct Runs {
  int64_t length = 0;
  std::vector<int64_t> starts;
};
Runs ContiguousRuns(const Box& box, std::span<const int64_t> shape);

/// The boxes that hold elements [begin, end) (flat, row-major) of a tensor of
/// `shape`, in row-major order: each holds a consecutive range of elements and
/// each begins where the one before ends; at most 2 * rank - 1 of them (one
/// for a 0-d tensor holding its element). Empty if the range is. Throws
/// InternalError unless 0 <= begin <= end <= the tensor's elements.
std::vector<Box> FlatRangeBoxes(std::span<const int64_t> shape, int64_t begin,
                                int64_t end);

/// Calls fn(src_start, dst_start, length) for matching runs of two boxes of
/// equal size inside two tensors (the longest runs contiguous in both), in
/// row-major order of the boxes. The destination is row-major contiguous; the
/// source too if `src_stride` is empty, else its element (i0, i1, ...) is at
/// sum(i_d * src_stride[d]) (then src_start need not increase, and a run
/// spans more than one element only where the source's strides are those of
/// a contiguous tensor).
template <typename Fn>
void ForEachRunPair(const Box& src_box, std::span<const int64_t> src_shape,
                    const Box& dst_box, std::span<const int64_t> dst_shape,
                    Fn&& fn, std::span<const int64_t> src_stride = {});

}  // namespace ucp

#include "engine/core/box_inl.h"
