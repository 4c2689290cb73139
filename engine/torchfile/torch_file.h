#pragma once
// Lazy reader of torch.save files (zip format of torch >= 1.6, and the legacy
// pre-1.6 stream).
//
// Zip format (container: see zip.h). Every entry is "<prefix>/<record>"; the
// prefix is taken from the first entry (torch uses the file stem, or
// "archive" when saving to a buffer). Records:
//   data.pkl            the pickled object (protocol 2 as torch writes it)
//   data/<key>          raw little-endian bytes of storage <key>
//   version             "3\n"; torch 2.x adds byteorder ("little"),
//                       .format_version, .storage_alignment,
//                       .data/serialization_id (all optional here)
// A TorchScript archive (constants.pkl, code/) is rejected.
//
// Tensors in data.pkl (the only objects this reader interprets; everything
// else stays an opaque pickle::Value):
//   torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride,
//                                   requires_grad, backward_hooks[, metadata])
//   torch._utils._rebuild_tensor(storage, storage_offset, size, stride)
//   torch._utils._rebuild_tensor_v3(storage, storage_offset, size, stride,
//                                   requires_grad, backward_hooks, dtype
//                                   [, metadata])   (torch 2.x; dtype is a
//                                   global such as torch.uint16)
//   torch._utils._rebuild_parameter(tensor, requires_grad, backward_hooks)
//   torch._utils._rebuild_parameter_with_state(tensor, requires_grad,
//                                   backward_hooks, state)
//   torch._tensor._rebuild_from_type_v2(func, new_type, args, state)
//                                   (a tensor subclass; func is one of the
//                                   rebuild functions above, args its args)
// `storage` is a persistent id (BINPERSID) holding the tuple
//   ('storage', <storage class global>, key: str, location: str, numel: int)
// Storage classes: torch.{Double,Float,Half,BFloat16,Long,Int,Short,Char,
// Byte,Bool,ComplexFloat,ComplexDouble}Storage (numel counts elements of that
// dtype) and torch.UntypedStorage / torch.storage.UntypedStorage (numel counts
// bytes; the tensor dtype comes from _rebuild_tensor_v3). The location is
// "cpu" or e.g. "cuda:0"; it is reported but data is always read on the CPU.
// storage_offset, size and stride count elements of the tensor's dtype; views
// share one storage key, and the whole storage is saved.
//
// Legacy format (torch < 1.6, or _use_new_zipfile_serialization=False): not a
// zip; five pickles back to back
//   1. magic number 0x1950a86a20f9469cfc6c    2. protocol version 1001
//   3. sys_info {'protocol_version', 'little_endian': True, 'type_sizes'}
//   4. the object, whose persistent ids are
//        ('storage', <storage class>, key, location, numel, view_metadata)
//      with view_metadata None (storage views of torch < 0.4 are rejected)
//   5. the list of storage keys
// followed, for each key of list 5 in order, by an int64 (little-endian)
// element count equal to numel, then the storage's raw bytes.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/file.h"
#include "engine/core/strided.h"
#include "engine/pickle/value.h"

namespace ucp {
class File;
}

namespace ucp::torchfile {

class ZipReader;

/// One container step: a str or int dict key, or a list/tuple index.
using PathComponent = std::variant<std::string, int64_t>;
using TensorPath = std::vector<PathComponent>;

/// "model/layers.0.w/3" style rendering for messages.
std::string FormatPath(const TensorPath& path);

/// How a tensor was pickled.
enum class TensorWrapper : uint8_t {
  kNone,                // a plain torch.Tensor
  kParameter,           // _rebuild_parameter
  kParameterWithState,  // _rebuild_parameter_with_state
  kSubclass,            // _rebuild_from_type_v2
};

/// One storage: a `data/<key>` record or a legacy storage blob.
struct StorageInfo {
  std::string key;
  DType dtype = DType::kUInt8;  // of the storage class (uint8 if untyped)
  bool untyped = false;         // torch.UntypedStorage: numel counts bytes
  int64_t numel = 0;            // declared, in elements of `dtype`
  uint64_t nbytes = 0;          // numel * ElementSize(dtype)
  std::string location;         // "cpu", "cuda:0", ...
};

struct TensorInfo {
  /// The node in the graph: the Parameter / subclass object for wrapped
  /// tensors, else the _rebuild_tensor_* call.
  const pickle::Value* node = nullptr;
  /// The inner _rebuild_tensor_* call (== node for plain tensors).
  const pickle::Value* tensor_node = nullptr;
  const StorageInfo* storage = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<int64_t> stride;
  int64_t storage_offset = 0;  // elements of dtype
  bool requires_grad = false;
  bool is_parameter = false;
  TensorWrapper wrapper = TensorWrapper::kNone;
  bool contiguous = true;
  int64_t numel = 0;
  uint64_t nbytes = 0;  // numel * element size: what ReadTensor produces
  /// The first path in depth-first pre-order at which the tensor is
  /// reachable from the root through dict / OrderedDict / list / tuple
  /// containers (notes/HELPERS.md), absent if only reachable through other
  /// objects.
  std::optional<TensorPath> path;

  const std::string& storage_key() const { return storage->key; }
  const std::string& device() const { return storage->location; }
};

class TorchFile {
 public:
  enum class Format : uint8_t { kZip, kLegacy };

  /// Opens a torch.save file and reads its index and pickle (no tensor
  /// data). Throws IoError if it cannot be read; FormatError naming the file
  /// and the problem if it is not a torch.save file (TorchScript archives
  /// included), is truncated or corrupt, lacks data.pkl or a storage record,
  /// has a storage record smaller than declared, a tensor view reaching
  /// outside its storage, an unknown storage class or dtype, a malformed
  /// persistent id, or tensor paths (TensorInfo::path) of more than 64 MiB +
  /// 16 bytes per pickle byte in all (a hostile pickle sharing long keys
  /// along a deep nesting); pickle errors carry the context
  /// "<file> > data.pkl".
  static TorchFile Open(const std::filesystem::path& path);
  /// The same for a file embedded at bytes [offset, offset + length) of
  /// `path` (e.g. a slice of a DCP .distcp file).
  static TorchFile Open(const std::filesystem::path& path, uint64_t offset,
                        uint64_t length);
  /// The same for a whole file already open (e.g. File::Anonymous), shared
  /// with the caller; its path() names it in messages.
  static TorchFile Open(std::shared_ptr<const File> file);
  /// The same for bytes [offset, offset + length) of a file already open
  /// (the many archives of one DCP .distcp file share one descriptor).
  static TorchFile Open(std::shared_ptr<const File> file, uint64_t offset,
                        uint64_t length);

  TorchFile(TorchFile&&) noexcept;
  TorchFile& operator=(TorchFile&&) noexcept;
  ~TorchFile();

  const std::filesystem::path& path() const noexcept;
  Format format() const noexcept;
  /// Zip prefix ("" for the legacy format).
  const std::string& archive_name() const noexcept;
  /// The zip index (nullptr for the legacy format).
  const ZipReader* zip() const noexcept;
  /// The raw bytes of data.pkl (for the legacy format: the object pickle).
  std::string_view pickle_bytes() const noexcept;

  /// The loaded object graph and the arena that owns it (callers may copy
  /// opaque objects out of it, or add nodes to it).
  const pickle::Value* root() const noexcept;
  const pickle::Arena& arena() const noexcept;
  pickle::Arena& arena() noexcept;

  /// Every tensor reachable from the root, in pickling order (the order in
  /// which torch.save assigned their storage keys).
  const std::vector<TensorInfo>& tensors() const noexcept;
  /// Every storage declared by a persistent id anywhere in the pickle (as
  /// torch.load loads them), in the order the unpickler meets them.
  const std::vector<StorageInfo>& storages() const noexcept;
  /// The tensor whose node (or inner tensor node) is `node`, else nullptr.
  const TensorInfo* FindTensor(const pickle::Value* node) const noexcept;
  /// The tensor first reachable at `path`, else nullptr.
  const TensorInfo* FindTensor(const TensorPath& path) const noexcept;
  const StorageInfo* FindStorage(std::string_view key) const noexcept;

  /// Reads the tensor as contiguous row-major bytes into `dst`
  /// (dst.size() == tensor.nbytes): one pread straight into `dst` for a
  /// contiguous tensor, else a read of the storage range it spans followed by
  /// a strided gather. Thread-safe. Throws UsageError if dst has the wrong
  /// size; FormatError / IoError (with file and tensor context) on read
  /// failures.
  void ReadTensor(const TensorInfo& tensor, std::span<std::byte> dst) const;

  /// Reads elements [element_offset, element_offset + element_count) of a
  /// tensor (row-major order) into `dst` (element_count * element size
  /// bytes): one pread for a contiguous tensor, one per element for a
  /// strided one (meant for samples). Thread-safe. Throws UsageError if the
  /// range is outside it or dst has the wrong size;
  /// FormatError / IoError on read failures.
  void ReadTensorRange(const TensorInfo& tensor, int64_t element_offset,
                       int64_t element_count, std::span<std::byte> dst) const;

  /// Reads bytes [byte_offset, byte_offset + dst.size()) of a storage.
  /// Thread-safe. Throws UsageError if the range is outside the storage,
  /// FormatError / IoError on read failures.
  void ReadStorage(const StorageInfo& storage, uint64_t byte_offset,
                   std::span<std::byte> dst) const;

  /// Where byte `byte_offset` of a storage lies in the file, when the
  /// storage's bytes are stored there verbatim (an uncompressed zip record
  /// or a legacy file); nullopt for compressed records. Throws UsageError
  /// if the offset is outside the storage, FormatError for a corrupt local
  /// header.
  std::optional<FileLocation> StorageLocation(const StorageInfo& storage,
                                              uint64_t byte_offset) const;

 private:
  struct Impl;
  explicit TorchFile(std::unique_ptr<Impl> impl);
  static TorchFile OpenFile(std::shared_ptr<const File> file, uint64_t offset,
                            uint64_t length);
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::torchfile
