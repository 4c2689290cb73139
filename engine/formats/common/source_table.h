#pragma once
// The byte sources of a universal::SourcePlan built from torch.save files:
// one universal::TorchStorageSource per (file, storage), shared by every
// tensor that views the storage.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/reshape/plan.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"

namespace ucp::formats {

class SourceTable {
 public:
  /// Appends to `plan`'s sources; `plan` must outlive the table.
  explicit SourceTable(universal::SourcePlan& plan) : plan_(plan) {}

  /// The index of the storage's source (created on first use).
  uint32_t Index(const std::shared_ptr<const torchfile::TorchFile>& file,
                 const torchfile::StorageInfo* storage);
  /// The tensor as a source tensor: any layout torch writes (strides, a
  /// storage offset, a storage shared with other tensors or larger than the
  /// view; TorchFile::Open has checked that the view lies inside its
  /// storage); strided only if it is not contiguous. `what` names it in
  /// messages.
  reshape::SourceTensor Tensor(
      const std::shared_ptr<const torchfile::TorchFile>& file,
      const torchfile::TensorInfo& tensor, const std::string& what);

 private:
  universal::SourcePlan& plan_;
  std::map<
      std::pair<const torchfile::TorchFile*, const torchfile::StorageInfo*>,
      uint32_t>
      index_;
};

}  // namespace ucp::formats
