// Mixture of experts in the layouts: the ep/etp topology and Megatron's two
// rank grids, the expert placement over EP, the MoE built-ins, and where every
// element of every param of a MoE model lands at many EP/ETP/TP/PP/DP. The
// expectations are written here from the spec (layouts/README.md "Mixture of
// experts"; Megatron-core's RankGenerator with its default order
// tp-cp-ep-dp-pp, local_expert_indices, apply_swiglu_sharded_factory; the
// names real megatron-core 0.16 gives a GPTModel with SequentialMLP experts),
// by enumeration rather than by the code's formulas.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "engine/core/error.h"
#include "layouts/layout.h"
#include "layouts/placement.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

Topology MoeTopo(int64_t tp, int64_t pp, int64_t dp, int64_t ep,
                 std::optional<int64_t> etp = std::nullopt) {
  Topology t = Topo(tp, pp, 1, dp);
  t.ep = ep;
  t.etp = etp;
  return t;
}

// ---------------------------------------------------------------- topology

TEST(MoeTopologyTest, ExpertSizesAndNames) {
  const Topology dense = Topo(2, 4);
  EXPECT_EQ(dense.ExpertTp(), 2);
  EXPECT_EQ(dense.ExpertDp(), 1);
  EXPECT_EQ(dense.ToString(), "tp=2 pp=4 vpp=1 dp=1");  // as before experts
  // world 16 = tp 2 x pp 2 x dp 4; expert grid etp 1 x ep 4 x pp 2 -> edp 2
  const Topology t = MoeTopo(2, 2, 4, 4, 1);
  EXPECT_EQ(t.ExpertTp(), 1);
  EXPECT_EQ(t.ExpertDp(), 2);
  EXPECT_EQ(t.ToString(), "tp=2 pp=2 vpp=1 dp=4 ep=4 etp=1");
  EXPECT_EQ(MoeTopo(2, 1, 2, 2).ToString(), "tp=2 pp=1 vpp=1 dp=2 ep=2");
  EXPECT_EQ(MoeTopo(2, 1, 2, 2).ExpertDp(), 1);
  EXPECT_EQ(MoeTopo(1, 1, 2, 4).ExpertDp(), 0);  // does not divide
}

TEST(MoeTopologyTest, ValidationNamesTheNumbers) {
  EXPECT_NO_THROW(ValidateParallelSizes(Topo(2, 2, 1, 3)));
  EXPECT_NO_THROW(ValidateParallelSizes(MoeTopo(2, 1, 4, 8, 1)));
  EXPECT_THAT([] { ValidateParallelSizes(MoeTopo(1, 1, 1, 0)); },
              ThrowsMessage<LayoutError>(HasSubstr(
                  "topology tp=1 pp=1 vpp=1 dp=1 ep=0: sizes must be >= 1")));
  EXPECT_THAT([] { ValidateParallelSizes(MoeTopo(1, 1, 1, 1, 0)); },
              ThrowsMessage<LayoutError>(HasSubstr("sizes must be >= 1")));
  EXPECT_THAT(
      [] { ValidateParallelSizes(MoeTopo(1, 2, 2, 4)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "topology tp=1 pp=2 vpp=1 dp=2 ep=4: etp 1 x ep 4 x pp 2 = 8 does "
          "not divide the world of tp 1 x pp 2 x dp 2 = 4 ranks")));
  EXPECT_THAT([] { ValidateParallelSizes(MoeTopo(2, 1, 3, 1, 4)); },
              ThrowsMessage<LayoutError>(HasSubstr(
                  "etp 4 x ep 1 x pp 1 = 4 does not divide the world of tp 2 "
                  "x pp 1 x dp 3 = 6 ranks")));
  // Every placement checks it.
  EXPECT_THAT([] { LayerPlacement(4, MoeTopo(1, 2, 2, 4)); },
              ThrowsMessage<LayoutError>(HasSubstr("does not divide")));
}

// Megatron's RankGenerator: ranks enumerated with the first name of the
// order fastest: dense tp, (cp), dp, pp; expert etp, ep, edp, pp.
TEST(MoeTopologyTest, RankCoordinatesFollowMegatronsOrder) {
  int checked = 0;
  int invalid = 0;
  for (int64_t tp : {1, 2, 4}) {
    for (int64_t pp : {1, 2, 3}) {
      for (int64_t dp : {1, 2, 3, 4}) {
        for (int64_t ep : {1, 2, 4}) {
          for (int64_t etp : {1, 2, 4}) {
            const Topology t = MoeTopo(tp, pp, dp, ep, etp);
            SCOPED_TRACE(t.ToString());
            if ((tp * dp) % (etp * ep) != 0) {
              EXPECT_THROW(CoordinatesOf(t, 0), LayoutError);
              ++invalid;
              continue;
            }
            const int64_t edp = tp * dp / (etp * ep);
            std::vector<RankCoordinates> want(tp * pp * dp);
            int64_t r = 0;
            for (int64_t p = 0; p < pp; ++p) {
              for (int64_t d = 0; d < dp; ++d) {
                for (int64_t x = 0; x < tp; ++x) {
                  want[r].tp = x;
                  want[r].dp = d;
                  want[r].pp = p;
                  EXPECT_EQ(DenseRank(t, x, d, p), r);
                  ++r;
                }
              }
            }
            r = 0;
            for (int64_t p = 0; p < pp; ++p) {
              for (int64_t d = 0; d < edp; ++d) {
                for (int64_t e = 0; e < ep; ++e) {
                  for (int64_t x = 0; x < etp; ++x) {
                    EXPECT_EQ(want[r].pp, p);  // both grids agree on the stage
                    want[r].etp = x;
                    want[r].ep = e;
                    want[r].edp = d;
                    EXPECT_EQ(ExpertRank(t, x, e, d, p), r);
                    ++r;
                  }
                }
              }
            }
            ASSERT_EQ(r, WorldSize(t));
            for (int64_t rank = 0; rank < r; ++rank) {
              EXPECT_EQ(CoordinatesOf(t, rank), want[rank]) << "rank " << rank;
              ++checked;
            }
            EXPECT_THROW(CoordinatesOf(t, r), LayoutError);
            EXPECT_THROW(ExpertRank(t, etp, 0, 0, 0), LayoutError);
          }
        }
      }
    }
  }
  EXPECT_GE(checked, 2000);
  EXPECT_GE(invalid, 20);
}

// What megatron-core 0.16's own RankGenerator says
// (data/mcore_0.16_rank_grid.json, written by make_mcore_rank_grid.py from
// parallel_state.RankGenerator with the default order).
TEST(MoeTopologyTest, RankCoordinatesMatchMegatronCore) {
  const nlohmann::json grid = nlohmann::json::parse(
      testutil::ReadFile(testutil::SourceDir() /
                         "tests/unit/layouts/data/mcore_0.16_rank_grid.json"));
  ASSERT_EQ(grid.at("columns"),
            nlohmann::json::parse(
                R"(["tp","dp","pp","etp","ep","edp","expert_pp"])"));
  int runs = 0;
  int ranks = 0;
  int etp_differs = 0;
  for (const nlohmann::json& run : grid.at("runs")) {
    const Topology t = MoeTopo(run.at("tp"), run.at("pp"), run.at("dp"),
                               run.at("ep"), run.at("etp").get<int64_t>());
    SCOPED_TRACE(t.ToString());
    ASSERT_EQ(static_cast<int64_t>(run.at("ranks").size()), WorldSize(t));
    for (size_t r = 0; r < run.at("ranks").size(); ++r) {
      const nlohmann::json& m = run.at("ranks")[r];
      const RankCoordinates c = CoordinatesOf(t, static_cast<int64_t>(r));
      const std::vector<int64_t> got = {c.tp, c.dp,  c.pp, c.etp,
                                        c.ep, c.edp, c.pp};
      EXPECT_EQ(got, m.get<std::vector<int64_t>>()) << "rank " << r;
      ++ranks;
    }
    etp_differs += t.ExpertTp() != t.tp;
    ++runs;
  }
  EXPECT_GE(runs, 200);
  EXPECT_GE(ranks, 3000);
  EXPECT_GE(etp_differs, 100);
}

// Megatron's local_expert_indices: ep rank r holds global experts
// r * E/EP + i for i < E/EP.
TEST(MoeExpertPlacementTest, ContiguousBlocksPerEpRank) {
  int checked = 0;
  for (int64_t experts = 1; experts <= 16; ++experts) {
    for (int64_t ep = 1; ep <= 16; ++ep) {
      if (experts % ep != 0) {
        EXPECT_THAT([&] { ExpertPlacement(experts, ep); },
                    ThrowsMessage<LayoutError>(HasSubstr(
                        "ep " + std::to_string(ep) + " does not divide the " +
                        std::to_string(experts) + " experts")));
        continue;
      }
      const ExpertPlacement placement(experts, ep);
      std::vector<ExpertLocation> want;
      for (int64_t r = 0; r < ep; ++r) {
        for (int64_t i = 0; i < experts / ep; ++i) want.push_back({r, i});
      }
      ASSERT_EQ(static_cast<int64_t>(want.size()), experts);
      for (int64_t e = 0; e < experts; ++e) {
        EXPECT_EQ(placement.Locate(e), want[e]) << experts << " " << ep;
        EXPECT_EQ(placement.Global(want[e].ep_rank, want[e].local_index), e);
        const LayerRange range = placement.ExpertsOf(want[e].ep_rank);
        EXPECT_TRUE(range.begin <= e && e < range.end);
        ++checked;
      }
      EXPECT_THROW(placement.Locate(experts), LayoutError);
      EXPECT_THROW(placement.Global(0, experts / ep), LayoutError);
      EXPECT_THROW(placement.ExpertsOf(ep), LayoutError);
    }
  }
  EXPECT_GE(checked, 100);
  EXPECT_THROW(ExpertPlacement(0, 1), LayoutError);
  EXPECT_THROW(ExpertPlacement(4, 0), LayoutError);
}

// ---------------------------------------------------------------- descriptor

constexpr char kMoeHead[] = R"(name: t
layers: {prefix: "decoder.layers.", count: n}
)";

void ExpectMoeParseError(const std::string& body, const std::string& message) {
  SCOPED_TRACE(body);
  EXPECT_THAT([&] { Layout::Parse(body, "t.yaml"); },
              ThrowsMessage<LayoutError>(HasSubstr(message)));
}

TEST(MoeDescriptorTest, ParsesExpertsAndEp) {
  const Layout l = Layout::Parse(std::string(kMoeHead) + R"(experts:
  infix: "mlp.experts."
  count: e
  moe_layers: "layer % 2 == 1"
rules:
  - name: fc1
    match: "decoder.layers.*.mlp.experts.*.fc1"
    ep: split
    tp: {split: {dim: 0, segments: 2}}
  - name: router
    match: "decoder.layers.*.mlp.router"
    ep: replicated
)",
                                 "t.yaml");
  ASSERT_TRUE(l.experts().has_value());
  EXPECT_EQ(l.experts()->infix, "mlp.experts.");
  EXPECT_TRUE(l.RuleNamed("fc1")->expert);
  EXPECT_FALSE(l.RuleNamed("router")->expert);
  EXPECT_EQ(l.NumExperts({{"e", 6}}), 6);
  EXPECT_THAT(
      [&] {
        l.NumExperts({{"e", 0}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("is 0, not >= 1")));
  EXPECT_FALSE(l.IsMoeLayer(0, {}));
  EXPECT_TRUE(l.IsMoeLayer(3, {}));

  const std::string name = "decoder.layers.12.mlp.experts.7.fc1";
  const std::optional<ExpertName> split = l.SplitExpert(name);
  ASSERT_TRUE(split.has_value());
  EXPECT_EQ(*split,
            (ExpertName{"decoder.layers.12.mlp.experts.", 12, 7, ".fc1"}));
  EXPECT_EQ(l.WithExpert(name, 31), "decoder.layers.12.mlp.experts.31.fc1");
  for (const char* not_expert :
       {"decoder.layers.12.mlp.router", "decoder.layers.1.mlp.experts.fc1",
        "decoder.layers.1.mlp.experts.7", "decoder.layers.x.mlp.experts.1.a",
        "decoder.layers.1.x.mlp.experts.1.a", "mlp.experts.1.fc1",
        "decoder.layers.1.mlp.experts.local_experts.1.fc1"}) {
    EXPECT_FALSE(l.SplitExpert(not_expert).has_value()) << not_expert;
  }
  EXPECT_THAT([&] { l.WithExpert("decoder.layers.1.mlp.router", 0); },
              ThrowsMessage<LayoutError>(HasSubstr("has no expert index")));
  EXPECT_THROW(l.WithExpert(name, -1), LayoutError);

  // A name with an expert index needs an expert rule, and the reverse.
  const Layout mixed = Layout::Parse(std::string(kMoeHead) + R"(experts:
  infix: "mlp.experts."
  count: e
rules:
  - name: expert
    match: "decoder.layers.*.mlp.experts.*.w"
    ep: split
  - name: dense
    match: "decoder.layers.*.v"
)",
                                     "t.yaml");
  const std::vector<std::string> names = {
      "decoder.layers.0.mlp.experts.3.w", "decoder.layers.0.mlp.experts.4.w",
      "decoder.layers.0.mlp.experts.x.w", "decoder.layers.0.mlp.experts.1.v"};
  const std::vector<Diagnostic> d = mixed.Check(names, {{"e", 4}});
  EXPECT_EQ(d[0].rule, "expert");
  EXPECT_THAT(d[1].problem,
              HasSubstr("expert 4 but the model has 4 experts (e)"));
  EXPECT_THAT(d[2].problem, HasSubstr("is for expert params but "
                                      "'decoder.layers.0.mlp.experts.x.w' "
                                      "has no expert index"));
  EXPECT_THAT(d[3].problem, HasSubstr("is not for expert params"));
  // Dense layouts have no expert names.
  EXPECT_FALSE(Layout::Builtin("mcore-llama")
                   .SplitExpert("decoder.layers.0.mlp.experts.1.linear_fc1.w")
                   .has_value());
  EXPECT_EQ(Layout::Builtin("mcore-llama").NumExperts({}), 0);
}

TEST(MoeDescriptorTest, ErrorsNameTheProblem) {
  const std::string rule = R"(rules:
  - name: r
    match: "decoder.layers.*.mlp.experts.*.w"
    ep: split
)";
  ExpectMoeParseError(std::string(kMoeHead) + rule,
                      "t.yaml:6:9: rule 'r': ep: split needs an experts "
                      "section");
  const std::string experts = "experts: {infix: \"mlp.experts.\", count: e}\n";
  ExpectMoeParseError(
      std::string(kMoeHead) + experts + R"(rules:
  - name: r
    match: "decoder.layers.*.w"
    ep: sharded
)",
      "rule 'r': ep must be split or replicated, not 'sharded'");
  ExpectMoeParseError(std::string(kMoeHead) + experts + R"(rules:
  - name: r
    match: ["decoder.layers.*.mlp.experts.*.w", "decoder.layers.*.w"]
    ep: split
)",
                      "rule 'r': ep: split, but the pattern "
                      "'decoder.layers.*.w' does not contain the experts "
                      "infix '.mlp.experts.'");
  ExpectMoeParseError(std::string(kMoeHead) +
                          "experts: {infix: \"mlp.experts\", count: e}\n" +
                          rule,
                      "experts.infix 'mlp.experts' must be a literal dotted "
                      "name ending in '.'");
  ExpectMoeParseError(
      std::string(kMoeHead) + "experts: {infix: \"mlp.*.\", count: e}\n" + rule,
      "must be a literal dotted name");
  ExpectMoeParseError(
      std::string(kMoeHead) + "experts: {infix: \"mlp.experts.\"}\n" + rule,
      "experts: missing 'count'");
  ExpectMoeParseError(std::string(kMoeHead) +
                          "experts: {infix: \"a.\", count: e, moe_layers: "
                          "\"tp > 1\"}\n" +
                          rule,
                      "experts.moe_layers: 'tp' is a topology variable");
  ExpectMoeParseError(std::string(kMoeHead) +
                          "experts: {infix: \"a.\", count: e, size: 2}\n" +
                          rule,
                      "experts: unknown key 'size'");
  ExpectMoeParseError("name: t\nexperts: {infix: \"a.\", count: e}\n" + rule,
                      "experts: needs a layers section");
  ExpectMoeParseError(std::string(kMoeHead) + experts + R"(rules:
  - name: r
    match: "embedding.mlp.experts.*.w"
    stage: first
    ep: split
)",
                      "rule 'r': ep: split is for layer params");
}

// ---------------------------------------------------------------- built-ins

// A GPTModel of megatron-core 0.16 with get_gpt_decoder_block_spec(local
// spec, RMSNorm): 4 SequentialMLP experts, top-2 router, GQA, SwiGLU, 2
// layers, hidden 16, moe_ffn 8; DeepSeek-like: moe_layer_freq [0, 1] and a
// shared expert. model.state_dict() names (the experts' local_experts.<i>
// with i = the global index at EP 1, written here in the canonical form
// mlp.experts.<e>.), and the names of its sharded state dict that differ
// (pre_mlp_layernorm as mlp.linear_fc1.layer_norm_weight).
using MoeExpected = std::vector<std::pair<std::string, std::string>>;

MoeExpected MoeLayerNames(int layer, bool shared) {
  const std::string p = "decoder.layers." + std::to_string(layer) + ".";
  MoeExpected e = {
      {p + "input_layernorm.weight", "input_norm"},
      {p + "self_attention.linear_proj.weight", "attn_proj"},
      {p + "self_attention.linear_proj._extra_state", "layer_extra_state"},
      {p + "self_attention.linear_qkv.weight", "qkv"},
      {p + "self_attention.linear_qkv._extra_state", "layer_extra_state"},
      {p + "pre_mlp_layernorm.weight", "mlp_norm"},
      {p + "mlp.linear_fc1.layer_norm_weight", "mlp_norm"},
      {p + "mlp.router.weight", "router"}};
  for (int x = 0; x < 4; ++x) {
    const std::string ex = p + "mlp.experts." + std::to_string(x) + ".";
    e.push_back({ex + "linear_fc1.weight", "expert_fc1"});
    e.push_back({ex + "linear_fc1._extra_state", "expert_extra_state"});
    e.push_back({ex + "linear_fc2.weight", "expert_fc2"});
    e.push_back({ex + "linear_fc2._extra_state", "expert_extra_state"});
  }
  if (shared) {
    e.push_back({p + "mlp.shared_experts.linear_fc1.weight", "shared_fc1"});
    e.push_back({p + "mlp.shared_experts.linear_fc1._extra_state",
                 "layer_extra_state"});
    e.push_back({p + "mlp.shared_experts.linear_fc2.weight", "shared_fc2"});
    e.push_back({p + "mlp.shared_experts.linear_fc2._extra_state",
                 "layer_extra_state"});
    e.push_back({p + "mlp.router.expert_bias", "router_expert_bias"});
    e.push_back({p + "mlp.shared_experts.gate_weight", "shared_gate"});
  }
  return e;
}

MoeExpected MoeModelNames(bool deepseek) {
  MoeExpected e = {{"embedding.word_embeddings.weight", "word_embeddings"}};
  if (deepseek) {
    const MoeExpected dense = {
        {"decoder.layers.0.input_layernorm.weight", "input_norm"},
        {"decoder.layers.0.self_attention.linear_proj.weight", "attn_proj"},
        {"decoder.layers.0.self_attention.linear_qkv.weight", "qkv"},
        {"decoder.layers.0.self_attention.linear_qkv._extra_state",
         "layer_extra_state"},
        {"decoder.layers.0.pre_mlp_layernorm.weight", "mlp_norm"},
        {"decoder.layers.0.mlp.linear_fc1.weight", "fc1_swiglu"},
        {"decoder.layers.0.mlp.linear_fc1._extra_state", "layer_extra_state"},
        {"decoder.layers.0.mlp.linear_fc2.weight", "fc2"},
        {"decoder.layers.0.mlp.linear_fc2._extra_state", "layer_extra_state"}};
    e.insert(e.end(), dense.begin(), dense.end());
  } else {
    const MoeExpected first = MoeLayerNames(0, false);
    e.insert(e.end(), first.begin(), first.end());
  }
  const MoeExpected moe = MoeLayerNames(1, deepseek);
  e.insert(e.end(), moe.begin(), moe.end());
  e.insert(e.end(),
           {{"decoder.final_layernorm.weight", "final_norm"},
            {"output_layer.weight", "output_layer"},
            {"output_layer._extra_state", "output_layer_extra_state"}});
  return e;
}

std::vector<std::string> MoeNamesOf(const MoeExpected& e) {
  std::vector<std::string> out;
  for (const auto& [name, rule] : e) out.push_back(name);
  return out;
}

TEST(MoeBuiltinTest, RulesOfMegatronCoreNames) {
  const Variables vars = {{"num_layers", 2}, {"num_moe_experts", 4}};
  for (const bool deepseek : {false, true}) {
    const MoeExpected expected = MoeModelNames(deepseek);
    const std::vector<std::string> names = MoeNamesOf(expected);
    const Layout l =
        Layout::Builtin(deepseek ? "mcore-moe-deepseek" : "mcore-moe-mixtral");
    const std::vector<Diagnostic> d = l.Check(names, vars);
    ASSERT_EQ(d.size(), expected.size());
    for (size_t i = 0; i < d.size(); ++i) {
      EXPECT_EQ(d[i].rule, expected[i].second)
          << d[i].name << ": " << d[i].problem;
      const Rule* rule = l.RuleNamed(expected[i].second);
      ASSERT_NE(rule, nullptr);
      // Exactly the routed experts' entries are expert-parallel.
      EXPECT_EQ(rule->expert,
                d[i].name.find(".mlp.experts.") != std::string::npos)
          << d[i].name;
    }
    EXPECT_EQ(Layout::DetectBuiltin(names).name(), l.name());
    EXPECT_GE(d.size(), 40u);
    // Megatron's own local names are not canonical: no rule.
    const std::vector<Diagnostic> local = l.Check(
        std::vector<std::string>{
            "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.4.linear_fc1.weight"},
        vars);
    for (const Diagnostic& x : local) EXPECT_FALSE(x.ok()) << x.name;
  }
  // Names of a dense model still go to the dense layouts.
  const std::vector<std::string> dense = {
      "embedding.word_embeddings.weight",
      "decoder.layers.0.self_attention.linear_qkv.weight",
      "decoder.layers.0.mlp.linear_fc1.weight", "output_layer.weight"};
  EXPECT_EQ(Layout::DetectBuiltin(dense).name(), "mcore-llama");
  // The Mixtral-like layout has no dense MLP.
  const Layout mixtral = Layout::Builtin("mcore-moe-mixtral");
  EXPECT_FALSE(mixtral
                   .Check(
                       std::vector<std::string>{
                           "decoder.layers.0.mlp.linear_fc1.weight"},
                       vars)
                   .front()
                   .ok());
}

TEST(MoeBuiltinTest, WhichLayersAreMoe) {
  const Layout deepseek = Layout::Builtin("mcore-moe-deepseek");
  const Layout mixtral = Layout::Builtin("mcore-moe-mixtral");
  std::vector<bool> got, want = {false, true, true, true, true, true};
  for (int64_t l = 0; l < 6; ++l) got.push_back(deepseek.IsMoeLayer(l, {}));
  EXPECT_EQ(got, want);
  // Megatron's int --moe-layer-freq 2 (layers i with i % 2 == 0), three
  // first dense layers
  got.clear();
  want = {false, false, false, false, true, false, true, false};
  for (int64_t l = 0; l < 8; ++l) {
    got.push_back(deepseek.IsMoeLayer(
        l, {{"moe_layer_freq", 2}, {"moe_first_dense_layers", 3}}));
  }
  EXPECT_EQ(got, want);
  for (int64_t l = 0; l < 6; ++l) EXPECT_TRUE(mixtral.IsMoeLayer(l, {}));
  EXPECT_EQ(mixtral.NumExperts({{"num_moe_experts", 8}}), 8);
  EXPECT_THAT([&] { mixtral.NumExperts({}); },
              ThrowsMessage<LayoutError>(HasSubstr("num_moe_experts")));
}

// ---------------------------------------------------------------- placement

// The Mixtral-like test model: 4 layers, hidden 16, 4 heads in 2 query
// groups (head dim 4), 8 experts of ffn 8 (fc1 [gate; up] = 16 rows).
constexpr int64_t kMoeLayers = 4;
constexpr int64_t kMoeHidden = 16;
constexpr int64_t kMoeExperts = 8;
constexpr int64_t kMoeFfn = 8;

Variables MoeVars() {
  return {{"num_layers", kMoeLayers},
          {"vocab_size", 100},
          {"make_vocab_size_divisible_by", 8},
          {"num_attention_heads", 4},
          {"num_query_groups", 2},
          {"num_moe_experts", kMoeExperts}};
}

std::vector<ParamShape> MoeParams() {
  std::vector<ParamShape> p = {
      {"embedding.word_embeddings.weight", {100, kMoeHidden}},
      {"decoder.final_layernorm.weight", {kMoeHidden}},
      {"output_layer.weight", {100, kMoeHidden}}};
  for (int64_t l = 0; l < kMoeLayers; ++l) {
    const std::string pre = "decoder.layers." + std::to_string(l) + ".";
    p.push_back({pre + "input_layernorm.weight", {kMoeHidden}});
    p.push_back({pre + "self_attention.linear_qkv.weight", {32, kMoeHidden}});
    p.push_back(
        {pre + "self_attention.linear_proj.weight", {kMoeHidden, kMoeHidden}});
    p.push_back({pre + "pre_mlp_layernorm.weight", {kMoeHidden}});
    p.push_back({pre + "mlp.router.weight", {kMoeExperts, kMoeHidden}});
    for (int64_t e = 0; e < kMoeExperts; ++e) {
      const std::string ex = pre + "mlp.experts." + std::to_string(e) + ".";
      p.push_back({ex + "linear_fc1.weight", {2 * kMoeFfn, kMoeHidden}});
      p.push_back({ex + "linear_fc2.weight", {kMoeHidden, kMoeFfn}});
    }
  }
  return p;
}

// What the spec says rank `c` holds of `param` at topology `t`: for each
// local element (row-major), the flat index of the global element; empty if
// the rank does not hold the param. Written from Megatron's rules: the
// layer's stage is layer / (L / PP); expert e is on ep rank e / (E / EP);
// column-parallel (dim 0) pieces are contiguous, SwiGLU fc1 pieces are
// [gate rows of the rank; up rows of the rank]; row-parallel (dim 1) pieces
// are contiguous columns; QKV with groups divisible by tp is a plain dim-0
// split; norms and the router are whole on every rank.
std::vector<int64_t> MoeSpecLocal(const ParamShape& param, const Topology& t,
                                  const RankCoordinates& c) {
  const std::string& n = param.name;
  int64_t layer = -1;
  int64_t expert = -1;
  if (n.starts_with("decoder.layers.")) {
    layer = std::stoll(n.substr(15));
    const size_t at = n.find(".mlp.experts.");
    if (at != std::string::npos) expert = std::stoll(n.substr(at + 13));
  }
  if (layer >= 0 && layer / (kMoeLayers / t.pp) != c.pp) return {};
  if (n.starts_with("decoder.final_layernorm") && c.pp != t.pp - 1) return {};
  if (expert >= 0 && expert / (kMoeExperts / t.ep) != c.ep) return {};
  const int64_t rows = param.shape[0];
  const int64_t cols = param.shape.size() > 1 ? param.shape[1] : 1;
  std::vector<int64_t> out;
  auto add_rows = [&](int64_t begin, int64_t count) {
    for (int64_t r = begin; r < begin + count; ++r) {
      for (int64_t k = 0; k < cols; ++k) out.push_back(r * cols + k);
    }
  };
  const bool fc1 = n.ends_with("linear_fc1.weight");
  const bool row_parallel =
      n.ends_with("linear_fc2.weight") || n.ends_with("linear_proj.weight");
  const int64_t tp = expert >= 0 ? t.ExpertTp() : t.tp;
  const int64_t rank = expert >= 0 ? c.etp : c.tp;
  if (fc1) {  // [gate; up], each half cut over tp
    const int64_t per = rows / 2 / tp;
    add_rows(rank * per, per);
    add_rows(rows / 2 + rank * per, per);
  } else if (n.ends_with("linear_qkv.weight")) {
    add_rows(rank * rows / tp, rows / tp);
  } else if (row_parallel) {
    const int64_t per = cols / tp;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = rank * per; k < (rank + 1) * per; ++k) {
        out.push_back(r * cols + k);
      }
    }
  } else {
    add_rows(0, rows);
  }
  return out;
}

// The same from ShardFor: local element -> global flat index.
std::vector<int64_t> MoeShardLocal(const Rule& rule, const ParamShape& param,
                                   const Topology& t,
                                   const RankCoordinates& c) {
  const int64_t tp = TpSizeFor(rule, t);
  const LocalShard shard =
      ShardFor(rule, param.shape, tp, rule.expert ? c.etp : c.tp);
  int64_t local_numel = 1;
  for (int64_t s : shard.local_shape) local_numel *= s;
  std::vector<int64_t> out(local_numel, -1);
  for (const Piece& piece : shard.pieces) {
    EXPECT_EQ(piece.region, Region::kMain);
    const size_t rank = piece.local.size.size();
    Shape idx(rank, 0);
    int64_t numel = 1;
    for (int64_t s : piece.local.size) numel *= s;
    for (int64_t i = 0; i < numel; ++i) {
      int64_t rem = i;
      for (size_t d = rank; d-- > 0;) {
        idx[d] = rem % piece.local.size[d];
        rem /= piece.local.size[d];
      }
      Shape local(rank), global(rank);
      for (size_t d = 0; d < rank; ++d) {
        local[d] = piece.local.offset[d] + idx[d];
        global[d] = piece.global.offset[d] + idx[d];
      }
      out[Flat(shard.local_shape, local)] = Flat(param.shape, global);
    }
  }
  return out;
}

TEST(MoePlacementTest, EveryElementOfEveryParamAtManyTopologies) {
  const Layout layout = Layout::Builtin("mcore-moe-mixtral");
  const Variables vars = MoeVars();
  const std::vector<ParamShape> params = MoeParams();
  int topologies = 0;
  int64_t values = 0;
  for (int64_t tp : {1, 2}) {
    for (int64_t pp : {1, 2}) {
      for (int64_t dp : {1, 2, 4}) {
        for (int64_t ep : {1, 2, 4, 8}) {
          for (int64_t etp : {1, 2, 4}) {
            const Topology t = MoeTopo(tp, pp, dp, ep, etp);
            if ((tp * dp) % (etp * ep) != 0) continue;
            SCOPED_TRACE(t.ToString());
            ValidateTopology(layout, params, vars, t);
            ++topologies;
            const int64_t world = tp * pp * dp;
            const int64_t edp = tp * dp / (etp * ep);
            const LayerPlacement layers(kMoeLayers, t);
            for (const ParamShape& param : params) {
              if (param.name.find("embedding") != std::string::npos ||
                  param.name.starts_with("output_layer")) {
                continue;  // vocab padding: placement_test.cc
              }
              const Rule& rule = layout.Match(param.name, vars);
              // How many ranks hold each element: an expert's over EDP, a
              // split dense param's over DP, a whole dense one's over TP x DP.
              const bool expert =
                  param.name.find(".mlp.experts.") != std::string::npos;
              EXPECT_EQ(rule.expert, expert) << param.name;
              const bool split = rule.tp.split;
              const int64_t copies = expert ? edp : split ? dp : tp * dp;
              EXPECT_EQ(DpSizeFor(rule, t), expert ? edp : dp);
              int64_t numel = 1;
              for (int64_t s : param.shape) numel *= s;
              std::vector<int64_t> count(numel, 0);
              for (int64_t r = 0; r < world; ++r) {
                const RankCoordinates c = CoordinatesOf(t, r);
                const std::vector<int64_t> want = MoeSpecLocal(param, t, c);
                // The layout says whether the rank holds it: its stage owns
                // the layer and, for an expert, its ep rank the expert.
                bool holds =
                    HomeOf(layout, rule, param.name, layers).pp_rank == c.pp;
                if (rule.expert) {
                  const ExpertPlacement experts(layout.NumExperts(vars), t.ep);
                  holds = holds &&
                          experts.Locate(layout.SplitExpert(param.name)->index)
                                  .ep_rank == c.ep;
                }
                ASSERT_EQ(holds, !want.empty()) << param.name << " rank " << r;
                if (!holds) continue;
                const std::vector<int64_t> got =
                    MoeShardLocal(rule, param, t, c);
                ASSERT_EQ(got, want) << param.name << " rank " << r;
                for (int64_t g : got) ++count[g];
                values += static_cast<int64_t>(got.size());
              }
              for (int64_t i = 0; i < numel; ++i) {
                ASSERT_EQ(count[i], copies) << param.name << " element " << i;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(topologies, 56);
  EXPECT_GE(values, 1000000);
}

TEST(MoePlacementTest, ValidationNamesTheNumbers) {
  const Layout layout = Layout::Builtin("mcore-moe-mixtral");
  const std::vector<ParamShape> params = MoeParams();
  const Variables vars = MoeVars();
  EXPECT_NO_THROW(
      ValidateTopology(layout, params, vars, MoeTopo(2, 2, 4, 8, 1)));
  EXPECT_THAT(
      [&] { ValidateTopology(layout, params, vars, MoeTopo(1, 1, 3, 3)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "target topology tp=1 pp=1 vpp=1 dp=3 ep=3 does not fit layout "
          "'mcore-moe-mixtral': param "
          "'decoder.layers.0.mlp.experts.0.linear_fc1.weight' (rule "
          "'expert_fc1' (line ")));
  EXPECT_THAT(
      [&] { ValidateTopology(layout, params, vars, MoeTopo(1, 1, 3, 3)); },
      ThrowsMessage<LayoutError>(
          HasSubstr("ep 3 does not divide the 8 experts")));
  // etp 16 cuts the 8 gate rows of fc1 too fine; tp 16 is fine for nothing
  // else either, but etp is named for the expert param.
  EXPECT_THAT(
      [&] { ValidateTopology(layout, params, vars, MoeTopo(1, 1, 16, 1, 16)); },
      ThrowsMessage<LayoutError>(
          HasSubstr("'decoder.layers.0.mlp.experts.0.linear_fc1.weight' (rule "
                    "'expert_fc1' (line")));
  EXPECT_THAT(
      [&] { ValidateTopology(layout, params, vars, MoeTopo(1, 1, 16, 1, 16)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "etp 16 x 2 segments does not divide dim 0 of size 16 (and 63 more "
          "problems)")));
  EXPECT_THAT(
      [&] { ValidateTopology(layout, params, vars, MoeTopo(1, 2, 2, 4)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "etp 1 x ep 4 x pp 2 = 8 does not divide the world of tp 1 x pp 2 "
          "x dp 2 = 4 ranks")));
  std::vector<ParamShape> extra = params;
  extra.push_back(
      {"decoder.layers.1.mlp.experts.8.linear_fc2.weight", {16, 8}});
  EXPECT_THAT(
      [&] { ValidateTopology(layout, extra, vars, MoeTopo(1, 1, 1, 1)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "param 'decoder.layers.1.mlp.experts.8.linear_fc2.weight' (rule "
          "'expert_fc2' (line")));
  EXPECT_THAT(
      [&] { ValidateTopology(layout, extra, vars, MoeTopo(1, 1, 1, 1)); },
      ThrowsMessage<LayoutError>(
          HasSubstr("expert 8 but the model has 8 experts (num_moe_experts)")));
  // DeepSeek-like: layer 0 is dense (moe_first_dense_layers 1), so an expert
  // there is a problem; with no dense first layer it is not.
  const Layout deepseek = Layout::Builtin("mcore-moe-deepseek");
  const std::vector<ParamShape> one = {
      {"decoder.layers.0.mlp.experts.1.linear_fc2.weight", {16, 8}}};
  EXPECT_THAT(
      [&] { ValidateTopology(deepseek, one, vars, MoeTopo(1, 1, 1, 1)); },
      ThrowsMessage<LayoutError>(HasSubstr(
          "an expert of layer 0, which experts.moe_layers (layer >= "
          "moe_first_dense_layers && layer % moe_layer_freq == 0) makes a "
          "dense layer")));
  EXPECT_NO_THROW(ValidateTopology(deepseek, one,
                                   vars.Merged({{"moe_first_dense_layers", 0}}),
                                   MoeTopo(1, 1, 1, 1)));
  Variables no_count = vars;
  no_count = Variables{{"num_layers", kMoeLayers},
                       {"vocab_size", 100},
                       {"make_vocab_size_divisible_by", 8},
                       {"num_attention_heads", 4},
                       {"num_query_groups", 2}};
  EXPECT_THAT(
      [&] { ValidateTopology(layout, params, no_count, MoeTopo(1, 1, 1, 1)); },
      ThrowsMessage<LayoutError>(HasSubstr("num_moe_experts")));
}

// ----------------------------------------------------------------
// megatron-core

// The canonical name of the chunk of a torch_dist key at prepended-axis
// indices `index` (megatron-core's sharded state dict: a key stacked over
// layers has the layer as its first prepended axis; the experts' key
// ...mlp.experts.experts.X has the global expert as its last one).
std::string MoeOracleName(std::string key, std::vector<int64_t> index) {
  const std::string stacked = ".mlp.experts.experts.";
  const size_t at = key.find(stacked);
  if (at != std::string::npos) {
    key = key.substr(0, at) + ".mlp.experts." + std::to_string(index.back()) +
          "." + key.substr(at + stacked.size());
    index.pop_back();
  }
  const std::string prefix = "decoder.layers.";
  if (key.starts_with(prefix) && !std::isdigit(key[prefix.size()])) {
    key =
        prefix + std::to_string(index.at(0)) + "." + key.substr(prefix.size());
  }
  return key;
}

// What megatron-core 0.16 itself does with its MoE GPTModels
// (data/mcore_0.16_moe_oracle.json, written by make_mcore_moe_oracle.py): at
// every TP/PP/DP/EP/ETP recorded, each rank's coordinates are CoordinatesOf's,
// a rank holds a param exactly when the layout's placement (its layer's stage;
// an expert's ep rank) says so, its chunks of the param are exactly the
// global boxes of ShardFor's pieces over TpSizeFor ranks (the SwiGLU fc1's
// gate and up chunks included), and its replica_id is (0, the tp / etp rank
// for a param whole on every tp / etp rank else 0, the dp / expert-dp rank).
TEST(MoeMcoreOracleTest, PlacesEveryParamLikeMegatronCore) {
  const nlohmann::json oracle = nlohmann::json::parse(
      testutil::ReadFile(testutil::SourceDir() /
                         "tests/unit/layouts/data/mcore_0.16_moe_oracle.json"));
  int runs = 0;
  int64_t chunks = 0;
  int64_t values = 0;
  int64_t expert_chunks = 0;
  for (const nlohmann::json& run : oracle.at("runs")) {
    const Topology t = MoeTopo(run.at("tp"), run.at("pp"), run.at("dp"),
                               run.at("ep"), run.at("etp").get<int64_t>());
    const std::string variant = run.at("variant");
    SCOPED_TRACE(variant + " " + t.ToString());
    const Layout layout = Layout::Builtin("mcore-moe-" + variant);
    const nlohmann::json& sizes = run.at("sizes");
    const Variables vars = {{"num_layers", sizes.at("layers")},
                            {"num_attention_heads", sizes.at("heads")},
                            {"num_query_groups", sizes.at("groups")},
                            {"num_moe_experts", sizes.at("experts")},
                            {"vocab_size", run.at("vocab")},
                            {"make_vocab_size_divisible_by", 1}};
    const LayerPlacement layers(layout.NumLayers(vars), t);
    const ExpertPlacement experts(layout.NumExperts(vars), t.ep);
    // name -> rank -> [(offset, size)], and the full shapes
    using Boxes = std::vector<std::pair<Shape, Shape>>;
    std::map<std::string, std::map<int64_t, Boxes>> held;
    std::map<std::string, Shape> full;
    const nlohmann::json& ranks = run.at("ranks");
    ASSERT_EQ(static_cast<int64_t>(ranks.size()), WorldSize(t));
    for (size_t r = 0; r < ranks.size(); ++r) {
      const nlohmann::json& m = ranks[r].at("coordinates");
      const RankCoordinates c = CoordinatesOf(t, static_cast<int64_t>(r));
      EXPECT_EQ((std::vector<int64_t>{c.tp, c.dp, c.pp, c.etp, c.ep, c.edp}),
                (std::vector<int64_t>{m.at("tp"), m.at("dp"), m.at("pp"),
                                      m.at("etp"), m.at("ep"), m.at("edp")}))
          << "rank " << r;
      for (const nlohmann::json& e : ranks[r].at("entries")) {
        const std::string key = e.at(0);
        const Shape shape = e.at(1).get<Shape>();
        const Shape offset = e.at(2).get<Shape>();
        const size_t n = e.at(4).get<size_t>();
        const std::vector<int64_t> replica =
            e.at(5).get<std::vector<int64_t>>();
        const std::string name =
            MoeOracleName(key, Shape(offset.begin(), offset.begin() + n));
        if (name.starts_with("embedding.") ||
            name.starts_with("output_layer.")) {
          continue;  // vocabulary padding: mcore_oracle_test.cc
        }
        const Rule& rule = layout.Match(name, vars);
        EXPECT_EQ(rule.expert,
                  key.find(".experts.experts.") != std::string::npos)
            << name;
        full[name] = Shape(shape.begin() + n, shape.end());
        held[name][r].emplace_back(Shape(offset.begin() + n, offset.end()),
                                   e.at(3).get<Shape>());
        ASSERT_EQ(replica.size(), 3u) << name;
        const int64_t tp_rank = rule.expert ? c.etp : c.tp;
        EXPECT_EQ(replica, (std::vector<int64_t>{0, rule.tp.split ? 0 : tp_rank,
                                                 rule.expert ? c.edp : c.dp}))
            << name << " rank " << r;
      }
    }
    for (const auto& [name, by_rank] : held) {
      const Rule& rule = layout.Match(name, vars);
      for (int64_t r = 0; r < WorldSize(t); ++r) {
        const RankCoordinates c = CoordinatesOf(t, r);
        bool holds = HomeOf(layout, rule, name, layers).pp_rank == c.pp;
        if (rule.expert) {
          holds =
              holds &&
              experts.Locate(layout.SplitExpert(name)->index).ep_rank == c.ep;
        }
        auto it = by_rank.find(r);
        ASSERT_EQ(holds, it != by_rank.end()) << name << " rank " << r;
        if (!holds) continue;
        const LocalShard shard =
            ShardFor(rule, full.at(name), TpSizeFor(rule, t),
                     rule.expert ? c.etp : c.tp);
        Boxes want;
        for (const Piece& p : shard.pieces)
          want.emplace_back(p.global.offset, p.global.size);
        Boxes got = it->second;
        std::sort(want.begin(), want.end());
        std::sort(got.begin(), got.end());
        EXPECT_EQ(got, want) << name << " rank " << r;
        for (const auto& [offset, size] : got) {
          int64_t numel = 1;
          for (int64_t s : size) numel *= s;
          values += numel;
          ++chunks;
          expert_chunks += rule.expert;
        }
      }
    }
    ++runs;
  }
  EXPECT_EQ(runs, 7);
  EXPECT_GE(chunks, 400);
  EXPECT_GE(expert_chunks, 180);
  EXPECT_GE(values, 50000);
}

}  // namespace
}  // namespace ucp::layouts
