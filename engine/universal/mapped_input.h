#pragma once
// Universal content under other names: a view of a UniversalInput whose
// params are made of boxes of the input's params (a rename is one whole box;
// a fused weight split in two is two params of one box each; a per-group
// split is a box per group). Every state kind the source params have in
// common (fp32 master, param, exp_avg, exp_avg_sq, ...) is mapped the same
// way, so a writer sees the mapped params with all their optimizer state.
// Nothing is read or copied up front: a writer's op reading a box of a mapped
// atom becomes, in Run(), ops reading the boxes of the source atoms it
// covers, which the input composes further (down to the source rank files
// for a convert).
//
// The view keeps the input's model (the caller rewrites what names the
// model's layout), opaque blobs and buffers; its training record's param_order,
// frozen and shared list the mapped names. Padding rows (pad atoms) are not
// carried: a mapped param holds the true vocabulary.

#include <memory>
#include <string>
#include <vector>

#include "engine/core/box.h"
#include "engine/universal/input.h"

namespace ucp::universal {

/// Box `src` of source param `param` is box `dst` of the mapped param (equal
/// sizes, same rank).
struct MappedPiece {
  std::string param;
  Box src;
  Box dst;
};

/// A param of the view: its name and shape (`info`; dtype, kind, group and
/// frozen are taken from its first piece's param) and the pieces covering it
/// exactly.
struct MappedParam {
  atoms::ParamInfo info;
  std::vector<MappedPiece> pieces;
};

/// `p` whole, named `name` (its rule and tied copies kept when the name is
/// its own).
MappedParam WholeParam(const atoms::StoredParam& p, std::string name);

/// The view of `input` with exactly `params`, in that order, and `model`.
/// `input` must outlive the view. A state kind held by the first piece's
/// param and by every other piece's param (in the same dtype) is mapped; a
/// state of another shape than its param's (a scalar step) is taken whole from
/// the first piece's param. Throws UsageError naming the mapped param for a
/// piece of an unknown source param, a box outside it or outside the mapped
/// shape, pieces that overlap or leave part of it uncovered.
std::unique_ptr<UniversalInput> MappedInput(const UniversalInput& input,
                                            std::vector<MappedParam> params,
                                            Model model);

}  // namespace ucp::universal
