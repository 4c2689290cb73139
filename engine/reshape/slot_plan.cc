#include "engine/reshape/slot_plan.h"

#include "engine/core/error.h"

namespace ucp::reshape {
namespace {

// Appends the boxes of elements [b, e) of the sub-tensor at `prefix` (one
// index per dim before `dim`), dims dim.. of `shape`.
void Decompose(std::span<const int64_t> shape, size_t dim, Shape& prefix,
               int64_t b, int64_t e, std::vector<Box>& out) {
  if (b >= e) return;
  const size_t rank = shape.size();
  int64_t stride = 1;  // elements per index of `dim`
  for (size_t i = dim + 1; i < rank; ++i) stride *= shape[i];
  auto emit = [&](int64_t lo, int64_t hi) {  // indices [lo, hi) of `dim`
    Box box;
    for (int64_t p : prefix) {
      box.offset.push_back(p);
      box.size.push_back(1);
    }
    box.offset.push_back(lo);
    box.size.push_back(hi - lo);
    for (size_t i = dim + 1; i < rank; ++i) {
      box.offset.push_back(0);
      box.size.push_back(shape[i]);
    }
    out.push_back(std::move(box));
  };
  auto recurse = [&](int64_t index, int64_t lo, int64_t hi) {
    prefix.push_back(index);
    Decompose(shape, dim + 1, prefix, lo, hi, out);
    prefix.pop_back();
  };
  if (b % stride == 0 && e % stride == 0) {
    emit(b / stride, e / stride);
    return;
  }
  const int64_t first = b / stride;
  const int64_t last = (e - 1) / stride;
  if (first == last) {
    recurse(first, b - first * stride, e - first * stride);
    return;
  }
  int64_t start = first;
  if (b % stride != 0) {
    recurse(first, b % stride, stride);
    start = first + 1;
  }
  const int64_t end_row = e / stride;
  if (start < end_row) emit(start, end_row);
  if (e % stride != 0) recurse(end_row, 0, e % stride);
}

// Flat index of a box's first element in a row-major tensor of `shape`.
int64_t FlatIndex(std::span<const int64_t> shape, const Box& box) {
  int64_t index = 0;
  for (size_t i = 0; i < shape.size(); ++i)
    index = index * shape[i] + box.offset[i];
  return index;
}

}  // namespace

std::vector<Box> FlatRangeBoxes(std::span<const int64_t> shape, int64_t begin,
                                int64_t end) {
  const int64_t numel = NumElements(shape);
  UCP_CHECK(0 <= begin && begin <= end && end <= numel, "flat range [", begin,
            ", ", end, ") of a tensor of ", numel, " elements");
  std::vector<Box> out;
  if (begin == end) return out;
  if (shape.empty()) {  // 0-d: the one element
    out.emplace_back();
    return out;
  }
  for (int64_t d : shape) {
    if (d == 0) return out;
  }
  Shape prefix;
  Decompose(shape, 0, prefix, begin, end, out);
  return out;
}

int64_t SlotElements(const Slot& slot) {
  const int64_t end = slot.end < 0 ? NumElements(slot.local_shape) : slot.end;
  return end - slot.begin;
}

std::vector<CopyOp> PlanSlot(const Slot& slot) {
  const Shape& shape = slot.local_shape;
  const int64_t end = slot.end < 0 ? NumElements(shape) : slot.end;
  for (const SlotPiece& p : slot.pieces) {
    UCP_CHECK(BoxInside(p.local, shape), "piece ", p.local.ToString(),
              " outside the local tensor ", ShapeString(shape));
    UCP_CHECK(p.local.size == p.src_box.size, "piece ", p.local.ToString(),
              " vs source box ", p.src_box.ToString());
  }
  std::vector<CopyOp> ops;
  for (const Box& box : FlatRangeBoxes(shape, slot.begin, end)) {
    const int64_t at = slot.dst_offset + FlatIndex(shape, box) - slot.begin;
    for (const SlotPiece& p : slot.pieces) {
      std::optional<Box> cut;
      if (box.rank() == 0) {
        cut = Box{};
      } else {
        cut = Intersect(box, p.local);
      }
      if (!cut || cut->empty()) continue;
      CopyOp op;
      op.src = p.src;
      op.src_box = *cut;
      op.dst_box = *cut;
      for (size_t i = 0; i < cut->rank(); ++i) {
        op.src_box.offset[i] =
            p.src_box.offset[i] + cut->offset[i] - p.local.offset[i];
        op.dst_box.offset[i] = cut->offset[i] - box.offset[i];
      }
      op.dst_offset = at;
      op.dst_shape = box.size;
      ops.push_back(std::move(op));
    }
  }
  return ops;
}

}  // namespace ucp::reshape
