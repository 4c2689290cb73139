// The distributed optimizer's buffer layout (buffer_layout.h) against cases
// computed by hand from Megatron-core's _ParamAndGradBuffer.__init__
// (core_v0.13.0, core_v0.8.0, core_v0.7.0) and against the generator's
// independent statement of the same rules (tests/tools/megatron_spec.py) for
// every chunk of every generated topology plus seeded random buffers.

#include "engine/formats/megatron/buffer_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <sstream>

#include "engine/core/error.h"
#include "engine/formats/megatron/param_groups.h"
#include "engine/json/json.h"
#include "tests/testutil/testutil.h"

namespace ucp::megatron {
namespace {

BufferLayout Layout(std::vector<BufferParam> params, int64_t dp,
                    bool distopt = true,
                    LayoutRules rules = LayoutRules::kCore013,
                    std::optional<int64_t> bucket_size = std::nullopt) {
  BufferOptions o;
  o.dp = dp;
  o.distributed_optimizer = distopt;
  o.rules = rules;
  o.bucket_size = bucket_size;
  return ComputeBufferLayout(params, o);
}

// megatron.md 1.6 worked example: named_parameters [B:50, A:100]; reversed, A
// sits at 0, B at the next multiple of 64; the bucket ends padded to
// lcm(4, 128) = 128.
TEST(BufferLayout, WorkedExample) {
  for (LayoutRules r : {LayoutRules::kCore013, LayoutRules::kCore08}) {
    BufferLayout l = Layout({{"B", 50, false}, {"A", 100, false}}, 4, true, r);
    EXPECT_EQ(l.ranges[1], (ParamRange{0, 100, 0}));
    EXPECT_EQ(l.ranges[0], (ParamRange{128, 178, 0}));
    ASSERT_EQ(l.buckets.size(), 1u);
    EXPECT_EQ(l.buckets[0], (Bucket{0, 256, 178}));
    EXPECT_EQ(l.order, (std::vector<size_t>{1, 0}));
    EXPECT_EQ(l.numel_unpadded(), 178);
    EXPECT_EQ(l.numel(), 256);
    EXPECT_EQ(l.WorldOffset(1), 0);
    EXPECT_EQ(l.WorldOffset(0), 128);
    // DP ranks own 64 elements each: A on ranks 0 and 1, B on rank 2.
    EXPECT_EQ(l.DpRange(0, 4, 2), (std::pair<int64_t, int64_t>{128, 192}));
    EXPECT_TRUE(l.DpRankHolds(1, 4, 0));
    EXPECT_TRUE(l.DpRankHolds(1, 4, 1));
    EXPECT_FALSE(l.DpRankHolds(1, 4, 2));
    EXPECT_FALSE(l.DpRankHolds(0, 4, 0));
    EXPECT_TRUE(l.DpRankHolds(0, 4, 2));
    EXPECT_FALSE(l.DpRankHolds(0, 4, 3));
    EXPECT_FALSE(l.FirstStraddling());
  }
}

// First pipeline stage with tied embeddings: the embedding comes first in
// named_parameters, so last in the buffer; it closes the bucket of the other
// params at its 64-aligned start (64, padded to 128) and gets its own.
TEST(BufferLayout, SharedEmbeddingOpensItsOwnBucket) {
  const std::vector<BufferParam> p = {{"emb", 100, true}, {"w", 30, false}};
  BufferLayout v13 = Layout(p, 1);
  EXPECT_EQ(v13.ranges[1], (ParamRange{0, 30, 0}));
  EXPECT_EQ(v13.ranges[0], (ParamRange{128, 228, 1}));  // padded bucket start
  EXPECT_EQ(v13.buckets, (std::vector<Bucket>{{0, 128, 64}, {128, 256, 100}}));
  EXPECT_EQ(v13.WorldOffset(0), 64);  // 128 - (128 - 64) dropped padding
  EXPECT_EQ(v13.numel_unpadded(), 164);
  EXPECT_FALSE(v13.FirstStraddling());

  // v0.8-v0.12 keep the 64-aligned start: the param begins before its
  // bucket (the quirk), and its bucket's unpadded size shrinks.
  BufferLayout v08 = Layout(p, 1, true, LayoutRules::kCore08);
  EXPECT_EQ(v08.ranges[0], (ParamRange{64, 164, 1}));
  EXPECT_EQ(v08.buckets, (std::vector<Bucket>{{0, 128, 64}, {128, 256, 36}}));
  EXPECT_EQ(v08.numel_unpadded(), 100);
  EXPECT_EQ(v08.FirstStraddling(), std::optional<size_t>(0));

  // v0.7: no 64 alignment; the bucket closes at 30 and the param stays at 30.
  BufferLayout v07 = Layout(p, 1, true, LayoutRules::kCore07);
  EXPECT_EQ(v07.ranges[0], (ParamRange{30, 130, 1}));
  EXPECT_EQ(v07.buckets, (std::vector<Bucket>{{0, 128, 30}, {128, 256, 2}}));
  EXPECT_EQ(v07.FirstStraddling(), std::optional<size_t>(0));
}

// Last stage: the tied output-layer copy is last in named_parameters, first
// in the buffer; its bucket is empty when it comes, so it just closes its
// own bucket after itself.
TEST(BufferLayout, SharedCopyFirstInBuffer) {
  for (LayoutRules r : {LayoutRules::kCore013, LayoutRules::kCore08}) {
    BufferLayout l = Layout({{"w", 30, false}, {"out", 100, true}}, 1, true, r);
    EXPECT_EQ(l.ranges[1], (ParamRange{0, 100, 0}));
    EXPECT_EQ(l.ranges[0], (ParamRange{128, 158, 1}));
    EXPECT_EQ(l.buckets, (std::vector<Bucket>{{0, 128, 100}, {128, 256, 30}}));
    EXPECT_EQ(l.WorldOffset(1), 0);
    EXPECT_EQ(l.WorldOffset(0), 100);
    EXPECT_EQ(l.numel_unpadded(), 130);
  }
}

// Without the distributed optimizer nothing is aligned or padded and shared
// params get no bucket of their own.
TEST(BufferLayout, NoDistributedOptimizer) {
  BufferLayout l =
      Layout({{"a", 10, false}, {"b", 20, true}, {"c", 5, false}}, 4, false);
  EXPECT_EQ(l.ranges[2], (ParamRange{0, 5, 0}));
  EXPECT_EQ(l.ranges[1], (ParamRange{5, 25, 0}));
  EXPECT_EQ(l.ranges[0], (ParamRange{25, 35, 0}));
  EXPECT_EQ(l.buckets, (std::vector<Bucket>{{0, 35, 35}}));
}

// --overlap-grad-reduce bucket size: a bucket closes once it holds >= the
// size (measured from the bucket start, alignment gaps included).
TEST(BufferLayout, BucketSize) {
  BufferLayout l =
      Layout({{"a", 80, false}, {"b", 80, false}, {"c", 80, false}}, 1, true,
             LayoutRules::kCore013, 100);
  EXPECT_EQ(l.ranges[2], (ParamRange{0, 80, 0}));
  EXPECT_EQ(l.ranges[1], (ParamRange{128, 208, 0}));
  EXPECT_EQ(l.ranges[0], (ParamRange{256, 336, 1}));
  EXPECT_EQ(l.buckets, (std::vector<Bucket>{{0, 256, 208}, {256, 384, 80}}));
  EXPECT_EQ(l.WorldOffset(0), 208);
}

// Bucket ends pad to lcm(dp, 128), or lcm(dp, 128, 65536) for high NCCL bus
// bandwidth.
TEST(BufferLayout, EndPadding) {
  EXPECT_EQ(Layout({{"a", 10, false}}, 3).buckets,
            (std::vector<Bucket>{{0, 384, 10}}));
  BufferOptions o;
  o.dp = 2;
  o.pad_for_high_nccl_busbw = true;
  const std::vector<BufferParam> p = {{"a", 10, false}};
  EXPECT_EQ(ComputeBufferLayout(p, o).buckets,
            (std::vector<Bucket>{{0, 65536, 10}}));
  EXPECT_TRUE(ComputeBufferLayout({}, o).buckets.empty());
}

// ---------------------------------------------------------------- oracle

std::vector<json::Value> OracleCases(uint64_t seed, int random) {
  std::string out;
  const int rc = testutil::RunCommand(
      StrCat(
          testutil::ShellQuote(testutil::Python()), " ",
          testutil::ShellQuote((testutil::SourceDir() / "tests" / "unit" /
                                "engine" / "formats" / "dump_buffer_layouts.py")
                                   .string()),
          " --seed ", seed % 1000000007, " --random ", random),
      &out);
  EXPECT_EQ(rc, 0) << out;
  std::vector<json::Value> cases;
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) cases.push_back(json::Value::Parse(line));
  }
  return cases;
}

std::vector<BufferParam> ParamsOf(const json::Value& c) {
  std::vector<BufferParam> p;
  for (const json::Value& x : c.At("params").items())
    p.push_back(
        {x.items()[0].AsString(), x.items()[1].AsInt(), x.items()[2].AsBool()});
  return p;
}

void ExpectSameLayout(const json::Value& c, const std::vector<BufferParam>& p,
                      const BufferLayout& l) {
  for (size_t i = 0; i < p.size(); ++i) {
    const json::Value& want = c.At("index").At(p[i].name);
    EXPECT_EQ(l.ranges[i],
              (ParamRange{want.items()[0].AsInt(), want.items()[1].AsInt(),
                          want.items()[2].AsInt()}))
        << p[i].name;
    EXPECT_EQ(l.WorldOffset(i), c.At("world").At(p[i].name).AsInt())
        << p[i].name;
  }
  std::vector<Bucket> want;
  for (const json::Value& b : c.At("buckets").items())
    want.push_back(
        {b.items()[0].AsInt(), b.items()[1].AsInt(), b.items()[2].AsInt()});
  EXPECT_EQ(l.buckets, want);
}

TEST(BufferLayout, MatchesTheGeneratorsOracle) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  const std::vector<json::Value> cases = OracleCases(seed, 3000);
  int grid = 0, random = 0, straddles = 0, step_checks = 0;
  // Per (variant, topology, pp rank): chunk layouts and params, to check
  // the param groups and which groups have a `step` on DP rank 0.
  struct Stage {
    std::vector<BufferLayout> layouts;
    std::vector<std::vector<BufferParam>> params;
    std::vector<std::vector<int64_t>> ndims;
    const json::Value* any = nullptr;
  };
  std::map<std::string, Stage> stages;
  for (const json::Value& c : cases) {
    const std::vector<BufferParam> p = ParamsOf(c);
    BufferOptions o;
    o.dp = c.At("dp").AsInt();
    o.distributed_optimizer = c.At("distopt").AsBool();
    o.rules = c.At("version").AsString() == "0.8" ? LayoutRules::kCore08
                                                  : LayoutRules::kCore013;
    if (const json::Value* b = c.Find("bucket_size"); b && b->is_int())
      o.bucket_size = b->AsInt();
    const BufferLayout l = ComputeBufferLayout(p, o);
    SCOPED_TRACE(c.Dump());
    if (c.Find("straddle") != nullptr) {
      EXPECT_TRUE(l.FirstStraddling().has_value());
      ++straddles;
      continue;
    }
    EXPECT_FALSE(l.FirstStraddling().has_value());
    ExpectSameLayout(c, p, l);
    if (c.At("case").AsString() == "random") {
      ++random;
      continue;
    }
    ++grid;
    Stage& s = stages[StrCat(c.At("variant").AsString(), "/",
                             c.At("topology").AsString(), "/",
                             c.At("pp_rank").AsInt())];
    s.layouts.push_back(l);
    s.params.push_back(p);
    std::vector<int64_t> nd;
    for (const json::Value& x : c.At("params").items())
      nd.push_back(x.items()[3].AsInt());
    s.ndims.push_back(nd);
    s.any = &c;
  }
  for (const auto& [name, s] : stages) {
    SCOPED_TRACE(name);
    std::vector<GroupKey> keys;
    std::vector<std::pair<size_t, size_t>> where;  // (chunk, index)
    for (size_t v = 0; v < s.params.size(); ++v) {
      for (size_t i = 0; i < s.params[v].size(); ++i) {
        keys.push_back(DefaultGroupKey(s.params[v][i].name,
                                       static_cast<size_t>(s.ndims[v][i])));
        where.emplace_back(v, i);
      }
    }
    const Grouping g = GroupParams(keys);
    const json::Value& groups = s.any->At("groups");
    ASSERT_EQ(g.members.size(), groups.size());
    for (size_t gi = 0; gi < g.members.size(); ++gi) {
      std::vector<std::string> got;
      for (size_t k : g.members[gi])
        got.push_back(s.params[where[k].first][where[k].second].name);
      std::vector<std::string> want;
      for (const json::Value& n : groups.items()[gi].items())
        want.push_back(n.AsString());
      EXPECT_EQ(got, want) << "group " << gi;
    }
    const json::Value& steps = s.any->At("steps");
    if (!steps.is_array()) continue;
    const int64_t dp = s.any->At("dp").AsInt();
    for (size_t gi = 0; gi < g.members.size(); ++gi) {
      bool has = false;
      for (size_t k : g.members[gi])
        has = has ||
              s.layouts[where[k].first].DpRankHolds(where[k].second, dp, 0);
      EXPECT_EQ(has, steps.items()[gi].AsBool()) << "group " << gi;
      ++step_checks;
    }
  }
  // 225 topologies: 1 + ... chunks each; every one checked.
  EXPECT_GT(grid, 700);
  EXPECT_EQ(random + straddles, 3000);
  EXPECT_GT(straddles, 10);
  EXPECT_GT(step_checks, 200);
}

}  // namespace
}  // namespace ucp::megatron
