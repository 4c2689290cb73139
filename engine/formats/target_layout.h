#pragma once
// The layout a layout-placed target (Megatron's formats: Driver::
// PlacesByLayout) cuts the params by, for universal content that holds none
// (read from DCP, MindSpore, a DeepSpeed ZeRO save, or mapped by --names):
// the built-in layout its param names match, or the one --layout names, with
// the model variables the layout needs that the content does not record.

#include <memory>
#include <string_view>

#include "engine/universal/input.h"
#include "layouts/variables.h"

namespace ucp::formats {

/// nullptr when `input` holds a layout descriptor (the target uses it);
/// else a view of `input` (same params, no padding rows) whose root holds
/// the layout `spec` gives (a built-in name or a YAML file; "" detects the
/// built-in the param names match) and the model variables: the content's,
/// then num_layers counted from the names, vocab_size the rows of the param
/// a vocabulary rule matches, make_vocab_size_divisible_by 128 (Megatron's
/// default), each unless `given` sets it (given wins). Throws LayoutError
/// naming the source's first param when no built-in layout matches, and
/// what Layout::FromSpec throws.
std::unique_ptr<universal::UniversalInput> WithTargetLayout(
    const universal::UniversalInput& input, std::string_view spec,
    const layouts::Variables& given);

}  // namespace ucp::formats
