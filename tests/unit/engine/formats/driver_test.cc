#include "engine/formats/driver.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"

namespace ucp::formats {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(DriverRegistryTest, EveryLinkedDriverRegistersItself) {
  std::vector<std::string> names;
  for (const Driver* d : Drivers()) names.emplace_back(d->Name());
  EXPECT_THAT(names, ::testing::IsSupersetOf(
                         {"megatron", "deepspeed", "deepspeed-universal"}));
  ASSERT_NE(FindDriver("deepspeed"), nullptr);
  EXPECT_TRUE(FindDriver("deepspeed")->CanWrite());
  EXPECT_EQ(FindDriver("nosuch"), nullptr);
  EXPECT_THAT([] { GetDriver("nosuch"); },
              ThrowsMessage<UsageError>(::testing::AllOf(
                  HasSubstr("known: "), HasSubstr("deepspeed, deepspeed-universal"),
                  HasSubstr("megatron"))));
}

TEST(DriverRegistryTest, DetectsTheFrameworksOwnCheckpoints) {
  const auto fx = testutil::FixturesDir();
  EXPECT_EQ(DetectDriver(fx / "megatron-23.06" / "synth_tp2").Name(), "megatron");
  EXPECT_EQ(
      DetectDriver(fx / "megatron-23.06" / "synth_tp2" / "iter_0000010").Name(),
      "megatron");
  EXPECT_EQ(DetectDriver(fx / "deepspeed-0.14.5" / "ds0145_z3_bf16_w2_mlp").Name(),
            "deepspeed");
  EXPECT_EQ(DetectDriver(fx / "deepspeed-0.14.5" / "ds0145_z0_fp32_w1_mlp" /
                         "global_step2")
                .Name(),
            "deepspeed");
  // --from overrides detection.
  EXPECT_EQ(DetectDriver(fx / "megatron-23.06", "deepspeed").Name(), "deepspeed");
}

TEST(DriverRegistryTest, ForeignInputIsAClearError) {
  testutil::TempDir dir;
  EXPECT_THAT([&] { DetectDriver(dir.path()); },
              ThrowsMessage<FormatError>(HasSubstr("not a checkpoint of a known format")));
  EXPECT_THAT([&] { DetectDriver(dir / "missing"); },
              ThrowsMessage<IoError>(HasSubstr("does not exist")));
  EXPECT_THAT([&] { DetectDriver(dir.path(), "nosuch"); },
              ThrowsMessage<UsageError>(HasSubstr("unknown format 'nosuch'")));
}

}  // namespace
}  // namespace ucp::formats
