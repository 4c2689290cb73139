#pragma once
// Megatron-LM legacy (`--ckpt-format torch`) checkpoints: discovery, reading
// into a universal SourcePlan, and writing rank files for any topology.
//
// On-disk layout (Megatron-core v0.13; see the format notes in
// megatron_format.h for every key):
//   <dir>/latest_checkpointed_iteration.txt   "N" or "release" (written last)
//   <dir>/iter_{N:07d}/ (or release/)
//     mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt
//                                               [+ distrib_optim.pt]

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/formats/driver.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/rng_state.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"
#include "engine/universal/source_plan.h"
#include "layouts/variables.h"

namespace ucp::megatron {

/// The target option the driver declares (driver.cc); its source option is
/// the family's kIterationOption (iteration_driver.h).
inline constexpr const char* kDistributedOptimizerOption =
    "distributed-optimizer";

/// A checkpoint found on disk.
struct Checkpoint {
  std::filesystem::path dir;       // the --save folder (holds the tracker)
  std::filesystem::path iter_dir;  // iter_0000100 / release
  int64_t iteration = 0;
  bool release = false;
  /// tp, pp, vpp (1 = none), dp, and for a mixture of experts ep (etp is
  /// unset or tp: Megatron's legacy format has no other) from args.
  layouts::Topology topology;
  bool distributed_optimizer = false;
  /// rank_files[pp][ep * tp_size + tp] =
  /// .../mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt
  std::vector<std::vector<std::filesystem::path>> rank_files;
  /// distrib_optim_files[pp][ep * tp_size + tp] = .../distrib_optim.pt
  /// (empty without the distributed optimizer, or without optimizer state:
  /// --no-save-optim).
  std::vector<std::vector<std::filesystem::path>> distrib_optim_files;
};

/// Finds the checkpoint in `dir` (LocateIteration, release/ accepted): the
/// tracker file's iteration or release folder (or `iteration` if given), or
/// `dir` itself if it is an iter_* / release folder. Reads the args of rank
/// (0, 0) for the topology and checks that every rank file (and
/// distrib_optim.pt when the distributed optimizer was used and rank (0, 0)
/// holds optimizer state) exists and that no rank folder is unexplained.
/// Throws FormatError naming the missing or malformed file (or unsupported
/// feature such as an expert tensor-parallel size other than TP), IoError if
/// `dir` is not a folder or unreadable, UsageError for an `iteration` the
/// folder lacks.
Checkpoint Discover(const std::filesystem::path& dir,
                    std::optional<int64_t> iteration = std::nullopt);

/// The run's settings from a legacy rank file's args (ReadRunConfig with
/// experts; a dense model's expert sizes dropped). Throws FormatError as
/// ReadRunConfig, or for an expert-parallel size without num_experts.
RunConfig ReadLegacyRunConfig(const ArgsView& args);

struct SourceOptions {
  /// A builtin layout name or a YAML file; empty: detect from the names.
  std::string layout;
  /// The tokenizer's vocabulary size when args lack it (needed to strip
  /// vocab padding and to re-pad for another TP). Without it the args'
  /// NullTokenizer size (vocab_size + 1) is used, else the padded size
  /// (all rows kept as real rows).
  std::optional<int64_t> true_vocab_size;
};

/// Canonical names (global layer indices, nested keys joined with ".") of
/// every entry of every chunk of every rank file, each once, in canonical
/// order, with the model variables derived from the args and the layout
/// used to place layers (options.layout, else detected from the names). No
/// rule matching is done: this feeds `ucp layout check`, which reports
/// unmatched names instead of failing on the first. Throws FormatError
/// naming the rank file, LayoutError if no layout can be chosen.
struct NameListing {
  std::vector<std::string> names;
  layouts::Variables variables;
  std::string layout_name;
  std::string layout_yaml;
};
NameListing ListNames(const Checkpoint& checkpoint,
                      const SourceOptions& options);

/// Reads every rank file (index and pickle only) and plans the universal
/// file: params in canonical order with global layer indices, atoms fp32 /
/// exp_avg / exp_avg_sq (/ step) and the training-dtype weights (`param`,
/// when they are not fp32), fragments from model_optim_rng.pt and
/// distrib_optim.pt, metadata and opaque objects (args, rng states, TE
/// _extra_state, ...). The plan keeps the rank files open. Throws
/// FormatError / LayoutError naming the rank file, param and problem
/// (unmatched or ambiguous names, shapes that disagree, optimizer groups
/// that do not follow Megatron's rule, a distrib_optim.pt whose buffer
/// layout does not match); IoError if a file cannot be read.
universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const SourceOptions& options);

struct TargetOptions {
  /// tp, pp, vpp, dp; ep for a mixture of experts (etp unset or tp).
  layouts::Topology topology;
  bool distributed_optimizer = false;
  /// Overrides the universal file's vocabulary size for the padding. Must
  /// not be below the stored rows, unless the universal file did not know
  /// the true size (its rows are the source's padded rows): then the rows
  /// beyond it are padding rows. Without it, such a file's rows are all
  /// kept, and a note says when Megatron could pad differently.
  std::optional<int64_t> true_vocab_size;
  /// Model weights only (no optimizer, no distrib_optim.pt). Implied when
  /// the universal file holds no optimizer state.
  bool no_optimizer = false;
  /// How the rank files' rng_state is written (rng_state.h).
  RngStateMode rng_state = RngStateMode::kKeep;
};

struct TargetSummary {
  /// Files written: model_optim_rng.pt, distrib_optim.pt and the tracker.
  int64_t files = 0;
  uint64_t bytes = 0;
  std::vector<std::string>
      notes;  // e.g. "rng states copied from source rank ..."
};

/// Writes the checkpoint for `options.topology` from universal content (a
/// universal file through universal::StoreInput, or a source checkpoint's
/// plan through universal::PlanInput for a one-step convert) into
/// `out_dir` (an existing, empty folder; wrap it in a StagedDirectory so a
/// failure leaves nothing under the final name): every rank file as
/// Megatron-core v0.13 would save it for that configuration (args patched
/// for the new topology, local layer numbering, vocab padded for the new TP,
/// optimizer state laid out for the new DP), tracker file last. Each file is
/// written under a temporary name and renamed when complete. Throws
/// LayoutError if the topology does not divide heads, query groups, layers
/// or split dims (or asks for VPP > 1 with PP = 1); UsageError for an etp
/// other than tp (the legacy format has one folder per (tp, pp, ep)) or ep /
/// etp for a model without routed experts; FormatError if the universal
/// file lacks what Megatron needs; IoError on write failures.
TargetSummary WriteTarget(const universal::UniversalInput& input,
                          const std::filesystem::path& out_dir,
                          const TargetOptions& options,
                          const reshape::ExecutorOptions& executor);
/// The plan WriteTarget executes (the files as data; formats/target_plan.h).
/// Throws what WriteTarget throws before writing.
std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input, const TargetOptions& options,
    const reshape::ExecutorOptions& executor);
/// The same from a universal file.
TargetSummary WriteTarget(const atoms::AtomStoreReader& store,
                          const std::filesystem::path& out_dir,
                          const TargetOptions& options,
                          const reshape::ExecutorOptions& executor);

}  // namespace ucp::megatron
