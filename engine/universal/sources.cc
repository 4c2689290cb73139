#include "engine/universal/sources.h"

#include "engine/core/error.h"
#include "engine/torchfile/zip.h"

namespace ucp::universal {

std::string TorchStorageSource::Describe() const {
  return StrCat("rank file ", file_->path().string(), " > storage ",
                storage_->key);
}

std::optional<std::pair<std::string, std::string>>
TorchStorageSource::ZipRecord() const {
  const torchfile::ZipReader* zip = file_->zip();
  if (zip == nullptr || zip->archive_offset() != 0) return std::nullopt;
  std::string name = file_->archive_name() + "/data/" + storage_->key;
  if (zip->Find(name) == nullptr) return std::nullopt;
  return std::pair(file_->path().lexically_normal().string(), std::move(name));
}

class StoreSources::DatasetSource : public reshape::ByteSource {
 public:
  DatasetSource(const atoms::AtomStoreReader& store, atoms::DatasetId id)
      : store_(store), id_(id) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    store_.Read(id_, offset, dst);
  }
  std::string Describe() const override {
    return StrCat("universal file ", store_.path().string(), " > ",
                  store_.dataset(id_).path);
  }

 private:
  const atoms::AtomStoreReader& store_;
  atoms::DatasetId id_;
};

StoreSources::StoreSources(const atoms::AtomStoreReader& store) {
  for (const atoms::DatasetInfo& d : store.datasets()) {
    sources_.push_back(std::make_unique<DatasetSource>(store, d.id));
  }
}

StoreSources::~StoreSources() = default;
StoreSources::StoreSources(StoreSources&&) noexcept = default;

reshape::SourceTensor StoreSources::Tensor(
    const atoms::DatasetInfo& dataset) const {
  return reshape::SourceTensor{dataset.id, 0, dataset.dtype, dataset.shape};
}

std::vector<const reshape::ByteSource*> StoreSources::list() const {
  std::vector<const reshape::ByteSource*> out;
  for (const auto& s : sources_) out.push_back(s.get());
  return out;
}

}  // namespace ucp::universal
