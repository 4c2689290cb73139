#include "engine/formats/dcp/items.h"

#include <cstdio>
#include <random>

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"

namespace ucp::dcp {

std::string RankFileName(int64_t rank) {
  return StrCat("__", rank, "_0.distcp");
}

ItemFiles::ItemFiles(std::vector<PlannedKey> keys,
                     std::vector<std::vector<PlannedItem>> items,
                     std::vector<size_t> entry_order, std::filesystem::path dir)
    : keys_(std::move(keys)),
      items_(std::move(items)),
      entry_order_(std::move(entry_order)),
      dir_(std::move(dir)),
      spans_(items_.size()) {
  std::vector<bool> listed(keys_.size(), false);
  for (size_t k : entry_order_) {
    UCP_CHECK(k < keys_.size(), "entry ", k, " of ", keys_.size(), " keys");
    listed[k] = true;
  }
  for (size_t k = 0; k < keys_.size(); ++k)
    if (!listed[k]) entry_order_.push_back(k);
  for (const auto& rank : items_) {
    for (const PlannedItem& it : rank) {
      UCP_CHECK(it.key < keys_.size(), "item of key ", it.key, " of ",
                keys_.size());
    }
  }
}

std::unique_ptr<formats::TorchSaveRunFile> ItemFiles::RankFile(
    int64_t rank) const {
  const std::string name = RankFileName(rank);
  auto f = std::make_unique<formats::TorchSaveRunFile>(dir_ / name);
  for (const PlannedItem& it : items_.at(static_cast<size_t>(rank))) {
    const PlannedKey& k = keys_[it.key];
    if (!k.tensor) {
      f->AddRawArchive(k.bytes);
      continue;
    }
    formats::TorchArchive& a = f->AddArchive();
    const size_t index = f->size() - 1;
    if (!it.constant.empty()) {
      a.SetRoot(a.AddConstant(k.dtype, it.chunk.sizes, it.constant));
      continue;
    }
    reshape::TargetTensor t;
    t.name = StrCat("rank file ", name, " > ", k.fqn, " > chunk ",
                    BoxString(it.chunk));
    t.dtype = k.dtype;
    t.shape = it.ops_shape.empty() ? it.chunk.sizes : it.ops_shape;
    t.ops = it.ops;
    torchfile::TensorSpec spec;
    spec.dtype = k.dtype;
    spec.shape = it.chunk.sizes;
    a.SetRoot(f->AddTensor(index, std::move(t), spec));
  }
  f->Layout();
  spans_[static_cast<size_t>(rank)] = f->archives();
  return f;
}

std::unique_ptr<formats::PlannedFile> ItemFiles::MetadataFile(
    std::vector<std::pair<std::string, std::string>> extra) const {
  for (int64_t r = 0; r < world(); ++r)
    if (spans_[static_cast<size_t>(r)].size() !=
        items_[static_cast<size_t>(r)].size())
      RankFile(r);
  std::vector<std::vector<std::pair<size_t, size_t>>> chunks_of(keys_.size());
  for (size_t r = 0; r < items_.size(); ++r)
    for (size_t j = 0; j < items_[r].size(); ++j)
      chunks_of[items_[r][j].key].emplace_back(r, j);
  Metadata m;
  for (const size_t i : entry_order_) {
    const PlannedKey& k = keys_[i];
    Entry e;
    e.fqn = k.fqn;
    e.tensor = k.tensor;
    e.dtype = k.dtype;
    e.size = k.shape;
    for (const auto& [r, j] : chunks_of[i]) {
      const PlannedItem& it = items_[r][j];
      const formats::ArchiveSpan& span = spans_[r][j];
      if (k.tensor) e.chunks.push_back(it.chunk);
      ItemKey key{k.fqn, k.tensor ? std::optional<Shape>(it.chunk.offsets)
                                  : std::nullopt};
      m.storage[key] = StorageInfo{
          RankFileName(static_cast<int64_t>(r)), span.offset, span.length, {}};
    }
    m.entries.push_back(std::move(e));
  }
  for (const PlannedKey& k : keys_)
    if (!k.path.empty()) m.planner_data.emplace_back(k.fqn, k.path);
  m.extra = std::move(extra);
  std::random_device rd;
  char uuid[40];
  std::snprintf(uuid, sizeof uuid, "%08x-%04x-4%03x-a%03x-%08x%04x", rd(),
                rd() & 0xffff, rd() & 0xfff, rd() & 0xfff, rd(), rd() & 0xffff);
  auto f = std::make_unique<formats::RawFile>(dir_ / kMetadataFile);
  f->AddBytes(PickleMetadata(m, uuid));
  return f;
}

}  // namespace ucp::dcp
