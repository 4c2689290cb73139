// formats::PlaceTarget as data: the facts the Megatron writers (and
// MindSpore's --tp/--pp/--dp) derive from universal content. Expected
// placements are Megatron's own rule, written by hand: pp stages hold
// consecutive equal blocks of layers
// (megatron/core/transformer/transformer_block.py, get_num_layers_to_build),
// and with vpp the layers go round-robin over the chunks
// (get_transformer_layer_offset).

#include "engine/formats/placed_target.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/core/error.h"
#include "layouts/layout.h"
#include "tests/unit/engine/formats/stub_input.h"

namespace ucp::formats {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

// Universal content of params only (no datasets): what PlaceTarget reads.
using ParamsOnly = testutil::StubInput;

atoms::StoredParam Param(std::string name, Shape shape) {
  atoms::StoredParam p;
  p.info.fqn = std::move(name);
  p.info.shape = std::move(shape);
  return p;
}

// A 4-layer Megatron-core GPT: vocab 1000 (stored with `vocab_rows` rows),
// hidden 8, fc2 [8, 16].
ParamsOnly Gpt(int64_t vocab_rows = 1000, bool with_layout = true) {
  universal::Model m;
  if (with_layout) m.layout_yaml = layouts::Layout::Builtin("mcore-gpt").yaml();
  for (const auto& [k, v] : std::vector<std::pair<std::string, int64_t>>{
           {"num_layers", 4},
           {"vocab_size", 1000},
           {"make_vocab_size_divisible_by", 128},
           {"num_attention_heads", 4}})
    m.variables.Set(k, v);
  std::vector<atoms::StoredParam> ps;
  ps.push_back(Param("embedding.word_embeddings.weight", {vocab_rows, 8}));
  for (int l = 0; l < 4; ++l) {
    ps.push_back(
        Param(StrCat("decoder.layers.", l, ".mlp.linear_fc2.weight"), {8, 16}));
  }
  return ParamsOnly(std::move(m), std::move(ps));
}

layouts::Topology Topo(int64_t tp, int64_t pp, int64_t vpp, int64_t dp) {
  layouts::Topology t;
  t.tp = tp;
  t.pp = pp;
  t.vpp = vpp;
  t.dp = dp;
  return t;
}

TEST(PlacedTargetTest, PlacesLayersAsMegatronDoes) {
  const ParamsOnly in = Gpt();
  const PlacedTarget t = PlaceTarget(in, {Topo(2, 2, 1, 3), std::nullopt});
  EXPECT_EQ(t.layout.name(), "mcore-gpt");
  EXPECT_EQ(t.topology.tp, 2);
  EXPECT_EQ(t.topology.dp, 3);
  EXPECT_EQ(t.vars.Get("num_layers"), 4);
  EXPECT_EQ(t.vars.Get("vocab_size"), 1000);
  EXPECT_FALSE(t.vocab_rows.has_value());
  // pp 2: stage 0 holds layers 0, 1; stage 1 holds 2, 3.
  int checked = 0;
  const layouts::LayerLocation want[] = {
      {0, 0, 0}, {0, 0, 1}, {1, 0, 0}, {1, 0, 1}};
  for (int64_t l = 0; l < 4; ++l, ++checked)
    EXPECT_EQ(t.placement.Locate(l), want[l]) << l;
  EXPECT_EQ(checked, 4);
  EXPECT_EQ(t.placement.StageLayers(0), 2);
}

TEST(PlacedTargetTest, VirtualPipelineChunksGoRoundRobin) {
  const ParamsOnly in = Gpt();
  const PlacedTarget t = PlaceTarget(in, {Topo(1, 2, 2, 1), std::nullopt});
  // pp 2 x vpp 2, one layer per chunk: chunk 0 of stages 0, 1 holds layers
  // 0, 1; chunk 1 holds 2, 3.
  const layouts::LayerLocation want[] = {
      {0, 0, 0}, {1, 0, 0}, {0, 1, 0}, {1, 1, 0}};
  for (int64_t l = 0; l < 4; ++l) EXPECT_EQ(t.placement.Locate(l), want[l]);
  // Negative control: the same content at pp 2 without vpp differs.
  const PlacedTarget flat = PlaceTarget(in, {Topo(1, 2, 1, 1), std::nullopt});
  EXPECT_NE(flat.placement.Locate(1), want[1]);
}

TEST(PlacedTargetTest, GivenTrueVocabSizeMarksRowsOnlyWhenUnknown) {
  const ParamsOnly in = Gpt(1024);  // padded rows stored as real
  // Content that knew its vocabulary: 1024 stored rows are not 1000.
  EXPECT_THAT(
      [&] {
        PlaceTarget(in, {Topo(1, 1, 1, 1), 1000, true});
      },
      ThrowsMessage<LayoutError>(HasSubstr("holds 1024")));
  // Content that did not: the given size marks rows 1000.. as padding.
  const PlacedTarget unknown = PlaceTarget(in, {Topo(1, 1, 1, 1), 1000, false});
  ASSERT_TRUE(unknown.vocab_rows.has_value());
  EXPECT_EQ(*unknown.vocab_rows, 1000);
  EXPECT_EQ(unknown.vars.Get("vocab_size"), 1000);
  // Without a given size nothing is marked.
  EXPECT_THAT(
      [&] {
        PlaceTarget(in, {Topo(1, 1, 1, 1), {}, false});
      },
      ThrowsMessage<LayoutError>(HasSubstr("holds 1024")));
  const PlacedTarget exact = PlaceTarget(Gpt(1000), {Topo(1, 1, 1, 1), 1000});
  EXPECT_FALSE(exact.vocab_rows.has_value());
}

TEST(PlacedTargetTest, RefusesWhatCannotBePlaced) {
  const ParamsOnly in = Gpt();
  EXPECT_THAT(
      [&] {
        PlaceTarget(in, {Topo(1, 1, 2, 1), {}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("needs pp > 1")));
  EXPECT_THAT(
      [&] {
        PlaceTarget(in, {Topo(1, 1, 1, 0), {}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("sizes must be >= 1")));
  // fc2's dim 1 (16) does not split over tp 3.
  EXPECT_THAT(
      [&] {
        PlaceTarget(in, {Topo(3, 1, 1, 1), {}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("linear_fc2")));
  // 4 layers do not split over pp 3.
  EXPECT_THAT(
      [&] {
        PlaceTarget(in, {Topo(1, 3, 1, 1), {}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("3")));
  const ParamsOnly bare = Gpt(1000, false);
  EXPECT_THAT(
      [&] {
        PlaceTarget(bare, {Topo(1, 1, 1, 1), {}});
      },
      ThrowsMessage<FormatError>(AllOf(HasSubstr("content.ucp.h5"),
                                       HasSubstr("has no layout descriptor"))));
}

// Content without a descriptor (a MindSpore checkpoint's) placed by a
// layout the request gives, its layers counted from the names when its
// variables do not say: the same placement as content that records both.
TEST(PlacedTargetTest, RequestLayoutAndCountedLayers) {
  ParamsOnly bare = Gpt(1000, false);
  PlaceRequest request{Topo(1, 2, 1, 1), std::nullopt};
  request.layout = layouts::Layout::Builtin("mcore-gpt");
  const PlacedTarget t = PlaceTarget(bare, request);
  EXPECT_EQ(t.layout.name(), "mcore-gpt");
  const PlacedTarget want = PlaceTarget(Gpt(), {Topo(1, 2, 1, 1), {}});
  int checked = 0;
  for (int64_t l = 0; l < 4; ++l, ++checked)
    EXPECT_EQ(t.placement.Locate(l), want.placement.Locate(l)) << l;
  EXPECT_EQ(checked, 4);

  // Params only (no num_layers): counted from the layer indices, 0..3.
  const ParamsOnly in = Gpt();
  std::vector<layouts::ParamShape> shapes;
  for (const atoms::StoredParam& p : in.params())
    shapes.push_back({p.info.fqn, p.info.shape});
  layouts::Variables given;
  given.Set("vocab_size", 1000);
  given.Set("make_vocab_size_divisible_by", 128);
  given.Set("num_attention_heads", 4);
  PlaceRequest counted{Topo(1, 2, 1, 1), std::nullopt};
  counted.count_layers = true;
  const PlacedTarget c = PlaceParams(layouts::Layout::Builtin("mcore-gpt"),
                                     given, shapes, counted);
  EXPECT_EQ(c.vars.Get("num_layers"), 4);
  EXPECT_EQ(c.placement.StageLayers(0), 2);
  // Not counted: the layout's num_layers is unknown.
  EXPECT_THROW(PlaceParams(layouts::Layout::Builtin("mcore-gpt"), given, shapes,
                           {Topo(1, 2, 1, 1), std::nullopt}),
               LayoutError);
  // Counted over pp 3: 4 layers do not split.
  counted.topology = Topo(1, 3, 1, 1);
  EXPECT_THROW(PlaceParams(layouts::Layout::Builtin("mcore-gpt"), given, shapes,
                           counted),
               LayoutError);
}

// A 2-layer Mixtral-like MoE model of 4 routed experts (mcore-moe-mixtral);
// `bias`: the experts have biases.
ParamsOnly Mixtral(bool bias = false) {
  universal::Model m;
  m.layout_yaml = layouts::Layout::Builtin("mcore-moe-mixtral").yaml();
  for (const auto& [k, v] : std::vector<std::pair<std::string, int64_t>>{
           {"num_layers", 2},
           {"vocab_size", 128},
           {"make_vocab_size_divisible_by", 64},
           {"num_attention_heads", 4},
           {"num_query_groups", 2},
           {"num_moe_experts", 4}})
    m.variables.Set(k, v);
  std::vector<atoms::StoredParam> ps;
  ps.push_back(Param("embedding.word_embeddings.weight", {128, 16}));
  for (int l = 0; l < 2; ++l) {
    ps.push_back(
        Param(StrCat("decoder.layers.", l, ".mlp.router.weight"), {4, 16}));
    for (int e = 0; e < 4; ++e) {
      const std::string x = StrCat("decoder.layers.", l, ".mlp.experts.", e);
      ps.push_back(Param(x + ".linear_fc1.weight", {16, 16}));
      ps.push_back(Param(x + ".linear_fc2.weight", {16, 8}));
      if (bias) ps.push_back(Param(x + ".linear_fc2.bias", {16}));
    }
  }
  return ParamsOnly(std::move(m), std::move(ps));
}

TEST(PlacedTargetTest, ExpertSizesMegatronRefusesAreUsageErrorsNamingThem) {
  const ParamsOnly moe = Mixtral();
  PlaceRequest r{Topo(1, 1, 1, 3), std::nullopt};
  r.topology.ep = 3;  // 4 experts
  r.experts = true;
  EXPECT_THAT([&] { PlaceTarget(moe, r); },
              ThrowsMessage<UsageError>(
                  HasSubstr("--ep 3 does not divide the 4 experts")));
  // Expert parallelism without experts (Megatron-LM's arguments).
  PlaceRequest dense{Topo(1, 1, 1, 2), std::nullopt};
  dense.topology.ep = 2;
  EXPECT_THAT([&] { PlaceTarget(Gpt(), dense); },
              ThrowsMessage<UsageError>(HasSubstr("has no routed experts")));
  // Expert biases with ETP > 1 (TransformerConfig: only with ETP 1).
  const ParamsOnly biased = Mixtral(/*bias=*/true);
  PlaceRequest b{Topo(2, 1, 1, 2), std::nullopt};
  b.topology.ep = 2;
  b.experts = true;
  EXPECT_THAT([&] { PlaceTarget(biased, b); },
              ThrowsMessage<UsageError>(HasSubstr("--etp 2: the experts have "
                                                  "biases")));
  // Control: at ETP 1 the size check passes (this layout then has no rule
  // for expert biases).
  b.topology.etp = 1;
  EXPECT_THAT([&] { PlaceTarget(biased, b); },
              ThrowsMessage<LayoutError>(HasSubstr("linear_fc2.bias")));
}

TEST(PlacedTargetTest, ExpertsPlacedOnlyForAWriterThatPlacesThem) {
  const ParamsOnly moe = Mixtral();
  PlaceRequest r{Topo(1, 1, 1, 4), std::nullopt};
  r.topology.ep = 4;
  EXPECT_THAT([&] { PlaceTarget(moe, r); },
              ThrowsMessage<UsageError>(HasSubstr("mixture-of-experts")));
  r.experts = true;
  const PlacedTarget t = PlaceTarget(moe, r);
  EXPECT_EQ(t.topology.ep, 4);
  EXPECT_EQ(t.topology.ExpertDp(), 1);
  EXPECT_EQ(t.layout.NumExperts(t.vars), 4);
}

}  // namespace
}  // namespace ucp::formats
