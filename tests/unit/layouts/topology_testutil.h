#pragma once
// Topology without designated initializers (GCC's -Wmissing-field-initializers
// flags every partial designated initializer).

#include <cstdint>
#include <optional>

#include "layouts/variables.h"

namespace ucp::layouts {

inline Topology Topo(int64_t tp, int64_t pp = 1, int64_t vpp = 1,
                     int64_t dp = 1,
                     std::optional<int64_t> first_stage_layers = std::nullopt,
                     std::optional<int64_t> last_stage_layers = std::nullopt) {
  Topology t;
  t.tp = tp;
  t.pp = pp;
  t.vpp = vpp;
  t.dp = dp;
  t.first_stage_layers = first_stage_layers;
  t.last_stage_layers = last_stage_layers;
  return t;
}

}  // namespace ucp::layouts
