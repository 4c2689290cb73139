#pragma once
// MindFormers "Checkpoint 2.0" (mindformers/checkpoint/, MindFormers 2.x,
// save_checkpoint with format "safetensors"):
//
//   <root>/latest_checkpointed_iteration.txt   the newest iteration N (text)
//   <root>/iteration_{N:08d}/
//     [<prefix>-]model-{rank:07d}-{world:07d}.safetensors
//         the rank's model tensors (its local slices), by parameter name
//     [<prefix>-]opt-{rank:07d}-{world:07d}.safetensors
//         its optimizer's, by MindSpore's names (moment1.<p> / adam_m.<p>,
//         moment2.<p> / adam_v.<p>, global_step, learning_rate, ...);
//         absent without optimizer state
//     common.json    {"epoch_num", "step_num", "global_step", "loss_scale",
//                     "global_batch_size", "consumed_samples",
//                     "ckpt_status"} (CommonInfo; values may be null)
//     metadata.json  written for more than one rank (one rank: none, every
//                    file whole):
//       {"state_dict_metadata": {<name>: {"properties": {"dtype", ...},
//          "global_shape": [...], "axis_fragmentations": [...],
//          "layout": {...} | null,
//          "chunk": [{"global_offset": [...], "local_shape": [...]}]}},
//        "storage_data": {"('<name>', (<o0>, <o1>, ...))":
//          [{"file_name": "<file>.safetensors", "storage_rank": r,
//            "rank_group": [...]}]}}
//       a chunk listed once per rank file holding it (replicas too).
// The safetensors container: engine/formats/common/safetensors.h.

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/formats/mindspore/ckpt.h"

namespace ucp::mindspore {

/// A safetensors file as records: each tensor an entry (its tensor type
/// MindSpore's name of the dtype) with one slice at its absolute offset.
/// Throws IoError; FormatError naming the file (and tensor) for a header
/// that is no safetensors header, an unknown dtype, data outside the file.
CkptIndex ReadSafetensorsIndex(const std::filesystem::path& path);

/// Whether `path` is named as MindSpore's safetensors container (by its
/// extension, nothing read), or as a checkpoint file of either container.
inline bool IsSafetensorsName(const std::filesystem::path& path) {
  return path.extension() == ".safetensors";
}
inline bool IsCheckpointFileName(const std::filesystem::path& path) {
  return path.extension() == ".ckpt" || IsSafetensorsName(path);
}

/// Whether `path` is a safetensors file MindSpore wrote
/// (save_checkpoint(format="safetensors"), CheckpointConfig(format=
/// "safetensors"), transform_checkpoints(output_format="safetensors"):
/// "__metadata__" {"format": "ms"}). Never throws.
bool LooksLikeMsSafetensors(const std::filesystem::path& path) noexcept;

/// Whether `path` is a checkpoint file MindSpore wrote in either of its
/// formats: a .ckpt record stream or a .safetensors file. Never throws.
bool LooksLikeCheckpointFile(const std::filesystem::path& path) noexcept;

/// The records of a checkpoint file in either format (a .safetensors file's
/// tensors, whole; else ReadCkptIndex). Throws what those throw.
CkptIndex ReadCheckpointFile(const std::filesystem::path& path);

/// Where a rank file's slice of a tensor lies.
struct Placed {
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offset;
};

struct Checkpoint2 {
  std::filesystem::path iter_dir;
  int64_t iteration = 0;          // common.json global_step, else N
  int64_t consumed_samples = -1;  // consumed_samples, else steps x batch
  int64_t world = 1;
  /// Rank r's model file, then its optimizer file (if any), rank by rank.
  std::vector<CkptIndex> files;
  std::vector<int64_t> rank_of;  // per file
  /// (file index, tensor name) -> its place (metadata.json; empty for one
  /// rank). A tensor it does not place is whole.
  std::map<std::pair<size_t, std::string>, Placed> placed;
};

/// The iteration folder `path` names: itself (it holds a model file), or
/// the tracker's (or else the newest) iteration_N/ of a save folder.
/// Absent if `path` is neither.
std::optional<std::filesystem::path> Checkpoint2Dir(
    const std::filesystem::path& path);

/// The iteration the save folder's tracker names; absent without one.
/// Throws FormatError for a tracker that holds no number.
std::optional<int64_t> Checkpoint2Tracker(const std::filesystem::path& root);

/// Reads an iteration folder: its files' indexes, common.json,
/// metadata.json. Throws IoError; FormatError naming the file for a missing
/// rank file, a malformed common.json / metadata.json, a file metadata.json
/// names that is not there, a folder newer than the tracker of its save
/// folder names (an unfinished save).
Checkpoint2 ReadCheckpoint2(const std::filesystem::path& iter_dir);

/// The folder name of iteration N: "iteration_0000000N" (8 digits).
std::string IterationFolderName(int64_t iteration);

/// MindFormers' shard id of a slice: Python's str((name, tuple(offset))),
/// "('w', (0, 16))", "('b', (6,))", "('s', ())".
std::string ShardId(const std::string& name,
                    const std::vector<int64_t>& offset);

/// The iteration folders of a save folder (each holding a model file) and
/// their iterations, oldest first. Never throws.
std::vector<std::pair<int64_t, std::filesystem::path>> Checkpoint2Iterations(
    const std::filesystem::path& root);

/// Whether `dir` is an iteration folder (holds a model file). Never throws.
bool IsCheckpoint2Folder(const std::filesystem::path& dir);

}  // namespace ucp::mindspore
