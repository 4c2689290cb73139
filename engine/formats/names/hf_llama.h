#pragma once
// `ucp export --hf`: a Hugging Face transformers model folder of a LLaMA-style
// model (LlamaForCausalLM: config.json + weights under its names), from the
// universal content of a Megatron-core GPTModel (layouts mcore-llama and
// mcore-gpt: RMSNorm, SwiGLU, rotary positions, no linear biases).
//
// Names (universal -> transformers; i = the global layer):
//   embedding.word_embeddings.weight          -> model.embed_tokens.weight
//   decoder.layers.i.input_layernorm.weight | .self_attention.linear_qkv.
//     layer_norm_weight                       ->
//     model.layers.i.input_layernorm.weight
//   decoder.layers.i.self_attention.linear_qkv.weight
//                                             ->
//                                             ...self_attn.{q,k,v}_proj.weight
//   decoder.layers.i.self_attention.linear_proj.weight ->
//   ...self_attn.o_proj.weight decoder.layers.i.pre_mlp_layernorm.weight |
//   .mlp.linear_fc1.layer_norm_weight
//                                             ->
//                                             ...post_attention_layernorm.weight
//   decoder.layers.i.mlp.linear_fc1.weight    -> ...mlp.{gate,up}_proj.weight
//   decoder.layers.i.mlp.linear_fc2.weight    -> ...mlp.down_proj.weight
//   decoder.final_layernorm.weight            -> model.norm.weight
//   output_layer.weight (untied)              -> lm_head.weight
// Megatron's fused QKV rows are grouped per query group: [ng, nq/ng + 2, d, h]
// (for group g its nq/ng query heads, then its key head, then its value
// head); transformers' q_proj holds the nq query heads in order ([nq * d, h]),
// k_proj / v_proj the ng key / value heads ([ng * d, h]); query head j
// attends with key head j / (nq / ng) in both. fc1 is [gate; up] (SwiGLU:
// silu(gate) * up in both). Megatron's rotary embedding (not interleaved,
// rotary_percent 1) is transformers' LLaMA rotary: no permutation.
// config.json: architectures LlamaForCausalLM, model_type llama, hidden_size,
// intermediate_size, num_hidden_layers, num_attention_heads,
// num_key_value_heads, head_dim (kv_channels), vocab_size (the true
// vocabulary), rms_norm_eps (norm_epsilon, default 1e-5), rope_theta
// (rotary_base, default 10000), max_position_embeddings, tie_word_embeddings,
// hidden_act silu, attention_bias / mlp_bias false, torch_dtype.

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/box.h"
#include "engine/core/dtype.h"
#include "engine/formats/exporter.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/mapped_input.h"
#include "layouts/variables.h"

namespace ucp::names {

/// A box `src` of universal param `param` (empty: the tensor's own) copied to
/// box `dst` of a row-major view of shape `dst_shape` starting at element
/// `dst_offset` of the tensor (empty `dst_shape`: the tensor itself).
struct HfPiece {
  std::string param;
  Box src;
  Box dst;
  int64_t dst_offset = 0;
  Shape dst_shape;
};

/// One transformers tensor: pieces of universal params' weights that fill it
/// (`param`: the first, whose atom picks the dtype; no pieces: all of it).
struct HfTensor {
  std::string name;
  std::string param;
  Shape shape;
  std::vector<HfPiece> pieces;
  /// Written in float32 whatever the export's dtype (the router's expert
  /// bias, as DeepSeek-V3's own files and transformers keep it).
  bool fp32 = false;
};

/// How `--hf` writes routed experts (`--hf-experts`, formats/exporter.h).
using formats::HfExperts;

struct HfModel {
  std::vector<HfTensor> tensors;  // in transformers' state-dict order
  json::Value config;             // config.json without torch_dtype
};

/// The LlamaForCausalLM of `input` (Qwen2ForCausalLM when the fused QKV has a
/// bias: q/k/v_proj.bias split like the weight; through MapToHf, a dense
/// model's QK norms make it Qwen3ForCausalLM). Throws UsageError (starting
/// with `flag`, the option asking for it) naming the param or setting when the
/// model is not one (another layout, other biases, LayerNorm, learned
/// positions, rope scaling,
/// interleaved or partial rotary, QK norms, mixture of experts, a param with no
/// place in it).
HfModel MapToHfLlama(const universal::UniversalInput& input,
                     std::string_view flag = "--hf");

/// The transformers model of `input` (LLaMA for a dense model, a
/// mixture of experts as MixtralForCausalLM, Qwen2MoeForCausalLM,
/// Qwen3MoeForCausalLM or Glm4MoeForCausalLM: README.md of this folder).
/// Throws UsageError like MapToHfLlama.
HfModel MapToHf(const universal::UniversalInput& input, HfExperts experts,
                std::string_view flag = "--hf");

/// The params of MapToHfLlama(input) under transformers' names, for a
/// universal::MappedInput (registered as name map "hf-llama"); absent when
/// `input` is not a Megatron-core GPTModel (layout mcore-llama / mcore-gpt).
/// Throws what MapToHfLlama throws for one that is not LLaMA-like.
std::optional<std::vector<universal::MappedParam>> HfLlamaParams(
    const universal::UniversalInput& input, std::string_view flag);

/// The params of a Megatron-core GPTModel (layout mcore-llama, with the
/// Transformer Engine names torch_dist keys carry: the norms fused into
/// linear_qkv / linear_fc1) made of a LLaMA whose params are named as
/// transformers' LlamaForCausalLM names them after `hf_name` (the identity
/// for transformers' own names): q/k/v_proj joined per query group into
/// linear_qkv and gate/up_proj into linear_fc1 ([gate; up]), the inverse of
/// MapToHfLlama; q/k/v_proj biases (Qwen2) joined alike into
/// linear_qkv.bias, q/k_norm (Qwen3) as q/k_layernorm; a sparse MoE block's
/// router (with DeepSeek-V3's mlp.gate.e_score_correction_bias as
/// router.expert_bias), per-expert fc1 / fc2 and shared expert (its gate
/// when there is one). The query groups are
/// `given`'s num_query_groups, else those the source records in its model
/// variables (a transformers folder: num_key_value_heads), else the heads (no
/// GQA: `given`'s, then the recorded num_attention_heads). Absent when the
/// names are not LLaMA's. Throws UsageError (starting with `flag`) naming what
/// is missing: the query groups, a param, a shape the groups do not divide, a
/// param with no place in the model.
std::optional<std::vector<universal::MappedParam>> McoreLlamaFromHf(
    const universal::UniversalInput& input,
    const std::function<std::string(const std::string&)>& hf_name,
    const layouts::Variables& given, std::string_view flag);

}  // namespace ucp::names
