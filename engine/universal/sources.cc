#include "engine/universal/sources.h"

#include <mutex>
#include <optional>

#include "engine/core/error.h"
#include "engine/core/hash.h"
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

// A dataset's bytes, checked against its xxh3 as they are read: the reads
// that continue the bytes hashed so far feed a streaming hash, and when they
// reach the end the digest must equal the stored one (a byte damaged after
// the file was written is then an error, not silently copied). A dataset
// read out of order is not checked here (`ucp verify` checks every one):
// hashing it would cost a second read.
class StoreSources::DatasetSource : public reshape::ByteSource {
 public:
  DatasetSource(const atoms::AtomStoreReader& store, atoms::DatasetId id)
      : store_(store), id_(id) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    store_.Read(id_, offset, dst);
    const atoms::DatasetInfo& d = store_.dataset(id_);
    std::lock_guard lock(mu_);
    if (out_of_order_ || d.nbytes == 0 || dst.empty()) return;
    if (offset == hashed_) {
      if (!hasher_) hasher_.emplace();
      hasher_->Update(dst.data(), dst.size());
      hashed_ += dst.size();
      if (hashed_ == d.nbytes) {
        const uint64_t digest = hasher_->Digest();
        hasher_.reset();
        out_of_order_ = true;  // done: later reads are not hashed again
        if (digest != d.xxh3) {
          throw FormatError(Describe(), ": the bytes read hash to ",
                            HashHex(digest), ", its xxh3 attribute is ",
                            HashHex(d.xxh3),
                            " (damaged after it was written; ucp verify "
                            "checks every dataset)");
        }
      }
    } else if (offset + dst.size() > hashed_) {
      out_of_order_ = true;  // a gap, or a read reaching past the hashed end
    }
  }
  std::string Describe() const override {
    return StrCat("universal file ", store_.path().string(), " > ",
                  store_.dataset(id_).path);
  }

 private:
  const atoms::AtomStoreReader& store_;
  atoms::DatasetId id_;
  mutable std::mutex mu_;
  mutable std::optional<Xxh3Hasher> hasher_;  // while a stream is hashed
  mutable uint64_t hashed_ = 0;
  mutable bool out_of_order_ = false;
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
