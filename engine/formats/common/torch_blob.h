#pragma once
// Opaque Python objects carried through the universal file as torch.save
// bytes (/opaque/<key>: args, rng states, TE _extra_state, optimizer param
// groups, ...), so that torch.load(io.BytesIO(bytes)) returns the object, and
// copied back into target rank files.
//
// A blob is a complete torch.save zip archive (archive folder "archive", as
// torch.save writes to a buffer) whose data.pkl is the object; tensors inside
// it (rng states, uint8 extra state) are stored compactly.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/universal/input.h"

namespace ucp::formats {

/// torch.save bytes of `object`, a node of `file`'s graph (or of any arena
/// when `file` is null and the object holds no tensors), built in memory
/// (nothing is written to disk). Throws IoError, FormatError when reading
/// tensor bytes fails, InternalError if a tensor has no source.
std::string SaveBlob(const torchfile::TorchFile* file,
                     const pickle::Value* object);

class GraphImporter;

/// torch.save bytes (built in memory) of the object `build` makes in the
/// writer's graph, importing values of other files through the importer.
/// Throws what `build` throws, IoError, FormatError reading tensor bytes.
std::string SaveGraph(const std::function<const pickle::Value*(
                          torchfile::TorchWriter&, GraphImporter&)>& build);

/// A tensor node of `writer` for a constant of `bytes` bytes of `dtype` and
/// `shape` (its data written later with WriteTensorData). Throws
/// InternalError if `bytes` is not the shape's size.
pickle::Value* ConstantNode(torchfile::TorchWriter& writer, DType dtype,
                            const Shape& shape, size_t bytes);

/// Copies objects into a TorchWriter's graph: from blobs of a universal file
/// or from other torch files; tensors become compact tensor nodes of the
/// writer whose bytes WriteTensors() fills after Begin().
class GraphImporter {
 public:
  explicit GraphImporter(torchfile::TorchWriter& writer) : writer_(writer) {}

  /// A copy of `value` (a node of `file`) in the writer's arena.
  pickle::Value* Import(std::shared_ptr<const torchfile::TorchFile> file,
                        const pickle::Value* value);
  /// A tensor node of the writer holding `bytes` (row-major, little-endian).
  /// Throws InternalError if their size is not the shape's.
  pickle::Value* Constant(DType dtype, const Shape& shape,
                          std::vector<std::byte> bytes);
  /// Writes the bytes of every imported and constant tensor. Call after
  /// Begin(). Throws like TorchFile::ReadTensor and
  /// TorchWriter::WriteTensorData.
  void WriteTensors();

 private:
  torchfile::TorchWriter& writer_;
  struct Pending {
    std::shared_ptr<const torchfile::TorchFile> file;
    const torchfile::TensorInfo* tensor;
    const pickle::Value* node;
  };
  std::vector<Pending> pending_;
  std::vector<std::pair<const pickle::Value*, std::vector<std::byte>>>
      constants_;
};

/// Opens the opaque blobs of the universal input (each a torch.save
/// archive) and keeps them open.
class BlobCache {
 public:
  explicit BlobCache(const universal::UniversalInput& input) : input_(input) {}
  /// The blob `key`; nullptr if the store has none. Throws FormatError
  /// naming the key if it is not a torch.save archive.
  std::shared_ptr<const torchfile::TorchFile> Find(const std::string& key);
  /// Like Find, but throws FormatError naming the universal file and key if
  /// the blob is missing.
  std::shared_ptr<const torchfile::TorchFile> Get(const std::string& key);

 private:
  const universal::UniversalInput& input_;
  std::map<std::string, std::shared_ptr<const torchfile::TorchFile>> open_;
};

}  // namespace ucp::formats
