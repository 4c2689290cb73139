// torchtitan's LLaMA / mixture-of-experts names as a name map
// (engine/formats/name_map.h):
//   mcore-llama  from torchtitan's names (a DCP save of torchtitan's Llama 3,
//                Qwen3 or DeepSeek-style MoE decoder; its stacked experts
//                read one param per global expert by ../dcp_plain): renamed to
//                transformers' names, then joined as hf_llama.h's
//                McoreLlamaFromHf joins them (QKV per query group, fc1 =
//                [w1 (gate); w3 (up)] per expert, fc2 = w2).
// The renames (torchtitan -> transformers; L the layer, e the global expert):
//   tok_embeddings.weight                -> model.embed_tokens.weight
//   layers.L.attention.w{q,k,v,o}.weight -> model.layers.L.self_attn.
//                                           {q,k,v,o}_proj.weight
//   layers.L.attention.{q,k}_norm.weight -> ...self_attn.{q,k}_norm.weight
//   layers.L.attention_norm.weight       -> ...input_layernorm.weight
//   layers.L.ffn_norm.weight             -> ...post_attention_layernorm.weight
//   layers.L.feed_forward.w{1,3,2}.weight-> ...mlp.{gate,up,down}_proj.weight
//   layers.L.moe.router.gate.weight      -> ...mlp.gate.weight
//   layers.L.moe.expert_bias             -> ...mlp.gate.e_score_correction_bias
//   layers.L.moe.experts.e.w{1,3,2}      -> ...mlp.experts.e.
//                                           {gate,up,down}_proj.weight
//   layers.L.moe.shared_experts.w{1,3,2}.weight
//                                        -> ...mlp.shared_expert.
//                                           {gate,up,down}_proj.weight
//   norm.weight                          -> model.norm.weight
//   output.weight                        -> lm_head.weight
// Every other name is kept (and refused by McoreLlamaFromHf as a param with
// no place in the model). The weights are not permuted: torchtitan's Qwen3
// and MoE models rotate halves as Megatron does (rotary_interleaved false);
// its Llama 3 rotates interleaved pairs (complex rotary), which Megatron
// takes with --rotary-interleaved (README.md of this folder).

#include <array>
#include <charconv>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/name_map.h"
#include "engine/formats/names/hf_llama.h"

namespace ucp::names {
namespace {

// A layer's name part in torchtitan, transformers' (after "layers.L.").
constexpr std::array<std::pair<std::string_view, std::string_view>, 16>
    kTorchtitanLayerNames = {{
        {"attention.wq.weight", "self_attn.q_proj.weight"},
        {"attention.wk.weight", "self_attn.k_proj.weight"},
        {"attention.wv.weight", "self_attn.v_proj.weight"},
        {"attention.wo.weight", "self_attn.o_proj.weight"},
        {"attention.q_norm.weight", "self_attn.q_norm.weight"},
        {"attention.k_norm.weight", "self_attn.k_norm.weight"},
        {"attention_norm.weight", "input_layernorm.weight"},
        {"ffn_norm.weight", "post_attention_layernorm.weight"},
        {"feed_forward.w1.weight", "mlp.gate_proj.weight"},
        {"feed_forward.w3.weight", "mlp.up_proj.weight"},
        {"feed_forward.w2.weight", "mlp.down_proj.weight"},
        {"moe.router.gate.weight", "mlp.gate.weight"},
        {"moe.expert_bias", "mlp.gate.e_score_correction_bias"},
        {"moe.shared_experts.w1.weight", "mlp.shared_expert.gate_proj.weight"},
        {"moe.shared_experts.w3.weight", "mlp.shared_expert.up_proj.weight"},
        {"moe.shared_experts.w2.weight", "mlp.shared_expert.down_proj.weight"},
    }};

// The layer index a name starts with ("layers.L.": L and the rest), if any.
std::optional<std::pair<std::string_view, std::string_view>> TorchtitanLayer(
    std::string_view name) {
  constexpr std::string_view kPrefix = "layers.";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  const size_t dot = name.find('.');
  if (dot == 0 || dot == std::string_view::npos) return std::nullopt;
  for (char c : name.substr(0, dot))
    if (c < '0' || c > '9') return std::nullopt;
  return std::pair(name.substr(0, dot), name.substr(dot + 1));
}

// One routed expert's param "moe.experts.<e>.<w1|w2|w3>": e and the stem.
std::optional<std::pair<std::string_view, std::string_view>> TorchtitanExpert(
    std::string_view rest) {
  constexpr std::string_view kPrefix = "moe.experts.";
  if (!rest.starts_with(kPrefix)) return std::nullopt;
  rest.remove_prefix(kPrefix.size());
  const size_t dot = rest.find('.');
  if (dot == 0 || dot == std::string_view::npos) return std::nullopt;
  int64_t e = 0;
  const std::string_view index = rest.substr(0, dot);
  const auto [end, ec] =
      std::from_chars(index.data(), index.data() + index.size(), e);
  if (ec != std::errc() || end != index.data() + index.size())
    return std::nullopt;
  const std::string_view stem = rest.substr(dot + 1);
  if (stem != "w1" && stem != "w2" && stem != "w3") return std::nullopt;
  return std::pair(index, stem);
}

// transformers' name of torchtitan's `name` (the name itself if none).
std::string TorchtitanToHf(const std::string& name) {
  if (name == "tok_embeddings.weight") return "model.embed_tokens.weight";
  if (name == "norm.weight") return "model.norm.weight";
  if (name == "output.weight") return "lm_head.weight";
  const auto layer = TorchtitanLayer(name);
  if (!layer) return name;
  const auto& [index, rest] = *layer;
  const std::string head = StrCat("model.layers.", index, ".");
  for (const auto& [tt, hf] : kTorchtitanLayerNames)
    if (rest == tt) return StrCat(head, hf);
  if (const auto expert = TorchtitanExpert(rest)) {
    const auto& [e, stem] = *expert;
    const std::string_view proj = stem == "w1"   ? "gate_proj"
                                  : stem == "w3" ? "up_proj"
                                                 : "down_proj";
    return StrCat(head, "mlp.experts.", e, ".", proj, ".weight");
  }
  return name;
}

// Megatron-core's names of a model under torchtitan's names, or absent when
// the input is not one (no tok_embeddings.weight and layer 0's wq).
std::optional<std::vector<universal::MappedParam>> McoreFromTorchtitan(
    const universal::UniversalInput& input, const layouts::Variables& given) {
  constexpr std::string_view kFlag = "--names mcore-llama";
  const atoms::StoredParam* embedding =
      input.FindParam("tok_embeddings.weight");
  if (embedding == nullptr ||
      input.FindParam("layers.0.attention.wq.weight") == nullptr)
    return std::nullopt;
  // The experts as torchtitan's current order stores them (w1 / w3 [F, D],
  // w2 [D, F]); the older [D, F] order would need a transpose, which a name
  // map (copies of boxes) does not do.
  if (embedding->info.shape.size() == 2) {
    const int64_t hidden = embedding->info.shape[1];
    for (const atoms::StoredParam& p : input.params()) {
      if (p.info.kind != atoms::ParamKind::kParam) continue;
      const auto layer = TorchtitanLayer(p.info.fqn);
      const auto expert =
          layer ? TorchtitanExpert(layer->second) : std::nullopt;
      if (!expert) continue;
      const int64_t d_dim = expert->second == "w2" ? 0 : 1;
      if (p.info.shape.size() != 2 || p.info.shape[d_dim] != hidden) {
        throw UsageError(
            kFlag, ": ", input.path().string(), " > ", p.info.fqn, " ",
            ShapeString(p.info.shape), ": not an expert of dim ", hidden,
            " in torchtitan's order (w1 / w3 [F, D], w2 [D, F]; the older "
            "[D, F] order is transposed, which a name map does not do)");
      }
    }
  }
  return McoreLlamaFromHf(input, TorchtitanToHf, given, kFlag);
}

}  // namespace

UCP_REGISTER_NAME_MAP(mcore_llama_from_torchtitan,
                      {"mcore-llama",
                       "torchtitan's names (Llama 3, Qwen3, MoE with routed "
                       "experts per global expert as the dcp reader gives "
                       "them, router, expert bias, shared experts)",
                       McoreFromTorchtitan, "mcore-llama"});

}  // namespace ucp::names
