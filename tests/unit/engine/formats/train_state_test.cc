// The training-state helpers (engine/formats/common/train_state.h): nn.Adam's
// beta powers computed as MindSpore computes them (float32, step by step),
// the betas derived back from them, and Adam's group defaults with notes.

#include "engine/formats/common/train_state.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

namespace ucp::formats {
namespace {

TEST(TrainStateTest, BetaPowerIsTheFloat32ProductStepByStep) {
  float p = 1.0f;
  for (int i = 0; i < 7; ++i) p = p * 0.85f;
  EXPECT_EQ(BetaPower(0.85, 7), p);
  EXPECT_EQ(BetaPower(0.9, 0), 1.0f);
  EXPECT_EQ(BetaPower(0.9, 1), 0.9f);
}

TEST(TrainStateTest, BetasComeBackFromTheirPowers) {
  int checked = 0;
  for (double beta : {0.9, 0.999, 0.85, 0.995, 0.8, 0.99, 0.95, 0.98}) {
    for (int64_t step : {1, 2, 3, 10, 100}) {
      const std::optional<double> b = BetaOfPower(BetaPower(beta, step), step);
      ASSERT_TRUE(b.has_value()) << beta << " " << step;
      // The float32 of the derived beta gives the same power (several
      // float32 betas can, after many steps); the shortest decimal.
      EXPECT_EQ(BetaPower(*b, step), BetaPower(beta, step)) << beta;
      if (step <= 3) {
        EXPECT_EQ(*b, beta) << step;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 40);
  EXPECT_EQ(BetaOfPower(0.81f, 0), std::nullopt);  // no step
  EXPECT_EQ(BetaOfPower(0.0f, 2), std::nullopt);   // underflowed
  EXPECT_EQ(BetaOfPower(1.5f, 2), std::nullopt);   // not a power of β < 1
  EXPECT_EQ(BetaOfPower(std::nanf(""), 2), std::nullopt);
}

TEST(TrainStateTest, ShortestDecimalOfAFloat32) {
  EXPECT_EQ(ShortestDecimal(0.02f), 0.02);
  EXPECT_EQ(ShortestDecimal(1e-3f), 1e-3);
  EXPECT_EQ(static_cast<float>(ShortestDecimal(0.1234567f)), 0.1234567f);
}

TEST(TrainStateTest, AdamGroupsCompletedWithDefaultsAndNotes) {
  universal::Model model;
  model.iteration = 7;
  universal::ParamGroup a, b;
  a.params = std::vector<std::string>{"a"};
  a.lr = 0.02;
  a.betas = {0.8, 0.99};
  b.params = std::vector<std::string>{"b"};
  b.eps = 1e-6;
  model.optimizer.groups = std::vector<universal::ParamGroup>{a, b};
  model.optimizer.step = 5;
  std::set<std::string> notes;
  const std::vector<universal::ParamGroup> g = AdamGroups(model, notes);
  ASSERT_EQ(g.size(), 2u);
  EXPECT_EQ(g[0].lr, 0.02);
  EXPECT_EQ(g[0].eps, 1e-8);
  EXPECT_EQ(g[0].weight_decay, 0.0);
  EXPECT_EQ((*g[0].betas)[0], 0.8);
  EXPECT_EQ(g[1].eps, 1e-6);
  EXPECT_EQ(g[1].lr, 1e-3);
  EXPECT_EQ((*g[1].betas)[1], 0.999);
  EXPECT_EQ(g[1].params, std::vector<std::string>{"b"});
  EXPECT_THAT(
      notes,
      ::testing::UnorderedElementsAre(
          ::testing::HasSubstr("no Adam lr: wrote lr 0.001"),
          ::testing::HasSubstr("no Adam betas"),
          ::testing::HasSubstr("no Adam eps: wrote eps 1e-08"),
          ::testing::HasSubstr("no Adam weight_decay: wrote weight_decay 0")));
  EXPECT_EQ(OptimizerStep(model), 5);
  model.optimizer.step.reset();
  model.training.emplace().step = 6;
  EXPECT_EQ(OptimizerStep(model), 6);
  model.training.reset();
  EXPECT_EQ(OptimizerStep(model), 7);
}

}  // namespace
}  // namespace ucp::formats
