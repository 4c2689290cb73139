#include "engine/torchfile/torch_file.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "engine/core/aligned_buffer.h"
#include "engine/core/checked.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/pickle/pickle.h"
#include "engine/torchfile/encoding.h"
#include "engine/torchfile/zip.h"

namespace ucp::torchfile {

using pickle::Kind;
using pickle::Value;

std::string FormatPath(const TensorPath& path) {
  std::string out;
  for (const PathComponent& c : path) {
    if (!out.empty()) out += '/';
    if (const auto* s = std::get_if<std::string>(&c)) {
      out += *s;
    } else {
      out += std::to_string(std::get<int64_t>(c));
    }
  }
  return out.empty() ? "<root>" : out;
}

namespace {

// Bytes of the legacy magic number pickle (protocol 2):
// 0x1950a86a20f9469cfc6c as LONG1 little-endian two's complement.
constexpr std::string_view kLegacyMagic(
    "\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19", 10);
constexpr int64_t kLegacyProtocolVersion = 1001;

// Bytes the paths of all tensors may take (TensorInfo::path): far beyond
// any real checkpoint (a few hundred bytes per tensor, and every tensor costs
// dozens of pickle bytes), far below what a hostile pickle could make them.
constexpr uint64_t kMinPathBudget = uint64_t{64} << 20;
constexpr uint64_t kPathBudgetPerPickleByte = 16;
// A torch.save archive's first local headers, pickle and small records
// are read with its magic number.
constexpr uint64_t kSniffBytes = 4096;

struct StorageLoc {
  const ZipEntry* entry = nullptr;  // zip
  uint64_t legacy_offset = 0;       // legacy: relative to the file start
  bool located = false;
};

}  // namespace

struct TorchFile::Impl {
  std::shared_ptr<const File> file;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t file_size = 0;
  Format format = Format::kZip;
  std::string archive_name;
  std::optional<ZipReader> zip;
  std::string pickle;
  pickle::Arena arena;
  const Value* root = nullptr;
  std::vector<StorageInfo> storages;
  std::vector<StorageLoc> locs;
  std::unordered_map<std::string, size_t> storage_by_key;
  std::unordered_map<const Value*, size_t> storage_by_persid;
  std::vector<TensorInfo> tensors;
  std::unordered_map<const Value*, size_t> tensor_by_node;

  std::string Describe() const {
    std::string s = file->path().string();
    if (offset != 0 || length != file_size) {
      s += StrCat(" (bytes ", offset, "..", offset + length, ")");
    }
    return s;
  }

  template <typename... Args>
  [[noreturn]] void Fail(Args&&... args) const {
    throw FormatError(Describe(), ": ", std::forward<Args>(args)...);
  }

  void ReadAt(void* dst, size_t n, uint64_t rel) const {
    if (!FitsWithin(rel, n, length)) {
      Fail("unexpected end of file (wanted ", n, " bytes at offset ", rel,
           ", file has ", length, ")");
    }
    file->ReadExact(dst, n, offset + rel);
  }

  // `head`: the archive's first bytes, already read.
  void LoadZip(std::span<const std::byte> head);
  void LoadLegacy();
  void CollectStorages(bool legacy);
  void LocateZipStorages();
  void CollectTensors();
  size_t StorageIndex(const StorageInfo& s) const {
    UCP_CHECK(&s >= storages.data() && &s < storages.data() + storages.size(),
              "storage does not belong to this TorchFile");
    return static_cast<size_t>(&s - storages.data());
  }
};

void TorchFile::Impl::LoadZip(std::span<const std::byte> head) {
  format = Format::kZip;
  zip.emplace(ZipReader::Open(file, offset, length, head));
  const std::vector<ZipEntry>& entries = zip->entries();
  if (entries.empty()) Fail("not a torch.save file (empty zip archive)");
  const std::string& first = entries.front().name;
  const size_t slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    Fail("not a torch.save file (zip entry '", first,
         "' is not inside an archive folder)");
  }
  archive_name = first.substr(0, slash);
  const std::string prefix = archive_name + "/";
  if (zip->Find(prefix + "constants.pkl") != nullptr) {
    Fail("not a torch.save file (a TorchScript archive: use torch.jit.load)");
  }
  const ZipEntry* data_pkl = zip->Find(prefix + "data.pkl");
  if (data_pkl == nullptr) Fail("not a torch.save file (no data.pkl record)");
  if (const ZipEntry* bo = zip->Find(prefix + "byteorder")) {
    std::string order = zip->ReadRecord(*bo, 64);
    if (order != "little") {
      Fail("byteorder record says '", order.substr(0, 16),
           "'; only little-endian files are supported");
    }
  }
  pickle = zip->ReadRecord(*data_pkl);
  try {
    root = pickle::Unpickle(pickle, arena);
  } catch (Error& e) {
    e.AddContext("data.pkl");
    e.AddContext(Describe());
    throw;
  }
}

void TorchFile::Impl::LoadLegacy() {
  format = Format::kLegacy;
  std::string buffer;
  auto grow = [&](uint64_t want) {
    want = std::min(want, length);
    if (want <= buffer.size()) return;
    const size_t have = buffer.size();
    buffer.resize(static_cast<size_t>(want));
    ReadAt(buffer.data() + have, buffer.size() - have, have);
  };
  size_t pos = 0;
  // Parses the next pickle, reading more of the file while it is cut short.
  auto parse = [&](pickle::Arena& a, const char* what) -> const Value* {
    for (;;) {
      try {
        size_t consumed = 0;
        const Value* v = pickle::Unpickle(std::string_view(buffer).substr(pos),
                                          a, &consumed);
        pos += consumed;
        return v;
      } catch (FormatError& e) {
        // Read more only if the pickle may just be cut short by the buffer;
        // a corrupt one would otherwise pull the whole file into memory.
        if (buffer.size() >= length ||
            e.message().find("truncated") == std::string::npos) {
          e.AddContext(what);
          e.AddContext(Describe());
          throw;
        }
        a = pickle::Arena();
        grow(std::max<uint64_t>(2 * buffer.size(), 1 << 20));
      }
    }
  };
  // 1. The magic number: a tiny pickle; never read further to find it.
  grow(64);
  {
    pickle::Arena scratch;
    const Value* magic = nullptr;
    try {
      size_t consumed = 0;
      magic = pickle::Unpickle(buffer, scratch, &consumed);
      pos = consumed;
    } catch (const Error&) {
      magic = nullptr;
    }
    if (magic == nullptr || magic->kind != Kind::kInt ||
        magic->big != kLegacyMagic) {
      Fail(
          "not a torch.save file (neither a zip archive nor the legacy "
          "format)");
    }
  }
  grow(1 << 20);
  {
    pickle::Arena scratch;
    const Value* version = parse(scratch, "legacy protocol version");
    if (version->kind != Kind::kInt || version->i != kLegacyProtocolVersion) {
      Fail("unsupported legacy protocol version ", pickle::Repr(version));
    }
  }
  {
    pickle::Arena scratch;
    const Value* sys_info = parse(scratch, "legacy sys_info");
    const Value* little =
        sys_info->IsDictLike() ? sys_info->Get("little_endian") : nullptr;
    if (little == nullptr || little->kind != Kind::kBool) {
      Fail("legacy sys_info is malformed: ", pickle::Repr(sys_info));
    }
    if (!little->b) Fail("big-endian legacy files are not supported");
  }
  const size_t object_start = pos;
  root = parse(arena, "legacy object pickle");
  pickle = buffer.substr(object_start, pos - object_start);
  std::vector<std::string> keys;
  {
    pickle::Arena scratch;
    const Value* list = parse(scratch, "legacy storage key list");
    if (list->kind != Kind::kList) {
      Fail("legacy storage key list is not a list: ", pickle::Repr(list));
    }
    for (const Value* k : list->items) {
      if (k == nullptr || (k->kind != Kind::kStr && k->kind != Kind::kBytes)) {
        Fail("legacy storage key is not a string: ", pickle::Repr(k));
      }
      keys.push_back(k->s);
    }
  }
  const uint64_t data_start = pos;
  buffer.clear();
  buffer.shrink_to_fit();

  try {
    CollectStorages(/*legacy=*/true);
  } catch (Error& e) {
    e.AddContext("legacy object pickle");
    e.AddContext(Describe());
    throw;
  }
  uint64_t cursor = data_start;
  for (const std::string& key : keys) {
    auto it = storage_by_key.find(key);
    if (it == storage_by_key.end()) {
      Fail("legacy storage list names key ", key,
           " that no persistent id declares");
    }
    StorageInfo& s = storages[it->second];
    StorageLoc& loc = locs[it->second];
    if (loc.located) Fail("legacy storage list names key ", key, " twice");
    unsigned char count_bytes[8];
    if (!FitsWithin(cursor, 8, length)) {
      Fail("truncated legacy stream: storage ", key, " is missing");
    }
    ReadAt(count_bytes, 8, cursor);
    int64_t count = 0;
    for (int b = 7; b >= 0; --b) count = (count << 8) | count_bytes[b];
    if (count != s.numel) {
      Fail("legacy storage ", key, " holds ", count,
           " elements, its persistent id declares ", s.numel);
    }
    cursor += 8;
    if (!FitsWithin(cursor, s.nbytes, length)) {
      Fail("truncated legacy stream: storage ", key, " needs ", s.nbytes,
           " bytes at offset ", cursor, ", file has ", length);
    }
    loc.legacy_offset = cursor;
    loc.located = true;
    cursor += s.nbytes;
  }
  for (size_t i = 0; i < storages.size(); ++i) {
    if (!locs[i].located) {
      Fail("storage ", storages[i].key, " has no data in the legacy stream");
    }
  }
}

void TorchFile::Impl::CollectStorages(bool legacy) {
  // Every persistent id in the arena, in the order torch.load meets them.
  for (const Value& node : arena.nodes()) {
    if (node.kind != Kind::kPersId) continue;
    std::optional<internal::PersistentStorage> p =
        internal::ParsePersistentId(&node, legacy);
    if (!p) continue;
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(p->numel),
                               ElementSize(p->cls.dtype), &nbytes) ||
        nbytes > (uint64_t{1} << 62)) {
      throw FormatError("storage ", p->key, " declares an absurd size (",
                        p->numel, " elements)");
    }
    auto [it, inserted] = storage_by_key.emplace(p->key, storages.size());
    if (inserted) {
      StorageInfo s;
      s.key = p->key;
      s.dtype = p->cls.dtype;
      s.untyped = p->cls.untyped;
      s.numel = p->numel;
      s.nbytes = nbytes;
      s.location = p->location;
      storages.push_back(std::move(s));
      locs.emplace_back();
    } else {
      const StorageInfo& s = storages[it->second];
      if (s.dtype != p->cls.dtype || s.untyped != p->cls.untyped) {
        throw FormatError("storage ", p->key, " is declared both as ",
                          DTypeName(s.dtype), " and as ",
                          DTypeName(p->cls.dtype));
      }
    }
    storage_by_persid.emplace(&node, it->second);
  }
}

void TorchFile::Impl::LocateZipStorages() {
  for (size_t i = 0; i < storages.size(); ++i) {
    const StorageInfo& s = storages[i];
    const std::string name = archive_name + "/data/" + s.key;
    const ZipEntry* e = zip->Find(name);
    if (e == nullptr) {
      Fail("missing record data/", s.key, " for storage ", s.key);
    }
    if (e->uncompressed_size < s.nbytes) {
      Fail("record data/", s.key, " has ", e->uncompressed_size,
           " bytes but its storage declares ", s.numel, " x ",
           DTypeName(s.dtype), " = ", s.nbytes, " bytes");
    }
    locs[i].entry = e;
    locs[i].located = true;
  }
}

void TorchFile::Impl::CollectTensors() {
  std::vector<size_t> storage_of;  // parallel to tensors
  internal::ForEachInPickleOrder(root, [&](const Value* v,
                                           std::vector<const Value*>& then) {
    if (v->kind == Kind::kPersId) return false;
    std::optional<internal::ParsedTensor> t = internal::ParseTensor(v);
    if (!t) return true;
    auto sit = storage_by_persid.find(t->persid);
    UCP_CHECK(sit != storage_by_persid.end());
    const StorageInfo& s = storages[sit->second];
    TensorInfo info;
    info.node = t->node;
    info.tensor_node = t->tensor_node;
    info.dtype = t->dtype.value_or(s.dtype);
    if (t->dtype && !s.untyped && *t->dtype != s.dtype) {
      throw FormatError("tensor of dtype ", DTypeName(*t->dtype),
                        " on storage ", s.key, " of dtype ",
                        DTypeName(s.dtype));
    }
    info.shape = std::move(t->shape);
    info.stride = std::move(t->stride);
    info.storage_offset = t->storage_offset;
    info.requires_grad = t->requires_grad;
    info.is_parameter = t->is_parameter;
    info.wrapper = t->wrapper;
    const size_t esize = ElementSize(info.dtype);
    std::optional<int64_t> numel = CheckedNumElements(info.shape);
    uint64_t nbytes = 0;
    if (!numel ||
        __builtin_mul_overflow(static_cast<uint64_t>(*numel), esize, &nbytes)) {
      throw FormatError("tensor on storage ", s.key, " has an absurd shape");
    }
    info.numel = *numel;
    info.nbytes = nbytes;
    info.contiguous = IsContiguous(info.shape, info.stride);
    std::optional<ElementRange> extent =
        ViewExtent(info.shape, info.stride, info.storage_offset);
    if (extent) {
      uint64_t end_bytes = 0;
      if (__builtin_mul_overflow(static_cast<uint64_t>(extent->end), esize,
                                 &end_bytes) ||
          end_bytes > s.nbytes) {
        throw FormatError("tensor view (offset ", info.storage_offset, ", ",
                          info.shape.size(), " dims) reaches element ",
                          extent->end, " of storage ", s.key, " which holds ",
                          s.nbytes, " bytes");
      }
    }
    const size_t index = tensors.size();
    tensors.push_back(std::move(info));
    storage_of.push_back(sit->second);
    tensor_by_node.emplace(t->node, index);
    tensor_by_node.emplace(t->tensor_node, index);
    then = std::move(t->trailing);
    return false;
  });
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].storage = &storages[storage_of[i]];
  }
  // Only a tensor's first path is kept, so only that one is materialised.
  auto pathless = [&](const Value* v) {
    auto it = tensor_by_node.find(v);
    return it != tensor_by_node.end() && !tensors[it->second].path;
  };
  internal::ForEachContainerLeaf(
      root, pathless,
      [&](const Value* v, const TensorPath& path) {
        tensors[tensor_by_node.at(v)].path = path;
      },
      kMinPathBudget + kPathBudgetPerPickleByte * pickle.size());
}

TorchFile::TorchFile(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TorchFile::TorchFile(TorchFile&&) noexcept = default;
TorchFile& TorchFile::operator=(TorchFile&&) noexcept = default;
TorchFile::~TorchFile() = default;

TorchFile TorchFile::Open(const std::filesystem::path& path) {
  auto file = std::make_shared<File>(File::OpenRead(path));
  const uint64_t size = file->Size();
  return OpenFile(std::move(file), 0, size);
}

TorchFile TorchFile::Open(std::shared_ptr<const File> file) {
  const uint64_t size = file->Size();
  return OpenFile(std::move(file), 0, size);
}

TorchFile TorchFile::Open(std::shared_ptr<const File> file, uint64_t offset,
                          uint64_t length) {
  return OpenFile(std::move(file), offset, length);
}

TorchFile TorchFile::Open(const std::filesystem::path& path, uint64_t offset,
                          uint64_t length) {
  return OpenFile(std::make_shared<File>(File::OpenRead(path)), offset, length);
}

TorchFile TorchFile::OpenFile(std::shared_ptr<const File> file, uint64_t offset,
                              uint64_t length) {
  auto impl = std::make_unique<Impl>();
  impl->file_size = file->Size();
  if (!FitsWithin(offset, length, impl->file_size)) {
    throw FormatError(file->path().string(), ": bytes ", offset, "..",
                      offset + length, " lie outside the file (",
                      impl->file_size, " bytes)");
  }
  impl->file = std::move(file);
  impl->offset = offset;
  impl->length = length;
  Impl& im = *impl;
  // The first local headers and small records of a torch.save archive (the
  // zip reader keeps them until ReleaseCache): one pread with the magic.
  std::vector<std::byte> first(
      static_cast<size_t>(std::min<uint64_t>(kSniffBytes, length)));
  im.ReadAt(first.data(), first.size(), 0);
  const auto* head = reinterpret_cast<const unsigned char*>(first.data());
  const size_t head_len = std::min<size_t>(8, first.size());
  if (head_len >= 4 && std::memcmp(head, "PK\x03\x04", 4) == 0) {
    im.LoadZip(first);
    try {
      im.CollectStorages(/*legacy=*/false);
    } catch (Error& e) {
      e.AddContext("data.pkl");
      e.AddContext(im.Describe());
      throw;
    }
    im.LocateZipStorages();
    im.zip->ReleaseCache();
  } else if (head_len >= 8 && std::memcmp(head, "PYTORCH1", 8) == 0) {
    im.Fail("not a torch.save file (a TorchScript file of torch < 1.4)");
  } else if (head_len >= 2 && head[0] == 0x80) {
    im.LoadLegacy();
  } else {
    im.Fail(
        "not a torch.save file (neither a zip archive nor the legacy "
        "format)");
  }
  try {
    im.CollectTensors();
  } catch (Error& e) {
    e.AddContext(im.format == Format::kZip ? "data.pkl"
                                           : "legacy object pickle");
    e.AddContext(im.Describe());
    throw;
  }
  return TorchFile(std::move(impl));
}

const std::filesystem::path& TorchFile::path() const noexcept {
  return impl_->file->path();
}
TorchFile::Format TorchFile::format() const noexcept { return impl_->format; }
const std::string& TorchFile::archive_name() const noexcept {
  return impl_->archive_name;
}
const ZipReader* TorchFile::zip() const noexcept {
  return impl_->zip ? &*impl_->zip : nullptr;
}
std::string_view TorchFile::pickle_bytes() const noexcept {
  return impl_->pickle;
}
const Value* TorchFile::root() const noexcept { return impl_->root; }
const pickle::Arena& TorchFile::arena() const noexcept { return impl_->arena; }
pickle::Arena& TorchFile::arena() noexcept { return impl_->arena; }
const std::vector<TensorInfo>& TorchFile::tensors() const noexcept {
  return impl_->tensors;
}
const std::vector<StorageInfo>& TorchFile::storages() const noexcept {
  return impl_->storages;
}

const TensorInfo* TorchFile::FindTensor(const Value* node) const noexcept {
  auto it = impl_->tensor_by_node.find(node);
  return it == impl_->tensor_by_node.end() ? nullptr
                                           : &impl_->tensors[it->second];
}

const TensorInfo* TorchFile::FindTensor(const TensorPath& path) const noexcept {
  for (const TensorInfo& t : impl_->tensors) {
    if (t.path && *t.path == path) return &t;
  }
  return nullptr;
}

const StorageInfo* TorchFile::FindStorage(std::string_view key) const noexcept {
  auto it = impl_->storage_by_key.find(std::string(key));
  return it == impl_->storage_by_key.end() ? nullptr
                                           : &impl_->storages[it->second];
}

namespace {

std::string TensorLabel(const TensorInfo& t) {
  if (t.path) return FormatPath(*t.path);
  return StrCat("on storage ", t.storage->key);
}

}  // namespace

void TorchFile::ReadStorage(const StorageInfo& storage, uint64_t byte_offset,
                            std::span<std::byte> dst) const {
  const size_t index = impl_->StorageIndex(storage);
  if (!FitsWithin(byte_offset, dst.size(), storage.nbytes)) {
    throw UsageError("read of ", dst.size(), " bytes at ", byte_offset,
                     " is outside storage ", storage.key, " of ",
                     storage.nbytes, " bytes");
  }
  if (dst.empty()) return;
  const StorageLoc& loc = impl_->locs[index];
  if (loc.entry != nullptr) {
    impl_->zip->ReadRange(*loc.entry, byte_offset, dst);
  } else {
    impl_->ReadAt(dst.data(), dst.size(), loc.legacy_offset + byte_offset);
  }
}

std::optional<FileLocation> TorchFile::StorageLocation(
    const StorageInfo& storage, uint64_t byte_offset) const {
  const size_t index = impl_->StorageIndex(storage);
  if (byte_offset > storage.nbytes) {
    throw UsageError("offset ", byte_offset, " is outside storage ",
                     storage.key, " of ", storage.nbytes, " bytes");
  }
  const StorageLoc& loc = impl_->locs[index];
  if (loc.entry != nullptr) {
    if (loc.entry->method != kZipStored) return std::nullopt;
    return FileLocation{impl_->zip->file().get(),
                        impl_->zip->DataOffset(*loc.entry) + byte_offset};
  }
  return FileLocation{impl_->file.get(),
                      impl_->offset + loc.legacy_offset + byte_offset};
}

void TorchFile::ReadTensor(const TensorInfo& t,
                           std::span<std::byte> dst) const {
  if (dst.size() != t.nbytes) {
    throw UsageError("tensor ", TensorLabel(t), " has ", t.nbytes,
                     " bytes, destination has ", dst.size());
  }
  if (t.nbytes == 0) return;
  const size_t esize = ElementSize(t.dtype);
  try {
    if (t.contiguous) {
      ReadStorage(*t.storage, static_cast<uint64_t>(t.storage_offset) * esize,
                  dst);
      return;
    }
    std::optional<ElementRange> extent =
        ViewExtent(t.shape, t.stride, t.storage_offset);
    UCP_CHECK(extent.has_value());
    AlignedBuffer buf(static_cast<size_t>(extent->end - extent->begin) * esize);
    ReadStorage(*t.storage, static_cast<uint64_t>(extent->begin) * esize,
                buf.span());
    GatherStrided(buf.data(), esize, t.shape, t.stride, dst.data());
  } catch (Error& e) {
    e.AddContext("tensor ", TensorLabel(t));
    throw;
  }
}

void TorchFile::ReadTensorRange(const TensorInfo& t, int64_t element_offset,
                                int64_t element_count,
                                std::span<std::byte> dst) const {
  if (element_offset < 0 || element_count < 0 || element_offset > t.numel ||
      element_count > t.numel - element_offset) {
    throw UsageError("elements [", element_offset, ", +", element_count,
                     ") are outside tensor ", TensorLabel(t), " of ", t.numel,
                     " elements");
  }
  const size_t esize = ElementSize(t.dtype);
  if (dst.size() != static_cast<uint64_t>(element_count) * esize) {
    throw UsageError("destination has ", dst.size(), " bytes for ",
                     element_count, " elements of ", DTypeName(t.dtype));
  }
  try {
    if (t.contiguous) {
      ReadStorage(
          *t.storage,
          static_cast<uint64_t>(t.storage_offset + element_offset) * esize,
          dst);
      return;
    }
    // A strided view: each element where its strides put it (Open checked
    // that the view lies inside its storage).
    for (int64_t k = 0; k < element_count; ++k) {
      int64_t rest = element_offset + k;
      int64_t at = t.storage_offset;
      for (size_t d = t.shape.size(); d-- > 0;) {
        at += rest % t.shape[d] * t.stride[d];
        rest /= t.shape[d];
      }
      ReadStorage(*t.storage, static_cast<uint64_t>(at) * esize,
                  dst.subspan(static_cast<size_t>(k) * esize, esize));
    }
  } catch (Error& e) {
    e.AddContext("tensor ", TensorLabel(t));
    throw;
  }
}

}  // namespace ucp::torchfile
