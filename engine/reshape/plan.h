#pragma once
// The plan language shared by to-universal and reshape: every output tensor
// (an atom in the universal file, or a tensor of a target rank file) is a
// row-major contiguous tensor assembled from boxes of source tensors, each a
// tensor at a byte offset of some byte source (a storage record of a torch
// file, an HDF5 dataset), row-major contiguous or with any element strides
// torch writes (transposed, sliced, sharing a storage, stride 0). Elements that
// no op covers are zero (e.g. vocab padding beyond the stored padding rows,
// alignment gaps of a flat optimizer buffer). Plans are pure data: format
// drivers build them, the executor runs them.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/box.h"
#include "engine/core/dtype.h"

namespace ucp::reshape {

/// A tensor whose first element is at `byte_offset` of source `source` (an
/// index into the executor's source table): row-major contiguous if `stride`
/// is empty, else element (i0, i1, ...) lies at element sum(i_d * stride[d])
/// from the first (strides in elements, non-negative, one per dim, as torch
/// records them). Whoever builds a strided tensor checks that its extent
/// lies inside the source (torch files: TorchFile::Open).
struct SourceTensor {
  uint32_t source = 0;
  uint64_t byte_offset = 0;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<int64_t> stride;  // empty: row-major contiguous
};

/// Elements [at, at + NumElements(shape)) of `t`, in row-major order, as a
/// tensor of `shape` (a flat buffer viewed as one param, a range of it, a
/// stacked tensor's slice). Strided tensors work when their elements are
/// equally spaced (a 1-D tensor of any stride, a contiguous one); any other
/// is refused. Throws FormatError naming `what` if refused, or if the range
/// lies outside `t`.
SourceTensor FlatView(const SourceTensor& t, int64_t at, Shape shape,
                      std::string_view what);

/// Copies `src_box` of `src` into `dst_box` of the target, converting the
/// dtype if it differs. The destination box lives in a row-major view of shape
/// `dst_shape` that starts at element `dst_offset` of the target (flattened);
/// an empty `dst_shape` means the target's own shape at offset 0. Views let a
/// flat target (a distributed-optimizer buffer) hold many parameters' shards.
/// Both boxes have the same sizes (and so the same rank).
struct CopyOp {
  SourceTensor src;
  Box src_box;
  Box dst_box;
  int64_t dst_offset = 0;
  Shape dst_shape;
};

struct TargetTensor {
  std::string name;  // used in messages: "param x > exp_avg"
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<CopyOp> ops;
};

/// One contiguous run of an op: `n` elements from source element `src`
/// (counted from the source tensor's first element in its storage: its
/// row-major index if it is contiguous, else the sum of index x stride) to
/// target element `dst` (flat). The `n` source elements are consecutive.
struct Run {
  int64_t src = 0;
  int64_t dst = 0;
  int64_t n = 0;
};

/// The op's runs in increasing target order (longest runs contiguous in both;
/// for a strided source, `src` need not increase, and runs are one element
/// long unless the source's innermost stride is 1).
std::vector<Run> OpRuns(const TargetTensor& t, const CopyOp& op);

/// The op's runs that write target elements [begin, end), clipped to them,
/// in increasing target order: OpRuns(t, op) restricted to the range,
/// computed from the range's boxes (work and memory follow the range, not the
/// op: the executor takes a strided source's one-element runs chunk by chunk).
std::vector<Run> OpRunsIn(const TargetTensor& t, const CopyOp& op,
                          int64_t begin, int64_t end);

/// The shape of the view an op writes into.
const Shape& DstShape(const TargetTensor& t, const CopyOp& op);

/// Bytes of the target tensor.
uint64_t NumBytes(const TargetTensor& t);

/// Checks a target: every op's boxes inside their tensors (views inside the
/// target) with equal sizes, a source's strides (if any) one per dim and
/// non-negative, a supported dtype conversion, and no two ops
/// writing the same element. Throws InternalError naming the tensor (these are
/// planner bugs).
void ValidateTarget(const TargetTensor& t);

/// True if the ops cover every element of the target exactly (no fill).
bool FullyCovered(const TargetTensor& t);

}  // namespace ucp::reshape
