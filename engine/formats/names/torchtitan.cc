// torchtitan's LLaMA / mixture-of-experts names as name maps
// (engine/formats/name_map.h):
//   mcore-llama  from torchtitan's names (a DCP save of torchtitan's Llama 3,
//                Qwen3 or DeepSeek-style MoE decoder; its stacked experts
//                read one param per global expert by ../dcp_plain): renamed to
//                transformers' names, then joined as hf_llama.h's
//                McoreLlamaFromHf joins them (QKV per query group, fc1 =
//                [w1 (gate); w3 (up)] per expert, fc2 = w2);
//   torchtitan   from a Megatron-core GPTModel: the transformers model of
//                hf_llama.h's MapToHf (experts per expert), renamed back
//                (the DCP writer restacks the experts).
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
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
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

// torchtitan's name of a transformers name MapToHf gives (per-expert
// experts; the inverse of TorchtitanToHf, with Mixtral's and GLM-4-MoE's
// MoE names too), or absent when torchtitan has none (Qwen2-MoE's shared
// expert gate, a bias).
std::optional<std::string> TorchtitanFromHf(std::string_view name) {
  if (name == "model.embed_tokens.weight") return "tok_embeddings.weight";
  if (name == "model.norm.weight") return "norm.weight";
  if (name == "lm_head.weight") return "output.weight";
  constexpr std::string_view kPrefix = "model.";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  const auto layer = TorchtitanLayer(name.substr(kPrefix.size()));
  if (!layer) return std::nullopt;
  const auto& [index, rest] = *layer;
  const std::string head = StrCat("layers.", index, ".");
  for (const auto& [tt, hf] : kTorchtitanLayerNames)
    if (rest == hf) return StrCat(head, tt);
  // GLM-4-MoE's shared experts; Mixtral's router
  for (const auto& [hf, w] : {std::pair<std::string_view, std::string_view>{
                                  "mlp.shared_experts.gate_proj.weight", "w1"},
                              {"mlp.shared_experts.up_proj.weight", "w3"},
                              {"mlp.shared_experts.down_proj.weight", "w2"}}) {
    if (rest == hf) return StrCat(head, "moe.shared_experts.", w, ".weight");
  }
  if (rest == "block_sparse_moe.gate.weight")
    return StrCat(head, "moe.router.gate.weight");
  // One routed expert: mlp.experts.<e>.<gate|up|down>_proj.weight (Qwen3-MoE,
  // GLM-4-MoE) or block_sparse_moe.experts.<e>.<w1|w3|w2>.weight (Mixtral).
  for (const std::string_view experts :
       {std::string_view("mlp.experts."),
        std::string_view("block_sparse_moe.experts.")}) {
    if (!rest.starts_with(experts)) continue;
    std::string_view tail = rest.substr(experts.size());
    const size_t dot = tail.find('.');
    if (dot == 0 || dot == std::string_view::npos) return std::nullopt;
    const std::string_view e = tail.substr(0, dot), proj = tail.substr(dot + 1);
    const std::string_view w =
        proj == "gate_proj.weight" || proj == "w1.weight"   ? "w1"
        : proj == "up_proj.weight" || proj == "w3.weight"   ? "w3"
        : proj == "down_proj.weight" || proj == "w2.weight" ? "w2"
                                                            : "";
    if (w.empty()) return std::nullopt;
    return StrCat(head, "moe.experts.", e, ".", w);
  }
  return std::nullopt;
}

// torchtitan's names of a Megatron-core GPTModel (layouts mcore-llama,
// mcore-gpt, mcore-moe-*): the transformers model `ucp export --hf` makes of
// it (hf_llama.h MapToHf, experts per expert), renamed; absent for another
// source.
std::optional<std::vector<universal::MappedParam>> TorchtitanFromMcore(
    const universal::UniversalInput& input, const layouts::Variables& given) {
  constexpr std::string_view kFlag = "--names torchtitan";
  const std::string layout = input.model().source.layout.value_or("");
  if (layout != "mcore-llama" && layout != "mcore-gpt" &&
      !layout.starts_with("mcore-moe-"))
    return std::nullopt;
  // MapToHf reads the model variables the content records: --model-var's
  // added; the router's top-k only goes into config.json, not needed here.
  universal::Model model = input.model();
  for (const auto& [k, v] : given.values()) model.variables.Set(k, v);
  if (!model.variables.Get("moe_router_topk"))
    model.variables.Set("moe_router_topk", 1);
  std::vector<universal::MappedParam> whole;
  for (const atoms::StoredParam& p : input.params())
    whole.push_back(universal::WholeParam(p, p.info.fqn));
  const std::unique_ptr<universal::UniversalInput> view =
      universal::MappedInput(input, std::move(whole), std::move(model));
  // Megatron pads the vocabulary (make_vocab_size_divisible_by); torchtitan
  // keeps the true one: --model-var vocab_size, else the recorded one.
  std::optional<int64_t> vocab = given.Find("vocab_size");
  if (!vocab)
    vocab = formats::ModelVariables(input.model().variables).Find("vocab_size");
  std::vector<universal::MappedParam> out;
  for (HfTensor& t : MapToHf(*view, HfExperts::kPerExpert, kFlag).tensors) {
    if ((t.name == "model.embed_tokens.weight" || t.name == "lm_head.weight") &&
        t.pieces.empty() && t.shape.size() == 2 && vocab && *vocab > 0 &&
        *vocab < t.shape[0]) {
      Box rows;
      rows.offset = {0, 0};
      rows.size = {*vocab, t.shape[1]};
      t.shape[0] = *vocab;
      t.pieces.push_back({"", rows, rows});
    }
    std::optional<std::string> name = TorchtitanFromHf(t.name);
    if (!name) {
      throw UsageError(kFlag, ": ", input.path().string(), " > ", t.param,
                       ": no torchtitan name for it (transformers' ", t.name,
                       ")");
    }
    universal::MappedParam m;
    m.info.fqn = std::move(*name);
    m.info.shape = std::move(t.shape);
    if (t.pieces.empty()) {
      m.pieces.push_back(
          {t.param, Box::Whole(m.info.shape), Box::Whole(m.info.shape)});
    }
    for (HfPiece& p : t.pieces) {
      if (p.dst_offset != 0 || !p.dst_shape.empty()) {  // fused experts only
        throw UsageError(kFlag, ": ", input.path().string(), " > ", t.param,
                         ": ", t.name, " is not a box of one tensor");
      }
      m.pieces.push_back({p.param.empty() ? t.param : std::move(p.param),
                          std::move(p.src), std::move(p.dst)});
    }
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace

UCP_REGISTER_NAME_MAP(torchtitan_from_mcore,
                      {"torchtitan",
                       "a Megatron-core GPTModel (layouts mcore-llama, "
                       "mcore-gpt, mcore-moe-*) that `ucp export --hf` "
                       "exports",
                       TorchtitanFromMcore, ""});

UCP_REGISTER_NAME_MAP(mcore_llama_from_torchtitan,
                      {"mcore-llama",
                       "torchtitan's names (Llama 3, Qwen3, MoE with routed "
                       "experts per global expert as the dcp reader gives "
                       "them, router, expert bias, shared experts)",
                       McoreFromTorchtitan, "mcore-llama"});

}  // namespace ucp::names
