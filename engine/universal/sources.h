#pragma once
// Byte sources over the inputs of the executor: storages of torch files and
// datasets of a universal file.

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/reshape/executor.h"
#include "engine/reshape/plan.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::universal {

/// Reads one storage of a torch file (shared by all tensors viewing it).
class TorchStorageSource : public reshape::ByteSource {
 public:
  TorchStorageSource(std::shared_ptr<const torchfile::TorchFile> file,
                     const torchfile::StorageInfo* storage)
      : file_(std::move(file)), storage_(storage) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    file_->ReadStorage(*storage_, offset, dst);
  }
  std::string Describe() const override;
  std::optional<FileLocation> Locate(uint64_t offset) const override {
    return file_->StorageLocation(*storage_, offset);
  }
  /// The file (lexically normal) and zip record holding the storage, when it
  /// is a record of a zip archive starting the file; nullopt otherwise.
  std::optional<std::pair<std::string, std::string>> ZipRecord() const;

 private:
  std::shared_ptr<const torchfile::TorchFile> file_;
  const torchfile::StorageInfo* storage_;
};

/// A byte source for every dataset of a universal file, indexed like the
/// store's datasets (source index == DatasetId).
class StoreSources {
 public:
  explicit StoreSources(const atoms::AtomStoreReader& store);
  ~StoreSources();
  StoreSources(StoreSources&&) noexcept;
  /// The source tensor of a dataset: the whole dataset, row-major.
  reshape::SourceTensor Tensor(const atoms::DatasetInfo& dataset) const;
  /// The sources in index order (append to the executor's source table).
  std::vector<const reshape::ByteSource*> list() const;

 private:
  class DatasetSource;
  std::vector<std::unique_ptr<DatasetSource>> sources_;
};

}  // namespace ucp::universal
