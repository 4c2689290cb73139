#pragma once
// PyTorch Distributed Checkpoint (DCP) metadata: the `.metadata` pickle,
// read through the pickle VM (never executing anything) and written as
// torch's FileSystemWriter writes it.
//
// Format (torch/distributed/checkpoint/metadata.py, filesystem.py; every
// torch from 2.0 to the newest):
//   Metadata (NEWOBJ + BUILD of its __dict__)
//     state_dict_metadata: {fqn: TensorStorageMetadata | BytesStorageMetadata}
//       TensorStorageMetadata: properties = TensorProperties (BUILD of the
//         tuple (dtype, layout, requires_grad, _MEM_FORMAT_ENCODING(n),
//         pin_memory[, strides])), size = torch.Size, chunks = [
//         ChunkStorageMetadata(offsets = torch.Size, sizes = torch.Size)]
//     planner_data: {fqn: (path components: str, or int list indices)}
//     storage_data: {MetadataIndex(fqn, offset = torch.Size | absent for
//       bytes, index = hint): _StorageInfo(relative_path, offset, length[,
//       transform_descriptors])}
//     storage_meta: StorageMeta(checkpoint_id, save_id, load_id[, modules])
//                   (torch >= 2.4)
//     version: "1.0.0" (torch >= 2.8)
//     any other attribute (Megatron-core's mcore_data) kept as it is
// Globals accepted (by module and name; any other is refused): the classes
// above (also from torch.distributed._shard.sharded_tensor.metadata, and
// subclasses other frameworks pickle there, read as their base class:
// Megatron-core's MCoreMetadata, ByteCheckpoint's Metadata / _StorageInfo),
// torch.Size, torch dtypes, torch.serialization._get_layout, pathlib paths,
// collections.OrderedDict, builtins.set / frozenset, and the planner
// classes of saved plans (SavePlan, WriteItem, WriteItemType,
// TensorWriteData, _StoragePrefix).

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/strided.h"
#include "engine/pickle/value.h"

namespace ucp::dcp {

/// A box of a global tensor (ChunkStorageMetadata). A 0-d tensor has one
/// chunk with empty offsets and sizes.
struct Chunk {
  Shape offsets;
  Shape sizes;
};

/// Where an item lies (_StorageInfo).
struct StorageInfo {
  std::string relative_path;
  uint64_t offset = 0;
  uint64_t length = 0;
  /// transform_descriptors ("stream.zstd/1"); empty if none.
  std::vector<std::string> transforms;
};

/// One key of the state dict.
struct Entry {
  std::string fqn;
  bool tensor = false;  // TensorStorageMetadata; else BytesStorageMetadata
  DType dtype = DType::kFloat32;
  Shape size;
  std::vector<Chunk> chunks;
  bool requires_grad = false;
};

/// The key of an item: the fqn and, for a tensor chunk, its offsets.
struct ItemKey {
  std::string fqn;
  std::optional<Shape> offset;
  bool operator<(const ItemKey& o) const {
    return fqn != o.fqn ? fqn < o.fqn : offset < o.offset;
  }
  bool operator==(const ItemKey& o) const {
    return fqn == o.fqn && offset == o.offset;
  }
};

/// A planner_data path component: a str key or an int list index.
using PathComponent = std::variant<std::string, int64_t>;

struct Metadata {
  std::vector<Entry> entries;  // in the file's order
  std::map<ItemKey, StorageInfo> storage;
  std::vector<std::pair<std::string, std::vector<PathComponent>>>
      planner_data;     // in the file's order
  std::string version;  // "" if absent
  /// Other attributes of the Metadata object (Megatron-core's mcore_data):
  /// name and the value as a pickle of its own (protocol 2), so that a run
  /// holds them as bytes, not as a graph of a node per field (megatron-core's
  /// per-key records are most of a large save's .metadata).
  std::vector<std::pair<std::string, std::string>> extra;

  const Entry* Find(std::string_view fqn) const;
};

/// Parses a `.metadata` pickle. Throws FormatError naming `path` and the
/// problem: not a pickle, an unknown global (named), a missing or malformed
/// field (naming the key).
Metadata ParseMetadata(std::string_view bytes,
                       const std::filesystem::path& path);

/// The `.metadata` of `m` as torch writes it (Metadata with storage_meta and
/// version "1.0.0"; TensorProperties as the 5-tuple every torch >= 2.0
/// reads), pickled with protocol 2. `save_id` names the save.
std::string PickleMetadata(const Metadata& m, const std::string& save_id);

/// "[0, 24]" for messages.
std::string BoxString(const Chunk& c);

}  // namespace ucp::dcp
