#pragma once
// torch_dist keys (torch_dist.h) and the universal file's canonical names.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/box.h"

namespace ucp::torch_dist {

/// What a DCP key of a torch_dist checkpoint holds.
struct KeyInfo {
  enum Kind : uint8_t {
    kModel,           // a model tensor (ShardedTensor)
    kOptimizerState,  // optimizer.state.<state>.<model key>
    kBucket,          // optimizer.distributed.dp_group_idx_... (dp_reshardable)
    kObject,          // a ShardedObject: <key>/shard_<offsets>_<shape>
    kCommonState,     // common_state/...
  };
  Kind kind = kModel;
  std::string model_key;  // kModel / kOptimizerState; kObject: its key
  std::string state;      // kOptimizerState: param, fp32_param, exp_avg, ...
  std::vector<int64_t> offsets;  // kObject: the shard's offsets and grid
  std::vector<int64_t> grid;
};

/// Classifies `fqn` (a tensor key if `tensor`).
KeyInfo ClassifyKey(std::string_view fqn, bool tensor);

/// Whether an optimizer-state key of shape `state` is the flattened form of
/// core <= 0.14 (fully_sharded_model_space) of a model key of shape `model`:
/// one dim more, [chunk grid..., local numel] (1-D model keys keep theirs).
inline bool IsFlattenedState(const Shape& state, const Shape& model) {
  return !model.empty() && state.size() == model.size() + 1;
}

/// "decoder.layers.<module path>" without a layer number: stacked on a
/// leading layer dim.
bool IsStacked(std::string_view model_key);

/// The canonical name of layer `layer` of a stacked key (or of an unstacked
/// key, layer < 0): the layer number inserted after "decoder.layers.", and
/// with `local_spec` the local layer spec's norm names.
std::string CanonicalName(std::string_view model_key, int64_t layer,
                          bool local_spec);

/// Mixture of experts: a routed expert's key holds "experts" twice
/// (".mlp.experts.experts."), with the global expert axis prepended after
/// the layer axis of a stacked key ([L, E, ...]) or first in a per-layer key
/// (decoder.layers.<g>.mlp.experts.experts.<rest> [E, ...]).
inline constexpr std::string_view kExpertsInfix = ".mlp.experts.experts.";

/// The prepended axes of a model key (ShardedTensor.prepend_axis_num).
struct KeyAxes {
  bool stacked = false;  // a leading layer dim (IsStacked)
  bool experts = false;  // a global expert dim (after the layer dim)
  /// A per-layer key's layer number (decoder.layers.<g>.…), else -1.
  int64_t layer = -1;
  size_t count() const { return (stacked ? 1 : 0) + (experts ? 1 : 0); }
};
KeyAxes AxesOf(std::string_view model_key);

/// The canonical name of layer `layer` (stacked keys; a per-layer key's own
/// number is used otherwise) and global expert `expert` (>= 0 for expert
/// keys: ".mlp.experts.experts." becomes ".mlp.experts.<expert>.") of
/// `model_key`, with `local_spec` the local layer spec's norm names (per-layer
/// keys too).
std::string CanonicalName(std::string_view model_key, int64_t layer,
                          int64_t expert, bool local_spec);

/// The key and layer (-1: not stacked) of a canonical name (the inverse);
/// an expert name's key is the stacked expert key and `expert` its global
/// expert index (-1: not an expert).
struct KeyOfName {
  std::string key;
  int64_t layer = -1;
  int64_t expert = -1;
};
KeyOfName ModelKeyOf(std::string_view canonical);

/// A dp_reshardable bucket key (distrib_optimizer.py,
/// sharded_param_state_dp_reshardable): optimizer.distributed.dp_group_idx_G
/// .gbuf_idx_B.dtype_(<param dtype>, <grad dtype>).bucket_idx_K.<state>.
/// A ChainedOptimizer's (mixture of experts) keys start with "chained_<i>."
/// (0: the dense half, 1: the expert half): `chain`, else -1.
struct BucketKey {
  int64_t chain = -1;
  int64_t group = 0, gbuf = 0, bucket = 0;
  std::string dtype, state;  // dtype: "(torch.bfloat16, torch.float32)"
};
/// The parts of a bucket key; absent if `fqn` is not one.
std::optional<BucketKey> ParseBucketKey(std::string_view fqn);

/// "rng_state/shard_0.1_2.4": Megatron's ShardedObject unique key.
std::string ObjectKey(std::string_view key, std::span<const int64_t> offsets,
                      std::span<const int64_t> grid);

/// A box of a row-major tensor whose elements are consecutive in memory
/// (slices of one dim below a fixed prefix), and its first flat element.
struct FlatBox {
  Box box;
  int64_t first = 0;
};
/// The boxes covering the flat elements [a, b) of a tensor of `shape`, in
/// order (a 0-d tensor: one empty box).
std::vector<FlatBox> FlatBoxes(const Shape& shape, int64_t a, int64_t b);

}  // namespace ucp::torch_dist
