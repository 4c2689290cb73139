#pragma once
// The `args` Namespace of a Megatron rank file: what the driver reads from it
// (topology, model variables, optimizer and buffer settings) and how it is
// patched for a target topology.
//
// Fields read (megatron/training/arguments.py; absent or None = default):
//   tensor_model_parallel_size, pipeline_model_parallel_size (1),
//   virtual_pipeline_model_parallel_size | num_virtual_stages_per_pipeline_rank
//   | num_layers_per_virtual_pipeline_stage (VPP = L / PP / that),
//   data_parallel_size (else world_size / (tp*pp*cp)), context_parallel_size
//   (1), decoder_first/last_pipeline_num_layers, use_distributed_optimizer,
//   num_layers, hidden_size, ffn_hidden_size, num_attention_heads,
//   group_query_attention + num_query_groups (= heads without GQA),
//   kv_channels, swiglu, untie_embeddings_and_output_weights, add_bias_linear,
//   make_vocab_size_divisible_by (128), padded_vocab_size, vocab_size and
//   tokenizer_type (NullTokenizer: true vocab = vocab_size + 1, the EOD
//   token), overlap_grad_reduce, ddp_bucket_size, ddp_num_buckets,
//   ddp_pad_buckets_for_high_nccl_busbw, overlap_param_gather_with_optimizer_
//   step, num_distributed_optimizer_instances, accumulate_allreduce_grads_in_
//   fp32, consumed_train_samples, optimizer, rank, local_rank.
// Mixture of experts (only when the reader asks for it, else refused):
//   expert_model_parallel_size (topology.ep), expert_tensor_parallel_size
//   (topology.etp), num_experts (variable num_moe_experts), moe_layer_freq
//   (an int: every freq-th layer; a list of 0/1 per layer: leading zeros
//   as moe_first_dense_layers, then every moe_layer_freq-th layer).
// Refused (FormatError): pipeline_model_parallel_layout,
// account_for_embedding/loss_in_pipeline_ split, standalone_embedding_stage.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "engine/formats/megatron/buffer_layout.h"
#include "engine/formats/placed_target.h"
#include "engine/json/json.h"
#include "engine/pickle/value.h"
#include "layouts/variables.h"

namespace ucp::megatron {

/// Typed read access to an argparse.Namespace. Accessors return nullopt for
/// absent fields and None values; they throw FormatError naming the field
/// and `where` for a value of another type.
class ArgsView {
 public:
  /// Throws FormatError if `ns` is not an argparse.Namespace-like object.
  ArgsView(const pickle::Value* ns, std::string where);

  const pickle::Value* node() const { return ns_; }
  const std::string& where() const { return where_; }
  /// nullptr if absent.
  const pickle::Value* Find(std::string_view field) const;
  std::optional<int64_t> Int(std::string_view field) const;
  std::optional<bool> Bool(std::string_view field) const;
  std::optional<std::string> Str(std::string_view field) const;
  /// Throws FormatError if absent or None.
  int64_t RequireInt(std::string_view field) const;

 private:
  const pickle::Value* ns_;
  std::string where_;
};

/// What a checkpoint's args say about the run.
struct RunConfig {
  layouts::Topology topology;
  int64_t cp = 1;
  bool distributed_optimizer = false;
  /// Model variables for layouts (num_layers, hidden_size, ...); topology
  /// independent, so without the vocabulary (see below).
  layouts::Variables variables;
  std::optional<int64_t> padded_vocab_size;
  /// True vocabulary from the tokenizer settings (NullTokenizer); absent if
  /// the args cannot tell.
  std::optional<int64_t> true_vocab_size;
  // Distributed-optimizer buffer settings.
  bool overlap_grad_reduce = false;
  std::optional<int64_t> ddp_bucket_size;
  std::optional<int64_t> ddp_num_buckets;
  bool pad_buckets_for_high_nccl_busbw = false;
  bool overlap_param_gather_with_optimizer_step = false;
  int64_t num_distributed_optimizer_instances = 1;
  bool grad_reduce_in_fp32 = true;
  std::optional<int64_t> consumed_train_samples;
  std::string optimizer = "adam";
  std::optional<int64_t> rank;
  std::optional<int64_t> local_rank;

  /// The data-parallel size the optimizer's buckets are padded for, at
  /// data-parallel size `dp`: dp * cp / num_distributed_optimizer_instances.
  int64_t OptimizerDp(int64_t dp) const;

  /// The distributed optimizer's buffer options of model chunk `chunk` of
  /// pipeline rank `pp_rank` at data-parallel size `dp` (`local_params`: the
  /// rank's param count over all its chunks, for --ddp-num-buckets): the
  /// bucket size rule of training.py:get_model and DistributedDataParallel
  /// (buffer_layout.h).
  BufferOptions DistributedBufferOptions(int64_t dp, int64_t pp_rank,
                                         int64_t chunk,
                                         int64_t local_params) const;
};

/// Throws FormatError naming the field for missing required fields, bad
/// types, inconsistent sizes and unsupported features (a mixture-of-experts
/// run unless `experts`: then ep, etp and the MoE variables are read).
RunConfig ReadRunConfig(const ArgsView& args, bool experts = false);

/// A lossy JSON view of a pickled value for the universal file's metadata:
/// scalars, lists/tuples and dicts as JSON, globals (torch dtypes) as
/// "module.name", other objects (and nesting deeper than 8) as their Python
/// repr.
json::Value ValueToJson(const pickle::Value* v, int depth = 0);
/// The Namespace's fields as a JSON object of ValueToJson views (the
/// universal file's `args` attribute).
json::Value ArgsToJson(const ArgsView& args);

/// The field values a target topology changes.
struct ArgsPatch {
  layouts::Topology topology;
  int64_t cp = 1;
  bool distributed_optimizer = false;
  int64_t padded_vocab_size = 0;
  int64_t num_layers = 0;
  int64_t tp_rank = 0;
  int64_t pp_rank = 0;
  /// Ranks per node for local_rank (= rank % gpus_per_node).
  int64_t gpus_per_node = 8;
  /// The source's VPP (to keep overlap_p2p_comm / align_param_gather).
  int64_t source_vpp = 1;
  int64_t source_tp = 1;
};

/// The global rank of (tp_rank, dp_rank 0, pp_rank) in Megatron's default
/// rank order tp-cp-ep-dp-pp.
int64_t GlobalRank(const layouts::Topology& topology, int64_t cp,
                   int64_t tp_rank, int64_t pp_rank);

/// Patches a Namespace (a copy in `arena`) for a target rank: parallel sizes,
/// VPP fields (virtual_pipeline_model_parallel_size and either
/// num_layers_per_virtual_pipeline_stage or, with uneven stages or when the
/// source used it, num_virtual_stages_per_pipeline_rank), data_parallel_size,
/// world_size, rank, local_rank,
/// padded_vocab_size, use_distributed_optimizer, and the fields v0.13
/// derives from the topology (transformer_pipeline_model_parallel_size,
/// expert_model_parallel_size (topology.ep), expert_tensor_parallel_size
/// (topology.etp when set, else the target tp where it was the source's),
/// inprocess_active_world_size,
/// overlap_p2p_comm, align_param_gather, sequence_parallel at TP 1,
/// decoder_first/last_pipeline_num_layers). Only fields present in the
/// Namespace are changed (plus the always-present topology sizes).
/// Throws InternalError if `ns` has no attribute dict.
void PatchArgs(pickle::Arena& arena, pickle::Value* ns, const ArgsPatch& patch);

/// A Namespace (in `arena`) for content that carries none, a model read from
/// another framework (a transformers folder: engine/formats/hf), built from
/// its model variables under Megatron's names and the placed target: the
/// fields training.py's model provider and --use-checkpoint-args read
/// (num_layers, hidden_size, ffn_hidden_size, num_attention_heads,
/// group_query_attention, num_query_groups, kv_channels, swiglu,
/// normalization, norm_epsilon, position_embedding_type, rotary_base,
/// untie_embeddings_and_output_weights, add_bias_linear, add_qkv_bias,
/// qk_layernorm, vocab_size, make_vocab_size_divisible_by,
/// max_position_embeddings, the dtype; num_experts, moe_ffn_hidden_size,
/// moe_router_topk, moe_layer_freq, moe_shared_expert_*, and from the
/// variables' `other` moe_router_score_function, _topk_scaling_factor,
/// _dtype (and the variables moe_router_enable_expert_bias, _num_groups,
/// _group_topk) for experts; rotary_percent),
/// iteration 0 and the topology fields PatchArgs then sets. nullptr unless
/// the variables describe a Megatron-core GPT: num_layers, hidden_size,
/// num_attention_heads and the `normalization` and
/// `position_embedding_type` the reader records beside them.
pickle::Value* NewArgs(pickle::Arena& arena, const universal::Model& model,
                       const formats::PlacedTarget& placed);
/// Whether `model`'s variables say what NewArgs needs beside the sizes (the
/// `normalization` and `position_embedding_type` a reader records): a check
/// before the target is placed.
bool DescribesGpt(const universal::Model& model);

}  // namespace ucp::megatron
