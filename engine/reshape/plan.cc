#include "engine/reshape/plan.h"

#include <algorithm>

#include "engine/core/convert.h"
#include "engine/core/error.h"

namespace ucp::reshape {

uint64_t NumBytes(const TargetTensor& t) {
  return static_cast<uint64_t>(NumElements(t.shape)) * ElementSize(t.dtype);
}

void ValidateTarget(const TargetTensor& t) {
  for (size_t i = 0; i < t.ops.size(); ++i) {
    const CopyOp& op = t.ops[i];
    UCP_CHECK(BoxInside(op.dst_box, t.shape), t.name, ": op ", i,
              " target box ", op.dst_box.ToString(), " outside shape of rank ",
              t.shape.size());
    UCP_CHECK(BoxInside(op.src_box, op.src.shape), t.name, ": op ", i,
              " source box ", op.src_box.ToString(), " outside its tensor");
    UCP_CHECK(op.src_box.size == op.dst_box.size, t.name, ": op ", i,
              " box sizes differ");
    UCP_CHECK(CanConvert(op.src.dtype, t.dtype), t.name, ": cannot convert ",
              DTypeName(op.src.dtype), " to ", DTypeName(t.dtype));
  }
  // Overlap check: sort by dim-0 start, compare neighbours that overlap in dim
  // 0.
  if (t.shape.empty()) {
    UCP_CHECK(t.ops.size() <= 1, t.name, ": several ops write a 0-d tensor");
    return;
  }
  std::vector<const CopyOp*> ops;
  for (const CopyOp& op : t.ops) {
    if (!op.dst_box.empty()) ops.push_back(&op);
  }
  std::sort(ops.begin(), ops.end(), [](const CopyOp* a, const CopyOp* b) {
    return a->dst_box.offset[0] < b->dst_box.offset[0];
  });
  for (size_t i = 0; i < ops.size(); ++i) {
    int64_t end0 = ops[i]->dst_box.offset[0] + ops[i]->dst_box.size[0];
    for (size_t j = i + 1; j < ops.size() && ops[j]->dst_box.offset[0] < end0;
         ++j) {
      UCP_CHECK(!Intersect(ops[i]->dst_box, ops[j]->dst_box).has_value(),
                t.name, ": ops write overlapping boxes ",
                ops[i]->dst_box.ToString(), " and ",
                ops[j]->dst_box.ToString());
    }
  }
}

bool FullyCovered(const TargetTensor& t) {
  int64_t covered = 0;
  for (const CopyOp& op : t.ops) covered += op.dst_box.NumElements();
  return covered == NumElements(t.shape);
}

}  // namespace ucp::reshape
