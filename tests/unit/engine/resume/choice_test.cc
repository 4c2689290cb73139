// The rules of `ucp resume` as data (engine/resume/choice.h). Expected values
// are the documented rules (engine/resume/README.md, cli/README.md "ucp
// resume"), written out by hand for each case.

#include "engine/resume/choice.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <new>
#include <string>
#include <vector>

#include "engine/core/error.h"

namespace ucp::resume {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Names(const std::vector<CandidateKey>& c) {
  std::vector<std::string> out;
  for (const CandidateKey& k : c) out.push_back(k.name);
  return out;
}

// A check that fails for the names in `broken` with that reason, and counts
// the candidates it was asked about.
struct FakeChecks {
  std::vector<CandidateKey> ordered;
  std::vector<std::pair<std::string, std::string>> broken;  // name, reason
  std::vector<std::string> asked;

  void operator()(size_t i) {
    asked.push_back(ordered[i].name);
    for (const auto& [name, reason] : broken)
      if (ordered[i].name == name) throw FormatError(reason);
  }
};

TEST(NewerFirstTest, NewestIterationFirstThenRankFilesThenName) {
  std::vector<CandidateKey> c = {
      {"global_step1", 1, CandidateKind::kRankFiles},
      {"model.ucp.h5", 3, CandidateKind::kUniversalFile},
      {"unknown.h5", -1, CandidateKind::kUniversalFile},
      {"universal3", 3, CandidateKind::kTopologyFree},
      {"global_step3", 3, CandidateKind::kRankFiles},
      {"global_step2", 2, CandidateKind::kRankFiles},
      {"b_step2", 2, CandidateKind::kRankFiles},
  };
  std::sort(c.begin(), c.end(), NewerFirst);
  EXPECT_EQ(Names(c),
            (std::vector<std::string>{"global_step3", "universal3",
                                      "model.ucp.h5", "global_step2", "b_step2",
                                      "global_step1", "unknown.h5"}));
}

TEST(NewerFirstTest, IsAStrictOrder) {
  const CandidateKey a{"x", 5, CandidateKind::kRankFiles};
  EXPECT_FALSE(NewerFirst(a, a));
  const CandidateKey b{"x", 5, CandidateKind::kUniversalFile};
  EXPECT_TRUE(NewerFirst(a, b));
  EXPECT_FALSE(NewerFirst(b, a));
}

TEST(SelectNewestIntactTest, TakesTheNewestCompleteAndChecksNoOlder) {
  FakeChecks checks{{{"iter_0000300", 300, CandidateKind::kRankFiles},
                     {"iter_0000200", 200, CandidateKind::kRankFiles},
                     {"iter_0000100", 100, CandidateKind::kRankFiles}},
                    {},
                    {}};
  const Selection s =
      SelectNewestIntact(checks.ordered, [&](size_t i) { checks(i); });
  ASSERT_TRUE(s.chosen.has_value());
  EXPECT_EQ(*s.chosen, 0u);
  EXPECT_TRUE(s.skipped.empty());
  EXPECT_EQ(checks.asked, std::vector<std::string>{"iter_0000300"});
}

TEST(SelectNewestIntactTest, FallsBackPastABrokenRankFile) {
  FakeChecks checks{
      {{"global_step3", 3, CandidateKind::kRankFiles},
       {"global_step2", 2, CandidateKind::kRankFiles},
       {"global_step1", 1, CandidateKind::kRankFiles}},
      {{"global_step3",
        "global_step3/zero_pp_rank_1_mp_rank_00_optim_states.pt: CRC-32 "
        "mismatch in record data/3"}},
      {}};
  std::vector<SkippedCheckpoint> reported;
  const Selection s = SelectNewestIntact(
      checks.ordered, [&](size_t i) { checks(i); },
      [&](const SkippedCheckpoint& k) { reported.push_back(k); });
  ASSERT_TRUE(s.chosen.has_value());
  EXPECT_EQ(checks.ordered[*s.chosen].name, "global_step2");
  ASSERT_EQ(s.skipped.size(), 1u);
  EXPECT_EQ(s.skipped[0].name, "global_step3");
  EXPECT_EQ(s.skipped[0].iteration, 3);
  EXPECT_THAT(s.skipped[0].reason,
              HasSubstr("zero_pp_rank_1_mp_rank_00_optim_states.pt"));
  ASSERT_EQ(reported.size(), 1u);  // as it happened, the same
  EXPECT_EQ(reported[0].reason, s.skipped[0].reason);
  EXPECT_EQ(checks.asked,
            (std::vector<std::string>{"global_step3", "global_step2"}));
}

// Megatron writes the tracker after the last rank file: while iteration 300
// is being written the tracker still names 200.
TEST(SelectNewestIntactTest,
     ASaveStillBeingWrittenIsSkippedAndTheTrackedOneLoads) {
  FakeChecks checks{{{"iter_0000300", 300, CandidateKind::kRankFiles},
                     {"iter_0000200", 200, CandidateKind::kRankFiles}},
                    {{"iter_0000300",
                      "iter_0000300/mp_rank_01_001/model_optim_rng.pt: "
                      "missing (3 of 4 rank files)"}},
                    {}};
  const Selection s =
      SelectNewestIntact(checks.ordered, [&](size_t i) { checks(i); });
  ASSERT_TRUE(s.chosen.has_value());
  EXPECT_EQ(checks.ordered[*s.chosen].name, "iter_0000200");
  ASSERT_EQ(s.skipped.size(), 1u);
  EXPECT_THAT(s.skipped[0].reason, HasSubstr("missing"));
  FitFacts f;
  f.checkpoint_folder = f.same_format = f.layout_fits = true;
  f.has_tracker = true;
  f.tracked = true;  // the tracker names iter_0000200
  EXPECT_EQ(ChooseAction(f), LoadAction::kSaveDir);
}

TEST(SelectNewestIntactTest, AllBrokenChoosesNoneAndSkipsEachNewestFirst) {
  FakeChecks checks{{{"b", 2, CandidateKind::kRankFiles},
                     {"a", 1, CandidateKind::kRankFiles}},
                    {{"b", "b: truncated"}, {"a", "a: missing"}},
                    {}};
  const Selection s =
      SelectNewestIntact(checks.ordered, [&](size_t i) { checks(i); });
  EXPECT_FALSE(s.chosen.has_value());
  ASSERT_EQ(s.skipped.size(), 2u);
  EXPECT_EQ(s.skipped[0].reason, "b: truncated");
  EXPECT_EQ(s.skipped[1].reason, "a: missing");
  EXPECT_FALSE(SelectNewestIntact({}, [&](size_t) {}).chosen.has_value());
}

TEST(SelectNewestIntactTest, AnErrorOutsideUcpsHierarchyIsNotASkip) {
  const std::vector<CandidateKey> c = {{"x", 1, CandidateKind::kRankFiles}};
  EXPECT_THROW(SelectNewestIntact(c, [](size_t) { throw std::bad_alloc(); }),
               std::bad_alloc);
}

FitFacts Fitting() {
  FitFacts f;
  f.checkpoint_folder = true;
  f.same_format = true;
  f.layout_fits = true;
  return f;
}

TEST(ChooseActionTest, AsSavedWithTheTrackerNamingItLoadsTheSaveFolder) {
  FitFacts f = Fitting();
  f.has_tracker = f.tracked = true;
  EXPECT_TRUE(LoadsAsSaved(f));
  EXPECT_EQ(ChooseAction(f), LoadAction::kSaveDir);
}

TEST(ChooseActionTest, AsSavedButNotTrackedIsLinkedBesideATracker) {
  FitFacts f = Fitting();
  f.has_tracker = true;
  f.tracked = false;
  EXPECT_EQ(ChooseAction(f), LoadAction::kLinkTracked);
}

TEST(ChooseActionTest, AFormatWithoutTrackerLoadsTheCheckpointFolder) {
  FitFacts f = Fitting();
  f.has_tracker = false;
  EXPECT_EQ(ChooseAction(f), LoadAction::kCheckpointDir);
  f.tracked = true;  // no tracker: never asked, no difference
  EXPECT_EQ(ChooseAction(f), LoadAction::kCheckpointDir);
}

TEST(ChooseActionTest, AnythingThatDoesNotLoadAsSavedIsReshaped) {
  FitFacts base = Fitting();
  base.has_tracker = base.tracked = true;
  ASSERT_EQ(ChooseAction(base), LoadAction::kSaveDir);  // the control
  FitFacts f = base;
  f.layout_fits = false;  // another TP / PP / DP / ZeRO stage
  EXPECT_EQ(ChooseAction(f), LoadAction::kReshape);
  f = base;
  f.checkpoint_folder = false;  // a universal file: no framework loads it
  EXPECT_EQ(ChooseAction(f), LoadAction::kReshape);
  f = base;
  f.same_format = false;  // --format another one
  EXPECT_EQ(ChooseAction(f), LoadAction::kReshape);
  f = base;
  f.renamed = true;  // --names
  EXPECT_EQ(ChooseAction(f), LoadAction::kReshape);
  EXPECT_FALSE(LoadsAsSaved(f));
}

TEST(LoadFolderNameTest, NamesTheCheckpointAndTheLayout) {
  LoadFolderParts p;
  p.checkpoint = "global_step3";
  p.topology = layouts::Topology{1, 1, 1, 3};
  p.options_suffix = "-z1";
  EXPECT_EQ(LoadFolderName(p), "global_step3-tp1-pp1-vpp1-dp3-z1");
  p.checkpoint = "iter_0000010";
  p.topology = layouts::Topology{1, 4, 1, 4};
  p.options_suffix = "-do";
  EXPECT_EQ(LoadFolderName(p), "iter_0000010-tp1-pp4-vpp1-dp4-do");
}

TEST(LoadFolderNameTest, ExpertSizesWhenGiven) {
  LoadFolderParts p;
  p.checkpoint = "iter_0000010";
  p.topology = layouts::Topology{2, 1, 1, 2};
  p.topology->ep = 4;
  EXPECT_EQ(LoadFolderName(p), "iter_0000010-tp2-pp1-vpp1-dp2-ep4-etp2");
  p.topology->ep = 1;
  p.topology->etp = 1;
  EXPECT_EQ(LoadFolderName(p), "iter_0000010-tp2-pp1-vpp1-dp2-ep1-etp1");
  p.topology->etp.reset();  // dense: as before
  EXPECT_EQ(LoadFolderName(p), "iter_0000010-tp2-pp1-vpp1-dp2");
}

TEST(LoadFolderNameTest, AFormatWithoutTopologyAnotherFormatAndNames) {
  LoadFolderParts p;
  p.checkpoint = "model.ucp.h5";
  EXPECT_EQ(LoadFolderName(p), "model.ucp.h5");
  p.topology = layouts::Topology{2, 1, 1, 2};
  p.other_format = "mindspore";
  p.names = "mindformers-llama";
  EXPECT_EQ(LoadFolderName(p),
            "model.ucp.h5-tp2-pp1-vpp1-dp2-mindspore-mindformers-llama");
}

TEST(DataSkipTest, ConsumedSamplesOverTheNewGlobalBatchSizeFloored) {
  DataSkip r;
  r.global_batch_size = 3;
  EXPECT_EQ(DataSkipSteps(r, 8), 2);
  r.global_batch_size = 16;
  EXPECT_EQ(DataSkipSteps(r, 8), 0);
  r.global_batch_size = 4;
  EXPECT_EQ(DataSkipSteps(r, 8), 2);
  r.global_batch_size = 1024;
  EXPECT_EQ(DataSkipSteps(r, int64_t{3} << 40), int64_t{3} << 30);
  EXPECT_EQ(DataSkipSteps(r, -1), std::nullopt);          // consumed unknown
  EXPECT_EQ(DataSkipSteps(DataSkip{}, 8), std::nullopt);  // no batch size
}

TEST(DataSkipTest, IgnoredOrGivenSteps) {
  DataSkip r;
  r.global_batch_size = 3;
  r.ignore = true;
  EXPECT_EQ(DataSkipSteps(r, 8), 0);
  DataSkip g;
  g.steps = 7;
  EXPECT_EQ(DataSkipSteps(g, 8), 7);
  EXPECT_EQ(DataSkipSteps(g, -1), 7);
}

TEST(DataSkipTest, BadRulesAreUsageErrors) {
  EXPECT_NO_THROW(CheckDataSkip(DataSkip{}));
  DataSkip r;
  r.global_batch_size = 0;
  EXPECT_THROW(CheckDataSkip(r), UsageError);
  r.global_batch_size = 1;
  EXPECT_NO_THROW(CheckDataSkip(r));
  r.steps = -1;
  EXPECT_THROW(CheckDataSkip(r), UsageError);
  r.steps = 0;
  EXPECT_NO_THROW(CheckDataSkip(r));
  r.ignore = true;
  EXPECT_THROW(CheckDataSkip(r), UsageError);
}

}  // namespace
}  // namespace ucp::resume
