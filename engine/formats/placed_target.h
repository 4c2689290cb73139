#pragma once
// The facts a layout-placed target (the Megatron formats, Megatron-DeepSpeed)
// derives from universal content before it lays out any rank: the layout
// and its resolved variables, the vocabulary rows a given true size marks
// as real, the validated target topology and the layer placement. Computed
// once here, by one function, for every writer that needs them.

#include <cstdint>
#include <optional>

#include "engine/universal/input.h"
#include "layouts/layout.h"
#include "layouts/placement.h"
#include "layouts/variables.h"

namespace ucp::formats {

struct PlacedTarget {
  layouts::Layout layout;
  /// The content's model variables (vocab_size from the given true size),
  /// resolved by the layout.
  layouts::Variables vars;
  /// The true vocabulary size given for content that did not know it (its
  /// stored rows are the source's padded rows): the rows that are real.
  std::optional<int64_t> vocab_rows;
  layouts::Topology topology;
  layouts::LayerPlacement placement;
};

/// What PlaceTarget needs besides the content.
struct PlaceRequest {
  layouts::Topology topology;
  /// --true-vocab-size; absent if not given.
  std::optional<int64_t> true_vocab_size;
  /// False when the content records that its true vocabulary size was
  /// unknown (the Megatron record's vocab_size_known).
  bool vocab_size_known = true;
};

/// The placed target of `input` for `request`. Throws FormatError naming the
/// input if it holds no layout descriptor, LayoutError if a target size is
/// below 1, a virtual pipeline is asked for without pp > 1, or the layout's
/// splits do not fit the target (layouts::ValidateTopology).
PlacedTarget PlaceTarget(const universal::UniversalInput& input,
                         const PlaceRequest& request);

}  // namespace ucp::formats
