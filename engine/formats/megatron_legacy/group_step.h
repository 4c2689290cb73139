#pragma once
// What the legacy Megatron writer (writer.cc) does with the 'step' entry of
// each optimizer group dict it writes, a pure step of its rank content:
//   torch.optim.Adam (Megatron without apex / Transformer Engine) keeps its
//   step per param, in the state: a non-distributed target's groups have
//   none; the distributed optimizer stores the value on every group
//   (distrib_optimizer.py state_dict, `.item()` of the tensor).
//   apex / TE FusedAdam keep an int per group, present once the group was
//   stepped: a group that holds no element of DP rank 0's shard of the
//   distributed optimizer has none; one that does takes the stored step,
//   else another group's (FusedAdam steps every group with params together).

namespace ucp::megatron {

enum class GroupStepAction {
  kKeep,              // the stored dict's entry, or its absence, stays
  kDrop,              // the stored entry is removed
  kTorchStep,         // set (or added) to torch Adam's step value
  kFromAnotherGroup,  // added: another group's step, else the iteration
};

/// `torch_step`: the source's optimizer was torch.optim.Adam;
/// `distributed`: the target keeps the distributed optimizer; `stepped`:
/// the group holds an element of DP rank 0's shard (always true for a
/// non-distributed target); `has_step`: the stored group dict has a 'step'.
/// Never throws.
GroupStepAction TargetGroupStep(bool torch_step, bool distributed, bool stepped,
                                bool has_step) noexcept;

}  // namespace ucp::megatron
