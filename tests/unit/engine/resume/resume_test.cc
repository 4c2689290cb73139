// resume::Decide and resume::Run on save folders made of the real DeepSpeed
// 0.14.5 fixture (ZeRO 2, 2 ranks; ../shared/fixtures, see its meta.json):
// its tag copied as global_step1..3 with `latest` naming the newest, as
// DeepSpeed leaves them. Expected values are the documented rules
// (engine/resume/README.md) applied by hand to the folder each test makes.

#include "engine/resume/resume.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"

namespace ucp::resume {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path& Fixture() {
  static const fs::path p = testutil::FixturesDir() / "deepspeed-0.14.5" /
                            "ds0145_z2_fp32_w2_mlp" / "global_step2";
  return p;
}

std::string ReadText(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void WriteText(const fs::path& p, const std::string& text) {
  std::ofstream(p) << text;
}

// save/global_step<k> for each k, `latest` naming `latest`.
fs::path MakeSave(const testutil::TempDir& t, std::initializer_list<int> tags,
                  const std::string& latest) {
  const fs::path save = t / "save";
  fs::create_directories(save);
  for (int k : tags)
    fs::copy(Fixture(), save / ("global_step" + std::to_string(k)));
  WriteText(save / "latest", latest);
  return save;
}

// DeepSpeed at data-parallel size `dp`, ZeRO stage `stage`.
ResumeRequest Request(const fs::path& save, int64_t dp, int stage) {
  ResumeRequest r;
  r.save_dir = save;
  r.target = [dp, stage](const std::string& source_format) {
    EXPECT_EQ(source_format, "deepspeed");
    ResumeTarget t;
    t.driver = &formats::GetDriver("deepspeed");
    t.options.topology.dp = dp;
    t.options.values.Set("zero-stage", std::to_string(stage));
    return t;
  };
  r.executor.threads = 1;
  return r;
}

int CountFiles(const fs::path& dir) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir)) n += e.is_regular_file();
  return n;
}

TEST(ResumeDecideTest, TheNewestFitsAndIsTracked) {
  testutil::TempDir t;
  const fs::path save = MakeSave(t, {1, 2, 3}, "global_step3");
  ResumeRequest req = Request(save, 2, 2);
  req.data_skip.global_batch_size = 3;
  ResumeDecision d = Decide(req);
  EXPECT_EQ(d.checkpoint, "global_step3");
  EXPECT_EQ(d.source_format, "deepspeed");
  EXPECT_TRUE(d.skipped.empty());
  EXPECT_EQ(d.action, LoadAction::kSaveDir);
  EXPECT_EQ(d.load, save);
  EXPECT_FALSE(d.reshaped());
  // meta.json: 2 steps of micro batch 2 on 2 ranks = 8 samples; 8 / 3.
  EXPECT_EQ(d.consumed_samples, 8);
  EXPECT_EQ(d.data_skip_steps, 2);
  const ResumeOutcome o = resume::Run(d);
  EXPECT_EQ(o.load, save);
  EXPECT_FALSE(fs::exists(save / "ucp-resume"));  // nothing written
}

TEST(ResumeDecideTest, ASaveStillBeingWrittenIsSkipped) {
  // DeepSpeed writes `latest` after the rank files: global_step3 lacks a
  // rank's optimizer file and `latest` still names global_step2.
  testutil::TempDir t;
  const fs::path save = MakeSave(t, {1, 2, 3}, "global_step2");
  const std::string missing = "zero_pp_rank_1_mp_rank_00_optim_states.pt";
  fs::remove(save / "global_step3" / missing);
  std::vector<std::string> reported;
  ResumeRequest req = Request(save, 2, 2);
  req.on_skipped = [&](const SkippedCheckpoint& s) {
    reported.push_back(s.name);
  };
  ResumeDecision d = Decide(req);
  EXPECT_EQ(d.checkpoint, "global_step2");
  ASSERT_EQ(d.skipped.size(), 1u);
  EXPECT_EQ(d.skipped[0].name, "global_step3");
  EXPECT_EQ(reported, std::vector<std::string>{"global_step3"});
  EXPECT_EQ(d.action, LoadAction::kSaveDir);
  EXPECT_EQ(d.load, save);
}

TEST(ResumeDecideTest, FallsBackPastABrokenRankFileAndLinksIt) {
  // The tracked newest is damaged (a rank file cut short): the one before
  // is handed out through a load folder of hard links and a tracker.
  testutil::TempDir t;
  const fs::path save = MakeSave(t, {1, 2, 3}, "global_step3");
  const fs::path victim =
      save / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt";
  fs::resize_file(victim, fs::file_size(victim) / 2);
  ResumeDecision d = Decide(Request(save, 2, 2));
  EXPECT_EQ(d.checkpoint, "global_step2");
  ASSERT_EQ(d.skipped.size(), 1u);
  EXPECT_THAT(d.skipped[0].reason,
              HasSubstr("zero_pp_rank_0_mp_rank_00_optim_states.pt"));
  EXPECT_EQ(d.action, LoadAction::kLinkTracked);
  EXPECT_FALSE(d.reshaped());
  const fs::path load =
      save / "ucp-resume" / "global_step2-tp1-pp1-vpp1-dp2-z2";
  EXPECT_EQ(d.load, load);
  const ResumeOutcome o = resume::Run(d);
  EXPECT_EQ(o.linked_files, CountFiles(Fixture()));
  EXPECT_EQ(o.copied_files, 0);
  EXPECT_EQ(ReadText(load / "latest"), "global_step2");
  EXPECT_EQ(
      fs::hard_link_count(save / "global_step2" / "mp_rank_00_model_states.pt"),
      2u);
}

TEST(ResumeDecideTest, ANewLayoutIsReshapedOnceThenReused) {
  testutil::TempDir t;
  const fs::path save = MakeSave(t, {2}, "global_step2");
  {
    ResumeDecision d = Decide(Request(save, 3, 1));
    EXPECT_EQ(d.action, LoadAction::kReshape);
    EXPECT_TRUE(d.own_load_folder);
    EXPECT_EQ(d.load, save / "ucp-resume" / "global_step2-tp1-pp1-vpp1-dp3-z1");
    const ResumeOutcome o = resume::Run(d);
    EXPECT_FALSE(o.reused);
    int ranks = 0;
    for (const auto& e : fs::directory_iterator(d.load / "global_step2"))
      ranks += e.path().filename().string().find("optim_states.pt") !=
               std::string::npos;
    EXPECT_EQ(ranks, 3);
    EXPECT_EQ(ReadText(d.load / "latest"), "global_step2");
  }
  {
    // (One decision per save folder at a time: each holds its lock.)
    ResumeDecision again = Decide(Request(save, 3, 1));
    EXPECT_TRUE(resume::Run(again).reused);
  }
  // -o: the request's folder, not ucp's own.
  ResumeRequest out = Request(save, 3, 1);
  out.output = t / "mine";
  ResumeDecision o = Decide(out);
  EXPECT_EQ(o.load, t / "mine");
  EXPECT_FALSE(o.own_load_folder);
}

TEST(ResumeDecideTest, NothingIntactOrNothingThere) {
  testutil::TempDir t;
  const fs::path save = MakeSave(t, {4}, "global_step4");
  fs::remove(save / "global_step4" / "mp_rank_00_model_states.pt");
  EXPECT_THAT([&] { Decide(Request(save, 2, 2)); },
              ::testing::ThrowsMessage<FormatError>(
                  HasSubstr("no complete and intact checkpoint")));
  fs::create_directory(t / "empty");
  EXPECT_THAT(
      [&] { Decide(Request(t / "empty", 2, 2)); },
      ::testing::ThrowsMessage<FormatError>(HasSubstr("no checkpoint in")));
  EXPECT_THROW(Decide(Request(t / "missing", 2, 2)), IoError);
  ResumeRequest bad = Request(t / "empty", 2, 2);
  bad.data_skip.global_batch_size = 0;
  EXPECT_THROW(Decide(bad), UsageError);
}

}  // namespace
}  // namespace ucp::resume
