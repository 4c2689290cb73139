#pragma once
// Topology without designated initializers (GCC's -Wmissing-field-initializers
// flags every partial designated initializer).

#include <cstdint>
#include <optional>

#include "engine/core/strided.h"
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

/// The row-major flat index of element `idx` of a tensor of `shape`.
inline int64_t Flat(const Shape& shape, const Shape& idx) {
  int64_t f = 0;
  for (size_t d = 0; d < shape.size(); ++d) f = f * shape[d] + idx[d];
  return f;
}

}  // namespace ucp::layouts
