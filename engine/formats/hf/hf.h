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
// transformers 5's fused experts (FusedExpertParts below) stand for the
// per-expert tensors of a MoE layer. FP8 block-scaled folders (DeepSeek-V3's,
// transformers' FineGrainedFP8Config): config.json "quantization_config":
// {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [br, bc]}, each
// F8_E4M3 weight W [r, c] beside W_scale_inv float32 [ceil(r / br),
// ceil(c / bc)] (a multiplier, in any shard): read dequantized
// (Fp8Dequantized below) or refused.
// The universal content keeps these names, each tensor in its own dtype
// (float32: the `fp32` state, else `param`), and the model variables the
// Megatron layouts and `ucp export --hf` use (README.md).

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
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
  // quantization_config {"quant_method": "fp8", "fmt": "e4m3",
  // "weight_block_size": [rows, cols]}: the F8_E4M3 weights' scale blocks
  // (0: not quantized).
  int64_t fp8_block_rows = 0, fp8_block_cols = 0;
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
/// config disagrees with. `dequantize`: the
/// dtype FP8 block-scaled weights are dequantized to (bf16 or float32);
/// absent, the first FP8 weight is a UsageError naming it and --dequantize.
universal::SourcePlan PlanSource(
    const Folder& folder, std::optional<DType> dequantize = std::nullopt);

/// transformers 5's fused experts (`save_pretrained(...,
/// save_original_format=False)`, modeling_mixtral.py MixtralExperts and the
/// Qwen MoE models' alike): a MoE layer i saved as
///   model.layers.i.mlp.experts.gate_up_proj [E, 2I', H] (expert j's gate
///       rows, then its up rows: gate_up_proj[j] is the [gate; up] linear)
///   model.layers.i.mlp.experts.down_proj    [E, H, I']
/// and Mixtral's router as model.layers.i.mlp.gate.weight. Told apart from
/// the per-expert names by these names and shapes; the universal content is
/// the per-expert form's (ExpectedTensors' names).
struct StoredPart {
  std::string stored;  // the tensor saved
  int64_t at = 0;      // the element the part's rows start at
};
/// {per-expert name: its part} for every layer saved fused. `shape_of`
/// gives a saved tensor's shape (nullptr: not saved); `where` names it for
/// messages. Throws FormatError naming the tensor for a fused tensor of
/// another shape or without its partner.
std::map<std::string, StoredPart> FusedExpertParts(
    const ModelConfig& config,
    const std::function<const Shape*(const std::string&)>& shape_of,
    const std::function<std::string(const std::string&)>& where);

/// The bytes of FP8 block-scaled weights dequantized while read: each weight
/// w (F8_E4M3 [rows, cols]) with its scale s (float32 [ceil(rows / br),
/// ceil(cols / bc)], a multiplier, possibly in another file) appears as
/// (float(w[r, c]) * s[r / br, c / bc]) rounded to the output dtype (bf16
/// to nearest even, as torch's .to(torch.bfloat16); or float32), laid out
/// one after another; a read computes only the elements it asks for (the
/// weight's bytes and the scale rows they need, nothing kept).
class Fp8Dequantized : public reshape::ByteSource {
 public:
  Fp8Dequantized(DType out, int64_t block_rows, int64_t block_cols);
  ~Fp8Dequantized() override;
  /// Adds a weight; returns the byte offset of its dequantized elements.
  uint64_t Add(const std::filesystem::path& weight_file, uint64_t weight_at,
               int64_t rows, int64_t cols,
               const std::filesystem::path& scale_file, uint64_t scale_at);
  void Read(uint64_t offset, std::span<std::byte> dst) const override;
  std::string Describe() const override;

 private:
  struct Weight;
  struct Files;
  void ReadWeight(const Weight& w, int64_t first, int64_t count,
                  std::byte* dst) const;
  DType out_;
  int64_t block_rows_, block_cols_;
  std::vector<Weight> weights_;
  std::unique_ptr<Files> files_;
  uint64_t end_ = 0;
};

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
