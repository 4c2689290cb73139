#pragma once
// torchtitan's routed experts in a DCP state dict (../../../layouts/README.md,
// "Mixture of experts (design)"; torchtitan's torchtitan/models/moe/moe.py,
// GroupedExperts, 2025-2026): each MoE layer
// keeps its experts' weights as one 3-D tensor per matrix, stacked over the
// layer's E experts,
//   <prefix>moe.experts.w1 [E, F, D]   w3 [E, F, D]   w2 [E, D, F]
// (2026 names add the shape: w1_EFD, w3_EFD, w2_EDF; older saves have w1 and
// w3 [E, D, F], w2 [E, F, D]: detected by shape against the router's
// <prefix>moe.router.gate.weight [E, D]). Its optimizer state has the same
// stacked shape. ucp keeps one param per (layer, expert, matrix), named with
// the global expert index after the infix as every MoE driver does:
//   <prefix>moe.experts.<e>.<w1|w2|w3>   the [F, D] / [D, F] slice of expert e
// (the slice as stored: the older order's slices are [D, F] / [F, D]).

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/formats/dcp/metadata.h"

namespace ucp::dcp {

inline constexpr std::string_view kExpertsInfix = "moe.experts.";

/// A stacked expert param name split: <prefix>moe.experts.<stem><suffix>
/// (stem w1 / w2 / w3, suffix empty or "_" and three capitals).
struct StackedName {
  std::string prefix;  // up to and with the infix
  std::string stem;    // w1, w2, w3
  std::string suffix;  // "_EFD", ... or empty
};

/// `name` split if it names a stacked expert tensor (ending in the stem and
/// suffix); absent otherwise. Never throws.
std::optional<StackedName> SplitStacked(std::string_view name);

/// The stacked name of a key anywhere in it (model.<p>, optimizer.state.<p>.
/// <kind>): absent if the key holds no stacked expert tensor. Never throws.
std::optional<StackedName> FindStacked(std::string_view key);

/// <prefix><e>.<stem>: expert e's own param. Never throws.
std::string ExpertParam(const StackedName& n, int64_t e);

/// The canonical per-expert param's parts: absent unless `name` is
/// <prefix>moe.experts.<e>.<w1|w2|w3>. Never throws.
struct ExpertParamName {
  std::string prefix;  // with the infix
  int64_t expert = 0;
  std::string stem;
};
std::optional<ExpertParamName> SplitExpertParam(std::string_view name);

/// For messages about a stacked expert tensor of `size`: the global experts
/// (dim-0 indices) `chunks` cover fewer times than once (`missing`) and more
/// than once (`twice`), empty chunks ignored. Never throws.
void ExpertCoverage(const Shape& size, const std::vector<Chunk>& chunks,
                    std::vector<int64_t>& missing, std::vector<int64_t>& twice);

/// "0, 2, 3". Never throws.
std::string IndexList(const std::vector<int64_t>& v);

}  // namespace ucp::dcp
