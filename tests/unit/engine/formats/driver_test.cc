#include "engine/formats/driver.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

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
  EXPECT_THAT(
      [] { GetDriver("nosuch"); },
      ThrowsMessage<UsageError>(::testing::AllOf(
          HasSubstr("known: "), HasSubstr("deepspeed, deepspeed-universal"),
          HasSubstr("megatron"))));
}

TEST(DriverRegistryTest, DetectsTheFrameworksOwnCheckpoints) {
  const auto fx = testutil::FixturesDir();
  EXPECT_EQ(DetectDriver(fx / "megatron-23.06" / "synth_tp2").Name(),
            "megatron");
  EXPECT_EQ(
      DetectDriver(fx / "megatron-23.06" / "synth_tp2" / "iter_0000010").Name(),
      "megatron");
  EXPECT_EQ(
      DetectDriver(fx / "deepspeed-0.14.5" / "ds0145_z3_bf16_w2_mlp").Name(),
      "deepspeed");
  EXPECT_EQ(DetectDriver(fx / "deepspeed-0.14.5" / "ds0145_z0_fp32_w1_mlp" /
                         "global_step2")
                .Name(),
            "deepspeed");
  // --from overrides detection.
  EXPECT_EQ(DetectDriver(fx / "megatron-23.06", "deepspeed").Name(),
            "deepspeed");
}

TEST(DriverRegistryTest, ForeignInputIsAClearError) {
  testutil::TempDir dir;
  EXPECT_THAT([&] { DetectDriver(dir.path()); },
              ThrowsMessage<FormatError>(
                  HasSubstr("not a checkpoint of a known format")));
  EXPECT_THAT([&] { DetectDriver(dir / "missing"); },
              ThrowsMessage<IoError>(HasSubstr("does not exist")));
  EXPECT_THAT([&] { DetectDriver(dir.path(), "nosuch"); },
              ThrowsMessage<UsageError>(HasSubstr("unknown format 'nosuch'")));
}

// Two stand-in formats: "probe-base" recognises a folder holding base.txt,
// "probe-refined" one holding refined.txt and refines probe-base (its
// folders hold base.txt too, as torch_dist's hold DCP's files). Each lists
// the subfolders it recognises as checkpoints.
class MarkerDriver : public Driver {
 public:
  MarkerDriver(std::string name, std::string marker,
               std::vector<std::string_view> refines)
      : name_(std::move(name)),
        marker_(std::move(marker)),
        refines_(std::move(refines)) {}
  std::string_view Name() const override { return name_; }
  std::string_view Summary() const override { return "a test's stand-in"; }
  Confidence Probe(const std::filesystem::path& path) const override {
    std::error_code ec;
    if (std::filesystem::exists(path / marker_, ec)) return Confidence::kYes;
    return ListCheckpoints(path).empty() ? Confidence::kNo : Confidence::kMaybe;
  }
  std::vector<std::string_view> Refines() const override { return refines_; }
  std::vector<SavedCheckpoint> ListCheckpoints(
      const std::filesystem::path& dir) const override {
    std::vector<SavedCheckpoint> out;
    std::error_code ec;
    for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end;
         it.increment(ec)) {
      if (std::filesystem::exists(it->path() / marker_, ec))
        out.push_back({it->path().filename().string(), -1, {}});
    }
    return out;
  }

 private:
  std::string name_, marker_;
  std::vector<std::string_view> refines_;
};

void RegisterMarkerDrivers() {
  static const bool once = [] {
    RegisterDriver(std::make_unique<MarkerDriver>(
        "probe-base", "base.txt", std::vector<std::string_view>{}));
    RegisterDriver(std::make_unique<MarkerDriver>(
        "probe-refined", "refined.txt",
        std::vector<std::string_view>{"probe-base"}));
    return true;
  }();
  (void)once;
}

TEST(DriverRegistryTest, ARefiningFormatTakesWhatItsBaseAlsoRecognises) {
  RegisterMarkerDrivers();
  testutil::TempDir dir;
  const auto base = dir / "base", both = dir / "both", save = dir / "save";
  for (const auto& d : {base, both, save / "step_1", save / "step_2"})
    std::filesystem::create_directories(d);
  testutil::WriteFile(base / "base.txt", "");
  testutil::WriteFile(both / "base.txt", "");
  testutil::WriteFile(both / "refined.txt", "");
  testutil::WriteFile(save / "step_1" / "base.txt", "");
  testutil::WriteFile(save / "step_2" / "base.txt", "");
  testutil::WriteFile(save / "step_2" / "refined.txt", "");
  // Both recognise `both` with the same confidence: the refining one's.
  EXPECT_EQ(DetectDriver(base).Name(), "probe-base");
  EXPECT_EQ(DetectDriver(both).Name(), "probe-refined");
  // Refining wins whatever the confidences: here both only list checkpoints.
  EXPECT_EQ(DetectDriver(save).Name(), "probe-refined");
  // step_2 is listed once, for the refining format; step_1 for the base.
  std::vector<std::string> listed;
  for (const ListedCheckpoint& c : ListSavedCheckpoints(save)) {
    listed.push_back(StrCat(c.driver->Name(), ":", c.checkpoint.name));
  }
  std::sort(listed.begin(), listed.end());
  EXPECT_THAT(listed, ::testing::ElementsAre("probe-base:step_1",
                                             "probe-refined:step_2"));
}

TEST(DriverRegistryTest, TheFrameworksRefinementsOfDcp) {
  // Megatron's torch_dist and Megatron-FSDP iteration folders are DCP
  // folders: each says so, and DCP refines nothing.
  for (std::string_view name : {"megatron-torch-dist", "megatron-fsdp"}) {
    const Driver* d = FindDriver(name);
    ASSERT_NE(d, nullptr) << name;
    EXPECT_THAT(d->Refines(), ::testing::ElementsAre("dcp")) << name;
  }
  ASSERT_NE(FindDriver("dcp"), nullptr);
  EXPECT_TRUE(FindDriver("dcp")->Refines().empty());
}

}  // namespace
}  // namespace ucp::formats
