#pragma once
// The slot planner: which boxes of which source tensors (atoms of a
// universal file, or source rank-file tensors) fill which elements of a
// target tensor. Pure functions, no I/O; format drivers describe their files
// with Slots and get CopyOps (plan.h) for the executor.
//
// A slot is one param's local tensor (its TP shard, say) as a target holds
// it: `local_shape`, made of pieces (a box of the local tensor copied from a
// box of a source tensor; uncovered local elements are zero: vocabulary
// padding, alignment gaps), placed in a flat target at element `dst_offset`,
// and optionally cut to the elements [begin, end) of its row-major
// flattening (a ZeRO partition or a distributed-optimizer shard holds a flat
// range of a parameter that may start and end inside a row):
//
//   target (flat):   ... | slot elements [begin, end) | ...
//                          ^ dst_offset
//
// PlanSlot decomposes [begin, end) into boxes of the local tensor that are
// each contiguous in row-major order (FlatRangeBoxes: at most 2*rank - 1 of
// them), intersects each with every piece, and emits one CopyOp per
// non-empty intersection; each op writes into a row-major view of its box's
// shape at the box's flat position, so every op stays a box copy.

#include <cstdint>
#include <span>
#include <vector>

#include "engine/core/box.h"
#include "engine/reshape/plan.h"

namespace ucp::reshape {

/// A box of the local tensor filled from a box (same sizes) of a source.
struct SlotPiece {
  Box local;
  SourceTensor src;
  Box src_box;
};

struct Slot {
  Shape local_shape;
  std::vector<SlotPiece> pieces;  // disjoint; uncovered elements are zero
  int64_t begin = 0;              // first element of the flattening
  int64_t end = -1;               // one past the last; -1: numel
  int64_t dst_offset = 0;         // target element receiving `begin`
};

/// Boxes of a row-major tensor of `shape` covering exactly the elements
/// [begin, end) of its flattening, in order, each contiguous in row-major
/// order (its elements are consecutive in the flattening and its own
/// row-major order is theirs). Empty for an empty range. A 0-d tensor has
/// one element and yields the empty box for [0, 1). Throws InternalError if
/// the range is outside [0, numel].
std::vector<Box> FlatRangeBoxes(std::span<const int64_t> shape, int64_t begin,
                                int64_t end);

/// The copy ops that write `slot` into a flat target (every op has a view:
/// dst_shape = its box's shape, dst_offset = where the box's first element
/// lands). Throws InternalError if a piece lies outside the local tensor or
/// its sizes differ from its source box, or if the range is invalid.
std::vector<CopyOp> PlanSlot(const Slot& slot);

/// Number of elements of the slot's range.
int64_t SlotElements(const Slot& slot);

}  // namespace ucp::reshape
