// Reading a transformers model folder into a universal SourcePlan (hf.h):
// every tensor the architecture has, checked against config.json, streamed
// from its safetensors file at its offset (nothing is loaded whole).

#include <algorithm>
#include <charconv>
#include <map>
#include <string_view>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/source_table.h"
#include "engine/formats/hf/hf.h"

namespace ucp::hf {
namespace {

namespace fs = std::filesystem;

// The bytes of one safetensors file (tensors at their file offsets).
class SafetensorsSource : public reshape::ByteSource {
 public:
  explicit SafetensorsSource(fs::path path)
      : path_(std::move(path)), file_(File::OpenRead(path_)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    file_.ReadExact(dst.data(), dst.size(), offset);
  }
  std::string Describe() const override {
    return StrCat("safetensors file ", path_.string());
  }
  std::optional<FileLocation> Locate(uint64_t offset) const override {
    return FileLocation{&file_, offset};
  }

 private:
  fs::path path_;
  File file_;
};

// Zeros, for fresh optimizer state (--init-optimizer).
class ZeroSource : public reshape::ByteSource {
 public:
  void Read(uint64_t, std::span<std::byte> dst) const override {
    std::fill(dst.begin(), dst.end(), std::byte{0});
  }
  std::string Describe() const override {
    return "fresh optimizer state (--init-optimizer: zeros)";
  }
};

// --init-optimizer (hf.h PlanSource): Adam's moments as float32 zeros and a
// float32 master copy of every bf16 / fp16 weight, in one param group, step 0.
void AddFreshOptimizer(universal::SourcePlan& plan) {
  const auto zeros = static_cast<uint32_t>(plan.sources.size());
  plan.sources.push_back(std::make_unique<ZeroSource>());
  std::vector<universal::AtomPlan> state;
  universal::ParamGroup group;
  group.params.emplace();
  // torch.optim.Adam's other settings, at their defaults (the group a job's
  // torch.optim.Adam state dict has, every key of which dcp.load asks for);
  // lr, betas, eps and weight_decay are left to the target (its defaults,
  // with a note).
  for (const char* flag : {"amsgrad", "maximize", "capturable",
                           "differentiable", "decoupled_weight_decay"})
    group.Set(flag, json::Value(false));
  for (const char* unset : {"foreach", "fused"})
    group.Set(unset, json::Value());
  for (const universal::AtomPlan& a : plan.atoms) {
    // (a buffer of the router, without optimizer state in Megatron too)
    if (a.param.ends_with(".e_score_correction_bias")) continue;
    group.params->push_back(a.param);
    if (a.dtype != DType::kFloat32) {  // the master copy of the weight
      universal::AtomPlan master = a;
      master.state_kind = "fp32";
      master.dtype = DType::kFloat32;
      state.push_back(std::move(master));
    }
    for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
      universal::AtomPlan m;
      m.param = a.param;
      m.state_kind = kind;
      m.dtype = DType::kFloat32;
      m.shape = a.shape;
      universal::Fragment fr;
      fr.src.source = zeros;
      fr.src.byte_offset = 0;
      fr.src.dtype = DType::kFloat32;
      fr.src.shape = a.shape;
      fr.src_box = Box::Whole(a.shape);
      fr.atom_box = Box::Whole(a.shape);
      fr.where = StrCat("--init-optimizer: ", a.param, " ", kind);
      m.fragments.push_back(std::move(fr));
      state.push_back(std::move(m));
    }
  }
  for (universal::AtomPlan& a : state) plan.atoms.push_back(std::move(a));
  universal::OptimizerInfo& opt = plan.model.optimizer;
  opt.type = "adam";
  opt.groups.emplace().push_back(std::move(group));
  opt.state_kinds = std::vector<std::string>{"exp_avg", "exp_avg_sq"};
  opt.step = 0;
}

// A tensor the architecture has: its name and the shape config.json gives.
struct Expected {
  std::string name;
  Shape shape;
};

// The tensors of `c`'s architecture in module order (transformers'
// state-dict order), the tied model's lm_head left out.
std::vector<Expected> ExpectedTensors(const ModelConfig& c) {
  const int64_t h = c.hidden, q = c.heads * c.head_dim,
                kv = c.kv_heads * c.head_dim;
  std::vector<Expected> out;
  out.push_back({"model.embed_tokens.weight", {c.vocab, h}});
  for (int64_t i = 0; i < c.layers; ++i) {
    const std::string l = StrCat("model.layers.", i, ".");
    out.push_back({l + "self_attn.q_proj.weight", {q, h}});
    if (c.qkv_bias) out.push_back({l + "self_attn.q_proj.bias", {q}});
    out.push_back({l + "self_attn.k_proj.weight", {kv, h}});
    if (c.qkv_bias) out.push_back({l + "self_attn.k_proj.bias", {kv}});
    out.push_back({l + "self_attn.v_proj.weight", {kv, h}});
    if (c.qkv_bias) out.push_back({l + "self_attn.v_proj.bias", {kv}});
    if (c.qk_norm) {
      out.push_back({l + "self_attn.q_norm.weight", {c.head_dim}});
      out.push_back({l + "self_attn.k_norm.weight", {c.head_dim}});
    }
    out.push_back({l + "self_attn.o_proj.weight", {h, q}});
    if (c.moe_layer[static_cast<size_t>(i)] && c.model_type == "mixtral") {
      const std::string m = l + "block_sparse_moe.";
      out.push_back({m + "gate.weight", {c.experts, h}});
      for (int64_t j = 0; j < c.experts; ++j) {
        const std::string x = StrCat(m, "experts.", j, ".");
        out.push_back({x + "w1.weight", {c.moe_ffn, h}});
        out.push_back({x + "w2.weight", {h, c.moe_ffn}});
        out.push_back({x + "w3.weight", {c.moe_ffn, h}});
      }
    } else if (c.moe_layer[static_cast<size_t>(i)]) {  // Qwen3-MoE's
      out.push_back({l + "mlp.gate.weight", {c.experts, h}});
      if (c.sigmoid_router)  // Glm4-MoE's score-correction bias
        out.push_back({l + "mlp.gate.e_score_correction_bias", {c.experts}});
      for (int64_t j = 0; j < c.experts; ++j) {
        const std::string x = StrCat(l, "mlp.experts.", j, ".");
        out.push_back({x + "gate_proj.weight", {c.moe_ffn, h}});
        out.push_back({x + "up_proj.weight", {c.moe_ffn, h}});
        out.push_back({x + "down_proj.weight", {h, c.moe_ffn}});
      }
      if (c.shared_ffn > 0 && c.sigmoid_router) {  // Glm4-MoE's, ungated
        const std::string x = l + "mlp.shared_experts.";
        out.push_back({x + "gate_proj.weight", {c.shared_ffn, h}});
        out.push_back({x + "up_proj.weight", {c.shared_ffn, h}});
        out.push_back({x + "down_proj.weight", {h, c.shared_ffn}});
      } else if (c.shared_ffn > 0) {  // Qwen2-MoE's gated shared expert
        const std::string x = l + "mlp.shared_expert.";
        out.push_back({x + "gate_proj.weight", {c.shared_ffn, h}});
        out.push_back({x + "up_proj.weight", {c.shared_ffn, h}});
        out.push_back({x + "down_proj.weight", {h, c.shared_ffn}});
        out.push_back({l + "mlp.shared_expert_gate.weight", {1, h}});
      }
    } else {
      out.push_back({l + "mlp.gate_proj.weight", {c.ffn, h}});
      out.push_back({l + "mlp.up_proj.weight", {c.ffn, h}});
      out.push_back({l + "mlp.down_proj.weight", {h, c.ffn}});
    }
    out.push_back({l + "input_layernorm.weight", {h}});
    out.push_back({l + "post_attention_layernorm.weight", {h}});
  }
  out.push_back({"model.norm.weight", {h}});
  if (!c.tied) out.push_back({"lm_head.weight", {c.vocab, h}});
  return out;
}

// The config's sizes, for messages.
std::string Sizes(const ModelConfig& c) {
  return StrCat("config.json: hidden_size ", c.hidden, ", num_attention_heads ",
                c.heads, ", num_key_value_heads ", c.kv_heads, ", head_dim ",
                c.head_dim, ", intermediate_size ", c.ffn, ", vocab_size ",
                c.vocab);
}

void SetVariable(universal::ModelInfo& m, const char* name, int64_t value,
                 bool is_bool = false) {
  m.Set(name, value);
  if (is_bool) {
    for (universal::ModelVariable& v : m.variables)
      if (v.name == name) v.is_bool = true;
  }
}

// Where a tensor lies: its file and header entry.
struct Located {
  size_t file = 0;
  const formats::SafetensorsTensor* tensor = nullptr;
  size_t index = 0;  // in the file's tensors
};

// Whether `name` is a tensor of Glm4-MoE's multi-token-prediction layers
// (model.layers.N with N in [num_hidden_layers, + num_nextn_predict_layers)),
// which GLM-4.5's own files hold and transformers ignores on load.
bool IsMtpLayer(const ModelConfig& c, const std::string& name) {
  const json::Value* n = c.json.Find("num_nextn_predict_layers");
  if (c.model_type != "glm4_moe" || n == nullptr || !n->is_int()) return false;
  const std::string_view prefix = "model.layers.";
  if (!name.starts_with(prefix)) return false;
  int64_t layer = 0;
  const char* begin = name.data() + prefix.size();
  const auto [end, ec] =
      std::from_chars(begin, name.data() + name.size(), layer);
  return ec == std::errc() && end != begin && *end == '.' &&
         layer >= c.layers && layer < c.layers + n->AsInt();
}

// Glm4-MoE's router and rotary settings under Megatron's names (hf.h,
// ReadGlm4Moe): the sigmoid score function, the expert bias, the scaling
// factor, the groups; the dense first layers for the layout
// (mcore-moe-deepseek's moe_first_dense_layers, moe_layer_freq).
void SetRouterVariables(const ModelConfig& c, universal::ModelInfo& vars) {
  SetVariable(vars, "moe_router_enable_expert_bias", 1, true);
  if (c.router_groups > 0) {
    SetVariable(vars, "moe_router_num_groups", c.router_groups);
    SetVariable(vars, "moe_router_group_topk", c.router_group_topk);
  }
  SetVariable(vars, "moe_first_dense_layers", c.first_dense);
  SetVariable(vars, "moe_layer_freq", 1);
  if (!vars.other.is_object()) vars.other = json::Value::Object();
  vars.other["moe_router_score_function"] = "sigmoid";
  vars.other["moe_router_topk_scaling_factor"] = c.routed_scaling;
  // (transformers computes the router in float32 whatever the weights')
  vars.other["moe_router_dtype"] = "fp32";
  vars.other["rotary_percent"] = c.rotary_percent;
}

}  // namespace

universal::SourcePlan PlanSource(const Folder& folder,
                                 std::optional<DType> dequantize) {
  const ModelConfig& c = folder.config;
  universal::SourcePlan plan;
  formats::SourceTable torch_sources(plan);
  std::map<std::string, Located> by_name;
  std::vector<uint32_t> source_of(folder.files.size(), 0);
  for (size_t f = 0; f < folder.files.size(); ++f) {
    const WeightFile& w = folder.files[f];
    if (!w.torch) {
      source_of[f] = static_cast<uint32_t>(plan.sources.size());
      plan.sources.push_back(std::make_unique<SafetensorsSource>(w.path));
    }
    for (size_t i = 0; i < w.tensors.size(); ++i) {
      if (!by_name.emplace(w.tensors[i].name, Located{f, &w.tensors[i], i})
               .second) {
        throw FormatError(w.torch ? "torch.save file " : "safetensors file ",
                          w.path.string(), " > ", w.tensors[i].name,
                          ": also in another file");
      }
    }
  }
  auto where = [&](const Located& at) {
    const WeightFile& w = folder.files[at.file];
    return StrCat(w.torch ? "torch.save file " : "safetensors file ",
                  w.path.string(), " > ", at.tensor->name);
  };
  auto fragment = [&](const Located& at) {
    const formats::SafetensorsTensor& t = *at.tensor;
    const WeightFile& w = folder.files[at.file];
    universal::Fragment fr;
    fr.where = where(at);
    if (w.torch) {  // any layout torch writes (strides, shared storages)
      fr.src =
          torch_sources.Tensor(w.torch, *w.torch_tensors[at.index], fr.where);
    } else {
      fr.src.source = source_of[at.file];
      fr.src.byte_offset = t.offset;
      fr.src.dtype = t.dtype;
      fr.src.shape = t.shape;
    }
    fr.src_box = Box::Whole(t.shape);
    fr.atom_box = Box::Whole(t.shape);
    return fr;
  };
  // transformers 5's fused experts: per-expert names as parts of them.
  const std::map<std::string, StoredPart> fused = FusedExpertParts(
      c,
      [&](const std::string& name) -> const Shape* {
        auto it = by_name.find(name);
        return it == by_name.end() ? nullptr : &it->second.tensor->shape;
      },
      [&](const std::string& name) { return where(by_name.at(name)); });
  // FP8 block-scaled weights, dequantized while read (one byte source).
  Fp8Dequantized* fp8 = nullptr;
  uint32_t fp8_source = 0;
  std::map<std::string, bool> used;
  std::string dtype;
  int64_t order = 0;
  std::vector<std::string> param_order;
  for (const Expected& e : ExpectedTensors(c)) {
    auto it = by_name.find(e.name);
    const StoredPart* part = nullptr;
    if (it == by_name.end()) {
      if (auto p = fused.find(e.name); p != fused.end()) {
        part = &p->second;
        it = by_name.find(part->stored);
      }
    }
    if (it == by_name.end()) {
      throw FormatError(folder.dir.string(), ": no tensor ", e.name, " (a ",
                        c.architecture, " of ", c.layers,
                        " layers has it); the weight files hold ",
                        by_name.size(), " tensors");
    }
    const formats::SafetensorsTensor& t = *it->second.tensor;
    // (a fused tensor's shape is checked by FusedExpertParts)
    if (t.shape != e.shape && (part == nullptr || t.shape.size() == 2)) {
      throw FormatError(where(it->second), ": shape ", ShapeString(t.shape),
                        ", but ", Sizes(c), " make it ", ShapeString(e.shape));
    }
    const bool is_fp8 = t.dtype == DType::kFloat8E4M3Fn && c.fp8_block_rows > 0;
    if (!is_fp8 && (!IsFloatingPoint(t.dtype) || ElementSize(t.dtype) < 2)) {
      throw UsageError(where(it->second), ": dtype ", DTypeName(t.dtype),
                       " (quantized or integer weights are not imported)");
    }
    universal::AtomPlan a;
    a.param = e.name;
    a.dtype = t.dtype;
    a.shape = e.shape;
    if (is_fp8) {
      if (!dequantize) {
        throw UsageError(
            where(it->second),
            ": an FP8 block-scaled weight (config.json quantization_config "
            "fp8), which ucp's targets do not keep: give --dequantize "
            "(bf16, or --dequantize fp32)");
      }
      const std::string scale = e.name + "_scale_inv";
      if (part != nullptr || folder.files[it->second.file].torch) {
        throw UsageError(where(it->second),
                         ": FP8 weights are read from safetensors files of "
                         "per-expert tensors only");
      }
      auto s = by_name.find(scale);
      if (s == by_name.end()) {
        throw FormatError(where(it->second), ": an F8_E4M3 weight without ",
                          scale,
                          " (quantization_config fp8 scales every FP8 "
                          "weight)");
      }
      const formats::SafetensorsTensor& st = *s->second.tensor;
      const Shape want{(e.shape[0] + c.fp8_block_rows - 1) / c.fp8_block_rows,
                       (e.shape[1] + c.fp8_block_cols - 1) / c.fp8_block_cols};
      if (folder.files[s->second.file].torch || st.dtype != DType::kFloat32 ||
          st.shape != want) {
        throw FormatError(where(s->second), ": ", DTypeName(st.dtype), " ",
                          ShapeString(st.shape), ", but the ", e.name, " ",
                          ShapeString(e.shape), " in blocks of ",
                          c.fp8_block_rows, "x", c.fp8_block_cols,
                          " (quantization_config weight_block_size) makes it "
                          "a float32 ",
                          ShapeString(want), " in a safetensors file");
      }
      if (fp8 == nullptr) {
        auto src = std::make_unique<Fp8Dequantized>(
            *dequantize, c.fp8_block_rows, c.fp8_block_cols);
        fp8 = src.get();
        fp8_source = static_cast<uint32_t>(plan.sources.size());
        plan.sources.push_back(std::move(src));
      }
      used[scale] = true;
      universal::Fragment fr;
      fr.where = StrCat(where(it->second), " x ", where(s->second));
      fr.src.source = fp8_source;
      fr.src.byte_offset =
          fp8->Add(folder.files[it->second.file].path, t.offset, e.shape[0],
                   e.shape[1], folder.files[s->second.file].path, st.offset);
      fr.src.dtype = *dequantize;
      fr.src.shape = e.shape;
      fr.src_box = fr.atom_box = Box::Whole(e.shape);
      a.dtype = *dequantize;
      a.fragments.push_back(std::move(fr));
    } else {
      universal::Fragment fr = fragment(it->second);
      if (part != nullptr) {  // the expert's rows of the fused tensor
        fr.src = reshape::FlatView(fr.src, part->at, e.shape, fr.where);
        fr.src_box = fr.atom_box = Box::Whole(e.shape);
      }
      a.fragments.push_back(std::move(fr));
    }
    a.state_kind = a.dtype == DType::kFloat32 ? "fp32" : "param";
    if (dtype.empty()) dtype = std::string(DTypeName(a.dtype));
    used[e.name] = true;
    used[it->first] = true;
    const DType atom_dtype = a.dtype;
    plan.atoms.push_back(std::move(a));
    param_order.push_back(e.name);
    plan.params.push_back(formats::ParamRow({.fqn = e.name,
                                             .shape = e.shape,
                                             .dtype = atom_dtype,
                                             .rule = "hf",
                                             .buffer = false,
                                             .group = 0,
                                             .order = order++,
                                             .frozen = false,
                                             .tied_copies = {}}));
  }
  for (const auto& [name, at] : by_name) {
    if (used.count(name)) continue;
    // Rotary frequencies older transformers saved: derived from rope_theta.
    if (name.ends_with(".rotary_emb.inv_freq")) continue;
    if (name.ends_with("_scale_inv")) {
      throw FormatError(where(at), ": a scale without its FP8 weight ",
                        name.substr(0, name.size() - 10),
                        " (the architecture's F8_E4M3 weights take one each)");
    }
    if (c.tied && name == "lm_head.weight") {
      // A tied model's saved copy: a replica of the embedding, which the
      // writer compares bit for bit.
      universal::AtomPlan& emb = plan.atoms.front();
      if (at.tensor->shape != emb.shape || at.tensor->dtype != emb.dtype) {
        throw FormatError(where(at), ": ", DTypeName(at.tensor->dtype), " ",
                          ShapeString(at.tensor->shape),
                          ", but tie_word_embeddings makes it a copy of the ",
                          DTypeName(emb.dtype), " ", ShapeString(emb.shape),
                          " model.embed_tokens.weight");
      }
      emb.fragments.push_back(fragment(at));
      continue;
    }
    if (IsMtpLayer(c, name)) {
      throw UsageError(where(at),
                       ": a tensor of the multi-token-prediction layer "
                       "(num_nextn_predict_layers), which transformers does "
                       "not load and ucp does not import (README of "
                       "engine/formats/hf)");
    }
    throw UsageError(where(at), ": a tensor with no place in ", c.architecture,
                     " (", Sizes(c), ", num_hidden_layers ", c.layers,
                     "; README of engine/formats/hf)");
  }

  universal::Model& model = plan.model;
  model.iteration = 0;
  model.consumed_samples = -1;
  universal::SourceInfo& src = model.source;
  src.framework = "transformers";
  src.driver = "hf";
  src.format = folder.files.front().torch ? "torch" : "safetensors";
  if (const json::Value* v = c.json.Find("transformers_version");
      v != nullptr && v->is_string())
    src.framework_version = v->AsString();
  src.tp = src.pp = src.vpp = src.dp = 1;
  src.dtype = dtype;
  universal::ModelInfo& vars = model.variables;
  // Megatron's names for the model's sizes (what its layouts and the export
  // read): the query groups are the key / value heads.
  SetVariable(vars, "num_layers", c.layers);
  SetVariable(vars, "hidden_size", c.hidden);
  SetVariable(vars, "ffn_hidden_size", c.ffn);
  SetVariable(vars, "num_attention_heads", c.heads);
  SetVariable(vars, "num_query_groups", c.kv_heads);
  SetVariable(vars, "kv_channels", c.head_dim);
  SetVariable(vars, "vocab_size", c.vocab);
  SetVariable(vars, "max_position_embeddings", c.max_positions);
  SetVariable(vars, "swiglu", 1, true);
  SetVariable(vars, "tied", c.tied ? 1 : 0, true);
  SetVariable(vars, "add_qkv_bias", c.qkv_bias ? 1 : 0, true);
  SetVariable(vars, "add_bias_linear", 0, true);
  SetVariable(vars, "qk_layernorm", c.qk_norm ? 1 : 0, true);
  if (c.experts > 0) {
    SetVariable(vars, "num_moe_experts", c.experts);
    SetVariable(vars, "moe_router_topk", c.topk);
    SetVariable(vars, "moe_ffn_hidden_size", c.moe_ffn);
    if (c.shared_ffn > 0) {
      SetVariable(vars, "moe_shared_expert_intermediate_size", c.shared_ffn);
      SetVariable(vars, "moe_shared_expert_gate", c.sigmoid_router ? 0 : 1,
                  true);
    }
  }
  if (c.sigmoid_router) SetRouterVariables(c, vars);
  if (!vars.other.is_object()) vars.other = json::Value::Object();
  vars.other["norm_epsilon"] = c.rms_norm_eps;
  vars.other["rotary_base"] = c.rope_theta;
  vars.other["normalization"] = "RMSNorm";
  vars.other["position_embedding_type"] = "rope";
  if (folder.init_optimizer) AddFreshOptimizer(plan);
  universal::TrainingInfo& training = universal::NewTraining(model, dtype);
  training.param_order = std::move(param_order);
  // The driver's record: config.json as read and where the weights were.
  json::Value record = json::Value::Object();
  record["architecture"] = c.architecture;
  if (dequantize && c.fp8_block_rows > 0) {
    // Dequantized: the targets record the model as it now is.
    json::Value config = json::Value::Object();
    for (const auto& [k, v] : c.json.members())
      if (k != "quantization_config") config[k] = v;
    record["config"] = std::move(config);
    record["dequantized"] = std::string(DTypeName(*dequantize));
  } else {
    record["config"] = c.json;
  }
  json::Value files = json::Value::Array();
  for (const WeightFile& f : folder.files)
    files.Append(f.path.filename().string());
  record["files"] = std::move(files);
  model.extras["hf"] = std::move(record);
  return plan;
}

std::string NamesLayoutYaml(const ModelConfig& c) {
  return StrCat("name: transformers-", c.model_type, "\n",
                "description: transformers' ", c.architecture,
                " (names and tensor-parallel plan)\n",
                R"(layers: {prefix: "model.layers.", count: num_layers}
rules:
  - name: embed_tokens
    match: "model.embed_tokens.weight"
    stage: first
    tp: {split: {dim: 0}}
  - name: qkv_colwise
    match: "model.layers.*.self_attn.{q,k,v}_proj.{weight,bias}"
    tp: {split: {dim: 0}}
  - name: o_proj_rowwise
    match: "model.layers.*.self_attn.o_proj.weight"
    tp: {split: {dim: 1}}
  - name: gate_up_colwise
    match: "model.layers.*.mlp.{gate,up}_proj.weight"
    tp: {split: {dim: 0}}
  - name: router
    match:
      - "model.layers.*.block_sparse_moe.gate.weight"
      - "model.layers.*.mlp.gate.weight"
      - "model.layers.*.mlp.gate.e_score_correction_bias"
    tp: replicated
  - name: expert_gate_up_colwise
    match:
      - "model.layers.*.block_sparse_moe.experts.*.{w1,w3}.weight"
      - "model.layers.*.mlp.experts.*.{gate,up}_proj.weight"
    tp: {split: {dim: 0}}
  - name: expert_down_rowwise
    match:
      - "model.layers.*.block_sparse_moe.experts.*.w2.weight"
      - "model.layers.*.mlp.experts.*.down_proj.weight"
    tp: {split: {dim: 1}}
  - name: down_proj_rowwise
    match: "model.layers.*.mlp.down_proj.weight"
    tp: {split: {dim: 1}}
  - name: shared_expert_gate_up_colwise
    match: "model.layers.*.mlp.{shared_expert,shared_experts}.{gate,up}_proj.weight"
    tp: {split: {dim: 0}}
  - name: shared_expert_down_rowwise
    match: "model.layers.*.mlp.{shared_expert,shared_experts}.down_proj.weight"
    tp: {split: {dim: 1}}
  - name: shared_expert_gate
    match: "model.layers.*.mlp.shared_expert_gate.weight"
    tp: replicated
  - name: norms
    match:
      - "model.layers.*.{input,post_attention}_layernorm.weight"
      - "model.layers.*.self_attn.{q,k}_norm.weight"
    tp: replicated
  - name: final_norm
    match: "model.norm.weight"
    stage: last
    tp: replicated
  - name: lm_head
    match: "lm_head.weight"
    when: "!tied"
    stage: last
    tp: {split: {dim: 0}}
)");
}

json::Value Inventory(const Folder& folder) {
  const ModelConfig& c = folder.config;
  json::Value j;
  j["format"] = "hf";
  j["path"] = folder.dir.string();
  j["architecture"] = c.architecture;
  if (!folder.index.empty()) j["index"] = folder.index.string();
  size_t count = 0;
  for (const WeightFile& f : folder.files) count += f.tensors.size();
  std::string text =
      StrCat(folder.dir.string(), "  (transformers ", c.architecture, ", ",
             c.layers, " layers, ", count, " tensors in ", folder.files.size(),
             folder.files.front().torch ? " torch.save" : " safetensors",
             " file", folder.files.size() == 1 ? "" : "s", ")\n");
  json::Value tensors = json::Value::Array();
  for (const WeightFile& f : folder.files) {
    const std::string file = f.path.filename().string();
    for (const formats::SafetensorsTensor& t : f.tensors) {
      json::Value x;
      x["name"] = t.name;
      x["dtype"] = std::string(DTypeName(t.dtype));
      json::Value shape = json::Value::Array();
      for (int64_t d : t.shape) shape.Append(d);
      x["shape"] = std::move(shape);
      x["file"] = file;
      if (!f.torch) {
        x["offset"] = t.offset;
        x["bytes"] = t.bytes;
      }
      tensors.Append(std::move(x));
      text += StrCat("  ", t.name, "  ", DTypeName(t.dtype), " ",
                     ShapeString(t.shape), "  ", file,
                     f.torch ? "" : StrCat(" @", t.offset), "\n");
    }
  }
  j["tensors"] = std::move(tensors);
  j["text"] = text;
  return j;
}

}  // namespace ucp::hf
