// transformers' LlamaForCausalLM from a Megatron-core GPT (hf_llama.h).

#include "engine/formats/names/hf_llama.h"

#include <charconv>
#include <map>
#include <optional>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/name_map.h"

namespace ucp::names {
namespace {

constexpr std::string_view kLayers = "decoder.layers.";

// An int / bool / float / string of a JSON object, if there.
std::optional<int64_t> Int(const json::Value& o, const char* k) {
  const json::Value* v = o.Find(k);
  if (v == nullptr) return std::nullopt;
  if (v->is_int()) return v->AsInt();
  if (v->is_bool()) return v->AsBool() ? 1 : 0;
  return std::nullopt;
}
std::optional<double> Number(const json::Value& o, const char* k) {
  const json::Value* v = o.Find(k);
  return v != nullptr && v->is_number() ? std::optional(v->AsDouble())
                                        : std::nullopt;
}
std::optional<std::string> String(const json::Value& o, const char* k) {
  const json::Value* v = o.Find(k);
  return v != nullptr && v->is_string() ? std::optional(v->AsString())
                                        : std::nullopt;
}

// Rows [begin, end) of a [rows, cols] tensor.
Box Rows(int64_t begin, int64_t end, int64_t cols) {
  Box b;
  b.offset = {begin, 0};
  b.size = {end - begin, cols};
  return b;
}

// The layout the source names: "" if none.
std::string SourceLayout(const universal::UniversalInput& input) {
  return input.model().source.layout.value_or("");
}

bool IsMcoreGpt(const std::string& layout) {
  return layout == "mcore-llama" || layout == "mcore-gpt";
}

// The mixture of experts of a model (hf_llama.h MapToHf).
enum class MoeArch { kNone, kMixtral, kQwen2Moe, kQwen3Moe, kGlm4Moe };
struct MoeInfo {
  MoeArch arch = MoeArch::kNone;
  std::vector<bool> moe_layer;  // per global layer
  int64_t experts = 0, topk = 0, expert_ffn = 0, shared_ffn = 0;
  int64_t first_moe = 0;  // Glm4Moe's first_k_dense_replace
  bool norm_topk = true;
  bool qk_norm = false;  // Megatron's q/k_layernorm: Qwen3-MoE's q/k_norm
  double scaling = 1.0;  // Glm4Moe's routed_scaling_factor
  int64_t groups = 1, group_topk = 1;  // Glm4Moe's n_group, topk_group
};

const char* ArchName(MoeArch arch) {
  switch (arch) {
    case MoeArch::kMixtral:
      return "MixtralForCausalLM";
    case MoeArch::kQwen2Moe:
      return "Qwen2MoeForCausalLM";
    case MoeArch::kQwen3Moe:
      return "Qwen3MoeForCausalLM";
    case MoeArch::kGlm4Moe:
      return "Glm4MoeForCausalLM";
    case MoeArch::kNone:
      break;
  }
  return "LlamaForCausalLM";
}

// Which transformers model the experts of `input` make (names, args), or
// UsageError naming what none of them has. Megatron's softmax router (top-k
// of the logits, softmax over them) is Mixtral's / Qwen2-MoE's; its sigmoid
// router with an expert bias (DeepSeek-V3's) is Glm4Moe's (DeepseekV3's
// without MLA attention).
MoeInfo MoeOf(const json::Value& args, const layouts::Variables& model,
              const json::Value& other, const std::string& where,
              int64_t layers,
              const std::function<bool(const std::string&)>& has) {
  MoeInfo info;
  auto refuse = [&](const std::string& why) {
    throw UsageError(where, ": ", why,
                     ", which none of MixtralForCausalLM, Qwen2MoeForCausalLM, "
                     "Qwen3MoeForCausalLM, Glm4MoeForCausalLM has");
  };
  int64_t moe_layers = 0, shared = 0, gated = 0, biased = 0, first = -1;
  int64_t dense_after = -1;  // a dense layer after the first MoE layer
  for (int64_t i = 0; i < layers; ++i) {
    const std::string l = StrCat(kLayers, i, ".mlp.");
    info.moe_layer.push_back(has(l + "router.weight"));
    if (!info.moe_layer.back()) {
      if (first >= 0 && dense_after < 0) dense_after = i;
      continue;
    }
    ++moe_layers;
    if (first < 0) first = i;
    if (has(l + "shared_experts.linear_fc1.weight")) ++shared;
    if (has(l + "shared_experts.gate_weight")) ++gated;
    if (has(l + "router.expert_bias")) ++biased;
  }
  if (moe_layers == 0) return info;
  info.first_moe = first;
  info.qk_norm =
      has(StrCat(kLayers, first, ".self_attention.q_layernorm.weight"));
  while (has(StrCat(kLayers, first, ".mlp.experts.", info.experts,
                    ".linear_fc1.weight")))
    ++info.experts;
  if (info.experts == 0)
    throw UsageError(where, ": layer ", first, " has a router but no expert 0");
  std::optional<int64_t> topk = Int(args, "moe_router_topk");
  if (!topk) topk = model.Find("moe_router_topk");
  if (!topk) {
    throw UsageError(where,
                     ": the router's top-k is not recorded in the source: "
                     "give --model-var moe_router_topk=K");
  }
  if (*topk < 1 || *topk > info.experts) {
    throw UsageError(where, ": moe_router_topk ", *topk, " is not in 1..",
                     info.experts, " (the experts of layer ", first, ")");
  }
  info.topk = *topk;
  // Without args (DCP), an expert bias says sigmoid: Megatron's softmax
  // router ignores the bias, DeepSeek-V3's aux-loss-free balancing needs it.
  // (the args, else what a transformers source recorded beside its
  // variables)
  std::optional<std::string> recorded_score =
      String(args, "moe_router_score_function");
  if (!recorded_score)
    recorded_score = String(other, "moe_router_score_function");
  const std::string score =
      recorded_score.value_or(biased > 0 ? "sigmoid" : "softmax");
  const int64_t groups =
      Int(args, "moe_router_num_groups")
          .value_or(model.Find("moe_router_num_groups").value_or(1));
  const int64_t group_topk =
      Int(args, "moe_router_group_topk")
          .value_or(model.Find("moe_router_group_topk").value_or(groups));
  const double scaling =
      Number(args, "moe_router_topk_scaling_factor")
          .value_or(
              Number(other, "moe_router_topk_scaling_factor").value_or(1.0));
  if (score == "sigmoid") {
    if (biased != moe_layers) {
      refuse(
          "a sigmoid router without an expert bias in every MoE layer "
          "(Glm4MoeForCausalLM's e_score_correction_bias)");
    }
    if (shared != moe_layers)
      refuse("a sigmoid router without shared experts in every MoE layer");
    if (gated > 0)
      refuse(
          "a gated shared expert (moe_shared_expert_gate) with a sigmoid "
          "router");
    if (dense_after >= 0) {
      refuse(StrCat("dense layer ", dense_after,
                    " after the first MoE layer (with a sigmoid router)"));
    }
    // Group-limited routing: transformers scores a group by its best two
    // experts, megatron-core by its best topk / group_topk.
    if (groups > 1 && group_topk < groups &&
        (info.topk / std::max<int64_t>(group_topk, 1) != 2 ||
         info.experts % groups != 0 || info.experts / groups < 2)) {
      refuse(StrCat("group-limited routing (moe_router_num_groups ", groups,
                    ", moe_router_group_topk ", group_topk,
                    ") that does not score a group by its best two experts"));
    }
    if (groups > 1 && group_topk < groups) {
      info.groups = groups;
      info.group_topk = group_topk;
    }
    info.arch = MoeArch::kGlm4Moe;
    info.norm_topk = info.topk > 1;  // Megatron normalizes when k > 1
    info.scaling = scaling;
    return info;
  }
  if (groups > 1)
    refuse(
        "group-limited routing (moe_router_num_groups) with a softmax router");
  if (score != "softmax")
    refuse(StrCat("a ", score, " router (moe_router_score_function)"));
  if (biased > 0)
    refuse(
        "an expert bias (moe_router_enable_expert_bias) with a softmax "
        "router");
  info.norm_topk = Int(args, "moe_router_pre_softmax").value_or(0) == 0;
  if (scaling != 1.0) {
    refuse(
        StrCat("scaled routing weights with a softmax router "
               "(moe_router_topk_scaling_factor ",
               scaling, ")"));
  }
  if (shared == 0 && info.qk_norm) {
    info.arch = MoeArch::kQwen3Moe;
  } else if (info.qk_norm) {
    refuse("QK layer norms with shared experts and a softmax router");
  } else if (shared == 0 && moe_layers == layers) {
    if (!info.norm_topk)
      refuse("unnormalized top-k weights (moe_router_pre_softmax)");
    info.arch = MoeArch::kMixtral;
  } else if (shared == moe_layers && gated == moe_layers) {
    info.arch = MoeArch::kQwen2Moe;
  } else if (shared == 0) {
    refuse("dense layers beside MoE layers without shared experts");
  } else if (shared != moe_layers) {
    refuse("shared experts in some MoE layers only");
  } else {
    refuse(
        "shared experts without a gate (moe_shared_expert_gate) with a "
        "softmax router");
  }
  return info;
}

// config.json's MoE fields.
void AddMoeConfig(json::Value& c, const MoeInfo& info,
                  const std::string& where) {
  c["num_experts_per_tok"] = info.topk;
  c["output_router_logits"] = false;
  if (info.arch == MoeArch::kMixtral) {
    c["num_local_experts"] = info.experts;
    c["sliding_window"] = json::Value();
    return;
  }
  c["moe_intermediate_size"] = info.expert_ffn;
  c["norm_topk_prob"] = info.norm_topk;
  if (c["intermediate_size"].AsInt() == 0)
    c["intermediate_size"] = info.expert_ffn;
  if (info.arch == MoeArch::kGlm4Moe) {
    if (info.expert_ffn <= 0 || info.shared_ffn % info.expert_ffn != 0) {
      throw UsageError(where, ": the shared experts' ffn ", info.shared_ffn,
                       " is not a multiple of the experts' ", info.expert_ffn,
                       " (Glm4MoeForCausalLM's n_shared_experts)");
    }
    c["n_routed_experts"] = info.experts;
    c["n_shared_experts"] = info.shared_ffn / info.expert_ffn;
    c["first_k_dense_replace"] = info.first_moe;
    c["routed_scaling_factor"] = info.scaling;
    c["n_group"] = info.groups;
    c["topk_group"] = info.group_topk;
    c["use_qk_norm"] = info.qk_norm;
    return;
  }
  c["num_experts"] = info.experts;
  if (info.arch == MoeArch::kQwen2Moe) {
    c["shared_expert_intermediate_size"] = info.shared_ffn;
    c["qkv_bias"] = false;
  } else {
    c["attention_bias"] = false;
  }
  c["decoder_sparse_step"] = 1;
  json::Value dense = json::Value::Array();
  for (size_t i = 0; i < info.moe_layer.size(); ++i)
    if (!info.moe_layer[i]) dense.Append(static_cast<int64_t>(i));
  c["mlp_only_layers"] = std::move(dense);
  c["use_sliding_window"] = false;
}

}  // namespace

namespace {

// LLaMA (`moe` absent: experts refused), or with experts (MoeOf): Mixtral
// (every layer MoE, no shared experts), Qwen2-MoE (shared experts with their
// gate, dense layers anywhere), Qwen3-MoE (QK norms, no shared experts, dense
// layers anywhere) or Glm4-MoE (DeepSeek-V3's sigmoid router with
// its expert bias, ungated shared experts, dense first layers). README.md.
// One mapper per export: Map() checks the model, maps every param to its
// transformers tensors (each must find its place) and writes config.json.
class DecoderMapper {
 public:
  DecoderMapper(const universal::UniversalInput& input, std::string_view flag,
                std::optional<HfExperts> moe)
      : input_(input),
        flag_(flag),
        moe_(moe),
        where_(StrCat(flag, ": ", input.path().string())),
        model_(formats::ModelVariables(input.model().variables)),
        args_(input.model().args) {
    for (const atoms::StoredParam& p : input.params())
      params_.emplace(p.info.fqn, &p);
  }

  HfModel Map() {
    CheckSupported();
    if (moe_) {
      info_ =
          MoeOf(args_, model_, input_.model().variables.other, where_, layers_,
                [&](const std::string& n) { return params_.count(n) > 0; });
    }
    // A dense model's QK norms (Megatron's qk_layernorm: Qwen3's q/k_norm);
    // the hf-llama map (no experts asked for) keeps refusing them.
    if (moe_ && info_.arch == MoeArch::kNone &&
        params_.count(StrCat(kLayers, 0, ".self_attention.q_layernorm.weight")))
      info_.qk_norm = true;
    if (Int(args_, "qk_layernorm").value_or(0) != 0 && !info_.qk_norm)
      Refuse("QK layer norms");
    model_name_ = ArchName(info_.arch);
    // Partial rotary embeddings: Glm4Moe's partial_rotary_factor.
    if (rotary_percent_ != 1.0 && info_.arch != MoeArch::kGlm4Moe) {
      Refuse(StrCat("partial rotary embeddings (rotary_percent ",
                    rotary_percent_, ")"));
    }
    const atoms::StoredParam& emb =
        Find({"embedding.word_embeddings.weight"}, 2);
    vocab_ = emb.info.shape[0];
    hidden_ = emb.info.shape[1];
    Whole("model.embed_tokens.weight", emb);
    for (int64_t i = 0; i < layers_; ++i) {
      const std::string l = StrCat(kLayers, i, ".");
      const std::string h = StrCat("model.layers.", i, ".");
      MapAttention(l, h);
      if (!moe_ || !info_.moe_layer[i]) {
        const std::string mlp = h + "mlp.";
        ffn_ = GateUp(Find({l + "mlp.linear_fc1.weight"}, 2),
                      mlp + "gate_proj.weight", mlp + "up_proj.weight");
        Whole(mlp + "down_proj.weight", Find({l + "mlp.linear_fc2.weight"}, 2));
      } else {
        MapMoeLayer(l, h);
      }
    }
    Whole("model.norm.weight", Find({"decoder.final_layernorm.weight"}, 1));
    if (!tied_) Whole("lm_head.weight", Find({"output_layer.weight"}, 2));
    for (const auto& [name, p] : params_) {
      if (p->info.kind == atoms::ParamKind::kParam && !used_.count(name) &&
          !(tied_ && name == "output_layer.weight")) {
        throw UsageError(where_, " > ", name, ": a param with no place in ",
                         model_name_);
      }
    }
    m_.config = Config();
    return std::move(m_);
  }

 private:
  [[noreturn]] void Refuse(const std::string& why) const {
    throw UsageError(where_, ": ", why,
                     ", which LlamaForCausalLM does not have");
  }

  // A Megatron-core GPTModel of LLaMA's shape (or a MoE one with experts),
  // with its head counts and layers known.
  void CheckSupported() {
    const std::string layout = SourceLayout(input_);
    const bool moe_layout =
        layout == "mcore-moe-mixtral" || layout == "mcore-moe-deepseek";
    if (!IsMcoreGpt(layout) && !(moe_ && moe_layout)) {
      throw UsageError(where_, " is not a Megatron-core GPTModel (layout '",
                       layout, "'; ", flag_,
                       " maps mcore-llama / mcore-gpt models as "
                       "LlamaForCausalLM)");
    }
    // mcore-llama's names are SwiGLU's and bias-free by the layout itself;
    // an mcore-gpt model says so in its variables.
    const bool llama = layout == "mcore-llama" || moe_layout;
    if (!llama && model_.Find("swiglu").value_or(0) != 1)
      Refuse("no SwiGLU (swiglu 0)");
    if (!llama && model_.Find("add_bias_linear").value_or(0) != 0)
      Refuse("linear biases (add_bias_linear)");
    if (auto n = String(args_, "normalization"); n && *n != "RMSNorm")
      Refuse(StrCat("normalization ", *n));
    if (auto p = String(args_, "position_embedding_type"); p && *p != "rope")
      Refuse(StrCat("position embeddings '", *p, "'"));
    if (Int(args_, "use_rope_scaling").value_or(0) != 0)
      Refuse("rope scaling (use_rope_scaling)");
    if (Int(args_, "rotary_interleaved").value_or(0) != 0)
      Refuse("interleaved rotary embeddings");
    // (the args, else what a transformers source recorded)
    rotary_percent_ =
        Number(args_, "rotary_percent")
            .value_or(Number(input_.model().variables.other, "rotary_percent")
                          .value_or(1.0));
    if (!moe_ && Int(args_, "qk_layernorm").value_or(0) != 0)
      Refuse("QK layer norms");
    if (!moe_ && Int(args_, "num_experts").value_or(0) > 0)
      Refuse("mixture of experts");
    const auto nq = model_.Find("num_attention_heads");
    const int64_t ng = model_.Find("num_query_groups").value_or(nq.value_or(0));
    const auto layers = model_.Find("num_layers");
    if (!nq || !layers || *nq <= 0 || ng <= 0 || *nq % ng != 0) {
      throw UsageError(where_,
                       ": the model's num_attention_heads / num_query_groups / "
                       "num_layers are not known");
    }
    nq_ = *nq;
    ng_ = ng;
    layers_ = *layers;
    tied_ = model_.Find("tied").value_or(0) != 0;
  }

  // The first of `names` the content has (rank-`rank`), marked used.
  const atoms::StoredParam& Find(std::initializer_list<std::string> names,
                                 size_t rank) {
    for (const std::string& n : names) {
      auto it = params_.find(n);
      if (it == params_.end()) continue;
      if (it->second->info.shape.size() != rank) {
        throw UsageError(where_, " > ", n, ": ", it->second->info.shape.size(),
                         " dims, expected ", rank);
      }
      used_[n] = true;
      return *it->second;
    }
    throw UsageError(where_, ": no ", *names.begin(), " (a ", model_name_,
                     " needs it)");
  }

  void Whole(const std::string& name, const atoms::StoredParam& p) {
    m_.tensors.push_back({name, p.info.fqn, p.info.shape, {}});
  }
  // Rows [begin, end) of 2-D param p as a whole tensor `name`.
  void RowRange(const std::string& name, const atoms::StoredParam& p,
                int64_t begin, int64_t end) {
    const int64_t cols = p.info.shape[1];
    HfTensor t{name, p.info.fqn, {end - begin, cols}, {}};
    t.pieces.push_back(
        {"", Rows(begin, end, cols), Rows(0, end - begin, cols)});
    m_.tensors.push_back(std::move(t));
  }
  // A SwiGLU fc1 [gate; up] as two tensors; returns the FFN size.
  int64_t GateUp(const atoms::StoredParam& fc1, const std::string& gate,
                 const std::string& up) {
    if (fc1.info.shape[0] % 2 != 0) {
      throw UsageError(where_, " > ", fc1.info.fqn, ": ", fc1.info.shape[0],
                       " rows, not [gate; up]");
    }
    const int64_t f = fc1.info.shape[0] / 2;
    RowRange(gate, fc1, 0, f);
    RowRange(up, fc1, f, 2 * f);
    return f;
  }

  // Norms, the fused QKV as q/k/v (query groups interleaved), QK norms, the
  // output projection, the pre-MLP norm of layer prefix `l` (HF prefix `h`).
  void MapAttention(const std::string& l, const std::string& h) {
    Whole(h + "input_layernorm.weight",
          Find({l + "input_layernorm.weight",
                l + "self_attention.linear_qkv.layer_norm_weight"},
               1));
    const atoms::StoredParam& qkv =
        Find({l + "self_attention.linear_qkv.weight"}, 2);
    const int64_t rows = qkv.info.shape[0];
    if (rows % (nq_ + 2 * ng_) != 0 || qkv.info.shape[1] != hidden_) {
      throw UsageError(where_, " > ", qkv.info.fqn, ": shape ",
                       ShapeString(qkv.info.shape), " is not [(", nq_,
                       " + 2 * ", ng_, ") * head dim, ", hidden_, "]");
    }
    const int64_t d = rows / (nq_ + 2 * ng_);
    head_dim_ = d;
    const int64_t r = nq_ / ng_;  // query heads per group
    HfTensor q{h + "self_attn.q_proj.weight", qkv.info.fqn, {nq_ * d, hidden_}};
    HfTensor k{h + "self_attn.k_proj.weight", qkv.info.fqn, {ng_ * d, hidden_}};
    HfTensor v{h + "self_attn.v_proj.weight", qkv.info.fqn, {ng_ * d, hidden_}};
    for (int64_t g = 0; g < ng_; ++g) {
      const int64_t at = g * (r + 2) * d;
      q.pieces.push_back({"", Rows(at, at + r * d, hidden_),
                          Rows(g * r * d, (g + 1) * r * d, hidden_)});
      k.pieces.push_back({"", Rows(at + r * d, at + (r + 1) * d, hidden_),
                          Rows(g * d, (g + 1) * d, hidden_)});
      v.pieces.push_back({"", Rows(at + (r + 1) * d, at + (r + 2) * d, hidden_),
                          Rows(g * d, (g + 1) * d, hidden_)});
    }
    m_.tensors.push_back(std::move(q));
    m_.tensors.push_back(std::move(k));
    m_.tensors.push_back(std::move(v));
    // The fused QKV's bias (add_qkv_bias: Qwen2's q/k/v biases), split alike.
    if ((info_.arch == MoeArch::kNone || info_.arch == MoeArch::kGlm4Moe) &&
        params_.count(l + "self_attention.linear_qkv.bias")) {
      const atoms::StoredParam& b =
          Find({l + "self_attention.linear_qkv.bias"}, 1);
      if (b.info.shape[0] != rows) {
        throw UsageError(where_, " > ", b.info.fqn, ": shape ",
                         ShapeString(b.info.shape), ", the weight's rows are ",
                         rows);
      }
      auto span = [](int64_t begin, int64_t end) {
        Box x;
        x.offset = {begin};
        x.size = {end - begin};
        return x;
      };
      HfTensor qb{h + "self_attn.q_proj.bias", b.info.fqn, {nq_ * d}};
      HfTensor kb{h + "self_attn.k_proj.bias", b.info.fqn, {ng_ * d}};
      HfTensor vb{h + "self_attn.v_proj.bias", b.info.fqn, {ng_ * d}};
      for (int64_t g = 0; g < ng_; ++g) {
        const int64_t at = g * (r + 2) * d;
        qb.pieces.push_back(
            {"", span(at, at + r * d), span(g * r * d, (g + 1) * r * d)});
        kb.pieces.push_back(
            {"", span(at + r * d, at + (r + 1) * d), span(g * d, (g + 1) * d)});
        vb.pieces.push_back({"", span(at + (r + 1) * d, at + (r + 2) * d),
                             span(g * d, (g + 1) * d)});
      }
      m_.tensors.push_back(std::move(qb));
      m_.tensors.push_back(std::move(kb));
      m_.tensors.push_back(std::move(vb));
      qkv_bias_ = true;
    }
    if (info_.qk_norm) {
      Whole(h + "self_attn.q_norm.weight",
            Find({l + "self_attention.q_layernorm.weight"}, 1));
      Whole(h + "self_attn.k_norm.weight",
            Find({l + "self_attention.k_layernorm.weight"}, 1));
    }
    Whole(h + "self_attn.o_proj.weight",
          Find({l + "self_attention.linear_proj.weight"}, 2));
    Whole(h + "post_attention_layernorm.weight",
          Find({l + "pre_mlp_layernorm.weight",
                l + "mlp.linear_fc1.layer_norm_weight"},
               1));
  }

  // A MoE layer: the router (and Glm4-MoE's expert bias), the experts, the
  // shared experts.
  void MapMoeLayer(const std::string& l, const std::string& h) {
    const bool mixtral = info_.arch == MoeArch::kMixtral;
    // Mixtral's own (v4) names: block_sparse_moe.{gate, experts.j.w1/w3/w2}.
    const std::string mlp =
        h + (mixtral && *moe_ == HfExperts::kPerExpert ? "block_sparse_moe."
                                                       : "mlp.");
    const atoms::StoredParam& router = Find({l + "mlp.router.weight"}, 2);
    if (router.info.shape != Shape{info_.experts, hidden_}) {
      throw UsageError(where_, " > ", router.info.fqn, ": shape ",
                       ShapeString(router.info.shape), ", expected [",
                       info_.experts, ", ", hidden_, "]");
    }
    Whole(mlp + "gate.weight", router);
    if (info_.arch == MoeArch::kGlm4Moe) {
      Whole(mlp + "gate.e_score_correction_bias",
            Find({l + "mlp.router.expert_bias"}, 1));
      m_.tensors.back().fp32 = true;
    }
    MapExperts(l, mlp, mixtral);
    const std::string s = l + "mlp.shared_experts.";
    if (info_.arch == MoeArch::kQwen2Moe) {
      info_.shared_ffn = GateUp(Find({s + "linear_fc1.weight"}, 2),
                                mlp + "shared_expert.gate_proj.weight",
                                mlp + "shared_expert.up_proj.weight");
      Whole(mlp + "shared_expert.down_proj.weight",
            Find({s + "linear_fc2.weight"}, 2));
      Whole(mlp + "shared_expert_gate.weight", Find({s + "gate_weight"}, 2));
    } else if (info_.arch == MoeArch::kGlm4Moe) {
      info_.shared_ffn = GateUp(Find({s + "linear_fc1.weight"}, 2),
                                mlp + "shared_experts.gate_proj.weight",
                                mlp + "shared_experts.up_proj.weight");
      Whole(mlp + "shared_experts.down_proj.weight",
            Find({s + "linear_fc2.weight"}, 2));
    }
  }

  // Every expert of layer prefix `l`, like expert 0, per expert or fused.
  void MapExperts(const std::string& l, const std::string& mlp, bool mixtral) {
    std::vector<const atoms::StoredParam*> fc1s, fc2s;
    for (int64_t e = 0; e < info_.experts; ++e) {
      const std::string x = StrCat(l, "mlp.experts.", e, ".");
      fc1s.push_back(&Find({x + "linear_fc1.weight"}, 2));
      fc2s.push_back(&Find({x + "linear_fc2.weight"}, 2));
      if (fc1s[e]->info.shape != fc1s[0]->info.shape ||
          fc2s[e]->info.shape != fc2s[0]->info.shape ||
          fc1s[e]->info.shape[0] % 2 != 0 ||
          fc1s[e]->info.shape[1] != hidden_ ||
          fc2s[e]->info.shape !=
              Shape{fc1s[0]->info.shape[1], fc1s[0]->info.shape[0] / 2}) {
        throw UsageError(where_, " > ", fc1s[e]->info.fqn, " ",
                         ShapeString(fc1s[e]->info.shape), ", ",
                         fc2s[e]->info.fqn, " ",
                         ShapeString(fc2s[e]->info.shape),
                         ": not a SwiGLU expert like expert 0's");
      }
    }
    const int64_t f = fc1s[0]->info.shape[0] / 2;
    info_.expert_ffn = f;
    if (*moe_ == HfExperts::kFused) {
      HfTensor gu{mlp + "experts.gate_up_proj",
                  fc1s[0]->info.fqn,
                  {info_.experts, 2 * f, hidden_}};
      HfTensor down{mlp + "experts.down_proj",
                    fc2s[0]->info.fqn,
                    {info_.experts, hidden_, f}};
      for (int64_t e = 0; e < info_.experts; ++e) {
        const Shape s1 = fc1s[e]->info.shape, s2 = fc2s[e]->info.shape;
        gu.pieces.push_back({fc1s[e]->info.fqn, Box::Whole(s1), Box::Whole(s1),
                             e * NumElements(s1), s1});
        down.pieces.push_back({fc2s[e]->info.fqn, Box::Whole(s2),
                               Box::Whole(s2), e * NumElements(s2), s2});
      }
      m_.tensors.push_back(std::move(gu));
      m_.tensors.push_back(std::move(down));
      return;
    }
    for (int64_t e = 0; e < info_.experts; ++e) {
      const std::string x = StrCat(mlp, "experts.", e, ".");
      if (mixtral) {
        GateUp(*fc1s[e], x + "w1.weight", x + "w3.weight");
        Whole(x + "w2.weight", *fc2s[e]);
      } else {
        GateUp(*fc1s[e], x + "gate_proj.weight", x + "up_proj.weight");
        Whole(x + "down_proj.weight", *fc2s[e]);
      }
    }
  }

  // config.json.
  json::Value Config() {
    json::Value c = json::Value::Object();
    json::Value arch = json::Value::Array();
    const char* type = "llama";
    int64_t ffn = ffn_;
    if (moe_ && info_.arch == MoeArch::kMixtral) {
      type = "mixtral";
      ffn = info_.expert_ffn;  // Mixtral's intermediate_size is the experts'
    } else if (moe_ && info_.arch == MoeArch::kQwen3Moe) {
      type = "qwen3_moe";
    } else if (moe_ && info_.arch == MoeArch::kQwen2Moe) {
      type = "qwen2_moe";
    } else if (moe_ && info_.arch == MoeArch::kGlm4Moe) {
      type = "glm4_moe";
    }
    // q/k/v biases without an output projection bias: Qwen2's attention
    // (LLaMA's attention_bias biases o_proj too); QK norms: Qwen3's.
    if (info_.arch == MoeArch::kNone && info_.qk_norm) {
      if (qkv_bias_) Refuse("q/k/v biases with QK layer norms");
      type = "qwen3";
      arch.Append("Qwen3ForCausalLM");
    } else if (qkv_bias_ && info_.arch == MoeArch::kNone) {
      type = "qwen2";
      arch.Append("Qwen2ForCausalLM");
    } else {
      arch.Append(ArchName(info_.arch));
    }
    c["architectures"] = std::move(arch);
    c["model_type"] = type;
    c["hidden_size"] = hidden_;
    c["intermediate_size"] = ffn;
    c["num_hidden_layers"] = layers_;
    c["num_attention_heads"] = nq_;
    c["num_key_value_heads"] = ng_;
    c["head_dim"] = head_dim_;
    c["vocab_size"] = vocab_;
    c["hidden_act"] = "silu";
    // Megatron's args, else what the source recorded beside its variables
    // (a transformers folder's config.json).
    const json::Value& other = input_.model().variables.other;
    c["rms_norm_eps"] =
        Number(args_, "norm_epsilon")
            .value_or(Number(other, "norm_epsilon").value_or(1e-5));
    c["rope_theta"] =
        Number(args_, "rotary_base")
            .value_or(Number(other, "rotary_base").value_or(10000.0));
    c["max_position_embeddings"] =
        Int(args_, "max_position_embeddings")
            .value_or(
                Int(args_, "seq_length")
                    .value_or(
                        model_.Find("max_position_embeddings").value_or(4096)));
    c["tie_word_embeddings"] = tied_;
    if (moe_ && info_.arch != MoeArch::kNone) {
      AddMoeConfig(c, info_, where_);
      if (info_.arch == MoeArch::kGlm4Moe) {
        // q/k/v biases (o_proj has none in Glm4MoeAttention)
        c["attention_bias"] = qkv_bias_;
        c["partial_rotary_factor"] = rotary_percent_;
      }
    } else {
      if (!qkv_bias_) c["attention_bias"] = false;
      if (info_.qk_norm) c["attention_bias"] = false;
      c["mlp_bias"] = false;
    }
    return c;
  }

  const universal::UniversalInput& input_;
  std::string_view flag_;
  std::optional<HfExperts> moe_;
  std::string where_;
  layouts::Variables model_;
  // The Megatron args object, as the source's reader recorded it.
  const json::Value& args_;
  std::map<std::string, const atoms::StoredParam*, std::less<>> params_;
  std::map<std::string, bool, std::less<>> used_;
  std::string model_name_ = "LlamaForCausalLM";
  MoeInfo info_;
  HfModel m_;
  int64_t nq_ = 0, ng_ = 0, layers_ = 0, hidden_ = 0, vocab_ = 0;
  int64_t head_dim_ = 0, ffn_ = 0;
  bool tied_ = false;
  bool qkv_bias_ = false;  // Qwen2ForCausalLM (or Glm4Moe's attention_bias)
  double rotary_percent_ = 1.0;  // Glm4Moe's partial_rotary_factor
};

}  // namespace

HfModel MapToHfLlama(const universal::UniversalInput& input,
                     std::string_view flag) {
  return DecoderMapper(input, flag, std::nullopt).Map();
}

HfModel MapToHf(const universal::UniversalInput& input, HfExperts experts,
                std::string_view flag) {
  return DecoderMapper(input, flag, experts).Map();
}

std::optional<std::vector<universal::MappedParam>> HfLlamaParams(
    const universal::UniversalInput& input, std::string_view flag) {
  if (!IsMcoreGpt(SourceLayout(input))) return std::nullopt;
  std::vector<universal::MappedParam> out;
  for (HfTensor& t : MapToHfLlama(input, flag).tensors) {
    universal::MappedParam m;
    m.info.fqn = std::move(t.name);
    m.info.shape = std::move(t.shape);
    if (t.pieces.empty()) {
      m.pieces.push_back(
          {t.param, Box::Whole(m.info.shape), Box::Whole(m.info.shape)});
    }
    for (HfPiece& p : t.pieces)
      m.pieces.push_back({p.param.empty() ? t.param : std::move(p.param),
                          std::move(p.src), std::move(p.dst)});
    out.push_back(std::move(m));
  }
  return out;
}

namespace {

// Megatron's linear_qkv from transformers' q / k / v_proj rows, joined per
// query group ([q_g; k_g; v_g] for each of the `ng` groups), and its bias from
// the q / k / v biases likewise when the source has them (Qwen2). `find`
// returns the source param of a transformers name (marking it used) or throws
// UsageError; so does a shape that is not q / k / v rows of `ng` groups.
void AppendFusedQkv(
    const std::string& h, const std::string& l, int64_t ng,
    const std::string& where,
    const std::function<const atoms::StoredParam&(const std::string&, size_t)>&
        find,
    bool has_bias, std::vector<universal::MappedParam>& out) {
  const atoms::StoredParam& q = find(h + "self_attn.q_proj.weight", 2);
  const atoms::StoredParam& k = find(h + "self_attn.k_proj.weight", 2);
  const atoms::StoredParam& v = find(h + "self_attn.v_proj.weight", 2);
  const int64_t hidden = q.info.shape[1];
  const int64_t nq = q.info.shape[0], nk = k.info.shape[0];
  if (nq % ng != 0 || nk % ng != 0 || v.info.shape != k.info.shape ||
      k.info.shape[1] != hidden) {
    throw UsageError(where, " > ", q.info.fqn, " ", ShapeString(q.info.shape),
                     ", ", k.info.fqn, " ", ShapeString(k.info.shape), ", ",
                     v.info.fqn, " ", ShapeString(v.info.shape),
                     ": not query / key / value rows of ", ng, " groups");
  }
  const int64_t qg = nq / ng, kg = nk / ng;  // rows per group
  universal::MappedParam qkv;
  qkv.info.fqn = l + "self_attention.linear_qkv.weight";
  qkv.info.shape = {nq + 2 * nk, hidden};
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t at = g * (qg + 2 * kg);
    qkv.pieces.push_back({q.info.fqn, Rows(g * qg, (g + 1) * qg, hidden),
                          Rows(at, at + qg, hidden)});
    qkv.pieces.push_back({k.info.fqn, Rows(g * kg, (g + 1) * kg, hidden),
                          Rows(at + qg, at + qg + kg, hidden)});
    qkv.pieces.push_back({v.info.fqn, Rows(g * kg, (g + 1) * kg, hidden),
                          Rows(at + qg + kg, at + qg + 2 * kg, hidden)});
  }
  out.push_back(std::move(qkv));
  // Query / key / value biases (Qwen2): joined per query group likewise.
  if (has_bias) {
    const atoms::StoredParam& qb = find(h + "self_attn.q_proj.bias", 1);
    const atoms::StoredParam& kb = find(h + "self_attn.k_proj.bias", 1);
    const atoms::StoredParam& vb = find(h + "self_attn.v_proj.bias", 1);
    if (qb.info.shape[0] != nq || kb.info.shape[0] != nk ||
        vb.info.shape[0] != nk) {
      throw UsageError(
          where, " > ", qb.info.fqn, " ", ShapeString(qb.info.shape), ", ",
          kb.info.fqn, " ", ShapeString(kb.info.shape), ", ", vb.info.fqn, " ",
          ShapeString(vb.info.shape), ": not the biases of the q / k / v rows");
    }
    universal::MappedParam bias;
    bias.info.fqn = l + "self_attention.linear_qkv.bias";
    bias.info.shape = {nq + 2 * nk};
    auto span = [](int64_t begin, int64_t end) {
      Box b;
      b.offset = {begin};
      b.size = {end - begin};
      return b;
    };
    for (int64_t g = 0; g < ng; ++g) {
      const int64_t at = g * (qg + 2 * kg);
      bias.pieces.push_back(
          {qb.info.fqn, span(g * qg, (g + 1) * qg), span(at, at + qg)});
      bias.pieces.push_back({kb.info.fqn, span(g * kg, (g + 1) * kg),
                             span(at + qg, at + qg + kg)});
      bias.pieces.push_back({vb.info.fqn, span(g * kg, (g + 1) * kg),
                             span(at + qg + kg, at + qg + 2 * kg)});
    }
    out.push_back(std::move(bias));
  }
}

}  // namespace

std::optional<std::vector<universal::MappedParam>> McoreLlamaFromHf(
    const universal::UniversalInput& input,
    const std::function<std::string(const std::string&)>& hf_name,
    const layouts::Variables& given, std::string_view flag) {
  const std::string where = StrCat(flag, ": ", input.path().string());
  std::map<std::string, const atoms::StoredParam*, std::less<>> by_hf;
  for (const atoms::StoredParam& p : input.params())
    if (p.info.kind == atoms::ParamKind::kParam)
      by_hf[hf_name(p.info.fqn)] = &p;
  if (!by_hf.count("model.embed_tokens.weight") ||
      !by_hf.count("model.layers.0.self_attn.q_proj.weight"))
    return std::nullopt;
  // --model-var first, then what the source records (a transformers folder:
  // its key / value heads).
  const layouts::Variables recorded =
      formats::ModelVariables(input.model().variables);
  std::optional<int64_t> groups = given.Find("num_query_groups");
  if (!groups) groups = recorded.Find("num_query_groups");
  if (!groups) groups = given.Find("num_attention_heads");
  if (!groups) groups = recorded.Find("num_attention_heads");
  if (!groups || *groups < 1) {
    throw UsageError(where,
                     ": the query groups of the attention are not recorded "
                     "in the source: give --model-var num_query_groups=N "
                     "(and num_attention_heads=N)");
  }
  const int64_t ng = *groups;
  std::map<std::string, bool, std::less<>> used;
  auto find = [&](const std::string& hf,
                  size_t rank) -> const atoms::StoredParam& {
    auto it = by_hf.find(hf);
    if (it == by_hf.end())
      throw UsageError(where, ": no ", hf, " (a LLaMA needs it)");
    if (it->second->info.shape.size() != rank) {
      throw UsageError(where, " > ", it->second->info.fqn, ": ",
                       it->second->info.shape.size(), " dims, expected ", rank);
    }
    used[hf] = true;
    return *it->second;
  };
  std::vector<universal::MappedParam> out;
  auto whole = [&](std::string name, const atoms::StoredParam& p) {
    out.push_back(universal::WholeParam(p, std::move(name)));
  };
  whole("embedding.word_embeddings.weight",
        find("model.embed_tokens.weight", 2));
  for (int64_t i = 0;
       by_hf.count(StrCat("model.layers.", i, ".self_attn.q_proj.weight"));
       ++i) {
    const std::string h = StrCat("model.layers.", i, ".");
    const std::string l = StrCat(kLayers, i, ".");
    whole(l + "self_attention.linear_qkv.layer_norm_weight",
          find(h + "input_layernorm.weight", 1));
    AppendFusedQkv(h, l, ng, where, find,
                   by_hf.count(h + "self_attn.q_proj.bias") > 0, out);
    // QK norms (Qwen3's q/k_norm: RMSNorm over each head's dim, before the
    // rotary embedding, as Megatron's qk_layernorm).
    if (by_hf.count(h + "self_attn.q_norm.weight")) {
      whole(l + "self_attention.q_layernorm.weight",
            find(h + "self_attn.q_norm.weight", 1));
      whole(l + "self_attention.k_layernorm.weight",
            find(h + "self_attn.k_norm.weight", 1));
    }
    whole(l + "self_attention.linear_proj.weight",
          find(h + "self_attn.o_proj.weight", 2));
    // [gate; up] of two transformers tensors as one fc1.
    auto gate_up = [&](const std::string& fqn, const std::string& gate_name,
                       const std::string& up_name) {
      const atoms::StoredParam& gate = find(gate_name, 2);
      const atoms::StoredParam& up = find(up_name, 2);
      if (gate.info.shape != up.info.shape) {
        throw UsageError(where, " > ", gate.info.fqn, " ",
                         ShapeString(gate.info.shape), " and ", up.info.fqn,
                         " ", ShapeString(up.info.shape), " differ");
      }
      const int64_t ffn = gate.info.shape[0], cols = gate.info.shape[1];
      universal::MappedParam fc1;
      fc1.info.fqn = fqn;
      fc1.info.shape = {2 * ffn, cols};
      fc1.pieces.push_back(
          {gate.info.fqn, Rows(0, ffn, cols), Rows(0, ffn, cols)});
      fc1.pieces.push_back(
          {up.info.fqn, Rows(0, ffn, cols), Rows(ffn, 2 * ffn, cols)});
      out.push_back(std::move(fc1));
    };
    const std::string moe = h + "block_sparse_moe.";
    if (by_hf.count(moe + "gate.weight")) {
      // Mixtral's sparse MoE block (layout mcore-moe-mixtral): the router,
      // each expert's w1 / w3 as [gate; up], w2 as fc2; the MoE layer's norm
      // is pre_mlp_layernorm (no fc1 to fuse it into).
      whole(l + "pre_mlp_layernorm.weight",
            find(h + "post_attention_layernorm.weight", 1));
      whole(l + "mlp.router.weight", find(moe + "gate.weight", 2));
      int64_t e = 0;
      for (; by_hf.count(StrCat(moe, "experts.", e, ".w1.weight")); ++e) {
        const std::string x = StrCat(moe, "experts.", e, ".");
        const std::string m = StrCat(l, "mlp.experts.", e, ".");
        gate_up(m + "linear_fc1.weight", x + "w1.weight", x + "w3.weight");
        whole(m + "linear_fc2.weight", find(x + "w2.weight", 2));
      }
      if (e == 0)
        throw UsageError(where, ": ", moe, "gate.weight but no expert 0");
      continue;
    }
    if (by_hf.count(h + "mlp.gate.weight")) {
      // Qwen3-MoE's sparse block (layouts mcore-moe-mixtral /
      // mcore-moe-deepseek): the router, each expert's gate / up as
      // [gate; up], down as fc2.
      whole(l + "pre_mlp_layernorm.weight",
            find(h + "post_attention_layernorm.weight", 1));
      whole(l + "mlp.router.weight", find(h + "mlp.gate.weight", 2));
      // DeepSeek-V3's / GLM-4-MoE's expert bias (aux-loss-free balancing).
      if (by_hf.count(h + "mlp.gate.e_score_correction_bias")) {
        whole(l + "mlp.router.expert_bias",
              find(h + "mlp.gate.e_score_correction_bias", 1));
      }
      int64_t e = 0;
      for (; by_hf.count(StrCat(h, "mlp.experts.", e, ".gate_proj.weight"));
           ++e) {
        const std::string x = StrCat(h, "mlp.experts.", e, ".");
        const std::string m = StrCat(l, "mlp.experts.", e, ".");
        gate_up(m + "linear_fc1.weight", x + "gate_proj.weight",
                x + "up_proj.weight");
        whole(m + "linear_fc2.weight", find(x + "down_proj.weight", 2));
      }
      if (e == 0)
        throw UsageError(where, ": ", h, "mlp.gate.weight but no expert 0");
      // Shared experts: Qwen2-MoE's `shared_expert` (with its sigmoid gate
      // below), DeepSeek-V3's / GLM-4-MoE's ungated `shared_experts`.
      for (const char* shared : {"mlp.shared_expert.", "mlp.shared_experts."}) {
        const std::string x = h + shared;
        if (!by_hf.count(x + "gate_proj.weight")) continue;
        gate_up(l + "mlp.shared_experts.linear_fc1.weight",
                x + "gate_proj.weight", x + "up_proj.weight");
        whole(l + "mlp.shared_experts.linear_fc2.weight",
              find(x + "down_proj.weight", 2));
      }
      if (by_hf.count(h + "mlp.shared_expert.gate_proj.weight") &&
          by_hf.count(h + "mlp.shared_expert_gate.weight")) {
        whole(l + "mlp.shared_experts.gate_weight",
              find(h + "mlp.shared_expert_gate.weight", 2));
      }
      continue;
    }
    whole(l + "mlp.linear_fc1.layer_norm_weight",
          find(h + "post_attention_layernorm.weight", 1));
    gate_up(l + "mlp.linear_fc1.weight", h + "mlp.gate_proj.weight",
            h + "mlp.up_proj.weight");
    whole(l + "mlp.linear_fc2.weight", find(h + "mlp.down_proj.weight", 2));
  }
  whole("decoder.final_layernorm.weight", find("model.norm.weight", 1));
  if (by_hf.count("lm_head.weight"))
    whole("output_layer.weight", find("lm_head.weight", 2));
  for (const auto& [hf, p] : by_hf) {
    if (!used.count(hf)) {
      throw UsageError(where, " > ", p->info.fqn,
                       ": a param with no place in a Megatron-core LLaMA "
                       "(mcore-llama)");
    }
  }
  return out;
}

UCP_REGISTER_NAME_MAP(mcore_llama_from_hf,
                      {"mcore-llama", "transformers' LlamaForCausalLM names",
                       [](const universal::UniversalInput& input,
                          const layouts::Variables& given) {
                         return McoreLlamaFromHf(
                             input, [](const std::string& n) { return n; },
                             given, "--names mcore-llama");
                       },
                       "mcore-llama"});

UCP_REGISTER_NAME_MAP(hf_llama_from_mcore,
                      {"hf-llama",
                       "a Megatron-core GPTModel (layouts mcore-llama, "
                       "mcore-gpt) with LLaMA's blocks",
                       [](const universal::UniversalInput& input,
                          const layouts::Variables&) {
                         return HfLlamaParams(input, "--names hf-llama");
                       },
                       ""});

}  // namespace ucp::names
