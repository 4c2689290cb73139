#pragma once
// PyTorch Distributed Checkpoint (DCP) checkpoints, the family's container:
// discovery, items, reading a state dict into a universal SourcePlan (the
// "dcp" driver of ../dcp_plain, Megatron-FSDP; Megatron-core's torch_dist
// reads the container with keys of its own).
//
// A checkpoint folder (torch/distributed/checkpoint/filesystem.py):
//   .metadata            pickled Metadata (metadata.h), written last: a
//                        folder without it is an incomplete checkpoint
//   __R_I.distcp         items of rank R (bucket I), back to back: each a
//                        whole torch.save archive (a tensor chunk: the
//                        chunk's tensor; BYTE_IO: any object) at the
//                        offset and length .metadata records, the
//                        archive possibly zstd-compressed whole
//                        ("stream.zstd/1")
//   __R.metadata         instead of .metadata for rank-local saves
//                        (save(..., use_collectives=False)): each rank's own
//                        items; merged, replicas checked to be identical
// A save folder holds checkpoint folders (torchtitan's step-N/); the newest
// complete one is read unless --checkpoint names one.
//
// Keys, in the layout of torch.distributed.checkpoint.state_dict's
// get_state_dict (planner_data tells the nesting):
//   model.<fqn>                       a param's weights (fp32 atom when
//                                     float32, else its training-dtype
//                                     `param` atom); integer tensors are
//                                     buffers
//   optimizer.state.<fqn>.<kind>      optimizer state (exp_avg, exp_avg_sq,
//                                     step, ...) of param <fqn>
//   optimizer.param_groups.<i>.<key>  BYTE_IO: group i's hyper-parameters,
//                                     `params` the fqns it optimizes
//   any other tensor                  a param named by its key
//   any other BYTE_IO item            kept verbatim
// In the universal file: atoms as above, every BYTE_IO item verbatim under
// /opaque/dcp/bytes/<key>, the param groups also as optimizer/param_groups
// (for other formats), the key order, kinds and planner_data in the root
// attribute "dcp" (DcpExtras below): {"keys": [{"key", "class", "param"?,
// "state"?}...] in the metadata's order, "planner_data": {fqn: [path
// component (str | int)...]} in state-dict order, "version", "world"}; a
// stacked expert key (experts.h: torchtitan's moe.experts.w1 ...) becomes one
// param per global expert, its record adding "experts" (E) and "order".

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/formats/dcp/metadata.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"

namespace ucp {
class File;
}

namespace ucp::dcp {

inline constexpr const char* kMetadataFile = ".metadata";
inline constexpr const char* kCheckpointOption = "checkpoint";
inline constexpr const char* kMetaAttr = "dcp";

/// One key of the source as the "dcp" attribute records it.
struct DcpKeyRecord {
  std::string key;
  std::string cls;           // KeyClassName
  std::string param, state;  // empty if none
  // A stacked expert tensor (experts.h): its experts (0: not one) and the
  // order its suffix or shape tells ("EFD", "EDF").
  int64_t experts = 0;
  std::string order;
};

/// The "dcp" root attribute, typed. Unknown members stay in `other`.
struct DcpExtras {
  std::vector<DcpKeyRecord> keys;
  /// fqn -> its path in the state dict, in state-dict order; absent if the
  /// record has none.
  std::optional<std::vector<std::pair<std::string, std::vector<PathComponent>>>>
      planner_data;
  std::optional<std::string> version;
  std::optional<int64_t> world;
  json::Value other = json::Value::Object();
};

/// The model's "dcp" record; absent if it has none. Throws FormatError
/// "universal file <file> > attribute dcp > ..." if it is malformed.
std::optional<DcpExtras> ReadDcpExtras(const universal::Model& model,
                                       const std::filesystem::path& file);
/// Stores `extras` as the model's "dcp" record.
void WriteDcpExtras(const DcpExtras& extras, universal::Model& model);

/// One item of a checkpoint: where it lies.
struct Item {
  std::filesystem::path file;  // absolute
  StorageInfo info;
  int64_t rank = 0;  // the metadata file that lists it (rank-local saves)
};

struct Checkpoint {
  std::filesystem::path dir;   // the save folder (parent)
  std::filesystem::path path;  // the checkpoint folder
  std::string name;            // its folder name
  int64_t iteration = 0;       // the name's trailing number, else the step of
                               // optimizer.state.*.step, else 0
  bool rank_local = false;
  std::vector<std::filesystem::path> metadata_files;
  /// Merged metadata: every chunk once (the first rank's), every key.
  Metadata metadata;
  /// Every item of every chunk / bytes key, replicas of rank-local saves
  /// included (in rank order).
  std::map<ItemKey, std::vector<Item>> items;
  /// Every file: the metadata files, then the .distcp files items name.
  std::vector<std::filesystem::path> files;
  int64_t world = 1;  // writing ranks (the __R_ prefixes)
};

/// True if `dir` holds a .metadata or __R.metadata.
bool IsCheckpointFolder(const std::filesystem::path& dir);

/// The checkpoint folders of save folder `dir` (complete or not: every
/// sub-folder with a .distcp or metadata file); the iteration is the name's
/// trailing number, -1 without one. Never throws.
std::vector<formats::SavedCheckpoint> ListCheckpoints(
    const std::filesystem::path& dir);

/// Finds and reads the checkpoint at `path` (a checkpoint folder, or a save
/// folder: sub-folder `name`, else the newest complete one), merging
/// rank-local metadata. Throws IoError if `path` is not a readable folder,
/// FormatError naming the file for a missing / malformed metadata file, an
/// item naming a missing file, chunks that do not tile their tensor (a hole
/// or an overlap, naming the key and box), UsageError if `name` is not a
/// checkpoint of the save folder.
Checkpoint Discover(const std::filesystem::path& path, const std::string& name);

/// The files of a checkpoint, each opened once and shared by its items.
class FileCache {
 public:
  /// Throws IoError.
  std::shared_ptr<const File> Get(const std::filesystem::path& path);

 private:
  std::map<std::filesystem::path, std::shared_ptr<const File>> open_;
};

/// The archive of an item, opened (decompressed in memory first when the
/// item is zstd-compressed). Throws FormatError naming the file and key.
std::shared_ptr<const torchfile::TorchFile> OpenItem(const Item& item,
                                                     const ItemKey& key,
                                                     FileCache& files);

/// The verbatim bytes of a BYTE_IO item (decompressed). Throws like OpenItem.
std::string ItemBytes(const Item& item, const ItemKey& key, FileCache& files);

/// Where a format built on this container (Megatron-FSDP's fsdp_dtensor)
/// puts a tensor key: the param it is (part of), that param's shape, and the
/// tensor's offset in it (empty: 0 in every dim); a 0-d state (a step) takes
/// only the name. An empty `param`: no param's (an rng state), kept as an
/// object (its item's bytes, like a BYTE_IO item's; one chunk).
struct ParamPlace {
  std::string param;
  Shape shape;
  Shape offset;
};
/// `key`: the DCP key; `name`: the param it names (model.<name>,
/// optimizer.state.<name>.<s>, else the key); `size`: its global shape.
/// Never throws.
using ParamNamer = std::function<ParamPlace(
    const std::string& key, const std::string& name, const Shape& size)>;

/// Reads every item's archive index and pickle and plans the universal
/// content (see above), params placed by `namer` when given (tensors of one
/// param from several keys: their atoms merged, overlapping 0-d states
/// checked as replicas). Throws FormatError naming the file, key and problem.
universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const ParamNamer& namer = nullptr);

/// The torch.save archives (items) file `file` of the checkpoint holds, in
/// file order; compressed items are none (formats::Source::Archives).
/// Never throws.
std::vector<formats::ArchiveSpan> Archives(const Checkpoint& checkpoint,
                                           const std::filesystem::path& file);

/// Keys, global shapes and dtypes, chunks and where each lies, for `ucp
/// inspect`, as `format` (a driver name) titled `title`.
json::Value Inventory(const Checkpoint& checkpoint,
                      std::string_view format = "dcp",
                      std::string_view title = "PyTorch DCP");

}  // namespace ucp::dcp
