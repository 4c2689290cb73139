#pragma once
// Elastic restart from a save folder (`ucp resume`, and any other front end):
// the newest complete and intact checkpoint of the folder (any registered
// format, or a universal file), and a folder the framework loads it from at
// the requested layout. Two steps:
//
//   resume::ResumeDecision d = resume::Decide(request);  // reads, writes
//   nothing resume::ResumeOutcome o = resume::Run(d);           // provides
//   d.load
//
// Decide lists every checkpoint, newest first (choice.h: NewerFirst), checks
// each completely until one passes (every rank file present and parsing,
// every tensor covered, replicas identical, each torch.save record's CRC-32,
// its ucp.manifest.json if any; a universal file: the xxh3 of every
// dataset), and decides what to hand out (choice.h: ChooseAction): SAVE_DIR
// when the checkpoint loads as saved and the tracker names it; the checkpoint
// folder when its format keeps no tracker; else a load folder
// (SAVE_DIR/ucp-resume/<LoadFolderName> or the request's output) holding
// hard links and a tracker, or the checkpoint rewritten for the target. A
// rewrite is planned in Decide, so that a layout the model cannot take fails
// before anything is made. Run makes that load folder (staged, renamed into
// place; one already there is verified against its manifest and reused, or
// remade when it is ucp's own). Nothing else is ever written into SAVE_DIR.
//
// Runs on one save folder take turns: Decide takes an advisory flock on the
// folder itself (opened read-only) and the decision holds it until it is
// destroyed. Without flock (some NFS / FUSE mounts) they run at once and the
// first load folder committed is the one each takes.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/formats/driver.h"
#include "engine/reshape/executor.h"
#include "engine/resume/choice.h"
#include "layouts/variables.h"

namespace ucp::atoms {
struct RootInfo;
}

namespace ucp::resume {

/// The format a chosen checkpoint is written out in, and its options.
struct ResumeTarget {
  const formats::Driver* driver = nullptr;  // writable
  formats::TargetOptions options;
};

struct ResumeRequest {
  std::filesystem::path save_dir;
  /// The load folder to make when one is needed; empty:
  /// save_dir/ucp-resume/<LoadFolderName>.
  std::filesystem::path output;
  /// The target for a checkpoint in format `source_format` ("" when a
  /// universal file does not say): the front end picks the driver (its own,
  /// or the one the user named) and checks its options against it. Throws
  /// UsageError naming the front end's option. Required.
  std::function<ResumeTarget(const std::string& source_format)> target;
  std::string names;              // a name map (formats/name_map.h), or ""
  layouts::Variables model_vars;  // for --names and layout-placed targets
  DataSkip data_skip;
  reshape::ExecutorOptions executor;
  /// Called as each newer checkpoint is skipped (may be empty).
  std::function<void(const SkippedCheckpoint&)> on_skipped;
  /// One-line notes: a filesystem without flock, a damaged load folder of
  /// ucp's own remade (may be empty).
  std::function<void(const std::string&)> on_note;

  /// A job's processes (cli/cmd_resume.cc): rank 0 decides and runs as
  /// usual; the others decide with `only` (rank 0's choice: the newer
  /// checkpoints are not looked at) and `lock` false (rank 0 holds the
  /// save folder's lock), then WriteShare into rank 0's staging folder.
  std::string only;
  bool lock = true;
  /// Called by Run with the staging folder of a load folder it writes,
  /// before writing (rank 0 of a job publishes it); may be empty.
  std::function<void(const std::filesystem::path& staging)> on_staging;
};

namespace internal {
struct Chosen;  // the checked checkpoint, opened, and the folder lock
}

/// What Decide chose; Run performs it. Move-only.
struct ResumeDecision {
  std::string checkpoint;  // the chosen checkpoint's folder or file name
  int64_t iteration = 0;
  int64_t consumed_samples = -1;  // -1: unknown
  std::string source_format;      // its format ("" if a universal file
                                  // does not say)
  ResumeTarget target;
  /// The newer checkpoints skipped, newest first, with the reason.
  std::vector<SkippedCheckpoint> skipped;
  LoadAction action = LoadAction::kSaveDir;
  /// What the framework loads: SAVE_DIR, the checkpoint folder, or the load
  /// folder Run makes.
  std::filesystem::path load;
  /// The load folder is ucp's own (under SAVE_DIR/ucp-resume/): a damaged
  /// one is remade; false for the request's output (an error instead).
  bool own_load_folder = false;
  std::optional<int64_t> data_skip_steps;  // none when unknown

  bool reshaped() const { return action == LoadAction::kReshape; }
  /// Whether Run makes a load folder (kLinkTracked, kReshape).
  bool writes() const {
    return action == LoadAction::kLinkTracked || action == LoadAction::kReshape;
  }

  /// Run's state: the opened checkpoint, the planned rewrite, the save
  /// folder's lock (released when the decision is destroyed).
  std::unique_ptr<internal::Chosen> chosen;
  std::function<void(const std::string&)> on_note;  // the request's

  ResumeDecision();
  ResumeDecision(ResumeDecision&&) noexcept;
  ResumeDecision& operator=(ResumeDecision&&) noexcept;
  ~ResumeDecision();
};

/// Chooses the checkpoint and what to hand out (see the top of this file).
/// Writes nothing. Throws IoError if save_dir is not a folder or cannot be
/// opened or locked; FormatError "no checkpoint in ..." if it holds none,
/// "no complete and intact checkpoint in ..." if every one fails its checks
/// (each reason passed to on_skipped); UsageError from `target`, from a
/// bad data_skip (CheckDataSkip) or for an unknown name map; LayoutError /
/// FormatError / UsageError when the target cannot be planned from the
/// checkpoint (a layout the model cannot take).
ResumeDecision Decide(const ResumeRequest& request);

struct ResumeOutcome {
  std::filesystem::path load;
  /// The load folder was there already, verified, and reused.
  bool reused = false;
  int64_t linked_files = 0;  // hard links made (kLinkTracked)
  int64_t copied_files = 0;  // copied instead (another filesystem)
};

/// Provides decision.load: nothing to do for kSaveDir / kCheckpointDir;
/// else makes the load folder (or verifies and reuses one already there).
/// A failure leaves nothing under the load folder's name (and removes
/// SAVE_DIR/ucp-resume/ if this run made it). Throws IoError if the folder
/// cannot be made (naming -o as the way out when it would be inside the
/// save folder) or free space is short; FormatError if a load folder given
/// as output is there but damaged; what the target's writer throws.
ResumeOutcome Run(ResumeDecision& decision);

/// A job's process other than rank 0, for a kReshape decision: writes its
/// share of the rewrite into `staging` (rank 0's staging folder, which
/// rank 0 commits); the job's split (formats::ScopedEmitSplit) assigns the
/// files. Throws what the target's writer throws.
void WriteShare(const ResumeDecision& decision,
                const std::filesystem::path& staging);

/// The format a universal file was made from: the source's "driver", else
/// the writable driver whose name starts its "framework" ("megatron-lm"); ""
/// if neither says. Never throws.
std::string NativeFormat(const universal::Model& model);
/// The same from a universal file's root attributes ("" if they are
/// malformed). Never throws.
std::string NativeFormat(const atoms::RootInfo& root);

}  // namespace ucp::resume
