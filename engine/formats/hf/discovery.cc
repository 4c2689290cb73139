// Finding a transformers model folder's files and reading its config.json
// and index (hf.h).

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/hf/hf.h"

namespace ucp::hf {
namespace {

namespace fs = std::filesystem;

constexpr const char* kConfig = "config.json";
constexpr const char* kSingle = "model.safetensors";
constexpr const char* kIndex = "model.safetensors.index.json";
constexpr const char* kTorchSingle = "pytorch_model.bin";
constexpr const char* kTorchIndex = "pytorch_model.bin.index.json";
// config.json and the index are small; anything larger is not one.
constexpr uint64_t kMaxJsonBytes = 64ull << 20;
// The largest integer setting config.json may give (2^24).
constexpr int64_t kMaxSetting = int64_t{1} << 24;

// The architectures ucp imports and their model_type.
constexpr std::pair<const char*, const char*> kArchitectures[] = {
    {"LlamaForCausalLM", "llama"},        {"MistralForCausalLM", "mistral"},
    {"Qwen2ForCausalLM", "qwen2"},        {"Qwen3ForCausalLM", "qwen3"},
    {"MixtralForCausalLM", "mixtral"},    {"Qwen2MoeForCausalLM", "qwen2_moe"},
    {"Qwen3MoeForCausalLM", "qwen3_moe"}, {"Glm4MoeForCausalLM", "glm4_moe"}};

json::Value ReadJsonFile(const fs::path& path, const std::string& what) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec))
    throw FormatError(what, " ", path.string(), ": no such file");
  const File f = File::OpenRead(path);
  const uint64_t size = f.Size();
  if (size > kMaxJsonBytes) {
    throw FormatError(what, " ", path.string(), ": ", size,
                      " bytes, more than a ", what, " holds");
  }
  std::string text(size, '\0');
  f.ReadExact(text.data(), size, 0);
  try {
    json::Value v = json::Value::Parse(text);
    if (!v.is_object()) throw FormatError("not a JSON object");
    return v;
  } catch (Error& e) {
    e.AddContext(what, " ", path.string());
    throw;
  }
}

class ConfigReader {
 public:
  ConfigReader(const json::Value& j, fs::path path)
      : j_(j), where_(StrCat("config.json ", path.string())) {}

  // A positive integer setting; `fallback` when absent or null (0: required).
  int64_t Int(const char* key, int64_t fallback = 0) const {
    const json::Value* v = j_.Find(key);
    if (v == nullptr || v->is_null()) {
      if (fallback > 0) return fallback;
      throw FormatError(where_, ": no ", key);
    }
    // (the cap keeps products of two settings, such as heads x head_dim or
    // layers x experts, far from int64's end; no model comes near it)
    if (!v->is_int() || v->AsInt() < 1 || v->AsInt() > kMaxSetting) {
      throw FormatError(where_, " > ", key, ": not an integer in [1, ",
                        kMaxSetting, "]");
    }
    return v->AsInt();
  }
  bool Bool(const char* key, bool fallback) const {
    const json::Value* v = j_.Find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_bool())
      throw FormatError(where_, " > ", key, ": not true or false");
    return v->AsBool();
  }
  double Number(const json::Value& in, const char* key, double fallback) const {
    const json::Value* v = in.Find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_number())
      throw FormatError(where_, " > ", key, ": not a number");
    return v->AsDouble();
  }
  // An integer setting >= 0; `fallback` when absent or null.
  int64_t Count(const char* key, int64_t fallback) const {
    const json::Value* v = j_.Find(key);
    if (v == nullptr || v->is_null()) return fallback;
    if (!v->is_int() || v->AsInt() < 0 || v->AsInt() > kMaxSetting) {
      throw FormatError(where_, " > ", key, ": not an integer in [0, ",
                        kMaxSetting, "]");
    }
    return v->AsInt();
  }
  // A setting ucp does not import: one usage error naming it.
  [[noreturn]] void Refuse(const std::string& setting,
                           const std::string& arch) const {
    throw UsageError(where_, ": ", setting, ", which ucp does not import for ",
                     arch, " (README of engine/formats/hf)");
  }

  // Glm4MoeForCausalLM (modeling_glm4_moe.py): layers from
  // first_k_dense_replace on sparse, each with n_routed_experts experts,
  // ungated shared experts of n_shared_experts x moe_intermediate_size, and
  // DeepSeek-V3's router (Glm4MoeTopkRouter): sigmoid scores, the top-k
  // chosen on scores + e_score_correction_bias within the topk_group best of
  // n_group groups (a group's score: the sum of its best two), weights the
  // chosen scores, divided by their sum when norm_topk_prob, times
  // routed_scaling_factor. megatron-core 0.16's sigmoid router
  // (moe_utils.topk_routing_with_score_function) is the same with
  // moe_router_enable_expert_bias, moe_router_num_groups / group_topk (a
  // group's score: the sum of its best topk / group_topk: two only when
  // topk / topk_group is 2) and moe_router_topk_scaling_factor, and
  // normalizes exactly when topk > 1: what the weights cannot make equal is
  // refused, naming the setting.
  void ReadGlm4Moe(ModelConfig& c) const {
    const std::string arch = c.architecture;
    c.experts =
        Int(j_.Find("n_routed_experts") != nullptr ? "n_routed_experts"
                                                   : "num_local_experts");
    c.moe_ffn = Int("moe_intermediate_size");
    c.shared_ffn = c.moe_ffn * Int("n_shared_experts", 1);
    c.first_dense = Count("first_k_dense_replace", 1);
    for (int64_t i = 0; i < c.layers; ++i)
      c.moe_layer.push_back(i >= c.first_dense);
    c.sigmoid_router = true;
    c.routed_scaling = Number(j_, "routed_scaling_factor", 1.0);
    if (!(c.routed_scaling > 0))
      Refuse(StrCat("routed_scaling_factor ", c.routed_scaling), arch);
    c.qk_norm = Bool("use_qk_norm", false);
    // Glm4MoeConfig's default partial_rotary_factor is 0.5 (transformers 5
    // keeps it in rope_parameters).
    c.rotary_percent = Number(j_, "partial_rotary_factor", 0.5);
    if (const json::Value* rp = j_.Find("rope_parameters");
        rp != nullptr && rp->is_object()) {
      c.rotary_percent = Number(*rp, "partial_rotary_factor", c.rotary_percent);
    }
    // (both take int(head_dim x factor) dims, in rotate-half pairs)
    const auto rotary_dims = static_cast<int64_t>(
        static_cast<double>(c.head_dim) * c.rotary_percent);
    if (!(c.rotary_percent > 0 && c.rotary_percent <= 1) || rotary_dims < 2 ||
        rotary_dims % 2 != 0) {
      Refuse(StrCat("partial_rotary_factor ", c.rotary_percent, " of head_dim ",
                    c.head_dim, " (", rotary_dims, " rotary dims, not even)"),
             arch);
    }
    const int64_t topk = Int("num_experts_per_tok");
    const int64_t groups = Int("n_group", 1), group_topk = Int("topk_group", 1);
    if (c.experts % groups != 0 || group_topk > groups) {
      throw FormatError(where_, ": n_group ", groups, " / topk_group ",
                        group_topk, " do not divide the ", c.experts,
                        " experts");
    }
    if (groups > 1 && group_topk < groups) {
      if (topk / group_topk != 2 || c.experts / groups < 2) {
        Refuse(StrCat("n_group ", groups, " with topk_group ", group_topk,
                      " and num_experts_per_tok ", topk,
                      " (a group's score is the sum of its best two; "
                      "megatron-core sums its best num_experts_per_tok / "
                      "topk_group)"),
               arch);
      }
      c.router_groups = groups;
      c.router_group_topk = group_topk;
    }
    if (Bool("norm_topk_prob", true) != (topk > 1)) {
      Refuse(StrCat("norm_topk_prob ", topk > 1 ? "false" : "true",
                    " with num_experts_per_tok ", topk,
                    " (megatron-core's sigmoid router normalizes the top-k "
                    "weights exactly when k > 1)"),
             arch);
    }
  }

  ModelConfig Read() const {
    ModelConfig c;
    c.json = j_;
    const json::Value* archs = j_.Find("architectures");
    if (archs == nullptr || !archs->is_array() || archs->size() != 1 ||
        !archs->items()[0].is_string()) {
      throw UsageError(where_,
                       ": no single \"architectures\" entry (ucp imports ",
                       KnownList(), ")");
    }
    c.architecture = archs->items()[0].AsString();
    for (const auto& [arch, type] : kArchitectures)
      if (c.architecture == arch) c.model_type = type;
    if (c.model_type.empty()) {
      throw UsageError(where_, ": architecture ", c.architecture,
                       " is not one ucp imports (", KnownList(), ")");
    }
    if (const json::Value* t = j_.Find("model_type");
        t != nullptr && (!t->is_string() || t->AsString() != c.model_type)) {
      throw FormatError(where_, ": model_type ", t->Dump(), " is not ",
                        c.architecture, "'s \"", c.model_type, "\"");
    }
    c.layers = Int("num_hidden_layers");
    c.hidden = Int("hidden_size");
    c.heads = Int("num_attention_heads");
    c.kv_heads = Int("num_key_value_heads", c.heads);
    c.ffn = Int("intermediate_size");
    c.vocab = Int("vocab_size");
    c.max_positions = Int("max_position_embeddings", 4096);
    if (c.heads % c.kv_heads != 0) {
      throw FormatError(where_, ": num_attention_heads ", c.heads,
                        " is not a multiple of num_key_value_heads ",
                        c.kv_heads);
    }
    if (c.hidden % c.heads != 0 && j_.Find("head_dim") == nullptr) {
      throw FormatError(where_, ": hidden_size ", c.hidden,
                        " is not a multiple of num_attention_heads ", c.heads,
                        " (and there is no head_dim)");
    }
    c.head_dim = Int("head_dim", c.hidden / c.heads);
    c.tied = Bool("tie_word_embeddings", false);
    c.rms_norm_eps = Number(j_, "rms_norm_eps", 1e-6);
    c.rope_theta = Number(j_, "rope_theta", 10000.0);
    // transformers 5 moves the rotary settings into rope_parameters.
    if (const json::Value* rp = j_.Find("rope_parameters");
        rp != nullptr && rp->is_object()) {
      c.rope_theta = Number(*rp, "rope_theta", c.rope_theta);
    }
    if (const json::Value* act = j_.Find("hidden_act");
        act != nullptr && (!act->is_string() || act->AsString() != "silu")) {
      Refuse(StrCat("hidden_act ", act->Dump()), c.architecture);
    }
    // Qwen3Attention: q_norm, k_norm
    c.qk_norm = c.model_type == "qwen3" || c.model_type == "qwen3_moe";
    if (c.model_type == "mixtral") {  // every layer sparse
      c.experts = Int("num_local_experts");
      c.moe_ffn = c.ffn;
      c.moe_layer.assign(static_cast<size_t>(c.layers), true);
    } else if (c.model_type == "glm4_moe") {
      ReadGlm4Moe(c);
    } else if (c.model_type == "qwen3_moe" || c.model_type == "qwen2_moe") {
      if (c.model_type == "qwen2_moe")
        c.shared_ffn = Int("shared_expert_intermediate_size");
      // (transformers 5 writes num_local_experts, 4 num_experts)
      c.experts =
          Int(j_.Find("num_local_experts") != nullptr ? "num_local_experts"
                                                      : "num_experts");
      c.moe_ffn = Int("moe_intermediate_size");
      const int64_t step = Int("decoder_sparse_step", 1);
      std::vector<int64_t> dense;
      if (const json::Value* m = j_.Find("mlp_only_layers");
          m != nullptr && !m->is_null()) {
        if (!m->is_array())
          throw FormatError(where_, " > mlp_only_layers: not a list");
        for (const json::Value& x : m->items()) {
          if (!x.is_int())
            throw FormatError(where_, " > mlp_only_layers: not integers");
          dense.push_back(x.AsInt());
        }
      }
      for (int64_t i = 0; i < c.layers; ++i) {
        c.moe_layer.push_back(std::find(dense.begin(), dense.end(), i) ==
                                  dense.end() &&
                              (i + 1) % step == 0);
      }
      // Megatron's router: softmax over the top-k logits, i.e. the top-k
      // probabilities renormalized.
      if (!Bool("norm_topk_prob", false))
        Refuse(
            "norm_topk_prob false (Megatron's router renormalizes the "
            "top-k probabilities)",
            c.architecture);
    }
    if (c.experts > 0) {
      c.topk = Int("num_experts_per_tok");
      if (c.topk > c.experts) {
        throw FormatError(where_, ": num_experts_per_tok ", c.topk,
                          " is more than the ", c.experts, " experts");
      }
    } else {
      c.moe_layer.assign(static_cast<size_t>(c.layers), false);
    }
    if (c.model_type == "qwen2") {
      c.qkv_bias = true;  // Qwen2Attention: q/k/v with bias, o_proj without
    } else if (c.model_type == "qwen2_moe") {
      c.qkv_bias = Bool("qkv_bias", true);  // (transformers 5's setting)
    } else if (c.model_type == "glm4_moe") {
      // Glm4MoeAttention: attention_bias biases q/k/v, never o_proj.
      c.qkv_bias = Bool("attention_bias", false);
    } else {
      if (Bool("attention_bias", false))
        Refuse("attention_bias true", c.architecture);
    }
    if (Bool("mlp_bias", false)) Refuse("mlp_bias true", c.architecture);
    ReadQuantization(c);
    return c;
  }

  // quantization_config: FP8 block-scaled weights (DeepSeek-V3's and
  // transformers' FineGrainedFP8Config: quant_method "fp8", fmt "e4m3",
  // weight_block_size [rows, cols]); any other quantization is named.
  void ReadQuantization(ModelConfig& c) const {
    const json::Value* q = j_.Find("quantization_config");
    if (q == nullptr || q->is_null()) return;
    const std::string at = where_ + " > quantization_config";
    if (!q->is_object()) throw FormatError(at, ": not an object");
    const json::Value* method = q->Find("quant_method");
    if (method == nullptr || !method->is_string() ||
        method->AsString() != "fp8") {
      throw UsageError(at, ": quant_method ",
                       method == nullptr ? "absent" : method->Dump(),
                       " is not one ucp reads (it reads \"fp8\": FP8 "
                       "block-scaled weights)");
    }
    if (const json::Value* fmt = q->Find("fmt");
        fmt != nullptr && (!fmt->is_string() || fmt->AsString() != "e4m3")) {
      throw UsageError(at, ": fmt ", fmt->Dump(),
                       " is not one ucp reads (it reads \"e4m3\")");
    }
    const json::Value* block = q->Find("weight_block_size");
    if (block == nullptr || !block->is_array() || block->size() != 2 ||
        !block->items()[0].is_int() || !block->items()[1].is_int() ||
        block->items()[0].AsInt() < 1 || block->items()[1].AsInt() < 1 ||
        block->items()[0].AsInt() > kMaxSetting ||
        block->items()[1].AsInt() > kMaxSetting) {
      throw UsageError(at, ": weight_block_size ",
                       block == nullptr ? "absent" : block->Dump(),
                       " is not [rows, columns] of positive integers (ucp "
                       "reads block-scaled FP8 only)");
    }
    c.fp8_block_rows = block->items()[0].AsInt();
    c.fp8_block_cols = block->items()[1].AsInt();
  }

 private:
  static std::string KnownList() {
    std::string s;
    for (const auto& [arch, type] : kArchitectures)
      s += StrCat(s.empty() ? "" : ", ", arch);
    return s;
  }

  const json::Value& j_;
  std::string where_;
};

// A shard name of the index: a plain file name in the folder.
bool IsPlainName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." &&
         name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

// A weight file's tensors: a safetensors header, or the leaves of a
// torch.save file's state dict (each must be a tensor).
WeightFile ReadWeightFile(const fs::path& path) {
  if (path.extension() != ".bin")
    return {path, formats::ReadSafetensorsHeader(path), nullptr, {}};
  WeightFile f;
  f.path = path;
  try {
    f.torch = std::make_shared<const torchfile::TorchFile>(
        torchfile::TorchFile::Open(path));
    for (const formats::ChunkLeaf& leaf :
         formats::FlattenChunk(*f.torch, f.torch->root())) {
      if (leaf.tensor == nullptr)
        throw FormatError(leaf.name, ": not a tensor");
      formats::SafetensorsTensor t;
      t.name = leaf.name;
      t.dtype = leaf.tensor->dtype;
      t.shape = leaf.tensor->shape;
      f.tensors.push_back(std::move(t));
      f.torch_tensors.push_back(leaf.tensor);
    }
  } catch (Error& e) {
    if (std::string_view(e.what()).find(path.string()) == std::string::npos)
      e.AddContext("torch.save file ", path.string());
    throw;
  }
  return f;
}

std::vector<WeightFile> ReadIndexed(const fs::path& dir,
                                    const fs::path& index) {
  const json::Value j = ReadJsonFile(index, "index");
  const std::string where = StrCat("index ", index.string());
  const json::Value* map = j.Find("weight_map");
  if (map == nullptr || !map->is_object() || map->size() == 0)
    throw FormatError(where, ": no weight_map");
  std::map<std::string, std::string> shard_of;  // tensor -> shard
  std::vector<std::string> shards;              // first-named order
  for (const auto& [tensor, shard] : map->members()) {
    if (!shard.is_string() || !IsPlainName(shard.AsString())) {
      throw FormatError(where, " > weight_map > ", tensor,
                        ": not a file name of the folder");
    }
    if (!shard_of.emplace(tensor, shard.AsString()).second)
      throw FormatError(where, " > weight_map: ", tensor, " named twice");
    if (std::find(shards.begin(), shards.end(), shard.AsString()) ==
        shards.end())
      shards.push_back(shard.AsString());
  }
  std::vector<WeightFile> files;
  std::set<std::string> found;
  for (const std::string& shard : shards) {
    const fs::path path = dir / shard;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      throw FormatError(where, " names shard ", shard,
                        ", which is not in the folder");
    }
    WeightFile f = ReadWeightFile(path);
    const char* kind = f.torch ? "torch.save file " : "safetensors file ";
    for (const formats::SafetensorsTensor& t : f.tensors) {
      auto it = shard_of.find(t.name);
      if (it == shard_of.end()) {
        throw FormatError(kind, path.string(), " > ", t.name,
                          ": a tensor the index ", index.string(),
                          " does not name");
      }
      if (it->second != shard) {
        throw FormatError(kind, path.string(), " > ", t.name, ": the index ",
                          index.string(), " puts it in ", it->second);
      }
      found.insert(t.name);
    }
    files.push_back(std::move(f));
  }
  for (const auto& [tensor, shard] : shard_of) {
    if (!found.count(tensor)) {
      throw FormatError(where, " > weight_map > ", tensor, ": not in shard ",
                        shard);
    }
  }
  return files;
}

}  // namespace

bool LooksLikeFolder(const fs::path& dir) noexcept {
  try {
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) return false;
    if (!fs::is_regular_file(dir / kConfig, ec)) return false;
    for (const char* f : {kSingle, kIndex, kTorchSingle, kTorchIndex})
      if (fs::is_regular_file(dir / f, ec)) return true;
    return false;
  } catch (...) {
    return false;
  }
}

namespace {

void CheckTensorCount(const Folder& f) {
  size_t tensors = 0;
  for (const WeightFile& w : f.files)
    tensors += w.tensors.size() + w.torch_tensors.size();
  const ModelConfig& c = f.config;
  const int64_t moe_layers =
      std::count(c.moe_layer.begin(), c.moe_layer.end(), true);
  // Every layer holds several tensors, every routed expert of a MoE layer
  // three: a config asking for more than the files hold is refused before
  // the names it implies are listed.
  const auto held = static_cast<int64_t>(tensors);
  if (c.layers > held || c.experts * moe_layers > held) {
    throw FormatError(
        (f.dir / kConfig).string(), ": num_hidden_layers ", c.layers,
        c.experts > 0 ? StrCat(" with ", c.experts, " experts per MoE layer")
                      : std::string(),
        " asks for more tensors than the folder's ", held);
  }
}

}  // namespace

Folder OpenFolder(const fs::path& dir) {
  Folder f;
  f.dir = dir;
  const fs::path config = dir / kConfig;
  f.config = ConfigReader(ReadJsonFile(config, "config.json"), config).Read();
  std::error_code ec;
  // transformers' order of preference.
  for (const auto& [single, index] :
       {std::pair(kSingle, kIndex), std::pair(kTorchSingle, kTorchIndex)}) {
    if (fs::is_regular_file(dir / single, ec)) {
      f.files.push_back(ReadWeightFile(dir / single));
      CheckTensorCount(f);
      return f;
    }
    if (fs::is_regular_file(dir / index, ec)) {
      f.index = dir / index;
      f.files = ReadIndexed(dir, f.index);
      CheckTensorCount(f);
      return f;
    }
  }
  throw FormatError(dir.string(), ": no ", kSingle, ", ", kIndex, ", ",
                    kTorchSingle, " or ", kTorchIndex,
                    " (a transformers model folder's weights)");
}

}  // namespace ucp::hf
