// MindFormers' LLaMA names as name maps (engine/formats/name_map.h):
//   mindformers-llama  from a Megatron-core GPTModel (the fused QKV split per
//                      query group, linear_fc1 into w1 / w3: hf_llama.h's
//                      transformers LLaMA, then renamed) or from transformers'
//                      LlamaForCausalLM names (renamed);
//   hf-llama           from MindFormers' LLaMA names (renamed back);
//   mcore-llama        from MindFormers' LLaMA names (renamed back, then
//                      joined as hf_llama.h's McoreLlamaFromHf joins them).
// Written as MindSpore records, the moments take MindFormers' AdamW names
// (adam_m. / adam_v.).
// The renames are MindFormers' own, both ways (mindformers/models/llama/
// convert_weight.py and convert_reversed.py, name_replace; the weights are
// not permuted: both models use the same rotary halves):
//   model.embed_tokens.weight       <-> model.tok_embeddings.embedding_weight
//   .self_attn.{q,k,v,o}_proj.      <-> .attention.{wq,wk,wv,wo}.
//   .mlp.{gate,down,up}_proj.       <-> .feed_forward.{w1,w2,w3}.
//   .input_layernorm.               <-> .attention_norm.
//   .post_attention_layernorm.      <-> .ffn_norm.
//   model.norm.                     <-> model.norm_out.
//   lm_head.weight                  <-> lm_head.weight
// Every other name (a bias, a buffer) is kept as it is.

#include <array>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/formats/name_map.h"
#include "engine/formats/names/hf_llama.h"
#include "engine/formats/names/mindspore_extras.h"
#include "engine/json/json.h"

namespace ucp::names {
namespace {

// transformers' name part, MindFormers' (in name_replace's order).
constexpr std::array<std::pair<std::string_view, std::string_view>, 11>
    kRenames = {{
        {"embed_tokens.weight", "tok_embeddings.embedding_weight"},
        {".self_attn.q_proj.", ".attention.wq."},
        {".self_attn.k_proj.", ".attention.wk."},
        {".self_attn.v_proj.", ".attention.wv."},
        {".self_attn.o_proj.", ".attention.wo."},
        {".mlp.gate_proj.", ".feed_forward.w1."},
        {".mlp.down_proj.", ".feed_forward.w2."},
        {".mlp.up_proj.", ".feed_forward.w3."},
        {".input_layernorm.", ".attention_norm."},
        {".post_attention_layernorm.", ".ffn_norm."},
        {".norm.", ".norm_out."},
    }};

// `name` with the first rename whose part it holds applied (to MindFormers'
// names when `to_mindformers`, else back).
std::string Rename(std::string name, bool to_mindformers) {
  for (const auto& [hf, mf] : kRenames) {
    const std::string_view from = to_mindformers ? hf : mf;
    const std::string_view to = to_mindformers ? mf : hf;
    if (const size_t at = name.find(from); at != std::string::npos) {
      name.replace(at, from.size(), to);
      return name;
    }
  }
  return name;
}

// Whether the input names its params as `embedding` and its first layer's
// query weight as `query` say (the names of one of the two models).
bool Has(const universal::UniversalInput& input, std::string_view embedding,
         std::string_view query) {
  return input.FindParam(embedding) != nullptr &&
         input.FindParam(query) != nullptr;
}

// Every param of `input`, whole, renamed.
std::vector<universal::MappedParam> Renamed(
    const universal::UniversalInput& input, bool to_mindformers) {
  std::vector<universal::MappedParam> out;
  for (const atoms::StoredParam& p : input.params())
    out.push_back(universal::WholeParam(p, Rename(p.info.fqn, to_mindformers)));
  return out;
}

std::optional<std::vector<universal::MappedParam>> MindFormersParams(
    const universal::UniversalInput& input, const layouts::Variables&) {
  if (auto hf = HfLlamaParams(input, "--names mindformers-llama")) {
    for (universal::MappedParam& m : *hf)
      m.info.fqn = Rename(std::move(m.info.fqn), true);
    return hf;
  }
  if (Has(input, "model.embed_tokens.weight",
          "model.layers.0.self_attn.q_proj.weight"))
    return Renamed(input, true);
  return std::nullopt;
}

std::optional<std::vector<universal::MappedParam>> HfFromMindFormers(
    const universal::UniversalInput& input, const layouts::Variables&) {
  if (Has(input, "model.tok_embeddings.embedding_weight",
          "model.layers.0.attention.wq.weight"))
    return Renamed(input, false);
  return std::nullopt;
}

// MindFormers' AdamW names its moments adam_m. / adam_v. (mindformers/core/
// optim/adamw.py, clone_state): written so unless the source says otherwise.
void AdamWMoments(universal::Model& model) {
  mindspore::MindSporeExtras meta =
      mindspore::ReadMindSporeExtras(model,
                                     "(the --names mindformers-llama view)")
          .value_or(mindspore::MindSporeExtras{});
  if (!meta.exp_avg_prefix) meta.exp_avg_prefix = "adam_m.";
  if (!meta.exp_avg_sq_prefix) meta.exp_avg_sq_prefix = "adam_v.";
  mindspore::WriteMindSporeExtras(meta, model);
}

}  // namespace

UCP_REGISTER_NAME_MAP(mindformers_llama,
                      {"mindformers-llama",
                       "a Megatron-core GPTModel (mcore-llama, mcore-gpt) with "
                       "LLaMA's blocks, or transformers' LlamaForCausalLM "
                       "names",
                       MindFormersParams, "mindformers-llama", AdamWMoments});
UCP_REGISTER_NAME_MAP(
    mcore_llama_from_mindformers,
    {"mcore-llama", "MindFormers' LLaMA names",
     [](const universal::UniversalInput& input, const layouts::Variables& given)
         -> std::optional<std::vector<universal::MappedParam>> {
       if (!Has(input, "model.tok_embeddings.embedding_weight",
                "model.layers.0.attention.wq.weight"))
         return std::nullopt;
       return McoreLlamaFromHf(
           input, [](const std::string& n) { return Rename(n, false); }, given,
           "--names mcore-llama");
     },
     "mcore-llama"});
UCP_REGISTER_NAME_MAP(hf_llama_from_mindformers,
                      {"hf-llama", "MindFormers' LLaMA names",
                       HfFromMindFormers, ""});

}  // namespace ucp::names
