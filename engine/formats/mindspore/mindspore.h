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

#include <filesystem>
#include <string>
#include <vector>

#include "engine/formats/driver.h"
#include "engine/formats/mindspore/ckpt.h"
#include "engine/formats/target_plan.h"
#include "engine/universal/input.h"
#include "engine/universal/source_plan.h"

namespace ucp::mindspore {

inline constexpr const char* kCheckpointOption = "checkpoint";
inline constexpr const char* kMetaAttr = "mindspore";

struct Checkpoint {
  std::filesystem::path dir;   // the folder holding the file
  std::filesystem::path path;  // the .ckpt file
  int64_t iteration = 0;       // global_step, else the step in the name
  CkptIndex index;
};

/// The checkpoint at `path`: a .ckpt file, or in a folder the file `file`
/// names, else the one its meta.json names (last_ckpt_file), else the
/// newest by the <prefix>-<epoch>_<step>.ckpt of its name, else its only
/// one. A folder with rank_1/ (a sharded save, which needs a strategy file)
/// is refused. Throws UsageError for an unknown `file`, FormatError naming
/// the file for a damaged or foreign one, IoError if unreadable.
Checkpoint Discover(const std::filesystem::path& path, const std::string& file);

/// The .ckpt files of folder `dir` (or of its rank_0/), oldest first.
/// Never throws.
std::vector<formats::SavedCheckpoint> ListCheckpoints(
    const std::filesystem::path& dir);

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
/// file is unsharded. Throws FormatError naming a param without weights,
/// UsageError for a dtype MindSpore has not.
std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options);

}  // namespace ucp::mindspore
