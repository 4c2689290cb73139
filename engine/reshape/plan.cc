#include "engine/reshape/plan.h"

#include <algorithm>

#include "engine/core/convert.h"
#include "engine/core/error.h"

namespace ucp::reshape {

SourceTensor FlatView(const SourceTensor& t, int64_t at, Shape shape,
                      std::string_view what) {
  const std::optional<int64_t> numel = CheckedNumElements(t.shape);
  const std::optional<int64_t> count = CheckedNumElements(shape);
  if (!numel || !count || at < 0 || at > *numel || *count > *numel - at) {
    throw FormatError(what, ": elements [", at, ", +",
                      count ? *count : int64_t{-1}, ") lie outside the ",
                      ShapeString(t.shape), " tensor");
  }
  const size_t es = ElementSize(t.dtype);
  SourceTensor v = t;
  v.shape = std::move(shape);
  v.stride.clear();
  if (t.stride.empty() || *count == 0) {
    v.byte_offset += static_cast<uint64_t>(at) * es;
    return v;
  }
  // The step between consecutive elements in row-major order, if it is the
  // same everywhere: a dim of more than one index must step by it times the
  // elements of the dims after it.
  int64_t step = 1;
  int64_t inner = 1;
  for (size_t d = t.shape.size(); d-- > 0;) {
    if (t.shape[d] == 1) continue;
    if (inner == 1) step = t.stride[d];
    if (t.stride[d] != step * inner) {
      throw FormatError(what, ": a ", ShapeString(t.shape),
                        " tensor of strides ", ShapeString(t.stride),
                        " cannot be read as a flat buffer (only one whose "
                        "elements are equally spaced can)");
    }
    inner *= t.shape[d];
  }
  if (step == 1) {
    v.byte_offset += static_cast<uint64_t>(at) * es;
    return v;
  }
  v.byte_offset += static_cast<uint64_t>(at) * static_cast<uint64_t>(step) * es;
  v.stride = ContiguousStrides(v.shape);
  for (int64_t& s : v.stride) s *= step;
  return v;
}

uint64_t NumBytes(const TargetTensor& t) {
  return static_cast<uint64_t>(NumElements(t.shape)) * ElementSize(t.dtype);
}

const Shape& DstShape(const TargetTensor& t, const CopyOp& op) {
  return op.dst_shape.empty() && op.dst_offset == 0 ? t.shape : op.dst_shape;
}

std::vector<Run> OpRuns(const TargetTensor& t, const CopyOp& op) {
  std::vector<Run> runs;
  ForEachRunPair(
      op.src_box, op.src.shape, op.dst_box, DstShape(t, op),
      [&](int64_t s, int64_t d, int64_t n) {
        runs.push_back({s, op.dst_offset + d, n});
      },
      op.src.stride);
  return runs;
}

std::vector<Run> OpRunsIn(const TargetTensor& t, const CopyOp& op,
                          int64_t begin, int64_t end) {
  std::vector<Run> runs;
  const Shape& view = DstShape(t, op);
  const int64_t lo = std::max<int64_t>(begin - op.dst_offset, 0);
  const int64_t hi = std::min(end - op.dst_offset, NumElements(view));
  if (lo >= hi) return runs;
  Shape delta(op.src_box.offset.size());
  for (size_t d = 0; d < delta.size(); ++d) {
    delta[d] = op.src_box.offset[d] - op.dst_box.offset[d];
  }
  for (const Box& range : FlatRangeBoxes(view, lo, hi)) {
    const std::optional<Box> dst = Intersect(range, op.dst_box);
    if (!dst) continue;
    ForEachRunPair(
        Shifted(*dst, delta), op.src.shape, *dst, view,
        [&](int64_t s, int64_t d, int64_t n) {
          runs.push_back({s, op.dst_offset + d, n});
        },
        op.src.stride);
  }
  return runs;
}

void ValidateTarget(const TargetTensor& t) {
  const int64_t numel = NumElements(t.shape);
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const CopyOp& op = t.ops[i];
    const Shape& view = DstShape(t, op);
    std::optional<int64_t> view_numel = CheckedNumElements(view);
    UCP_CHECK(view_numel && op.dst_offset >= 0 &&
                  op.dst_offset + *view_numel <= numel,
              t.name, ": op ", i, " view at ", op.dst_offset,
              " leaves the target of ", numel, " elements");
    UCP_CHECK(BoxInside(op.dst_box, view), t.name, ": op ", i, " target box ",
              op.dst_box.ToString(), " outside its view");
    UCP_CHECK(BoxInside(op.src_box, op.src.shape), t.name, ": op ", i,
              " source box ", op.src_box.ToString(), " outside its tensor");
    UCP_CHECK(op.src.stride.empty() ||
                  (op.src.stride.size() == op.src.shape.size() &&
                   std::ranges::all_of(op.src.stride,
                                       [](int64_t s) { return s >= 0; })),
              t.name, ": op ", i, " source strides ",
              ShapeString(op.src.stride), " for shape ",
              ShapeString(op.src.shape));
    UCP_CHECK(op.src_box.size == op.dst_box.size, t.name, ": op ", i,
              " box sizes differ");
    UCP_CHECK(CanConvert(op.src.dtype, t.dtype), t.name, ": cannot convert ",
              DTypeName(op.src.dtype), " to ", DTypeName(t.dtype));
    // The elements it writes (the target's side alone: a strided source's
    // one-element runs would cost memory per element).
    const Runs written = ContiguousRuns(op.dst_box, view);
    for (int64_t start : written.starts) {
      ranges.emplace_back(op.dst_offset + start,
                          op.dst_offset + start + written.length);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    UCP_CHECK(ranges[i].first >= ranges[i - 1].second, t.name,
              ": ops write overlapping elements at ", ranges[i].first);
  }
}

bool FullyCovered(const TargetTensor& t) {
  int64_t covered = 0;
  for (const CopyOp& op : t.ops) covered += op.dst_box.NumElements();
  return covered == NumElements(t.shape);
}

}  // namespace ucp::reshape
