#pragma once
// Building DeepSpeed's pickled objects and files (internal to the driver).

#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/strided.h"
#include "engine/formats/common/sinks.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/pickle/value.h"
#include "engine/reshape/executor.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/universal/input.h"

namespace ucp::deepspeed::internal {

/// torch.Size(shape).
pickle::Value* TorchSize(pickle::Arena& a, const Shape& shape);
/// fragment_address(numel=, start=) (deepspeed.utils.tensor_fragment).
pickle::Value* FragmentAddress(pickle::Arena& a, int64_t numel, int64_t start);
/// ZeroStageEnum member (getattr(ZeroStageEnum, 'optimizer_states' |
/// 'gradients' | 'weights')).
pickle::Value* ZeroStage(pickle::Arena& a, int stage);
/// A static LossScaler(cur_scale=1.0): what fp32 / bf16 runs save.
pickle::Value* DefaultLossScaler(pickle::Arena& a);

/// One torch.save file being built: its writer, the objects imported from
/// universal blobs, and the executor jobs that fill its tensors.
struct FileBuild {
  explicit FileBuild(std::filesystem::path p);
  std::filesystem::path path;
  std::unique_ptr<torchfile::TorchWriter> writer;
  std::unique_ptr<formats::GraphImporter> importer;
  std::vector<reshape::Job> jobs;
  std::deque<formats::WriterSink> sinks;
  std::vector<std::pair<const pickle::Value*, std::vector<std::byte>>>
      constants;

  pickle::Arena& arena() { return writer->arena(); }
  /// A new tensor node filled by `tensor`'s ops (name, dtype, shape set).
  pickle::Value* AddTensor(reshape::TargetTensor tensor);
  /// A new tensor node with known bytes.
  pickle::Value* AddConstant(DType dtype, const Shape& shape,
                             std::vector<std::byte> bytes);
  /// Begin(root), imported tensors and constants written.
  void Begin(const pickle::Value* root);
};

/// Runs every job of `files` (after Begin), then commits each file.
/// Returns the bytes written. Throws what the executor and writers throw.
uint64_t RunAndCommit(const universal::UniversalInput& input,
                      std::vector<std::unique_ptr<FileBuild>>& files,
                      const reshape::ExecutorOptions& executor,
                      const std::string& label);

}  // namespace ucp::deepspeed::internal
