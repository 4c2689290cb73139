#include "engine/formats/common/train_state.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string_view>

#include "engine/core/error.h"

namespace ucp::formats {

int64_t OptimizerStep(const universal::Model& model) noexcept {
  if (model.optimizer.step) return *model.optimizer.step;
  if (model.training && model.training->step) return *model.training->step;
  return model.iteration;
}

float BetaPower(double beta, int64_t step) noexcept {
  const auto b = static_cast<float>(beta);
  float power = 1.0f;
  for (int64_t k = 0; k < step && power != 0.0f; ++k) power *= b;
  return power;
}

double ShortestDecimal(float x) noexcept {
  for (int digits = 1; digits <= 9; ++digits) {
    char text[32];
    std::snprintf(text, sizeof text, "%.*g", digits, static_cast<double>(x));
    const double d = std::strtod(text, nullptr);
    if (static_cast<float>(d) == x) return d;
  }
  return static_cast<double>(x);
}

std::optional<double> BetaOfPower(float power, int64_t step) noexcept {
  if (step < 1 || !(power > 0.0f && power <= 1.0f)) return std::nullopt;
  // The float32 nearest the real root, then its neighbours: the one whose
  // step-by-step float32 product is `power`.
  const auto guess = static_cast<float>(
      std::pow(static_cast<double>(power), 1.0 / static_cast<double>(step)));
  float below = guess, above = guess;
  std::optional<float> found;
  for (int i = 0; i < 64 && !found; ++i) {
    if (BetaPower(below, step) == power) found = below;
    if (!found && BetaPower(above, step) == power) found = above;
    below = std::nextafter(below, 0.0f);
    above = std::nextafter(above, 2.0f);
  }
  if (!found) return std::nullopt;
  return ShortestDecimal(*found);
}

void CompleteAdamGroup(universal::ParamGroup& group,
                       std::span<const char* const> keys,
                       std::set<std::string>& notes) {
  for (const char* key : keys) {
    const std::string_view k = key;
    if (k == "betas") {
      if (group.betas) continue;
      group.betas = {kAdamBeta1, kAdamBeta2};
      group.int_mask = static_cast<uint8_t>(group.int_mask & ~(8 | 16));
      // A betas member that is not a pair of numbers is replaced.
      if (group.other.Find("betas") != nullptr) {
        std::vector<std::pair<std::string, json::Value>> keep;
        for (const auto& m : group.other.members())
          if (m.first != "betas") keep.push_back(m);
        group.other = json::Value::FromMembers(std::move(keep));
      }
      notes.insert(StrCat("the source records no Adam betas: wrote (",
                          kAdamBeta1, ", ", kAdamBeta2,
                          "), torch.optim.Adam's default"));
      continue;
    }
    std::optional<double>* have = k == "lr"             ? &group.lr
                                  : k == "eps"          ? &group.eps
                                  : k == "weight_decay" ? &group.weight_decay
                                                        : nullptr;
    if (have == nullptr || have->has_value()) continue;
    const double def = k == "lr"    ? kAdamLr
                       : k == "eps" ? kAdamEps
                                    : kAdamWeightDecay;
    *have = def;
    notes.insert(StrCat("the source records no Adam ", k, ": wrote ", k, " ",
                        def, ", torch.optim.Adam's default"));
  }
}

std::vector<universal::ParamGroup> AdamGroups(const universal::Model& model,
                                              std::set<std::string>& notes) {
  std::vector<universal::ParamGroup> out;
  if (!model.optimizer.groups) return out;
  for (const universal::ParamGroup& g : *model.optimizer.groups) {
    out.push_back(g);
    CompleteAdamGroup(out.back(), kAdamHyperparams, notes);
  }
  return out;
}

}  // namespace ucp::formats
