// What the legacy Megatron writer does with each optimizer group's 'step'
// (group_step.h), against the optimizers' own behaviour, by hand:
// torch.optim.Adam keeps `step` in each param's state and none in its
// param_groups (torch/optim/adam.py, _init_group); Megatron's distributed
// optimizer writes the value on every group (distrib_optimizer.py
// state_dict: param_group["step"] = ... .item()); apex FusedAdam keeps an
// int 'step' in each group it has stepped (apex/optimizers/fused_adam.py:
// group['step'] += 1 when the group has params with grads).

#include <gtest/gtest.h>

#include "engine/formats/megatron_legacy/group_step.h"

namespace ucp::megatron {
namespace {

using A = GroupStepAction;

TEST(MegatronGroupStepTest, TorchAdam) {
  // Non-distributed: the groups hold no step (dropped when stored).
  EXPECT_EQ(TargetGroupStep(true, false, true, true), A::kDrop);
  EXPECT_EQ(TargetGroupStep(true, false, true, false), A::kKeep);
  // Distributed: every group, stepped or not, gets the value.
  for (bool stepped : {false, true})
    for (bool has : {false, true})
      EXPECT_EQ(TargetGroupStep(true, true, stepped, has), A::kTorchStep);
}

TEST(MegatronGroupStepTest, FusedAdam) {
  // A group DP rank 0 holds none of has not been stepped: no 'step'.
  EXPECT_EQ(TargetGroupStep(false, true, false, true), A::kDrop);
  EXPECT_EQ(TargetGroupStep(false, true, false, false), A::kKeep);
  // A stepped group keeps its step, or takes another group's.
  EXPECT_EQ(TargetGroupStep(false, true, true, true), A::kKeep);
  EXPECT_EQ(TargetGroupStep(false, true, true, false), A::kFromAnotherGroup);
  // Non-distributed: every group counts as stepped.
  EXPECT_EQ(TargetGroupStep(false, false, true, true), A::kKeep);
  EXPECT_EQ(TargetGroupStep(false, false, true, false), A::kFromAnotherGroup);
}

}  // namespace
}  // namespace ucp::megatron
