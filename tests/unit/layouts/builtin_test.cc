// The built-in descriptors: they parse, detect their models and match the
// Transformer Engine spec names (read from Megatron-core core_v0.8.0's
// gpt_layer_specs.py, extensions/transformer_engine.py and TE's modules;
// the local-spec names are checked against real Megatron-core in
// mcore_oracle_test.cc, the legacy names against a Megatron-LM 23.06
// checkpoint in megatron_fixture_test.cc).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>

#include "engine/core/error.h"
#include "layouts/layout.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(BuiltinTest, EveryBuiltinParses) {
  EXPECT_THAT(
      Layout::BuiltinNames(),
      ElementsAre("mcore-gpt", "mcore-llama", "mcore-moe-deepseek",
                  "mcore-moe-mixtral", "megatron-deepspeed-gpt-pipe",
                  "megatron-gpt-legacy", "mindformers-llama"));
  for (const std::string& name : Layout::BuiltinNames()) {
    const Layout l = Layout::Builtin(name);
    EXPECT_EQ(l.name(), name);
    EXPECT_EQ(l.source(), "builtin:" + name);
    EXPECT_FALSE(l.description().empty());
    EXPECT_FALSE(l.rules().empty());
    EXPECT_EQ(l.yaml().substr(0, 2), "# ");
    // PipelineModule names start with the layer index: no layer prefix.
    EXPECT_EQ(l.layer_count().text(),
              l.layer_prefixes().empty() ? "0" : "num_layers");
    // The stored text parses to the same layout.
    EXPECT_EQ(Layout::Parse(l.yaml(), "copy").rules().size(), l.rules().size());
  }
  EXPECT_THAT([] { Layout::Builtin("gpt"); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("no built-in layout 'gpt' (built-in: mcore-gpt, "
                            "mcore-llama, mcore-moe-deepseek, "
                            "mcore-moe-mixtral, megatron-deepspeed-gpt-pipe, "
                            "megatron-gpt-legacy, mindformers-llama)")));
}

// name -> expected rule
using Expected = std::vector<std::pair<std::string, std::string>>;

void ExpectRules(const Layout& layout, const Expected& expected,
                 const Variables& vars) {
  std::vector<std::string> names;
  for (const auto& [name, rule] : expected) names.push_back(name);
  const std::vector<Diagnostic> d = layout.Check(names, vars);
  for (size_t i = 0; i < d.size(); ++i) {
    EXPECT_EQ(d[i].rule, expected[i].second)
        << d[i].name << ": " << d[i].problem;
  }
}

// Transformer Engine spec: LayerNorm (fused into linear_qkv / linear_fc1),
// linear biases, GELU, learned positions, tied embeddings, PP = 1.
Expected TeGptNames() {
  Expected e = {
      {"embedding.word_embeddings.weight", "word_embeddings"},
      {"embedding.position_embeddings.weight", "position_embeddings"}};
  const std::vector<std::pair<std::string, std::string>> layer = {
      {"self_attention.linear_proj.weight", "attn_proj"},
      {"self_attention.linear_proj.bias", "attn_proj_bias"},
      {"self_attention.linear_proj._extra_state", "layer_extra_state"},
      {"self_attention.linear_qkv.layer_norm_weight", "input_norm"},
      {"self_attention.linear_qkv.layer_norm_bias", "input_norm"},
      {"self_attention.linear_qkv.weight", "qkv"},
      {"self_attention.linear_qkv.bias", "qkv"},
      {"self_attention.linear_qkv._extra_state", "layer_extra_state"},
      {"self_attention.core_attention._extra_state", "layer_extra_state"},
      {"mlp.linear_fc1.layer_norm_weight", "mlp_norm"},
      {"mlp.linear_fc1.layer_norm_bias", "mlp_norm"},
      {"mlp.linear_fc1.weight", "fc1"},
      {"mlp.linear_fc1.bias", "fc1"},
      {"mlp.linear_fc1._extra_state", "layer_extra_state"},
      {"mlp.linear_fc2.weight", "fc2"},
      {"mlp.linear_fc2.bias", "fc2_bias"},
      {"mlp.linear_fc2._extra_state", "layer_extra_state"}};
  for (int i = 0; i < 2; ++i) {
    for (const auto& [s, r] : layer)
      e.emplace_back("decoder.layers." + std::to_string(i) + "." + s, r);
  }
  e.insert(e.end(),
           {{"decoder.final_layernorm.weight", "final_norm"},
            {"decoder.final_layernorm.bias", "final_norm"},
            {"output_layer._extra_state", "output_layer_extra_state"}});
  return e;
}

// Transformer Engine spec, LLaMA style: RMSNorm (no norm biases), SwiGLU,
// GQA, no linear biases, RoPE, untied output layer, qk-layernorm.
Expected TeLlamaNames(bool with_qk_norm) {
  Expected e = {{"embedding.word_embeddings.weight", "word_embeddings"}};
  std::vector<std::pair<std::string, std::string>> layer = {
      {"self_attention.linear_proj.weight", "attn_proj"},
      {"self_attention.linear_proj._extra_state", "layer_extra_state"},
      {"self_attention.linear_qkv.layer_norm_weight", "input_norm"},
      {"self_attention.linear_qkv.weight", "qkv"},
      {"self_attention.linear_qkv._extra_state", "layer_extra_state"},
      {"self_attention.core_attention._extra_state", "layer_extra_state"},
      {"mlp.linear_fc1.layer_norm_weight", "mlp_norm"},
      {"mlp.linear_fc1.weight", "fc1_swiglu"},
      {"mlp.linear_fc1._extra_state", "layer_extra_state"},
      {"mlp.linear_fc2.weight", "fc2"},
      {"mlp.linear_fc2._extra_state", "layer_extra_state"}};
  if (with_qk_norm) {
    layer.push_back({"self_attention.q_layernorm.weight", "qk_norm"});
    layer.push_back({"self_attention.k_layernorm.weight", "qk_norm"});
  }
  for (int i = 0; i < 3; ++i) {
    for (const auto& [s, r] : layer)
      e.emplace_back("decoder.layers." + std::to_string(i) + "." + s, r);
  }
  e.insert(e.end(),
           {{"decoder.final_layernorm.weight", "final_norm"},
            {"output_layer.weight", "output_layer"},
            {"output_layer._extra_state", "output_layer_extra_state"}});
  return e;
}

std::vector<std::string> Names(const Expected& e) {
  std::vector<std::string> out;
  for (const auto& [name, rule] : e) out.push_back(name);
  return out;
}

TEST(BuiltinTest, McoreGptMatchesTransformerEngineNames) {
  const Layout l = Layout::Builtin("mcore-gpt");
  ExpectRules(l, TeGptNames(), {{"swiglu", 0}, {"tied", 1}});
  Expected llama = TeLlamaNames(true);
  ExpectRules(l, llama, {{"swiglu", 1}, {"tied", 0}});
  // Tied with PP > 1: the last stage's output_layer.weight is a copy.
  const Rule& copy = l.Match("output_layer.weight", {{"tied", 1}});
  EXPECT_EQ(copy.name, "output_layer_tied");
  EXPECT_EQ(copy.tied_to, "embedding.word_embeddings.weight");
  EXPECT_TRUE(copy.tp.SameAs(l.RuleNamed("word_embeddings")->tp));
  EXPECT_FALSE(copy.Exists({}, Topo(2)));
  EXPECT_TRUE(copy.Exists({}, Topo(2, 2)));
  EXPECT_EQ(copy.stage, Stage::kLast);
}

TEST(BuiltinTest, McoreLlamaMatchesTransformerEngineNames) {
  const Layout l = Layout::Builtin("mcore-llama");
  ExpectRules(l, TeLlamaNames(true), {});
  // Tied models are not LLaMA-style: the output layer matches no rule.
  EXPECT_THAT(
      [&] {
        l.Match("output_layer.weight", {{"tied", 1}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("condition '!tied' is false")));
  // Biases are not part of it.
  EXPECT_EQ(l.Find("decoder.layers.0.self_attention.linear_qkv.bias", {}),
            nullptr);
}

TEST(BuiltinTest, LegacyMatchesEverySpelling) {
  const Layout l = Layout::Builtin("megatron-gpt-legacy");
  const Variables vars = {{"swiglu", 0}, {"tied", 1}};
  const Expected e = {
      {"language_model.embedding.word_embeddings.weight", "word_embeddings"},
      {"language_model.embedding.position_embeddings.weight",
       "position_embeddings"},
      {"language_model.encoder.layers.0.input_norm.weight", "input_norm"},
      {"language_model.encoder.layers.0.input_layernorm.bias", "input_norm"},
      {"language_model.transformer.layers.0.input_layernorm.weight",
       "input_norm"},
      {"language_model.encoder.layers.0.self_attention.query_key_value.weight",
       "qkv"},
      {"language_model.transformer.layers.3.attention.query_key_value.bias",
       "qkv"},
      {"language_model.encoder.layers.0.self_attention.query_key_value._extra_"
       "state",
       "layer_extra_state"},
      {"language_model.encoder.layers.0.self_attention.dense.weight",
       "attn_dense"},
      {"language_model.encoder.layers.0.self_attention.dense.bias",
       "attn_dense_bias"},
      {"language_model.encoder.layers.0.post_attention_norm.weight",
       "post_attention_norm"},
      {"language_model.encoder.layers.0.post_attention_layernorm.bias",
       "post_attention_norm"},
      {"language_model.encoder.layers.0.mlp.dense_h_to_4h.weight", "fc1"},
      {"language_model.encoder.layers.0.mlp.dense_h_to_4h.bias", "fc1"},
      {"language_model.encoder.layers.0.mlp.dense_4h_to_h.weight", "fc2"},
      {"language_model.encoder.layers.0.mlp.dense_4h_to_h.bias", "fc2_bias"},
      {"language_model.encoder.final_norm.weight", "final_norm"},
      {"language_model.encoder.final_layernorm.bias", "final_norm"},
      {"language_model.transformer.final_layernorm.weight", "final_norm"},
      {"language_model.output_layer._extra_state", "output_layer_extra_state"},
      {"word_embeddings_for_head.weight", "word_embeddings_for_head"}};
  ExpectRules(l, e, vars);
  EXPECT_EQ(l.Match("language_model.encoder.layers.0.mlp.dense_h_to_4h.weight",
                    {{"swiglu", 1}})
                .name,
            "fc1_swiglu");
  EXPECT_EQ(l.Match("language_model.output_layer.weight", {{"tied", 0}}).name,
            "output_layer");
  EXPECT_EQ(l.KeyPath("language_model.embedding.word_embeddings.weight"),
            (std::vector<std::string>{"language_model", "embedding",
                                      "word_embeddings", "weight"}));
  EXPECT_EQ(l.KeyPath("language_model.encoder.layers.0.input_layernorm.weight"),
            (std::vector<std::string>{"language_model", "encoder",
                                      "layers.0.input_layernorm.weight"}));
  EXPECT_EQ(
      l.KeyPath("language_model.output_layer.weight"),
      (std::vector<std::string>{"language_model", "output_layer", "weight"}));
  EXPECT_EQ(l.KeyPath("word_embeddings_for_head.weight"),
            (std::vector<std::string>{"word_embeddings_for_head", "weight"}));
  EXPECT_EQ(
      l.SplitLayer("language_model.transformer.layers.4.attention.dense.weight")
          ->index,
      4);
}

// Megatron-DeepSpeed GPTModelPipe names (PipelineModule: the global layer
// index first, tied modules under tied_modules.<key>, a bare final norm).
Expected PipeNames(bool swiglu) {
  Expected e = {
      {"tied_modules.embed.word_embeddings.weight", "word_embeddings"},
      {"tied_modules.embed.position_embeddings.weight", "position_embeddings"}};
  const std::vector<std::pair<std::string, std::string>> layer = {
      {"input_layernorm.weight", "norms"},
      {"input_layernorm.bias", "norms"},
      {"self_attention.query_key_value.weight", "qkv"},
      {"self_attention.query_key_value.bias", "qkv"},
      {"self_attention.dense.weight", "attn_dense"},
      {"self_attention.dense.bias", "row_parallel_bias"},
      {"post_attention_layernorm.weight", "norms"},
      {"post_attention_layernorm.bias", "norms"},
      {"mlp.dense_h_to_4h.weight", swiglu ? "fc1_swiglu" : "fc1"},
      {"mlp.dense_h_to_4h.bias", swiglu ? "fc1_swiglu" : "fc1"},
      {"mlp.dense_4h_to_h.weight", "fc2"},
      {"mlp.dense_4h_to_h.bias", "row_parallel_bias"}};
  for (int i = 2; i < 14; i += 11) {
    for (const auto& [s, r] : layer)
      e.emplace_back(std::to_string(i) + "." + s, r);
  }
  e.insert(e.end(), {{"16.weight", "final_norm"},
                     {"16.bias", "final_norm"},
                     {"1.word_embeddings.weight", "word_embeddings"},
                     {"17.lm_head.weight", "lm_head"}});
  return e;
}

TEST(BuiltinTest, PipeMatchesPipelineModuleNames) {
  const Layout l = Layout::Builtin("megatron-deepspeed-gpt-pipe");
  ExpectRules(l, PipeNames(false), {{"swiglu", 0}});
  ExpectRules(l, PipeNames(true), {{"swiglu", 1}});
  EXPECT_EQ(Layout::DetectBuiltin(Names(PipeNames(false))).name(),
            "megatron-deepspeed-gpt-pipe");
}

// MindFormers' LLaMA names and the split each of its shard() calls gives
// (mindformers/models/llama; see the descriptor's header).
TEST(BuiltinTest, MindFormersLlamaMatchesItsNames) {
  const Layout l = Layout::Builtin("mindformers-llama");
  const Expected names = {
      {"model.tok_embeddings.embedding_weight", "word_embeddings"},
      {"model.layers.0.attention_norm.weight", "norms"},
      {"model.layers.0.attention.wq.weight", "qkv"},
      {"model.layers.0.attention.wk.weight", "qkv"},
      {"model.layers.0.attention.wv.bias", "qkv"},
      {"model.layers.0.attention.wo.weight", "attn_out"},
      {"model.layers.1.ffn_norm.weight", "norms"},
      {"model.layers.1.feed_forward.w1.weight", "ffn_in"},
      {"model.layers.1.feed_forward.w3.weight", "ffn_in"},
      {"model.layers.1.feed_forward.w2.weight", "ffn_out"},
      {"model.norm_out.weight", "final_norm"},
      {"lm_head.weight", "output"}};
  ExpectRules(l, names, {{"num_layers", 2}});
  EXPECT_EQ(Layout::DetectBuiltin(Names(names)).name(), "mindformers-llama");
  const Variables vars = l.Resolve({{"num_layers", 2}});
  EXPECT_EQ(l.Match("model.layers.0.attention.wo.weight", vars).tp.dim, 1);
  EXPECT_EQ(l.Match("model.layers.1.feed_forward.w1.weight", vars).tp.dim, 0);
  EXPECT_FALSE(l.Match("lm_head.weight", vars).tp.split);  // vocab_emb_dp
  const Variables mp = l.Resolve({{"num_layers", 2}, {"vocab_emb_dp", 0}});
  EXPECT_TRUE(l.Match("lm_head.weight", mp).tp.split);
  EXPECT_EQ(l.Match("model.tok_embeddings.embedding_weight", mp).name,
            "word_embeddings_mp");
  // The fused qkv_concat / ffn_concat weights are not described.
  std::vector<std::string> fused = Names(names);
  fused.push_back("model.layers.0.attention.w_qkv.weight");
  EXPECT_TRUE(Layout::DetectBuiltins(fused).empty());
}

TEST(BuiltinTest, DetectionPicksTheRightBuiltin) {
  EXPECT_EQ(Layout::DetectBuiltin(Names(TeGptNames())).name(), "mcore-gpt");
  EXPECT_EQ(Layout::DetectBuiltin(Names(TeLlamaNames(false))).name(),
            "mcore-llama");
  EXPECT_THAT(Layout::DetectBuiltins(Names(TeLlamaNames(false))),
              ElementsAre("mcore-llama", "mcore-gpt"));
  const std::vector<std::string> legacy = {
      "language_model.embedding.word_embeddings.weight",
      "language_model.encoder.layers.0.self_attention.query_key_value.weight"};
  EXPECT_EQ(Layout::DetectBuiltin(legacy).name(), "megatron-gpt-legacy");
  const std::vector<std::string> moe = {
      "decoder.layers.0.self_attention.linear_qkv.weight",
      "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"};
  EXPECT_THAT([&] { Layout::DetectBuiltin(moe); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("no built-in layout recognises these 2 names")));
  EXPECT_TRUE(Layout::DetectBuiltins(std::vector<std::string>{}).empty());
}

}  // namespace
}  // namespace ucp::layouts
