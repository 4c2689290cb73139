#pragma once
// Writer of torch.save files (zip format), planned first, then filled in any
// order from any thread.
//
// What is written (container layout: zip.h; torch 1.13 and 2.x load it):
//   <prefix>/data.pkl     the graph, pickled by pickle::Pickle (protocol 2)
//   <prefix>/byteorder    "little"
//   <prefix>/data/<key>   one storage per tensor node holding exactly its
//                         elements, contiguous (compact: a view gets only the
//                         bytes it covers); keys "0", "1", ... in the order
//                         the pickler first meets each tensor, records in
//                         numeric key order
//   <prefix>/version      "3\n"
// The prefix is the file stem unless TorchWriterOptions says otherwise.
//
// A tensor node made by NewTensor() is what torch.save pickles for a CPU
// tensor (storage_offset 0, contiguous stride, empty backward hooks):
//   _rebuild_tensor_v2(PersId(('storage', torch.<X>Storage, key, location,
//                      numel)), 0, size, stride, requires_grad, OrderedDict())
// for the dtypes with a typed storage class; uint16/32/64 and float8 (which
// torch 1.13 cannot load) use torch 2.x's
//   _rebuild_tensor_v3(PersId(('storage', torch.storage.UntypedStorage, key,
//                      location, nbytes)), 0, size, stride, requires_grad,
//                      OrderedDict(), torch.<dtype>)
// and a parameter wraps it (with requires_grad False inside) as
//   _rebuild_parameter(<tensor>, requires_grad, OrderedDict()).
// The nodes are shared the way torch.save's pickler memoises the objects
// ('storage' and 'cpu' strings once, 'cuda:N' per tensor, fresh tuples and
// OrderedDicts), so data.pkl equals torch.save's byte for byte for the same
// objects.
//
// Usage: build the graph in arena() with NewTensor() nodes; Begin(root)
// pickles it, assigns storage keys, plans the zip layout and reserves the
// file (temporary name); WriteTensorData() fills tensor bytes (thread-safe,
// any order, each byte exactly once); Commit() checks completeness, writes
// the headers and renames the file into place. If the writer is destroyed
// before a successful Commit(), nothing appears under the final name.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/aligned_buffer.h"
#include "engine/core/dtype.h"
#include "engine/core/strided.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/zip.h"

namespace ucp::torchfile {

struct TensorSpec {
  DType dtype = DType::kFloat32;
  Shape shape;
  bool requires_grad = false;
  bool is_parameter = false;
  /// Location tag written into the persistent id ("cpu", "cuda:0", ...).
  std::string device = "cpu";
};

struct TorchWriterOptions {
  /// Archive folder; empty: the file stem ("archive" if that is empty).
  std::string archive_name;
  ZipLayoutOptions zip;
  /// Build the file in memory (TorchWriter::Contents()) and write nothing to
  /// the path, which only names it (its stem is the default archive name).
  bool in_memory = false;
};

class TorchWriter {
 public:
  /// Nothing touches the disk before Begin().
  explicit TorchWriter(std::filesystem::path path,
                       TorchWriterOptions options = {});
  TorchWriter(TorchWriter&&) noexcept;
  TorchWriter& operator=(TorchWriter&&) noexcept;
  ~TorchWriter();

  /// Where the graph is built.
  pickle::Arena& arena() noexcept;

  /// A new tensor node to place in the graph. Throws UsageError for a
  /// negative or overflowing shape, an empty device, or after Begin().
  pickle::Value* NewTensor(const TensorSpec& spec);
  /// A new compact tensor like `source` (dtype, shape, requires_grad,
  /// device, Parameter-ness); Parameter state and tensor-subclass type and
  /// state are deep-copied into arena(). Throws like NewTensor.
  pickle::Value* NewTensorLike(const TensorInfo& source);
  /// The spec of a node made by NewTensor*, nullptr for other nodes.
  const TensorSpec* FindSpec(const pickle::Value* tensor) const noexcept;

  /// Names the file (before Begin): a graph may be built before its folder
  /// is known. Throws UsageError after Begin or Prepare.
  void SetPath(std::filesystem::path path);

  /// Pickles the graph at `root`, assigns storage keys, plans the archive and
  /// creates the temporary file with its full size reserved. Tensor nodes not
  /// reachable from `root` get no storage. Throws UsageError if called twice
  /// or if the graph holds a persistent id (storage) not made by this writer;
  /// InternalError for a malformed graph; IoError.
  void Begin(const pickle::Value* root);

  /// Begin in two steps. Prepare pickles and plans the archive and returns
  /// its size (throws like Begin, but no IoError); Open then creates the file
  /// as Begin does, or OpenIn places the archive in bytes [offset, offset +
  /// size) of `file`, reserved by its owner (a run of torch.save archives in
  /// one file, as PyTorch DCP writes), who commits `file` after this
  /// writer's Commit() (which then writes the headers there, without sync or
  /// rename). Open / OpenIn throw UsageError without Prepare or when called
  /// twice, IoError.
  uint64_t Prepare(const pickle::Value* root);
  void Open();
  void OpenIn(std::shared_ptr<OutputFile> file, uint64_t offset);

  /// After Begin(): the tensors that got a storage, in storage key order.
  const std::vector<const pickle::Value*>& planned_tensors() const noexcept;
  /// After Begin(): storage key and byte size (numel * element size) of a
  /// planned tensor. Throw UsageError for other nodes.
  const std::string& StorageKey(const pickle::Value* tensor) const;
  uint64_t TensorBytes(const pickle::Value* tensor) const;
  /// The data.pkl bytes (after Begin()).
  const std::string& pickle_bytes() const noexcept;
  /// The planned archive (after Begin()).
  const ZipLayout& layout() const;

  /// Writes bytes [byte_offset, byte_offset + bytes.size()) of the tensor's
  /// contiguous little-endian data. Thread-safe, any order. Throws
  /// UsageError if not after Begin(), the tensor is not planned, the range
  /// lies outside it or overlaps bytes already written; IoError. Any
  /// exception fails the writer (Commit() then throws).
  void WriteTensorData(const pickle::Value* tensor, uint64_t byte_offset,
                       std::span<const std::byte> bytes);

  /// Fills `chunk` with the tensor's bytes starting at `byte_offset`.
  using FillFunction =
      std::function<void(uint64_t byte_offset, std::span<std::byte> chunk)>;
  /// Writes a whole tensor through a reused 4 KiB-aligned buffer of at most
  /// `buffer_bytes`, calling `fill` for consecutive chunks. Throws like
  /// WriteTensorData, plus whatever `fill` throws.
  void WriteTensor(const pickle::Value* tensor, const FillFunction& fill,
                   size_t buffer_bytes = size_t{64} << 20);

  /// Checks that every byte of every planned tensor was written exactly once,
  /// writes the zip headers, fsyncs and renames onto the final name. Throws
  /// UsageError (naming the incomplete tensor) if data is missing or Begin()
  /// was not called, IoError; the temporary file is then removed.
  void Commit();
  /// Commit of an archive embedded among others laid back to back (OpenIn):
  /// as ZipWriter::Commit(carry), its last run left in `carry`.
  void Commit(ZipWriter::PendingRun& carry);

  /// The committed file's bytes when written in memory
  /// (TorchWriterOptions::in_memory). Throws UsageError otherwise or before
  /// Commit(), IoError.
  std::string Contents() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Copies the elements of `tensor` (of `source`, any view) in row-major
/// order into the planned tensor `node` of `writer` (after Begin()), through
/// `scratch`, grown to at most max(`buffer_bytes`, 4096) bytes. A
/// non-contiguous view is gathered in blocks of leading-dim slices, so a view
/// declaring far more elements than its storage holds (stride 0) never needs
/// its declared size in memory; ReadTensor additionally holds the storage
/// extent one block covers (at most the storage, whose bytes are in the
/// file). Throws like TorchFile::ReadTensor and TorchWriter::WriteTensorData.
void CopyTensorData(const TorchFile& source, const TensorInfo& tensor,
                    TorchWriter& writer, const pickle::Value* node,
                    AlignedBuffer& scratch,
                    size_t buffer_bytes = size_t{64} << 20);

/// Writes `source` to `path` with every tensor replaced by a compact copy
/// (NewTensorLike) and all other objects copied unchanged; tensor bytes are
/// streamed through a buffer of about `buffer_bytes` (CopyTensorData).
/// Throws like TorchFile's reads and TorchWriter (UsageError if `source`
/// holds storages that no recognised tensor uses).
void WriteCompactCopy(const TorchFile& source,
                      const std::filesystem::path& path,
                      const TorchWriterOptions& options = {},
                      size_t buffer_bytes = size_t{64} << 20);

}  // namespace ucp::torchfile
