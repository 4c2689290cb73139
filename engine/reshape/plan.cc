#include "engine/reshape/plan.h"

#include <algorithm>

#include "engine/core/convert.h"
#include "engine/core/error.h"

namespace ucp::reshape {

uint64_t NumBytes(const TargetTensor& t) {
  return static_cast<uint64_t>(NumElements(t.shape)) * ElementSize(t.dtype);
}

const Shape& DstShape(const TargetTensor& t, const CopyOp& op) {
  return op.dst_shape.empty() && op.dst_offset == 0 ? t.shape : op.dst_shape;
}

std::vector<Run> OpRuns(const TargetTensor& t, const CopyOp& op) {
  std::vector<Run> runs;
  ForEachRunPair(op.src_box, op.src.shape, op.dst_box, DstShape(t, op),
                 [&](int64_t s, int64_t d, int64_t n) {
                   runs.push_back({s, op.dst_offset + d, n});
                 });
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
    UCP_CHECK(op.src_box.size == op.dst_box.size, t.name, ": op ", i,
              " box sizes differ");
    UCP_CHECK(CanConvert(op.src.dtype, t.dtype), t.name, ": cannot convert ",
              DTypeName(op.src.dtype), " to ", DTypeName(t.dtype));
    for (const Run& r : OpRuns(t, op)) ranges.emplace_back(r.dst, r.dst + r.n);
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
