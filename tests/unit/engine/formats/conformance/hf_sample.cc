// The Hugging Face sample of the conformance suite (a read-only format): a
// transformers LlamaForCausalLM folder (one layer, GQA 2 heads / 1 key-value
// head, untied) written here from the safetensors spec (huggingface/
// safetensors, tensor.rs: u64 LE header length, the JSON header, the data)
// and transformers' names (modeling_llama.py), independently of ucp's
// reader. Real transformers folders read, converted and loaded by
// megatron-core: tests/cli/test_hf_import.py.

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "tests/testutil/testutil.h"
#include "tests/unit/engine/formats/conformance/conformance.h"

namespace ucp::formats::conformance {
namespace {

namespace fs = std::filesystem;

// hidden 4, 2 heads of dim 2, 1 key / value head, ffn 6, vocabulary 8.
std::string Safetensors() {
  const std::vector<std::pair<std::string, std::vector<int64_t>>> tensors = {
      {"model.embed_tokens.weight", {8, 4}},
      {"model.layers.0.input_layernorm.weight", {4}},
      {"model.layers.0.self_attn.q_proj.weight", {4, 4}},
      {"model.layers.0.self_attn.k_proj.weight", {2, 4}},
      {"model.layers.0.self_attn.v_proj.weight", {2, 4}},
      {"model.layers.0.self_attn.o_proj.weight", {4, 4}},
      {"model.layers.0.post_attention_layernorm.weight", {4}},
      {"model.layers.0.mlp.gate_proj.weight", {6, 4}},
      {"model.layers.0.mlp.up_proj.weight", {6, 4}},
      {"model.layers.0.mlp.down_proj.weight", {4, 6}},
      {"model.norm.weight", {4}},
      {"lm_head.weight", {8, 4}}};
  std::string header = "{\"__metadata__\":{\"format\":\"pt\"}";
  std::string data;
  float next = 0.5f;
  for (const auto& [name, shape] : tensors) {
    size_t n = 1;
    std::string dims;
    for (int64_t d : shape) {
      n *= static_cast<size_t>(d);
      dims += (dims.empty() ? "" : ",") + std::to_string(d);
    }
    const size_t begin = data.size();
    for (size_t i = 0; i < n; ++i, next += 0.125f) {
      char b[4];
      std::memcpy(b, &next, 4);
      data.append(b, 4);
    }
    header += ",\"" + name + "\":{\"dtype\":\"F32\",\"shape\":[" + dims +
              "],\"data_offsets\":[" + std::to_string(begin) + "," +
              std::to_string(data.size()) + "]}";
  }
  header += "}";
  while (header.size() % 8 != 0) header += ' ';
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] =
        static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return out + header + data;
}

fs::path Make(const fs::path& dir) {
  fs::create_directories(dir);
  testutil::WriteFile(
      dir / "config.json",
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
 "hidden_size": 4, "intermediate_size": 6, "num_hidden_layers": 1,
 "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 8,
 "hidden_act": "silu", "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
 "dtype": "float32"})");
  testutil::WriteFile(dir / "model.safetensors", Safetensors());
  return dir;
}

const bool kRegistered = RegisterSample({
    .driver = "hf",
    .make = Make,
    .same = {},
    .other = {},
    .not_reproduced = {},
    // transformers loads a model folder whatever the parallel layout.
    .loads_at_any_layout = true,
});

}  // namespace
}  // namespace ucp::formats::conformance
