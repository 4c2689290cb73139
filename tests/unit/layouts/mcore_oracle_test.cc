// Checks the mcore-gpt (and mcore-llama) descriptors against what
// Megatron-core core_v0.8.0 itself reports: data/mcore_core_v0.8.0_oracle.json
// was written by make_mcore_oracle.py, which builds the real GPTModel (local
// layer spec) on every rank of several TP/PP/VPP topologies and records each
// state-dict key, its local shape and the global offsets that
// sharded_state_dict() assigns (including the SwiGLU fc1 factory and the
// padded vocabulary). For every entry of every rank and model chunk:
//  - the canonical name (local layer -> global via LayerPlacement) names the
//    same global layer as Megatron's layer axis offset;
//  - exactly one rule matches; opaque entries are the `_extra_state` ones;
//  - the rule's home is this (pp rank, chunk);
//  - ShardFor's local shape equals the real one, and its pieces map every
//    local element to the same global element (padded-vocab coordinates) as
//    Megatron's sharded tensors;
//  - tied copies exist exactly where exists_when says.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "engine/core/box.h"
#include "layouts/layout.h"
#include "layouts/placement.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using json = nlohmann::json;

const json& Oracle() {
  static const json* oracle = new json(json::parse(testutil::ReadFile(
      testutil::SourceDir() /
      "tests/unit/layouts/data/mcore_core_v0.8.0_oracle.json")));
  return *oracle;
}

// Calls fn(local index, global index) for the elements of two equal boxes.
template <typename Fn>
void ForEachPair(const Box& local, const Box& global, Fn&& fn) {
  if (local.NumElements() == 0) return;
  Shape i(local.size.size(), 0);
  while (true) {
    Shape a = i, b = i;
    for (size_t d = 0; d < i.size(); ++d)
      a[d] += local.offset[d], b[d] += global.offset[d];
    fn(a, b);
    size_t d = i.size();
    while (d > 0) {
      --d;
      if (++i[d] < local.size[d]) break;
      i[d] = 0;
      if (d == 0) return;
    }
    if (i.empty()) return;
  }
}

Variables VariablesOf(const json& run) {
  Variables vars;
  for (const auto& [k, v] : run.at("variables").items())
    vars.Set(k, v.get<int64_t>());
  return vars;
}

struct Counts {
  int entries = 0;
  int tensors = 0;
  int swiglu = 0;
  int vocab = 0;
  int tied = 0;
};

// `drop` filters names out (to simulate RMSNorm, which has no norm biases).
void CheckRun(const Layout& layout, const json& run, Counts& counts,
              const std::function<bool(const std::string&)>& drop = nullptr) {
  const Variables vars = layout.Resolve(VariablesOf(run));
  const int64_t tp = run.at("tp"), pp = run.at("pp"), vpp = run.at("vpp");
  const Topology topology = Topo(tp, pp, vpp);
  const LayerPlacement placement(layout.NumLayers(vars), topology);
  const int64_t true_vocab = vars.Get("vocab_size");
  for (const json& rank : run.at("ranks")) {
    const int64_t tp_rank = rank.at("tp_rank"), pp_rank = rank.at("pp_rank");
    for (const json& chunk : rank.at("chunks")) {
      const int64_t vp = chunk.at("vp_chunk");
      SCOPED_TRACE(testing::Message() << "tp_rank " << tp_rank << " pp_rank "
                                      << pp_rank << " chunk " << vp);
      std::set<std::string> names;
      for (const json& e : chunk.at("entries")) {
        const std::string key = e.at("key");
        if (drop && drop(key)) continue;
        SCOPED_TRACE(key);
        ++counts.entries;
        const std::string name =
            CanonicalName(layout, key, placement, pp_rank, vp);
        names.insert(name);
        const Rule& rule = layout.Match(name, vars);
        const Home home = HomeOf(layout, rule, name, placement);
        EXPECT_EQ(home.pp_rank, pp_rank);
        EXPECT_EQ(home.vp_chunk, vp);
        EXPECT_TRUE(rule.Exists(vars, topology));
        if (!e.contains(
                "local_shape")) {  // None: Megatron linears' _extra_state
          EXPECT_EQ(rule.entry, EntryKind::kOpaque);
          continue;
        }
        EXPECT_EQ(rule.entry, EntryKind::kParam);
        const Shape local_shape = e.at("local_shape").get<Shape>();
        const json& parts = e.at("sharded");
        ASSERT_FALSE(parts.empty());
        // Megatron's global tensor: strip the prepended layer axis.
        const json& first = parts.at(0);
        const int prepend = first.at("prepend_axis_num");
        Shape global_shape = first.at("global_shape").get<Shape>();
        if (prepend == 1) {
          ASSERT_TRUE(layout.SplitLayer(name));
          EXPECT_EQ(first.at("global_offset").at(0).get<int64_t>(),
                    layout.SplitLayer(name)->index)
              << "global layer";
          EXPECT_EQ(global_shape.front(), placement.num_layers());
        }
        global_shape.erase(global_shape.begin(),
                           global_shape.begin() + prepend);
        Shape full = global_shape;
        int64_t padded = 0, pad_rows = 0;
        if (rule.tp.vocab) {
          padded = *PaddedDimSize(rule, vars, tp);
          EXPECT_EQ(global_shape.at(rule.tp.dim),
                    padded);  // Megatron's padded size
          full[rule.tp.dim] = true_vocab;
          pad_rows = padded - true_vocab;
          ++counts.vocab;
        }
        EXPECT_EQ(FullShapeFromLocal(rule, local_shape, tp, vars), full);
        const LocalShard shard =
            ShardFor(rule, full, tp, tp_rank, padded, pad_rows);
        ASSERT_EQ(shard.local_shape, local_shape);
        ++counts.tensors;
        if (parts.size() == 2) ++counts.swiglu;
        if (rule.tied_to) ++counts.tied;
        // local element -> padded global element, from Megatron ...
        const int64_t n = [&] {
          int64_t k = 1;
          for (int64_t d : local_shape) k *= d;
          return k;
        }();
        std::vector<int64_t> want(n, -1), got(n, -1);
        for (const json& part : parts) {
          Shape off = part.at("global_offset").get<Shape>();
          off.erase(off.begin(), off.begin() + prepend);
          Shape size = part.at("data_shape").get<Shape>();
          Shape local_off(size.size(), 0);
          local_off[0] = part.at("local_dim0_offset");
          ForEachPair(Box{local_off, size}, Box{off, size},
                      [&](const Shape& l, const Shape& g) {
                        want[Flat(local_shape, l)] = Flat(global_shape, g);
                      });
        }
        // ... and from the pieces (padding rows follow the true size).
        for (const Piece& p : shard.pieces) {
          Box global = p.global;
          if (p.region == Region::kPad)
            global.offset[rule.tp.dim] += true_vocab;
          ForEachPair(p.local, global, [&](const Shape& l, const Shape& g) {
            EXPECT_EQ(got[Flat(local_shape, l)], -1)
                << "two pieces cover one element";
            got[Flat(local_shape, l)] = Flat(global_shape, g);
          });
        }
        ASSERT_EQ(got, want);
      }
      // Tied copies: present on the last stage exactly when exists_when holds.
      if (const Rule* copy = layout.RuleNamed("output_layer_tied");
          copy && vars.Get("tied") && pp_rank == pp - 1 && vp == vpp - 1) {
        EXPECT_EQ(names.count("output_layer.weight") > 0,
                  copy->Exists(vars, topology));
      }
    }
  }
}

TEST(McoreOracleTest, McoreGptPlacesLikeMegatronCore) {
  const Layout layout = Layout::Builtin("mcore-gpt");
  ASSERT_EQ(Oracle().at("megatron"), "core_v0.8.0");
  Counts counts;
  std::set<std::string> configs;
  for (const json& run : Oracle().at("runs")) {
    SCOPED_TRACE(testing::Message()
                 << run.at("config").get<std::string>() << " tp "
                 << run.at("tp") << " pp " << run.at("pp") << " vpp "
                 << run.at("vpp"));
    configs.insert(run.at("config"));
    CheckRun(layout, run, counts);
  }
  EXPECT_EQ(configs.size(), 3u);
  // The oracle exercised what it is meant to.
  EXPECT_GT(counts.tensors, 1000);
  EXPECT_GT(counts.swiglu, 100);
  EXPECT_GT(counts.vocab, 40);
  EXPECT_GT(counts.tied, 5);
}

// mcore-llama on the SwiGLU/GQA/no-bias/RoPE/untied configuration with the
// norm biases removed (Megatron-core 0.8's local spec has no RMSNorm; RMSNorm
// differs from LayerNorm only by having no bias).
TEST(McoreOracleTest, McoreLlamaPlacesLikeMegatronCore) {
  const Layout layout = Layout::Builtin("mcore-llama");
  auto norm_bias = [](const std::string& key) {
    return key.ends_with("layernorm.bias");
  };
  Counts counts;
  for (const json& run : Oracle().at("runs")) {
    if (run.at("config") != "swiglu_gqa_nobias_rope_untied_qknorm") continue;
    SCOPED_TRACE(testing::Message()
                 << "tp " << run.at("tp") << " pp " << run.at("pp") << " vpp "
                 << run.at("vpp"));
    CheckRun(layout, run, counts, norm_bias);
    // Detection on all names of the run.
    std::vector<std::string> names;
    for (const json& rank : run.at("ranks")) {
      for (const json& chunk : rank.at("chunks")) {
        for (const json& e : chunk.at("entries")) names.push_back(e.at("key"));
      }
    }
    EXPECT_EQ(Layout::DetectBuiltin(names).name(),
              "mcore-gpt");  // has norm biases
    std::erase_if(names, norm_bias);
    EXPECT_EQ(Layout::DetectBuiltin(names).name(), "mcore-llama");
  }
  EXPECT_GT(counts.swiglu, 30);
}

TEST(McoreOracleTest, ValidateTopologyAcceptsEveryOracleTopology) {
  const Layout layout = Layout::Builtin("mcore-gpt");
  for (const json& run : Oracle().at("runs")) {
    if (run.at("tp") != 1 || run.at("pp") != 1) continue;
    // Full shapes from the single-rank run (vocab at its true size).
    const Variables vars = VariablesOf(run);
    std::vector<ParamShape> params;
    for (const json& e :
         run.at("ranks").at(0).at("chunks").at(0).at("entries")) {
      if (!e.contains("local_shape")) continue;
      Shape s = e.at("local_shape").get<Shape>();
      const std::string key = e.at("key");
      if (layout.Match(key, vars).tp.vocab) s[0] = vars.Get("vocab_size");
      params.push_back({key, s});
    }
    for (const json& other : Oracle().at("runs")) {
      if (other.at("config") != run.at("config")) continue;
      EXPECT_NO_THROW(ValidateTopology(
          layout, params, vars,
          Topo(other.at("tp"), other.at("pp"), other.at("vpp"))));
    }
    EXPECT_THROW(ValidateTopology(layout, params, vars, Topo(3)), LayoutError);
  }
}

}  // namespace
}  // namespace ucp::layouts
