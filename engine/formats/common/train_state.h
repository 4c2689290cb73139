#pragma once
// The training state every format keeps in its own form (the optimizer
// step, Adam's hyper-parameters, MindSpore's beta powers), read from and
// completed for universal content (universal::Model's optimizer and training
// record) by the drivers' readers and writers.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "engine/universal/model.h"

namespace ucp::formats {

/// torch.optim.Adam's defaults (also MindSpore nn.Adam's, but for its lr),
/// written where a source records no such value.
inline constexpr double kAdamLr = 1e-3;
inline constexpr double kAdamBeta1 = 0.9;
inline constexpr double kAdamBeta2 = 0.999;
inline constexpr double kAdamEps = 1e-8;
inline constexpr double kAdamWeightDecay = 0.0;

/// The optimizer step of universal content: the optimizer's step, else the
/// training record's, else the iteration.
int64_t OptimizerStep(const universal::Model& model) noexcept;

/// β^step as MindSpore's nn.Adam keeps it (beta1_power, beta2_power):
/// 1.0 multiplied by float32(β) `step` times in float32.
float BetaPower(double beta, int64_t step) noexcept;

/// The shortest decimal that rounds to float32 `x` (0.9, not 0.899999976):
/// a float32 hyper-parameter as the user wrote it.
double ShortestDecimal(float x) noexcept;

/// The β that nn.Adam's BetaPower gives `power` of after `step` steps, as
/// the shortest decimal rounding to that float32 β (0.9, not 0.899999976);
/// absent if step < 1, `power` is not in (0, 1], or no float32 β gives it
/// exactly.
std::optional<double> BetaOfPower(float power, int64_t step) noexcept;

/// Adam's hyper-parameters a torch param group holds: lr, betas, eps,
/// weight_decay.
inline constexpr const char* kAdamHyperparams[] = {"lr", "betas", "eps",
                                                   "weight_decay"};

/// Completes param group `group` with each of `keys` (of kAdamHyperparams)
/// it lacks, from the defaults above; for each one filled, one note into
/// `notes` naming it and the value written.
void CompleteAdamGroup(universal::ParamGroup& group,
                       std::span<const char* const> keys,
                       std::set<std::string>& notes);

/// The optimizer's groups (none if it has none), each completed by
/// CompleteAdamGroup with every key of kAdamHyperparams.
std::vector<universal::ParamGroup> AdamGroups(const universal::Model& model,
                                              std::set<std::string>& notes);

}  // namespace ucp::formats
