// DeepSpeed's flat layouts against the numbers DeepSpeed 0.14.5 itself saved
// for the fixture MLP (fc1.weight 91, fc1.bias 13, fc2.weight 65, fc2.bias 5
// elements, 2 ranks): param_slice_mappings, group_paddings and partition
// sizes read from ../shared/fixtures/deepspeed-0.14.5/*_w2_mlp.

#include "engine/formats/deepspeed/flat_layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ucp::deepspeed::internal {
namespace {

const std::vector<int64_t> kMlp = {91, 13, 65, 5};

std::vector<std::vector<int64_t>> Flat(const std::vector<Window>& ws) {
  std::vector<std::vector<int64_t>> out;
  for (const Window& w : ws)
    out.push_back({static_cast<int64_t>(w.member), w.begin, w.end, w.dst});
  return out;
}

TEST(FlatLayoutTest, ZeroPartitionsAsDeepSpeedSavedThem) {
  const ZeroGroup g = ZeroLayout(kMlp, 2);
  EXPECT_EQ(g.numel, 174);
  EXPECT_EQ(g.padded, 176);
  EXPECT_EQ(g.partition, 88);
  // zero_pp_rank_1: fc1.weight 3@0, fc1.bias 13@3, fc2.weight 65@16,
  // fc2.bias 5@81 (fragment_address numel@start); group_paddings [2].
  EXPECT_EQ(Flat(ZeroWindows(kMlp, g, 1)),
            (std::vector<std::vector<int64_t>>{
                {0, 88, 91, 0}, {1, 0, 13, 3}, {2, 0, 65, 16}, {3, 0, 5, 81}}));
  EXPECT_EQ(Flat(ZeroWindows(kMlp, g, 0)),
            (std::vector<std::vector<int64_t>>{{0, 0, 88, 0}}));
  EXPECT_EQ(g.Real(0), 88);
  EXPECT_EQ(g.Real(1), 86);
  EXPECT_EQ(g.Padding(0, 2, false), 0);
  EXPECT_EQ(g.Padding(1, 2, false), 2);
  EXPECT_EQ(g.Padding(0, 2, true), 0);  // BF16_Optimizer: last rank only
  EXPECT_EQ(g.Padding(1, 2, true), 2);
}

TEST(FlatLayoutTest, RanksBeyondTheDataHoldOnlyPadding) {
  const std::vector<int64_t> bias = {7};
  const ZeroGroup g = ZeroLayout(bias, 8);  // A = 16: Np 16, ps 2
  EXPECT_EQ(g.partition, 2);
  EXPECT_EQ(g.Real(3), 1);
  EXPECT_EQ(g.Real(5), 0);
  EXPECT_EQ(g.Padding(5, 8, false), 2);
  EXPECT_EQ(g.Padding(7, 8, true), 9);
  EXPECT_TRUE(ZeroWindows(bias, g, 5).empty());
}

TEST(FlatLayoutTest, Zero3PiecesAsDeepSpeedSavedThem) {
  // fp32_flat_groups[0] of 89 elements on each rank: 46 + 7 + 33 + 3.
  int64_t length = 0;
  EXPECT_EQ(
      Flat(Zero3Windows(kMlp, 2, 1, &length)),
      (std::vector<std::vector<int64_t>>{
          {0, 46, 91, 0}, {1, 7, 13, 46}, {2, 33, 65, 53}, {3, 3, 5, 86}}));
  EXPECT_EQ(length, 89);
  EXPECT_EQ(Zero3Piece(5, 8), 1);
  EXPECT_TRUE(Zero3Windows(std::vector<int64_t>{5}, 8, 6, &length).empty());
  EXPECT_EQ(length, 1);
}

TEST(FlatLayoutTest, Fp16OptimizerGroupsAreBackToBack) {
  // FP16_Optimizer's fp32_groups_flat[0] of the MLP: 91 + 13 + 65 + 5
  // elements, no padding; an empty param takes no window.
  int64_t length = 0;
  EXPECT_EQ(
      Flat(ConcatWindows(kMlp, &length)),
      (std::vector<std::vector<int64_t>>{
          {0, 0, 91, 0}, {1, 0, 13, 91}, {2, 0, 65, 104}, {3, 0, 5, 169}}));
  EXPECT_EQ(length, 174);
  EXPECT_EQ(Flat(ConcatWindows(std::vector<int64_t>{3, 0, 2}, &length)),
            (std::vector<std::vector<int64_t>>{{0, 0, 3, 0}, {2, 0, 2, 3}}));
  EXPECT_EQ(length, 5);
}

}  // namespace
}  // namespace ucp::deepspeed::internal
