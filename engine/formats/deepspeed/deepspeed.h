#pragma once
// DeepSpeed checkpoints: discovery, reading into a universal SourcePlan, and
// writing native rank files and universal folders for any DP size and ZeRO
// stage. Formats: deepspeed_format.h.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/formats/deepspeed/deepspeed_format.h"
#include "engine/formats/driver.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"

namespace ucp::deepspeed {

/// The options the drivers declare (driver.cc).
inline constexpr const char* kTagOption = "tag";
inline constexpr const char* kZeroStageOption = "zero-stage";
/// Stage 0 fp16 targets: "fused" (FP16_Optimizer, which DeepSpeed uses with
/// FusedAdam) or "unfused" (FP16_UnfusedOptimizer, any other optimizer).
inline constexpr const char* kFp16OptimizerOption = "fp16-optimizer";

struct Checkpoint {
  std::filesystem::path dir;      // the save folder (holds `latest`)
  std::filesystem::path tag_dir;  // dir / tag
  std::string tag;
  int stage = 0;  // ZeRO stage (BF16_Optimizer: 0)
  Wrapper wrapper = Wrapper::kTorch;
  bool bf16_prefix = false;  // optimizer files named bf16_zero_pp_...
  int64_t dp = 1;
  /// ZeRO 3: one per dp rank; else one (mp_rank_00_model_states.pt).
  std::vector<std::filesystem::path> model_files;
  /// One per dp rank (empty for Wrapper::kTorch).
  std::vector<std::filesystem::path> optim_files;
  /// Model parallelism (Megatron-DeepSpeed): mp rank = pp_rank * tp +
  /// tp_rank with a PipelineModule, tp_rank without. 1 and 1 otherwise.
  int64_t tp = 1;
  int64_t pp = 1;
  /// A PipelineModule: model states hold module None; the weights are in
  /// layer files.
  bool pipeline = false;
  /// model_files / optim_files of every mp rank (index mp; [0] equals the
  /// two lists above).
  struct MpRank {
    std::vector<std::filesystem::path> model_files;
    std::vector<std::filesystem::path> optim_files;
  };
  std::vector<MpRank> mp_ranks;
  /// Pipeline layer files layer_{idx}-model_{tp}-model_states.pt: per tp
  /// rank, (layer index, path) by index.
  std::vector<std::vector<std::pair<int64_t, std::filesystem::path>>>
      layer_files;
  /// Mixture of experts (deepspeed.moe.layer.MoE): the expert files
  /// layer_{L}_expert_{G}_mp_rank_00_model_states.pt by (MoE layer L, global
  /// expert G); the legacy expert_{G}_mp_rank_00_model_states.pt (every
  /// layer's params of expert G) under L = -1. Empty without experts.
  std::map<std::pair<int64_t, int64_t>, std::filesystem::path> expert_files;
  /// expp_rank_{E}_mp_rank_00_optim_states.pt by expert-parallel rank E
  /// (stage 0's expert optimizer; DeepSpeed writes none under ZeRO, or
  /// {'optimizer': None}).
  std::map<int64_t, std::filesystem::path> expert_optim_files;
  /// The expert-parallel size: dp over the partition_count of the first
  /// expert group ('moe': True) of optimizer file 0; 1 without experts.
  int64_t ep = 1;
  /// A universal folder: its zero/ folder (per-param atoms and
  /// optimizer_state.pt) replaces the optimizer files.
  std::filesystem::path zero_dir;
  /// The files Discover already opened (model file 0, optimizer file 0),
  /// reused by PlanSource so that no pickle is parsed twice.
  std::shared_ptr<const torchfile::TorchFile> first_model;
  std::shared_ptr<const torchfile::TorchFile> first_optim;
};

/// True if `dir` holds DeepSpeed model states of mp rank 00 (a tag folder,
/// or a universal folder).
bool HoldsModelStates(const std::filesystem::path& dir);

/// The tag folders of save folder `dir`: every sub-folder holding a
/// DeepSpeed rank file (complete or not); the iteration is the tag's
/// trailing number (global_step120 -> 120), -1 without one. Never throws.
std::vector<formats::SavedCheckpoint> ListTags(
    const std::filesystem::path& dir);

/// Finds the checkpoint: `dir/latest`'s tag (or `tag`), or `dir` itself if it
/// is a tag folder. Checks that every rank file the checkpoint's own world
/// size and model parallelism need is there and that the files agree on
/// them, and lists a mixture-of-experts checkpoint's expert files (which
/// experts each MoE layer needs is checked by PlanSource). Throws
/// UsageError if there is no `latest` and no tag is given (naming the tags
/// present), FormatError naming the missing / extra / mismatched file, or
/// an unsupported layout (expert files with model parallelism or at ZeRO
/// stage 0 or 3, an unknown ZeRO stage); IoError if `dir` is not a
/// readable folder.
Checkpoint Discover(const std::filesystem::path& dir, const std::string& tag);

/// Reads every rank file (index and pickle only) and plans the universal
/// content (deepspeed_format.h). The plan keeps the files open. With model
/// parallelism, each mp rank's local tensors are merged into whole ones by
/// the layout (`options.layout`, else detected from the names; vocabulary
/// size from `options.true_vocab_size` (--vocab-size), else the checkpoint's
/// universal_checkpoint_info, else the padded rows). Throws FormatError
/// naming the rank file, param and problem; LayoutError if no layout fits.
universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const formats::SourceOptions& options = {});

/// The param names (every mp rank's), model variables and layout of a
/// Megatron-DeepSpeed checkpoint with TP or PP, for `ucp layout check`.
/// Throws UsageError for a checkpoint without model parallelism (its names
/// need no layout), LayoutError if no layout recognises the names, else as
/// PlanSource.
formats::Source::NameListing ListNames(const Checkpoint& checkpoint,
                                       const formats::SourceOptions& options);

/// Plans native DeepSpeed rank files for options.topology.dp ranks and ZeRO
/// stage --zero-stage (default: the source's): <tag>/... and `latest`
/// (last). Throws UsageError for tp/pp the source cannot take or an unknown
/// stage, FormatError if the universal content lacks master weights.
std::unique_ptr<formats::TargetPlan> PlanNative(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options);

/// Plans a DeepSpeed universal checkpoint folder (what ds_to_universal
/// writes and `load_universal` reads): <tag>_universal/zero/<param>/
/// {fp32,exp_avg,exp_avg_sq,step}.pt, zero/optimizer_state.pt, the model
/// states file(s) (one per data-parallel rank of the source at ZeRO 3, as
/// ds_to_universal copies them), and latest_universal (last).
std::unique_ptr<formats::TargetPlan> PlanUniversalFolder(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options);

/// The universal folders (<tag>_universal with zero/) of save folder `dir`,
/// complete or not; the iteration is the tag's trailing number, -1 without
/// one. Never throws.
std::vector<formats::SavedCheckpoint> ListUniversalFolders(
    const std::filesystem::path& dir);

/// A DeepSpeed universal folder as a source: `path` is a save folder with
/// latest_universal (or `tag`, the universal folder's name), or the
/// universal folder itself. The Checkpoint has zero_dir set; PlanSource
/// reads it. Throws UsageError / FormatError like Discover.
Checkpoint DiscoverUniversal(const std::filesystem::path& path,
                             const std::string& tag);

}  // namespace ucp::deepspeed
