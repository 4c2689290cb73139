#include "layouts/variables.h"

#include <algorithm>

#include "engine/core/error.h"

namespace ucp::layouts {

void Variables::Set(std::string_view name, int64_t value) {
  auto it = values_.find(name);
  if (it == values_.end()) {
    values_.emplace(std::string(name), value);
  } else {
    it->second = value;
  }
}

std::optional<int64_t> Variables::Find(std::string_view name) const {
  auto it = values_.find(name);
  if (it == values_.end()) return std::nullopt;
  return it->second;
}

int64_t Variables::Get(std::string_view name) const {
  if (auto v = Find(name)) return *v;
  throw LayoutError("model variable '", name, "' is not set (set: ",
                    values_.empty() ? std::string("none") : ToString(), ")");
}

Variables Variables::Merged(const Variables& overrides) const {
  Variables out = *this;
  for (const auto& [name, value] : overrides.values_) out.Set(name, value);
  return out;
}

std::string Variables::ToString() const {
  std::string out;
  for (const auto& [name, value] : values_) {
    if (!out.empty()) out += ", ";
    out += StrCat(name, "=", value);
  }
  return out;
}

std::string Topology::ToString() const {
  std::string out = StrCat("tp=", tp, " pp=", pp, " vpp=", vpp, " dp=", dp);
  if (first_stage_layers)
    out += StrCat(" first_stage_layers=", *first_stage_layers);
  if (last_stage_layers)
    out += StrCat(" last_stage_layers=", *last_stage_layers);
  if (ep != 1 || etp) out += StrCat(" ep=", ep);
  if (etp) out += StrCat(" etp=", *etp);
  return out;
}

int64_t Topology::ExpertDp() const {
  int64_t grid = 0;
  int64_t ranks = 0;  // tp x dp: the world of one pipeline stage
  if (ExpertTp() < 1 || ep < 1 || tp < 1 || dp < 1 ||
      __builtin_mul_overflow(ExpertTp(), ep, &grid) ||
      __builtin_mul_overflow(tp, dp, &ranks) || ranks % grid != 0) {
    return 0;
  }
  return ranks / grid;
}

bool IsTopologyVariable(std::string_view name) {
  return std::find(std::begin(kTopologyVariables), std::end(kTopologyVariables),
                   name) != std::end(kTopologyVariables);
}

Variables WithTopology(const Variables& vars, const Topology& topology) {
  Variables out = vars;
  out.Set("tp", topology.tp);
  out.Set("pp", topology.pp);
  out.Set("vpp", topology.vpp);
  out.Set("dp", topology.dp);
  return out;
}

}  // namespace ucp::layouts
