#pragma once
// The facts a layout-placed target (the Megatron formats, Megatron-DeepSpeed,
// MindSpore's --tp/--pp/--dp) derives from universal content before it lays
// out any rank: the layout and its resolved variables, the vocabulary rows a
// given true size marks as real, the validated target topology and the layer
// placement. Computed once here, by one function, for every writer that
// needs them.

#include <cstdint>
#include <optional>
#include <span>

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

  /// The vocabulary rows a target rank file's args record as
  /// padded_vocab_size: the first vocab-padded rule's padded size at the
  /// target TP, else vocab_size, else 0.
  int64_t PaddedVocabSize() const;
};

/// What PlaceTarget needs besides the content.
struct PlaceRequest {
  layouts::Topology topology;
  /// --true-vocab-size; absent if not given.
  std::optional<int64_t> true_vocab_size;
  /// False when the content records that its true vocabulary size was
  /// unknown (the Megatron record's vocab_size_known).
  bool vocab_size_known = true;
  /// The layout of content that holds no descriptor (a built-in one its
  /// names match); absent: such content is refused.
  std::optional<layouts::Layout> layout;
  /// Whether the writer places routed experts by EP / ETP (a layout with
  /// experts is refused otherwise).
  bool experts = false;
  /// Whether num_layers, when the content's variables do not set it, is
  /// counted from the params' layer indices (content that records no model
  /// variables, such as a MindSpore checkpoint's).
  bool count_layers = false;
};

/// The placed target of `input` for `request`: placed by the input's layout
/// descriptor, else by `request.layout`. Throws UsageError for a layout with
/// routed experts unless `request.experts` or expert sizes Megatron
/// refuses (--ep > 1 without routed experts, an expert count --ep does not
/// divide, expert biases with --etp > 1), FormatError naming the input
/// if it holds no layout descriptor and the request gives none, LayoutError
/// if a target size is below 1, a virtual pipeline is asked for without
/// pp > 1, or the layout's splits do not fit the target
/// (layouts::ValidateTopology).
PlacedTarget PlaceTarget(const universal::UniversalInput& input,
                         const PlaceRequest& request);

/// The same for params of `shapes` under `layout`, with the model variables
/// `given` (the content's; `request.layout` is not used), where no universal
/// content is at hand. Throws LayoutError as PlaceTarget.
PlacedTarget PlaceParams(layouts::Layout layout, layouts::Variables given,
                         std::span<const layouts::ParamShape> shapes,
                         const PlaceRequest& request);

}  // namespace ucp::formats
