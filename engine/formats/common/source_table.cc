#include "engine/formats/common/source_table.h"

#include "engine/core/error.h"
#include "engine/universal/sources.h"

namespace ucp::formats {

uint32_t SourceTable::Index(
    const std::shared_ptr<const torchfile::TorchFile>& file,
    const torchfile::StorageInfo* storage) {
  auto key = std::make_pair(file.get(), storage);
  auto it = index_.find(key);
  if (it != index_.end()) return it->second;
  const auto index = static_cast<uint32_t>(plan_.sources.size());
  plan_.sources.push_back(
      std::make_unique<universal::TorchStorageSource>(file, storage));
  index_.emplace(key, index);
  return index;
}

reshape::SourceTensor SourceTable::Tensor(
    const std::shared_ptr<const torchfile::TorchFile>& file,
    const torchfile::TensorInfo& t, const std::string& what) {
  (void)what;  // TorchFile::Open checked that the view lies in its storage
  reshape::SourceTensor s;
  s.source = Index(file, t.storage);
  s.byte_offset =
      static_cast<uint64_t>(t.storage_offset) * ElementSize(t.dtype);
  s.dtype = t.dtype;
  s.shape = t.shape;
  if (!t.contiguous) s.stride = t.stride;
  return s;
}

}  // namespace ucp::formats
