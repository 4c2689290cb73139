#pragma once
// The "hf" format: a Hugging Face transformers model folder, read (weights
// only), as `save_pretrained` writes it:
//   DIR/config.json                       {"architectures": [A], "model_type",
//                                          "hidden_size", ...}
//   DIR/model.safetensors                 one file, or
//   DIR/model.safetensors.index.json      {"metadata": {"total_size": n},
//                                          "weight_map": {tensor: shard}}
//   DIR/model-00001-of-0000N.safetensors  the shards it names
//   DIR/pytorch_model.bin                 or torch.save files of the state
//   DIR/pytorch_model.bin.index.json      dict (older transformers,
//   DIR/pytorch_model-0000i-of-0000N.bin  safe_serialization=False)
// (safetensors container: ../common/safetensors.h; torch.save files are read
// by ucp's torchfile reader, no pickle executed). transformers
// (modeling_utils.py, _get_resolved_checkpoint_files) takes model.safetensors,
// its index, pytorch_model.bin, its index, in that order. Every shard the
// index names must exist, every tensor it names must be in its shard, and
// every tensor of a shard must be named by the index (for that shard); a
// shard name is a plain file name in DIR.
//
// Architectures (config.json "architectures"[0]): LlamaForCausalLM,
// MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM,
// Qwen2MoeForCausalLM, Qwen3MoeForCausalLM, Glm4MoeForCausalLM; their tensors
// (i < num_hidden_layers, d = head_dim or hidden_size / num_attention_heads, nq
// = num_attention_heads, nkv = num_key_value_heads (default nq), H =
// hidden_size, I = intermediate_size, V = vocab_size):
//   model.embed_tokens.weight                      [V, H]
//   model.layers.i.input_layernorm.weight          [H]
//   model.layers.i.self_attn.q_proj.weight         [nq * d, H]
//   model.layers.i.self_attn.{k,v}_proj.weight     [nkv * d, H]
//   model.layers.i.self_attn.{q,k,v}_proj.bias     Qwen2 only: [nq * d],
//                                                  [nkv * d]
//   model.layers.i.self_attn.{q,k}_norm.weight     Qwen3 only: [d]
//   model.layers.i.self_attn.o_proj.weight         [H, nq * d]
//   model.layers.i.post_attention_layernorm.weight [H]
//   model.layers.i.mlp.{gate,up}_proj.weight       [I, H]
//   model.layers.i.mlp.down_proj.weight            [H, I]
//   Mixtral instead (j < num_local_experts, E of them; transformers' per-
//   expert names, which transformers 5 still saves):
//   model.layers.i.block_sparse_moe.gate.weight    [E, H] (the router)
//   model.layers.i.block_sparse_moe.experts.j.{w1,w3}.weight [I, H] (gate, up)
//   model.layers.i.block_sparse_moe.experts.j.w2.weight      [H, I]
//   Qwen3-MoE's sparse layers (not in mlp_only_layers, (i + 1) a multiple
//   of decoder_sparse_step; I' = moe_intermediate_size), the others dense:
//   model.layers.i.mlp.gate.weight                 [E, H] (the router)
//   model.layers.i.mlp.experts.j.{gate,up}_proj.weight [I', H]
//   model.layers.i.mlp.experts.j.down_proj.weight  [H, I']
//   Qwen2-MoE's likewise, with its gated shared expert (S =
//   shared_expert_intermediate_size; q/k/v biases unless qkv_bias false):
//   model.layers.i.mlp.shared_expert.{gate,up}_proj.weight [S, H]
//   model.layers.i.mlp.shared_expert.down_proj.weight      [H, S]
//   model.layers.i.mlp.shared_expert_gate.weight           [1, H]
//   Glm4-MoE's sparse layers (i >= first_k_dense_replace; E =
//   n_routed_experts, I' = moe_intermediate_size, S = I' * n_shared_experts;
//   q/k/v biases with attention_bias, q/k_norm with use_qk_norm):
//   model.layers.i.mlp.gate.weight                 [E, H] (sigmoid router)
//   model.layers.i.mlp.gate.e_score_correction_bias [E] (float32)
//   model.layers.i.mlp.experts.j.{gate,up,down}_proj.weight  as Qwen3-MoE's
//   model.layers.i.mlp.shared_experts.{gate,up}_proj.weight [S, H]
//   model.layers.i.mlp.shared_experts.down_proj.weight      [H, S]
//   model.norm.weight                              [H]
//   lm_head.weight                                 [V, H] (untied; a tied
//                                                  model's copy, if saved,
//                                                  must equal the embedding)
// (modeling_llama.py, modeling_mistral.py, modeling_qwen2.py,
// modeling_qwen3.py; LLaMA's and Qwen3's attention_bias, mlp_bias and
// hidden_act other than silu are refused).
// The universal content keeps these names, each tensor in its own dtype
// (float32: the `fp32` state, else `param`), and the model variables the
// Megatron layouts and `ucp export --hf` use (README.md).

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/formats/common/safetensors.h"
#include "engine/json/json.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"

namespace ucp::hf {

/// One weight file of the folder and its tensors (header or state-dict
/// order): a safetensors file (`tensors` with their offsets), or a torch.save
/// file (`torch` set; `tensors` name, dtype and shape each of `torch_tensors`
/// in the same order, offsets unused).
struct WeightFile {
  std::filesystem::path path;
  std::vector<formats::SafetensorsTensor> tensors;
  std::shared_ptr<const torchfile::TorchFile> torch;
  std::vector<const torchfile::TensorInfo*> torch_tensors;
};

/// The model config.json describes, checked.
struct ModelConfig {
  std::string architecture;  // "LlamaForCausalLM", ...
  std::string model_type;    // "llama", ...
  int64_t layers = 0, hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t ffn = 0, vocab = 0, max_positions = 0;
  bool tied = false;
  bool qkv_bias = false;        // Qwen2
  bool qk_norm = false;         // Qwen3
  int64_t experts = 0;          // num_local_experts / num_experts (0: dense)
  int64_t topk = 0;             // num_experts_per_tok
  int64_t moe_ffn = 0;          // an expert's intermediate size
  int64_t shared_ffn = 0;       // Qwen2-MoE's gated shared expert (0: none)
  std::vector<bool> moe_layer;  // per layer: a sparse MoE block
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  json::Value json;  // config.json as read

  // Glm4-MoE's (DeepSeek-V3's) MoE block: ungated shared experts
  // (mlp.shared_experts.*), a sigmoid router with its score-correction bias
  // (mlp.gate.e_score_correction_bias), scaled weights, group-limited routing.
  bool sigmoid_router = false;
  double routed_scaling = 1.0;    // routed_scaling_factor
  int64_t router_groups = 0;      // n_group when it limits the choice (else 0)
  int64_t router_group_topk = 0;  // topk_group likewise
  int64_t first_dense = 0;        // first_k_dense_replace
  double rotary_percent = 1.0;    // partial_rotary_factor
};

/// An opened folder: config, the weight files (and the index, if one).
struct Folder {
  std::filesystem::path dir;
  ModelConfig config;
  std::filesystem::path index;  // empty: one model.safetensors
  std::vector<WeightFile> files;
  /// --init-optimizer: the content gets fresh optimizer state (PlanSource).
  bool init_optimizer = false;
};

/// Whether `dir` looks like a transformers model folder (config.json and
/// model.safetensors, pytorch_model.bin or an index of either). Never throws.
bool LooksLikeFolder(const std::filesystem::path& dir) noexcept;

/// Reads config.json, the index and every file's header. Throws UsageError
/// naming config.json and the setting for an architecture or setting ucp
/// does not import; FormatError naming the file (and tensor) for a missing
/// or malformed file, an index naming a missing shard or tensor, a shard
/// tensor the index does not name; IoError if a file cannot be read.
Folder OpenFolder(const std::filesystem::path& dir);

/// The universal content: every tensor a fragment of its atom, in the
/// model's module order. With `folder.init_optimizer`, also fresh Adam state
/// for every weight (not the router's score-correction bias, a buffer):
/// exp_avg and exp_avg_sq float32 zeros, a float32 master copy (`fp32`) of
/// bf16 / fp16 weights, one param group without hyper-parameters (a target
/// writes torch.optim.Adam's defaults, saying so), optimizer step 0. Throws
/// UsageError naming the file and tensor for a tensor with no place in the
/// architecture; FormatError for a missing tensor or a shape or dtype the
/// config disagrees with.
universal::SourcePlan PlanSource(const Folder& folder);

/// What `ucp inspect` shows: every tensor with dtype, shape and file.
json::Value Inventory(const Folder& folder);

/// A layout descriptor of transformers' names (`ucp layout check`): how
/// transformers' own tensor-parallel plan (base_model_tp_plan of the three
/// configs) cuts each tensor: q/k/v, gate/up (and the q/k/v biases) by rows
/// (dim 0), o_proj / down_proj by columns (dim 1), the embedding and lm_head
/// by vocabulary rows, norms replicated. Only `layout check` uses it (the
/// universal content holds no layout: a Megatron target takes Megatron-core's
/// through --names mcore-llama).
std::string NamesLayoutYaml(const ModelConfig& config);

}  // namespace ucp::hf
