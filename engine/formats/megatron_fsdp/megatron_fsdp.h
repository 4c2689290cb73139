#pragma once
// Megatron-FSDP checkpoints (`--use-megatron-fsdp --ckpt-format
// fsdp_dtensor`, Megatron-LM's training/checkpointing.py with megatron-core's
// transformer/fsdp_dtensor_checkpoint.py): read by the "megatron-fsdp"
// driver into universal content under Megatron's canonical names, so that
// any Megatron target (torch_dist, the legacy torch format), DCP, DeepSpeed
// or an export can be written from it.
//
// A save folder as Megatron's other formats keep it:
//   latest_checkpointed_iteration.txt   the tracker
//   iter_NNNNNNN/                       a DCP checkpoint folder (dcp.h),
//                                       saved by torch's own FileSystemWriter:
//                                       .metadata and no metadata.json
// Keys (torch's flattening of the state dict training saves):
//   model.[module.]*<name>              the fp32 main weight of param <name>
//                                       (Megatron-FSDP keeps no other copy),
//                                       a global DTensor (unevenly sharded
//                                       over DP, whole across TP)
//   model.[module.]*<x>.linear_fc1.{weight,bias}_{w,v}
//                                       SwiGLU's fc1 split in its two halves
//                                       (handle_swiglu_in_state_dict): _w the
//                                       gate rows, _v the up rows of the
//                                       canonical [gate; up] param
//   optimizer.state.[module.]*<name>.<kind>
//                                       exp_avg, exp_avg_sq, step (torch
//                                       AdamW's), fc1 split the same way
//   optimizer.param_to_group_meta.[module.]*<name>.<key>
//                                       each param's group hyper-parameters
//   args, iteration, checkpoint_version, opt_param_scheduler.*,
//   rng_state.<i>.* (uint8 tensors and objects), ...
//                                       objects
// Names lose their wrappers' "module." prefixes (the model keys and the
// optimizer's carry different numbers of them). In the universal file: the
// canonical params with their layout (built-in, detected from the names,
// model variables from args), vocabulary padding rows as pad atoms, the
// param groups the metas make, args and the top-level scalars as a Megatron
// source keeps them (args, top_level/<key>), other objects under
// megatron_fsdp/<key> (the rng states' uint8 tensors, flattened by torch from
// get_rng_state's list, among them).
// Not read: pipeline parallelism (each stage numbers its layers from 0),
// mixture-of-experts models.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "engine/formats/dcp/dcp.h"
#include "engine/formats/driver.h"
#include "engine/formats/megatron/args.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"
#include "layouts/variables.h"

namespace ucp::megatron_fsdp {

struct Checkpoint {
  std::filesystem::path dir;       // the save folder
  std::filesystem::path iter_dir;  // iter_NNNNNNN
  int64_t iteration = 0;
  dcp::Checkpoint dcp;
  /// As saved: args' sizes, else DP = the writing ranks.
  layouts::Topology topology;
  /// The args object (its item) and what it says; null / absent without.
  std::shared_ptr<const torchfile::TorchFile> args;
  std::optional<megatron::RunConfig> run;
};

/// True if `dir` is a complete DCP checkpoint folder of Megatron's naming
/// (iter_N, beside Megatron's tracker) without torch_dist's metadata.json or
/// common.pt, or a save folder with the tracker holding one and no torch_dist
/// iteration. Never throws.
bool IsFsdpFolder(const std::filesystem::path& dir);

/// True if iteration folder `iter_dir` is a DCP folder (complete, or with a
/// .distcp file) without torch_dist's metadata.json or common.pt. Never
/// throws.
bool HoldsFsdpFiles(const std::filesystem::path& iter_dir);

/// Finds the checkpoint (a save folder: `iteration`, else the tracker's; or
/// an iteration folder) and reads its DCP metadata and args. Throws IoError,
/// FormatError naming the tracker, folder or args field (another ckpt_format,
/// pipeline parallelism), UsageError for an iteration the save folder lacks,
/// and what dcp::Discover throws.
Checkpoint Discover(const std::filesystem::path& path,
                    std::optional<int64_t> iteration);

/// The param a key's name stands for: `name` without its "module." prefixes.
std::string CanonicalName(std::string_view name);

/// Plans the universal content (see above). Throws FormatError naming the
/// folder, key or args field; LayoutError when no layout matches the names.
universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const formats::SourceOptions& options);

}  // namespace ucp::megatron_fsdp
