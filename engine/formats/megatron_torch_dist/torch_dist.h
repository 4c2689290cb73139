#pragma once
// Megatron-core `--ckpt-format torch_dist` checkpoints (megatron/core/
// dist_checkpointing; core v0.8-v0.16, both common-state forms of v0.19+):
// discovery, reading into a universal SourcePlan with Megatron's canonical
// names (the "megatron" driver's universal content: the two Megatron formats
// convert into each other), and planning the files of any TP/PP/VPP/DP.
//
// Folders
//   <save>/latest_checkpointed_iteration.txt   "N" (written last)
//   <save>/iter_{N:07d}/
//     metadata.json     {"sharded_backend": "torch_dist",
//                        "sharded_backend_version": 1, "common_backend":
//                        "torch", "common_backend_version": 1} (written
//                        last: without it the checkpoint is incomplete;
//                        core <= 0.18 requires all four keys)
//     .metadata         DCP metadata (engine/formats/dcp/metadata.h; core
//                        0.15's MCoreMetadata read as its base)
//     __R_I.distcp      DCP items of global rank R (dcp.h)
//     common.pt         torch.save(common dict) (core <= 0.18); core 0.19+
//                        may keep it instead as the DCP bytes item
//                        "common_state/shard_0_1" = torch.save([dict])
// The common dict (training/checkpointing.py generate_state_dict, minus
// everything sharded): args (argparse.Namespace), checkpoint_version 3.0,
// iteration, optimizer {optimizer: {param_groups: [group without params]},
// param_state_sharding_type, [grad_scaler]}, opt_param_scheduler,
// [rerun_state_machine], num_floating_point_operations_so_far,
// content_metadata {distrib_optim_sharding_type, singleton_local_shards,
// chained_optim_avoid_prefix, distrib_optim_fully_reshardable_mem_efficient}.
//
// DCP keys (ShardedTensor keys; no "model." prefix):
//   embedding.word_embeddings.weight   [padded vocab, h], split dim 0 by TP
//   embedding.position_embeddings.weight
//   decoder.layers.<module path>       a homogeneous decoder's layers stacked
//                                      on a leading layer dim [L, ...]
//                                      (global layer numbers); chunks
//                                      [1, local shape] at [layer, TP
//                                      offsets]; SwiGLU's linear_fc1 is the
//                                      TP-invariant [gate; up]: two chunks
//                                      per rank (its gate rows, its up rows)
//   decoder.final_layernorm.*, output_layer.weight (untied only; a tied
//                                      copy is never stored)
//   keys are spec-invariant: the local layer spec's input_layernorm.* and
//   pre_mlp_layernorm.* are stored as self_attention.linear_qkv.layer_norm_*
//   and mlp.linear_fc1.layer_norm_* (universal names follow args.
//   transformer_impl: "local" -> the local spec's names)
//   <module>._extra_state/shard_<layer>_<L>   BYTE_IO torch.save([state])
//   rng_state/shard_<pp>.<tp>_<PP>.<TP>       BYTE_IO torch.save([[rng]])
// Optimizer state (content_metadata.distrib_optim_sharding_type):
//   fully_reshardable   optimizer.state.{param,exp_avg,exp_avg_sq}.<model
//                       key>: fp32, the model key's shape and chunks
//   non-distributed     optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.
//                       <model key> (Float16OptimizerWithFloat16Params):
//                       read
//   dp_reshardable      optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.
//                       dtype_(<param dtype>, <grad dtype>).bucket_idx_<k>.
//                       {param,exp_avg,exp_avg_sq}: per DDP bucket, 1-D
//                       [bucket numel unpadded], DP rank r's slice at
//                       r * (padded bucket / dp); g = tp + TP * pp (the
//                       rank in the model-parallel group), b = model chunk;
//                       a param's state at its buffer range minus the
//                       bucket's start (megatron/buffer_layout.h: not
//                       stored, rebuilt from the args and checked against
//                       every key's size); objects <prefix>.optimizer
//                       ({param_groups}), <prefix>.per_bucket_numel[_unpadded]
//   dp_zero_gather_scatter  object optimizer.distributed.dp_group_idx_<g>.
//                       param_state (DP rank 0's): [{buckets_coalesced: True,
//                       <chunk>: {(<param dtype>, <grad dtype>): {param,
//                       exp_avg, exp_avg_sq: fp32 1-D, numel_unpadded}}}],
//                       each bucket's unpadded state one after the other
//                       (the legacy distrib_optim.pt dict; placed by the same
//                       buffer layout); object <prefix>.optimizer
//
// In the universal file: what the "megatron" driver keeps (megatron_format.h:
// canonical names with global layer numbers, param / fp32 / exp_avg /
// exp_avg_sq atoms, vocabulary padding rows as pad atoms, args, param
// groups, extra states, rng states, the common dict's other entries as
// top_level/<key>), plus this driver's own root attribute
// "megatron_torch_dist" (JSON, typed as TorchDistExtras below):
// {"content_metadata": {...} as read, "common_in": "common.pt" |
// "common_state" | "", "optimizer": the optimizer state's form read}.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/formats/dcp/dcp.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"
#include "layouts/variables.h"

namespace ucp::torch_dist {

inline constexpr const char* kTransformerImplOption = "transformer-impl";
inline constexpr const char* kDistributedOptimizerOption =
    "distributed-optimizer";
inline constexpr const char* kOptimizerShardingOption = "optimizer-sharding";
inline constexpr const char* kMetaAttr = "megatron_torch_dist";
inline constexpr const char* kMetadataJson = "metadata.json";
inline constexpr const char* kCommonFile = "common.pt";
inline constexpr const char* kCommonStatePrefix = "common_state/";

/// The "megatron_torch_dist" root attribute, typed (every member required:
/// the reader always writes them). Unknown members stay in `other`.
struct TorchDistExtras {
  /// The common state's content_metadata as read (an object).
  json::Value content_metadata = json::Value::Object();
  std::string common_in;  // "common.pt", "common_state" or ""
  std::string optimizer;  // Checkpoint::optimizer of the source
  json::Value other = json::Value::Object();

  bool operator==(const TorchDistExtras&) const = default;
};

/// The model's "megatron_torch_dist" record; absent if it has none. Throws
/// FormatError "universal file <file> > attribute megatron_torch_dist > ..."
/// naming the member if one is missing or has the wrong type.
std::optional<TorchDistExtras> ReadTorchDistExtras(
    const universal::Model& model, const std::filesystem::path& file);
/// Stores `extras` as the model's "megatron_torch_dist" record.
void WriteTorchDistExtras(const TorchDistExtras& extras,
                          universal::Model& model);

struct Checkpoint {
  std::filesystem::path dir;       // the save folder (holds the tracker)
  std::filesystem::path iter_dir;  // iter_0000100
  int64_t iteration = 0;
  bool release = false;  // iter_dir is release/ (iteration 0)
  dcp::Checkpoint dcp;   // the DCP container
  /// The common dict (a node of common_file), nullptr if the checkpoint has
  /// none; where it was.
  std::shared_ptr<const torchfile::TorchFile> common_file;
  const pickle::Value* common = nullptr;
  std::string common_in;  // "common.pt", "common_state" or ""
  json::Value content_metadata = json::Value::Object();
  /// content_metadata's distrib_optim_sharding_type, else inferred from the
  /// keys: "fully_reshardable", "dp_reshardable", "dp_zero_gather_scatter"
  /// (a param_state object), "fully_sharded_model_space" (flattened keys),
  /// "non_distributed", "none"; "fully_sharded_bucket_space" is named by
  /// content_metadata only (dp_reshardable's keys, padded sizes).
  std::string optimizer;
  layouts::Topology topology;  // from args, else TP/PP from the chunks
  std::vector<std::filesystem::path> files;  // every file read
};

/// Finds the checkpoint at `path`: a save folder (the tracker's iteration,
/// or `iteration`) or an iter_* folder. Throws FormatError naming the file
/// for a missing or malformed metadata.json / .metadata / common state (and
/// what dcp::Discover refuses), UsageError for an iteration that is not
/// there, IoError if `path` is not a readable folder.
Checkpoint Discover(const std::filesystem::path& path,
                    std::optional<int64_t> iteration);

/// True if iteration folder `iter_dir` holds a metadata.json, a .metadata or
/// a first rank file (a checkpoint of this format, complete or not). Never
/// throws.
bool HoldsTorchDistFiles(const std::filesystem::path& iter_dir);

/// True if `dir` is an iter folder of this format (metadata.json naming the
/// torch_dist backend). Never throws.
bool IsTorchDistFolder(const std::filesystem::path& dir);

struct SourceOptions {
  std::string layout;  // builtin name or YAML; "" detect
  std::optional<int64_t> true_vocab_size;
  /// "local" or "transformer_engine"; empty: args.transformer_impl, else
  /// "transformer_engine" (Megatron's default).
  std::string transformer_impl;
};

/// Plans the universal content (see above). Throws FormatError naming the
/// file, key and problem (an optimizer format not read, a key no layout rule
/// matches, chunks that disagree with the model); LayoutError if no layout
/// fits; IoError.
universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const SourceOptions& options);

struct TargetOptions {
  layouts::Topology topology;
  bool distributed_optimizer = false;
  /// "fully_reshardable" or "dp_reshardable" (the DDP buckets of the target
  /// DP, Megatron's default form); absent: fully_reshardable. Without
  /// distributed_optimizer the optimizer state takes the non-distributed
  /// optimizer's form (Float16OptimizerWithFloat16Params / FP32Optimizer).
  std::optional<std::string> optimizer_sharding;
  bool no_optimizer = false;
  std::optional<int64_t> true_vocab_size;
};

/// Plans iter_N/ for `options.topology`: one __R_0.distcp per global rank
/// (Megatron's rank order tp-cp-ep-dp-pp; each (tp, pp) group's items spread
/// over its DP ranks, as the fully parallel save spreads them), common.pt
/// and the common_state item (every core reads one of them), .metadata, then
/// metadata.json, then the tracker. Model tensors are chunked as Megatron
/// shards them for that TP/PP (vocabulary padded for the new TP); the
/// optimizer state fully_reshardable, or dp_reshardable for the target DP,
/// or without the distributed optimizer the non-distributed optimizer's
/// (fp32 masters and moments by model key, the torch Adam step in the
/// common state). Throws LayoutError if the topology cannot hold the model,
/// FormatError if the universal content lacks what Megatron needs,
/// UsageError for an optimizer sharding without the distributed optimizer.
std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input, const TargetOptions& options);

}  // namespace ucp::torch_dist
