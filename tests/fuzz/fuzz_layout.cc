// Fuzz harness: layout descriptors (layouts/: YAML, expressions, globs).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/error.h"
#include "layouts/layout.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    const ucp::layouts::Layout l = ucp::layouts::Layout::Parse(text, "fuzz");
    const std::vector<std::string> names = {
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "language_model.encoder.layers.1.mlp.dense_h_to_4h.weight",
        "3.input_layernorm.weight", "embedding.word_embeddings.weight"};
    ucp::layouts::Variables vars = {{"num_layers", 2}, {"vocab_size", 30},
                                    {"swiglu", 1},     {"tied", 1},
                                    {"num_attention_heads", 4}};
    (void)l.Check(names, vars);
  } catch (const ucp::Error&) {
  }
  return 0;
}
