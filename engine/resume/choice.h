#pragma once
// The rules of `ucp resume` as pure functions of data (no files): which
// checkpoint of a save folder is taken, what is done to hand it out, under
// which load folder name, and how many data steps the new run skips.
// engine/resume/resume.h applies them to a save folder on disk; each rule is
// the one documented in engine/resume/README.md and cli/README.md.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "layouts/variables.h"

namespace ucp::resume {

/// What a checkpoint of a save folder is, in the order preferred among
/// checkpoints of one iteration.
enum class CandidateKind : uint8_t {
  kRankFiles = 0,      // a format with a topology: the files training wrote
  kTopologyFree = 1,   // a writable format without one (a universal folder
                       // made from those files)
  kUniversalFile = 2,  // a ucp universal file
};

/// One checkpoint found in a save folder, as far as ordering needs it.
struct CandidateKey {
  std::string name;        // its folder or file name
  int64_t iteration = -1;  // -1: unknown (sorts last)
  CandidateKind kind = CandidateKind::kRankFiles;
};

/// Strict weak order, newest first: the higher iteration; at one
/// iteration the lower kind; then the greater name.
bool NewerFirst(const CandidateKey& a, const CandidateKey& b);

/// A newer checkpoint passed over, and why (the check's message).
struct SkippedCheckpoint {
  std::string name;
  int64_t iteration = -1;
  std::string reason;
};

/// The newest checkpoint that passed its checks, and the newer ones that
/// did not.
struct Selection {
  std::optional<size_t> chosen;  // index into the candidates; none if all fail
  std::vector<SkippedCheckpoint> skipped;  // newest first
};

/// Calls `check(i)` on `ordered` (newest first) in order until one returns
/// normally: that one is chosen. A check that throws ucp::Error skips its
/// candidate with the error's message as the reason (passed to `on_skipped`
/// too, when given, as it happens); older candidates are not checked.
/// Throws what `check` throws that is not a ucp::Error.
Selection SelectNewestIntact(
    const std::vector<CandidateKey>& ordered,
    const std::function<void(size_t)>& check,
    const std::function<void(const SkippedCheckpoint&)>& on_skipped = {});

/// What is handed out for the chosen checkpoint.
enum class LoadAction : uint8_t {
  kSaveDir,        // it loads as saved and the tracker names it: SAVE_DIR
  kCheckpointDir,  // it loads as saved, its format keeps no tracker: the
                   // checkpoint folder itself
  kLinkTracked,    // it loads as saved but the tracker names another: a load
                   // folder of hard links beside a tracker naming it
  kReshape,        // it does not: a load folder with it rewritten
};

/// The facts the action depends on.
struct FitFacts {
  bool checkpoint_folder = false;  // false: a universal file (loads nowhere)
  bool same_format = false;        // the target format is the checkpoint's
  bool renamed = false;            // written under other names (--names)
  bool layout_fits = false;  // its format loads it with the target options
  bool has_tracker = false;  // the format names its current checkpoint in
                             // a tracker file (Driver::HasTracker)
  bool tracked = false;      // the save folder's tracker names this one
};

/// Whether the checkpoint loads as saved: a checkpoint folder, in the target
/// format, under its own names, and the layout fits.
bool LoadsAsSaved(const FitFacts& facts);
/// The action the facts call for (`tracked` matters only when the
/// checkpoint loads as saved and its format has a tracker).
LoadAction ChooseAction(const FitFacts& facts);

/// What the load folder's name says.
struct LoadFolderParts {
  std::string checkpoint;  // the chosen checkpoint's name
  /// The target topology, when the target format has one.
  std::optional<layouts::Topology> topology;
  std::string options_suffix;  // formats::LayoutOptionsSuffix: "-do", "-z1"
  std::string other_format;    // the target format if not the checkpoint's
  std::string names;           // the name map (--names), "" for none
};

/// "<checkpoint>[-tpT-ppP-vppV-dpD[-epE-etpX]]<options_suffix>[-<other_format>]
/// [-<names>]", the default load folder under SAVE_DIR/ucp-resume/.
std::string LoadFolderName(const LoadFolderParts& parts);

/// How the new run's data-skip steps are given.
struct DataSkip {
  /// The new run's global batch size: steps = consumed samples / it.
  std::optional<int64_t> global_batch_size;
  std::optional<int64_t> steps;  // given as is
  bool ignore = false;           // 0
};

/// Throws UsageError if a batch size is < 1, steps are < 0, or both
/// `ignore` and `steps` are given.
void CheckDataSkip(const DataSkip& rule);
/// 0 when ignored; the given steps; else consumed samples / global batch
/// size (floor) when both are known (`consumed_samples` >= 0); else none.
/// Expects a rule CheckDataSkip accepts.
std::optional<int64_t> DataSkipSteps(const DataSkip& rule,
                                     int64_t consumed_samples);

}  // namespace ucp::resume
