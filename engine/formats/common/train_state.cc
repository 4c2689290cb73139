#include "engine/formats/common/train_state.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"

namespace ucp::formats {

int64_t OptimizerStep(const atoms::RootInfo& root,
                      const std::filesystem::path& path) {
  for (const auto& [text, what] : {std::pair{&root.optimizer, "optimizer"},
                                   std::pair{&root.training, "training"}}) {
    const json::Value v = ParseJsonAttr(*text, what, path);
    if (const json::Value* s = v.is_object() ? v.Find("step") : nullptr;
        s != nullptr && s->is_number())
      return static_cast<int64_t>(s->AsDouble());
  }
  return root.iteration;
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

void CompleteAdamGroup(json::Value& group, std::span<const char* const> keys,
                       std::set<std::string>& notes) {
  if (!group.is_object()) return;
  for (const char* key : keys) {
    const std::string k = key;
    const json::Value* have = group.Find(k);
    if (k == "betas") {
      if (have != nullptr && have->is_array() && have->size() == 2 &&
          have->items()[0].is_number() && have->items()[1].is_number())
        continue;
      json::Value b = json::Value::Array();
      b.Append(kAdamBeta1);
      b.Append(kAdamBeta2);
      group[k] = std::move(b);
      notes.insert(StrCat("the source records no Adam betas: wrote (",
                          kAdamBeta1, ", ", kAdamBeta2,
                          "), torch.optim.Adam's default"));
      continue;
    }
    if (have != nullptr && have->is_number()) continue;
    const double def = k == "lr"    ? kAdamLr
                       : k == "eps" ? kAdamEps
                       : k == "weight_decay"
                           ? kAdamWeightDecay
                           : std::numeric_limits<double>::quiet_NaN();
    if (std::isnan(def)) continue;
    group[k] = def;
    notes.insert(StrCat("the source records no Adam ", k, ": wrote ", k, " ",
                        def, ", torch.optim.Adam's default"));
  }
}

json::Value AdamGroups(const atoms::RootInfo& root,
                       const std::filesystem::path& path,
                       std::set<std::string>& notes) {
  const json::Value opt = ParseJsonAttr(root.optimizer, "optimizer", path);
  json::Value out = json::Value::Array();
  const json::Value* gs = opt.is_object() ? opt.Find("groups") : nullptr;
  if (gs == nullptr || !gs->is_array()) return out;
  for (const json::Value& g : gs->items()) {
    json::Value c = g;
    CompleteAdamGroup(c, kAdamHyperparams, notes);
    out.Append(std::move(c));
  }
  return out;
}

}  // namespace ucp::formats
