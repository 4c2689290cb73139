#include "engine/formats/megatron/target.h"

#include <utility>

namespace ucp::megatron {

MegatronTarget PlaceMegatronTarget(const universal::UniversalInput& input,
                                   const layouts::Topology& topology,
                                   std::optional<int64_t> true_vocab_size) {
  MegatronExtras meta = ReadMegatronExtras(input.model(), input.path())
                            .value_or(MegatronExtras{});
  formats::PlaceRequest request{topology, true_vocab_size,
                                meta.VocabSizeKnown()};
  request.experts = true;
  formats::PlacedTarget placed = formats::PlaceTarget(input, request);
  return {std::move(meta), std::move(placed)};
}

}  // namespace ucp::megatron
