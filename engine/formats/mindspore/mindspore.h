#pragma once
// MindSpore checkpoints (the "mindspore" driver): a `.ckpt` file written by
// mindspore.save_checkpoint (format: ckpt.h), or a folder holding such files
// (a MindFormers rank_0/ folder, with or without meta.json), read into the
// universal content. Parameters become atoms (float32 ones `fp32`, others
// `param` in their dtype); Adam's moments, `moment1.<p>` / `moment2.<p>`
// (nn.Adam) or `adam_m.<p>` / `adam_v.<p>` (AdamWeightDecay, MindFormers),
// become `exp_avg` / `exp_avg_sq` of <p>; every other record (global_step,
// learning_rate, beta1_power, ...) is kept verbatim in the root's
// "mindspore" attribute. global_step is the iteration.
//
// A sharded save (rank_0/, rank_1/, ... each with its .ckpt files) is read
// with its strategy file (strategy.h): each rank's slice is placed by its
// layout into the whole parameter, replicas are checked bit for bit. The
// files of one step are taken on every rank: the newest <epoch>_<step>
// every rank has (not newer than any rank's meta.json), as MindFormers'
// resume takes them.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/formats/driver.h"
#include "engine/formats/mindspore/checkpoint2.h"
#include "engine/formats/mindspore/ckpt.h"
#include "engine/formats/mindspore/strategy.h"
#include "engine/formats/names/mindspore_extras.h"
#include "engine/formats/target_plan.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/model.h"
#include "engine/universal/source_plan.h"

namespace ucp::mindspore {

inline constexpr const char* kCheckpointOption = "checkpoint";
inline constexpr const char* kStrategyOption = "strategy";
inline constexpr const char* kCheckpoint2Option = "checkpoint2";
/// The rank files' container: "ckpt" (a .ckpt record stream) or
/// "safetensors" (save_checkpoint(format="safetensors")).
inline constexpr const char* kFileFormatOption = "file-format";
/// The record-name prefixes of Adam's moments and the state kind each is:
/// nn.Adam's moment1. / moment2., AdamWeightDecay's (MindFormers') adam_m. /
/// adam_v. (a reader and a writer of the same names).
inline constexpr std::pair<const char*, const char*> kMomentPrefixes[] = {
    {"moment1.", "exp_avg"},
    {"moment2.", "exp_avg_sq"},
    {"adam_m.", "exp_avg"},
    {"adam_v.", "exp_avg_sq"}};

/// A moment record's param and state kind: `name` is a kMomentPrefixes prefix
/// plus a name `is_param` accepts (a record of the same file or strategy);
/// nullopt for any other name.
template <typename IsParam>
std::optional<std::pair<std::string, std::string>> MomentOf(
    std::string_view name, IsParam&& is_param) {
  for (const auto& [prefix, kind] : kMomentPrefixes) {
    const std::string_view p(prefix);
    if (name.starts_with(p) && is_param(name.substr(p.size())))
      return std::pair(std::string(name.substr(p.size())), std::string(kind));
  }
  return std::nullopt;
}

/// Opaque blob key prefix of a map tensor's raw records (+ its tag).
inline constexpr const char* kMapTensorKey = "mindspore/maptensor/";

struct Checkpoint {
  std::filesystem::path dir;   // the folder holding the file
  std::filesystem::path path;  // the .ckpt file (rank 0's)
  int64_t iteration = 0;  // global_step, else step_num, else the name's step
  /// step_num x global_batch_size (MindFormers' append_dict); -1 if unknown.
  int64_t consumed_samples = -1;
  CkptIndex index;  // rank 0's
  /// A sharded save: every rank's file (rank order; [0] is `index`) and
  /// the strategy placing their slices. Empty / absent for one file.
  std::vector<CkptIndex> ranks;
  std::optional<Strategy> strategy;
  /// A MindFormers Checkpoint 2.0 iteration folder (checkpoint2.h): its
  /// files (rank order, model then optimizer) are the sources.
  std::optional<Checkpoint2> v2;
};

/// The checkpoint at `path`: a .ckpt file, or in a folder the file `file`
/// names, else the one its meta.json names (last_ckpt_file), else the
/// newest by the <prefix>-<epoch>_<step>.ckpt of its name, else its only
/// one. A folder with rank_1/ (or any folder given a `strategy`) is a
/// sharded save: `file` names rank 0's file and the other ranks' files of
/// the same step are taken; its strategy is `strategy`, else the first of
/// <path>/strategy.ckpt, <path>/strategy.json, <path>/strategy/ and
/// <path>/../strategy/ (MindFormers' output/strategy). Throws UsageError
/// for an unknown `file`, FormatError naming the file for a damaged or
/// foreign one, a rank without the step's file or a missing strategy,
/// IoError if unreadable.
Checkpoint Discover(const std::filesystem::path& path, const std::string& file,
                    const std::string& strategy = "");

/// The .ckpt files of folder `dir` (or of its rank_0/), oldest first; of a
/// sharded save, rank 0's files of the steps every rank has. Never throws.
std::vector<formats::SavedCheckpoint> ListCheckpoints(
    const std::filesystem::path& dir);

/// The files of `c`: every rank's of a sharded save, else the one. Never
/// throws.
std::vector<const CkptIndex*> Files(const Checkpoint& c);

/// Whether `dir` holds rank_0/ and rank_1/ and rank_0/ a .ckpt file.
/// Never throws.
bool LooksSharded(const std::filesystem::path& dir);

/// What `ucp inspect` shows of `c` (formats::Source::Inventory): every
/// record by tag in file order — its tensor type, the dims each rank stores,
/// the ranks holding it, its bytes — as {"text", "format", "path", "ranks",
/// "strategy", "records": [...]}. Never throws.
json::Value Inventory(const Checkpoint& c);

/// The universal content of `c` (tensor bytes stay in the file). Throws
/// FormatError naming the file and record.
universal::SourcePlan PlanSource(const Checkpoint& c);

/// The MindSpore checkpoint of universal content `input`, planned: rank_0/
/// holding one .ckpt file (the source's name and record order when it was a
/// MindSpore checkpoint, else ucp_rank_0-1_<iteration>.ckpt) with every
/// param's weights (fp32 masters where there are, else the training-dtype
/// weights), Adam's moments (the source's names, else nn.Adam's moment1. /
/// moment2.), the source's other records verbatim (else global_step from the
/// iteration), then meta.json as MindFormers writes it. No topology: the
/// file is unsharded, unless options name a strategy file: then rank_R/
/// for each of its ranks, each holding its slices of its stage's params,
/// meta.json in each, and the strategy copied beside them. Throws
/// FormatError naming a param without weights or one its layout does not
/// fit, UsageError for a dtype MindSpore has not.
std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options);

}  // namespace ucp::mindspore
