#pragma once
// The Adam step of a torch optimizer, as universal content carries it for
// Megatron's writers: torch.optim.Adam keeps it per param
// (state[p]['step'], a float32 scalar tensor in torch >= 1.12), which
// universal files hold as a scalar 'step' atom of each param (the legacy
// reader's Float16/FP32Optimizer sources, torch_dist's non-distributed
// `common_step`, DCP, DeepSpeed); Megatron's DistributedOptimizer without
// apex / Transformer Engine stores it on every param group instead
// (distrib_optimizer.py state_dict: the tensor's `.item()`, a float; with
// apex's / Transformer Engine's FusedAdam `int(step)`), a 'step' of the
// stored groups. Writers put it where their target keeps it.

#include <optional>

#include "engine/reshape/executor.h"
#include "engine/universal/input.h"

namespace ucp::megatron {

struct TorchStep {
  double value = 0;
  bool integral = false;    // an int64 atom (torch < 1.12) or an int group step
  bool from_atoms = false;  // a per-param atom, not a group's 'step'
};

/// The first param's 'step' atom (when `atoms`), else the first float or int
/// 'step' of the stored optimizer groups (blob "optimizer/param_groups");
/// absent if neither. Throws FormatError naming the dataset for a 'step' atom
/// that is not a scalar of a numeric dtype, or an unreadable groups blob;
/// IoError.
std::optional<TorchStep> FindTorchStep(
    const universal::UniversalInput& input, bool atoms,
    const reshape::ExecutorOptions& executor);

}  // namespace ucp::megatron
