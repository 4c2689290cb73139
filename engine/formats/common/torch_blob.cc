#include "engine/formats/common/torch_blob.h"

#include "engine/core/aligned_buffer.h"
#include "engine/core/error.h"

namespace ucp::formats {
namespace {

// Copies `value` into the writer's arena, replacing tensors of `file` with
// new compact tensor nodes; returns the copy and records (tensor, node).
pickle::Value* CopyWithTensors(
    torchfile::TorchWriter& writer, const torchfile::TorchFile* file,
    const pickle::Value* value,
    std::vector<std::pair<const torchfile::TensorInfo*, const pickle::Value*>>&
        copies) {
  return writer.arena().Copy(
      value, [&](const pickle::Value* v) -> pickle::Value* {
        if (file == nullptr) return nullptr;
        const torchfile::TensorInfo* t = file->FindTensor(v);
        if (t == nullptr) return nullptr;
        pickle::Value* node;
        if (v == t->node) {
          node = writer.NewTensorLike(*t);
        } else {  // the inner tensor of a Parameter, met on its own
          torchfile::TensorSpec spec{t->dtype, t->shape, false, false,
                                     t->device()};
          node = writer.NewTensor(spec);
        }
        copies.emplace_back(t, node);
        return node;
      });
}

void WriteCopies(torchfile::TorchWriter& writer,
                 const torchfile::TorchFile& file,
                 const std::vector<std::pair<const torchfile::TensorInfo*,
                                             const pickle::Value*>>& copies) {
  AlignedBuffer buf;
  for (const auto& [t, node] : copies) {
    torchfile::CopyTensorData(file, *t, writer, node, buf);
  }
}

}  // namespace

std::string SaveBlob(const torchfile::TorchFile* file,
                     const pickle::Value* object) {
  torchfile::TorchWriterOptions options;
  options.archive_name = "archive";
  options.in_memory = true;
  torchfile::TorchWriter writer("ucp-blob.pt", options);
  std::vector<std::pair<const torchfile::TensorInfo*, const pickle::Value*>>
      copies;
  pickle::Value* root = CopyWithTensors(writer, file, object, copies);
  writer.Begin(root);
  if (file != nullptr) WriteCopies(writer, *file, copies);
  writer.Commit();
  return writer.Contents();
}

std::string SaveGraph(const std::function<const pickle::Value*(
                          torchfile::TorchWriter&, GraphImporter&)>& build) {
  torchfile::TorchWriterOptions options;
  options.archive_name = "archive";
  options.in_memory = true;
  torchfile::TorchWriter writer("ucp-blob.pt", options);
  GraphImporter importer(writer);
  const pickle::Value* root = build(writer, importer);
  writer.Begin(root);
  importer.WriteTensors();
  writer.Commit();
  return writer.Contents();
}

pickle::Value* GraphImporter::Import(
    std::shared_ptr<const torchfile::TorchFile> file,
    const pickle::Value* value) {
  std::vector<std::pair<const torchfile::TensorInfo*, const pickle::Value*>>
      copies;
  pickle::Value* copy = CopyWithTensors(writer_, file.get(), value, copies);
  for (const auto& [t, node] : copies) pending_.push_back({file, t, node});
  return copy;
}

pickle::Value* ConstantNode(torchfile::TorchWriter& writer, DType dtype,
                            const Shape& shape, size_t bytes) {
  UCP_CHECK(
      bytes == static_cast<size_t>(NumElements(shape)) * ElementSize(dtype),
      "constant of ", bytes, " bytes for shape ", ShapeString(shape));
  torchfile::TensorSpec spec;
  spec.dtype = dtype;
  spec.shape = shape;
  return writer.NewTensor(spec);
}

pickle::Value* GraphImporter::Constant(DType dtype, const Shape& shape,
                                       std::vector<std::byte> bytes) {
  pickle::Value* node = ConstantNode(writer_, dtype, shape, bytes.size());
  constants_.emplace_back(node, std::move(bytes));
  return node;
}

void GraphImporter::WriteTensors() {
  AlignedBuffer buf;
  for (const Pending& p : pending_) {
    torchfile::CopyTensorData(*p.file, *p.tensor, writer_, p.node, buf);
  }
  pending_.clear();
  for (const auto& [node, bytes] : constants_)
    if (!bytes.empty()) writer_.WriteTensorData(node, 0, bytes);
  constants_.clear();
}

std::shared_ptr<const torchfile::TorchFile> BlobCache::Find(
    const std::string& key) {
  auto it = open_.find(key);
  if (it != open_.end()) return it->second;
  const atoms::DatasetInfo* d = input_.FindOpaque(key);
  if (d == nullptr) return nullptr;
  std::shared_ptr<const torchfile::TorchFile> f = input_.OpenBlob(*d);
  open_.emplace(key, f);
  return f;
}

std::shared_ptr<const torchfile::TorchFile> BlobCache::Get(
    const std::string& key) {
  std::shared_ptr<const torchfile::TorchFile> f = Find(key);
  if (f == nullptr) {
    throw FormatError(input_.path().string(), " lacks /opaque/", key);
  }
  return f;
}

}  // namespace ucp::formats
