#pragma once
// What both Megatron writers (legacy and torch_dist) derive before laying
// out rank files: the content's "megatron" record and the layout-placed
// target, routed experts placed by EP / ETP.

#include <cstdint>
#include <optional>

#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/placed_target.h"

namespace ucp::megatron {

struct MegatronTarget {
  MegatronExtras meta;  // the record, or its defaults when there is none
  formats::PlacedTarget placed;
};

/// The record of `input` and formats::PlaceTarget for `topology` (the true
/// vocabulary size `true_vocab_size` if given, else the content's; known
/// unless the record says otherwise). Throws what ReadMegatronExtras and
/// formats::PlaceTarget throw.
MegatronTarget PlaceMegatronTarget(const universal::UniversalInput& input,
                                   const layouts::Topology& topology,
                                   std::optional<int64_t> true_vocab_size);

}  // namespace ucp::megatron
