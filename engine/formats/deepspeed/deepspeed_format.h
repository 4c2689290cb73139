#pragma once
// DeepSpeed checkpoints (DeepSpeed 0.14-0.19 runtime/engine.py save_checkpoint,
// checkpoint/constants.py, runtime/zero/stage_1_and_2.py), as this driver reads
// and writes them, Megatron-DeepSpeed's model parallelism and
// mixture-of-experts layers (ZeRO 0-2, without model parallelism) included
// (below).
//
// Folders
//   <save>/latest                 the tag, no newline (written last)
//   <save>/<tag>/                 default tag global_step<N>
//     mp_rank_00_model_states.pt                  ZeRO 0/1/2 (dp rank 0)
//     zero_pp_rank_{d}_mp_rank_00_model_states.pt ZeRO 3, every dp rank d
//     [bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt
//                                   ZeRO 1/2/3 and BF16_Optimizer (bf16_
//                                   prefix iff bf16 training); d unpadded
// model states: dict {module: OrderedDict (lp dtype; ZeRO-3: empty
//   placeholders, buffers real), buffer_names, optimizer (ZeRO 0 fp32: the
//   torch optimizer's state_dict, else None), param_shapes ([OrderedDict
//   name -> torch.Size] per group; ZeRO-3 per sub-group; None at ZeRO 0
//   fp32), frozen_param_shapes, shared_params {alias: name},
//   frozen_param_fragments (stage 2: full tensors; 3: partitions),
//   lr_scheduler, data_sampler, random_ltd, sparse_tensor_module_names,
//   skipped_steps, global_steps, global_samples, dp_world_size,
//   mp_world_size, ds_config, ds_version, client state...}
//   ZeRO 0 fp16: optimizer = FP16_Optimizer.state_dict() {dynamic_loss_scale,
//   cur_scale, cur_iter, [last_overflow_iter, scale_factor, scale_window
//   if dynamic], optimizer_state_dict (the inner optimizer over one flat
//   fp32 master per group: state {g: {step, exp_avg, exp_avg_sq}}),
//   fp32_groups_flat [per group: the params back to back, no padding],
//   clip_grad}, or FP16_UnfusedOptimizer's (same scale keys,
//   optimizer_state_dict over one fp32 master per param, fp32_groups
//   [[per param]]); param_shapes and shared_params None: neither says which
//   params a group holds. Read: a group is the module's params in order
//   (filtered, as trainers build groups); each master slice belongs to the
//   next module param whose fp16 weights are that slice rounded (first and
//   last 16 elements compared; a frozen param with the same fp16 values as a
//   later trainable one is taken for it), params in no group are frozen;
//   tied params are module entries sharing a storage view. ZeRO 0 fp32:
//   each torch optimizer id to the next module param of its state's shape.
// optim states: {optimizer_state_dict: {...}, ds_config, ds_version}
//   ZeRO 1/2 (zero_stage 1|2): loss_scaler, dynamic_loss_scale, overflow,
//     clip_grad, base_optimizer_state {state: {g: {step, exp_avg,
//     exp_avg_sq}}, param_groups: [...]}, single_partition_of_fp32_groups
//     (padding stripped), zero_stage, group_paddings, partition_count,
//     ds_version, param_slice_mappings [OrderedDict name ->
//     fragment_address(numel, start)]
//   BF16_Optimizer (no zero_stage): clip_grad, base_optimizer_state,
//     single_partition_of_fp32_groups (full partition), group_paddings,
//     partition_count, ds_version, param_slice_mappings
//   ZeRO 3: zero_stage, loss_scaler, dynamic_loss_scale, overflow,
//     partition_count (int), optimizer_state_dict {state: {s: ...},
//     param_groups}, fp32_flat_groups [per sub-group]
// Flat layouts (W = dp):
//   ZeRO 1/2, BF16: per group, params in param_shapes order, N = sum numel,
//     A = 2W, Np = ceil(N/A)*A, ps = Np/W; rank r owns flat[r*ps, (r+1)*ps);
//     padding_r = ps if N <= r*ps, (r+1)*ps - N if inside, else 0
//     (BF16_Optimizer: Np - N on the last rank only).
//   ZeRO 3: per sub-group, per param p = ceil(n/W); rank r holds
//     padded(param)[r*p, (r+1)*p), params back to back.
//
// Mixture of experts (deepspeed.moe.layer.MoE, engine._save_moe_checkpoint):
//   mp_rank_00_model_states.pt  the module without expert params, num_experts
//     [per MoE layer]; DeepSpeed < 0.16: no param_shapes, buffer_names,
//     ds_config (the groups then come from param_slice_mappings)
//   layer_{L}_expert_{G}_mp_rank_00_model_states.pt  {<m>.deepspeed_moe.
//     experts.deepspeed_experts.{G}.<p>: tensor} for MoE layer L (module
//     order), global expert G (L, G unpadded); legacy expert_{G}_mp_rank_00_
//     model_states.pt: every layer's params of expert G
//   expp_rank_{E}_mp_rank_00_optim_states.pt  ZeRO 0: {'optimizer': ep rank
//     E's torch optimizer state_dict} (ids over its dense params, then its
//     local experts' in module order); under ZeRO {'optimizer': None} (0.19:
//     not written)
//   ZeRO 1/2: an expert group (param group with 'moe': True, 'name':
//     'ep_size_{ep}') lists one rank's local experts (local index i, global
//     ep_rank * E/ep + i); dp rank D holds ep rank D % ep's experts,
//     partition D / ep of dp / ep (partition_count).
//
// Model parallelism (Megatron-DeepSpeed), read and written:
//   mp rank = pp_rank * TP + tp_rank (PipelineModule) or tp_rank (GPTModel
//   with --no-pipeline-parallel); mp_world_size = PP * TP; every file above
//   exists per mp rank (mp_rank_XX, zero_pp_rank_{d}_mp_rank_XX, %02d) and
//   holds that rank's local tensors, flat groups over its own params.
//   PipelineModule: module None; the weights are in
//     layer_{idx:02d}-model_{tp:02d}-model_states.pt (layer_{idx:02d}-
//     model_states.pt without a model axis), layer-local keys, one file per
//     layer index and tp rank, independent of PP. Param names are the
//     PipelineModule's: "<idx>.<key>", tied modules "tied_modules.<k>.<key>"
//     (listed on every stage using them; the layer file exists once).
//   Without param_shapes (ZeRO 0 fp16) the stages are GPTModelPipe's:
//   'type:transformer' over the layer files with "self_attention." keys,
//   the file with word_embeddings.weight the tied module "tied_modules.embed"
//   of the first and last stage (unless args untie them); the FP16 masters
//   must then match each stage's weights.
//   TP = number of tp ranks in the layer file names (else mp_world_size);
//   PP = mp_world_size / TP. A layer index belongs to the stage whose
//   param_shapes carry it; a file without such params to the stage of the
//   nearest lower index.
//   Merge: each mp rank is planned alone, then its local tensors are mapped
//   onto whole ones by a layout's TP placement (model_parallel.h; builtin
//   megatron-deepspeed-gpt-pipe or megatron-gpt-legacy, or --layout);
//   vocabulary rows beyond the true size (--vocab-size, else
//   universal_checkpoint_info.original_vocab_size, else none) go to the pad
//   atom; a tied param of several stages is taken from the first.
//   Write (any TP the heads and query groups allow, any PP dividing the
//   transformer layers; ZeRO 1/2, BF16_Optimizer with a pipeline,
//   FP16_Optimizer): the stored layout cuts each param for its tp rank, the
//   vocabulary re-padded for the target TP; stages by DeepSpeed's
//   'type:transformer' partition (the layers
//   "<idx>.self_attention.*" spread evenly, what precedes them on the first
//   stage, what follows on the last, tied modules on both); the saved args'
//   tensor/pipeline_model_parallel_size, data_parallel_size, world_size and
//   padded_vocab_size (also universal_checkpoint_info's) updated.
//
// What this driver keeps in the universal file:
//   /params/<name>/fp32, exp_avg, exp_avg_sq (+ any other state kind),
//     step (0-d, torch optimizers), param (lp weights when not fp32, stage
//     0-2; frozen params and buffers: their stored tensor)
//   /opaque/top_level/<key>   model-states entries (ds_config,
//     lr_scheduler, client state, ...)
//   /opaque/optim/<key>       non-tensor optimizer entries (loss_scaler,
//     zero_stage, clip_grad, ...), /opaque/optim_top/<key> (ds_config, ...)
//   /opaque/optimizer/param_groups  the groups without 'params'
//   root attr "deepspeed" (JSON; typed as DeepSpeedExtras below, read and
//     written only by this folder's drivers): {"tag", "stage", "wrapper",
//     "bf16_prefix", "groups" (names per group), "module_keys",
//     "model_keys", "step_kind", "step_value"?, "zero3_sub_groups"?,
//     "lp_dtype", "model_parallel"? {"tp", "pp", "pipeline", "layout",
//     "layout_yaml", "tied_layers" {"tied_modules.<k>": layer index},
//     "variables", "vocab_size", "vocab_size_from"} for Megatron-DeepSpeed
//     sources (the other mp ranks' opaque entries sit under
//     /opaque/mp_rank_XX/...), "moe"? {"num_experts", "layers", "ep",
//     "expert_groups", "legacy_names"} for mixture-of-experts sources}.

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/json/json.h"

namespace ucp::universal {
struct Model;
}  // namespace ucp::universal

namespace ucp::deepspeed {

/// The layer index that starts a PipelineModule param name ("12.weight" ->
/// 12), absent for other names.
inline std::optional<int64_t> LayerIndex(std::string_view name) {
  size_t n = 0;
  int64_t v = 0;
  while (n < name.size() && n < 9 && name[n] >= '0' && name[n] <= '9')
    v = v * 10 + (name[n++] - '0');
  if (n == 0 || n >= name.size() || name[n] != '.') return std::nullopt;
  return v;
}

/// DeepSpeed's 'type:transformer' pipeline partition, as Megatron-
/// DeepSpeed's GPTModelPipe uses it: the stage of layer `idx` given the
/// sorted indices of the transformer layers, whose count pp divides (they
/// spread evenly; what precedes them goes to the first stage, what follows
/// to the last, what lies between to the stage of the next one).
inline int64_t TransformerStage(std::span<const int64_t> transformer,
                                int64_t pp, int64_t idx) {
  if (idx < transformer.front()) return 0;
  if (idx > transformer.back()) return pp - 1;
  const auto per = static_cast<int64_t>(transformer.size()) / pp;
  return (std::lower_bound(transformer.begin(), transformer.end(), idx) -
          transformer.begin()) /
         per;
}

inline constexpr std::string_view kLatestFile = "latest";
inline constexpr std::string_view kLatestUniversalFile = "latest_universal";
inline constexpr std::string_view kMetaAttr = "deepspeed";

/// How the optimizer state is kept.
enum class Wrapper {
  kTorch,  // ZeRO 0, fp32: the torch optimizer inside the model states
  kFp16,   // ZeRO 0, fp16: FP16_Optimizer / FP16_UnfusedOptimizer, ditto
  kBf16,   // BF16_Optimizer: ZeRO 0 (or 1) with bf16
  kZero,   // DeepSpeedZeroOptimizer (stage 1/2) or stage 3
};

/// The "model_parallel" member of the "deepspeed" record: a
/// Megatron-DeepSpeed source's topology and what a writer needs to place
/// its params on another TP / PP size. Unknown members stay in `other`.
struct DeepSpeedModelParallel {
  int64_t tp = 1;
  int64_t pp = 1;
  bool pipeline = false;              // PipelineModule (layer files)
  std::optional<std::string> layout;  // the layout's name
  /// The layout's YAML; absent in files of an older ucp.
  std::optional<std::string> layout_yaml;
  /// "tied_modules.<k>" -> the layer index whose file holds it.
  std::optional<std::map<std::string, int64_t>> tied_layers;
  std::optional<std::map<std::string, int64_t>> variables;  // resolved
  std::optional<int64_t> vocab_size;           // the true vocabulary
  std::optional<std::string> vocab_size_from;  // where it came from
  json::Value other = json::Value::Object();

  bool operator==(const DeepSpeedModelParallel&) const = default;
};

/// The "moe" member of the "deepspeed" record: a mixture-of-experts source
/// (deepspeed.moe.layer.MoE layers). Expert params are named in the
/// universal file by their global expert id, as DeepSpeed's expert files
/// name them: "<layer>.deepspeed_moe.experts.deepspeed_experts.<G>.<rest>".
/// Unknown members stay in `other`.
struct DeepSpeedMoe {
  std::vector<int64_t> num_experts;  // per MoE layer (the model states')
  /// Per MoE layer (DeepSpeed's moe_layer_id, module order): the module
  /// path in front of kExpertInfix ("moe", "layers.3.mlp").
  std::vector<std::string> layers;
  int64_t ep = 1;  // the source's expert-parallel size
  /// The optimizer groups holding expert params (ZeRO partitions them over
  /// the expert-data-parallel ranks).
  std::vector<int64_t> expert_groups;
  bool legacy_names = false;  // expert_{G}_mp_rank_XX files (no layer)
  json::Value other = json::Value::Object();

  bool operator==(const DeepSpeedMoe&) const = default;
};

/// What separates a MoE layer's module path from the expert index in an
/// expert param's name (DeepSpeed's moe_str_prefix, without its leading dot).
inline constexpr std::string_view kExpertInfix =
    "deepspeed_moe.experts.deepspeed_experts.";

/// An expert param name split at kExpertInfix: the module path (without
/// the dot), the expert index (local in the module, global in expert
/// files) and the rest after the index's dot; absent for other names.
struct ExpertName {
  std::string layer;
  int64_t expert = 0;
  std::string rest;
};
inline std::optional<ExpertName> SplitExpertName(std::string_view name) {
  const size_t at = name.find(kExpertInfix);
  if (at == std::string_view::npos || (at > 0 && name[at - 1] != '.'))
    return std::nullopt;
  std::string_view t = name.substr(at + kExpertInfix.size());
  size_t n = 0;
  int64_t v = 0;
  while (n < t.size() && n < 9 && t[n] >= '0' && t[n] <= '9')
    v = v * 10 + (t[n++] - '0');
  if (n == 0 || n >= t.size() || t[n] != '.') return std::nullopt;
  return ExpertName{std::string(name.substr(0, at == 0 ? 0 : at - 1)), v,
                    std::string(t.substr(n + 1))};
}
/// The name of expert `expert` of module path `layer`, param `rest`.
inline std::string ExpertParamName(std::string_view layer, int64_t expert,
                                   std::string_view rest) {
  std::string s(layer);
  if (!s.empty()) s += '.';
  s += kExpertInfix;
  s += std::to_string(expert);
  s += '.';
  s += rest;
  return s;
}

/// The "deepspeed" root attribute, typed. Required: tag, stage, wrapper,
/// lp_dtype (every record has them); the rest is an empty optional when
/// absent. Unknown members stay in `other`.
struct DeepSpeedExtras {
  std::string tag;
  int64_t stage = 0;
  /// "torch" | "fp16" (FP16_Optimizer) | "fp16_unfused" | "bf16" | "zero".
  std::string wrapper;
  std::string lp_dtype;  // the training dtype's name
  std::optional<bool> bf16_prefix;
  /// Trainable param names per optimizer group, in flat order.
  std::optional<std::vector<std::vector<std::string>>> groups;
  std::optional<std::vector<std::string>> module_keys;  // module order
  std::optional<std::vector<std::string>> model_keys;   // model-states keys
  /// "tensor" | "int" | "float" | "none": how the optimizer kept its step.
  std::optional<std::string> step_kind;
  std::optional<double> step_value;  // an int / float step's value
  std::optional<int64_t> zero3_sub_groups;
  std::optional<DeepSpeedModelParallel> model_parallel;
  std::optional<DeepSpeedMoe> moe;
  json::Value other = json::Value::Object();

  bool operator==(const DeepSpeedExtras&) const = default;
};

/// The model's "deepspeed" record; absent if it has none. Throws
/// FormatError "universal file <file> > attribute deepspeed > ..." naming
/// the member if a member has the wrong type or a required one is missing.
std::optional<DeepSpeedExtras> ReadDeepSpeedExtras(
    const universal::Model& model, const std::filesystem::path& file);
/// Stores `extras` as the model's "deepspeed" record.
void WriteDeepSpeedExtras(const DeepSpeedExtras& extras,
                          universal::Model& model);

}  // namespace ucp::deepspeed
