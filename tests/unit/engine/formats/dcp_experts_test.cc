// torchtitan's stacked routed experts (engine/formats/dcp/experts.h): which
// names are stacked expert tensors, the per-expert names, and which experts
// a set of chunks covers. Expected values from the format (moe.md:
// torchtitan's `layers.{L}.moe.experts.w1 [E, F, D]`, the 2026 suffixed
// names) and, for coverage, counted by hand on the boxes.

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/formats/dcp/experts.h"

namespace ucp::dcp {
namespace {

TEST(DcpExpertsTest, StackedNamesAndTheirExperts) {
  for (const char* name :
       {"layers.3.moe.experts.w1", "layers.3.moe.experts.w2_EDF",
        "layers.3.moe.experts.w3_EFD"}) {
    const std::optional<StackedName> n = SplitStacked(name);
    ASSERT_TRUE(n.has_value()) << name;
    EXPECT_EQ(n->prefix, "layers.3.moe.experts.");
    EXPECT_EQ(ExpertParam(*n, 5),
              "layers.3.moe.experts.5." + std::string(name).substr(21, 2));
  }
  EXPECT_EQ(SplitStacked("layers.3.moe.experts.w1_EFD")->suffix, "_EFD");
  // Not stacked: a per-expert name, a shared expert, other stems, a prefix
  // that only ends in the infix.
  for (const char* name :
       {"layers.3.moe.experts.0.w1", "layers.3.moe.shared_experts.w1.weight",
        "layers.3.moe.experts.w4", "layers.3.moe.experts.w1_efd",
        "layers.3.xmoe.experts.w1", "layers.3.moe.experts.w1.weight"}) {
    EXPECT_FALSE(SplitStacked(name).has_value()) << name;
  }
  // In a key: model.<p>, optimizer.state.<p>.<kind>.
  EXPECT_EQ(
      FindStacked("optimizer.state.layers.1.moe.experts.w2.exp_avg")->stem,
      "w2");
  EXPECT_EQ(FindStacked("model.layers.1.moe.experts.w2_EDF")->suffix, "_EDF");
  EXPECT_FALSE(FindStacked("model.layers.1.moe.router.gate.weight"));
  // The per-expert name back.
  const std::optional<ExpertParamName> x =
      SplitExpertParam("layers.12.moe.experts.37.w3");
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->prefix, "layers.12.moe.experts.");
  EXPECT_EQ(x->expert, 37);
  EXPECT_EQ(x->stem, "w3");
  EXPECT_FALSE(SplitExpertParam("layers.12.moe.experts.w3"));
  EXPECT_FALSE(SplitExpertParam("layers.12.block_sparse_moe.experts.1.w3"));
  EXPECT_FALSE(SplitExpertParam("layers.12.moe.experts.-1.w3"));
  EXPECT_FALSE(SplitExpertParam("layers.12.moe.experts.1.w3.weight"));
}

TEST(DcpExpertsTest, CoverageNamesMissingAndDoubledExperts) {
  const Shape size = {4, 6, 8};
  auto chunk = [](Shape o, Shape s) {
    Chunk c;
    c.offsets = std::move(o);
    c.sizes = std::move(s);
    return c;
  };
  std::vector<int64_t> missing, twice;
  // FSDP Shard(1) halves of experts 0 and 1, expert 2 whole, expert 3 lost;
  // an empty chunk ignored.
  ExpertCoverage(size,
                 {chunk({0, 0, 0}, {2, 3, 8}), chunk({0, 3, 0}, {2, 3, 8}),
                  chunk({2, 0, 0}, {1, 6, 8}), chunk({3, 0, 0}, {0, 6, 8})},
                 missing, twice);
  EXPECT_EQ(missing, std::vector<int64_t>{3});
  EXPECT_TRUE(twice.empty());
  missing.clear();
  // Expert 1 saved twice (once over expert 0's offsets: 0 doubled, 1 lost).
  ExpertCoverage(size,
                 {chunk({0, 0, 0}, {1, 6, 8}), chunk({0, 0, 0}, {1, 6, 8}),
                  chunk({2, 0, 0}, {2, 6, 8})},
                 missing, twice);
  EXPECT_EQ(missing, std::vector<int64_t>{1});
  EXPECT_EQ(twice, std::vector<int64_t>{0});
  EXPECT_EQ(IndexList({0, 2, 3}), "0, 2, 3");
}

}  // namespace
}  // namespace ucp::dcp
