#pragma once
// The files of a DCP checkpoint from planned items, for the dcp driver and
// the formats that store their state in DCP (Megatron-core torch_dist):
//   __R_0.distcp   rank R's items back to back, in the order given: a tensor
//                  chunk is a torch.save archive of the chunk, a BYTE_IO
//                  item its verbatim bytes (a torch.save archive too)
//   .metadata      every key (in the order given) with its chunks (in rank
//                  order) and where each item lies; planner_data for the
//                  keys that have a path; extra Metadata attributes kept
// Which rank writes which item, and how a chunk's bytes are made (copy ops
// from universal atoms), is the caller's plan.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "engine/formats/dcp/metadata.h"
#include "engine/formats/target_plan.h"
#include "engine/reshape/plan.h"

namespace ucp::dcp {

/// A key of the checkpoint being planned.
struct PlannedKey {
  std::string fqn;
  bool tensor = false;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::string bytes;                // BYTE_IO: the item's bytes
  std::vector<PathComponent> path;  // planner_data; empty: not listed
};

/// An item: a chunk of a tensor key (made by `ops`, whose destination boxes
/// lie in the chunk, or given as `constant` bytes), or a BYTE_IO key.
struct PlannedItem {
  size_t key = 0;
  Chunk chunk;
  /// The shape the ops' destination boxes address, when not the chunk's
  /// (the same elements: a layer chunk [1, n, m] filled as [n, m]).
  Shape ops_shape;
  std::vector<reshape::CopyOp> ops;
  std::vector<std::byte> constant;
};

/// "__3_0.distcp".
std::string RankFileName(int64_t rank);

class ItemFiles {
 public:
  /// `items[r]`: rank r's items in file order. `entry_order`: the keys in
  /// the order .metadata lists them (keys left out follow in index order).
  /// The files are planned in folder `dir` (relative to the output folder).
  ItemFiles(std::vector<PlannedKey> keys,
            std::vector<std::vector<PlannedItem>> items,
            std::vector<size_t> entry_order, std::filesystem::path dir = {});

  int64_t world() const noexcept { return static_cast<int64_t>(items_.size()); }
  const std::vector<PlannedKey>& keys() const noexcept { return keys_; }
  const std::vector<PlannedItem>& items(int64_t rank) const {
    return items_.at(static_cast<size_t>(rank));
  }

  /// Rank r's file. Its archives' places are remembered for the metadata.
  /// Throws like TorchSaveRunFile::Layout.
  std::unique_ptr<formats::TorchSaveRunFile> RankFile(int64_t rank) const;

  /// The .metadata (rank files not planned yet are planned for their
  /// places), with `extra` attributes (name, the value pickled: as
  /// Metadata::extra) after torch's own.
  std::unique_ptr<formats::PlannedFile> MetadataFile(
      std::vector<std::pair<std::string, std::string>> extra = {}) const;

 private:
  std::vector<PlannedKey> keys_;
  std::vector<std::vector<PlannedItem>> items_;
  std::vector<size_t> entry_order_;
  std::filesystem::path dir_;
  mutable std::vector<std::vector<formats::ArchiveSpan>> spans_;
};

}  // namespace ucp::dcp
