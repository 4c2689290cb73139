#include "engine/formats/deepspeed/graph.h"

#include "engine/core/error.h"
#include "engine/core/progress.h"

namespace ucp::deepspeed::internal {

using pickle::ObjectOp;
using pickle::Value;

Value* TorchSize(pickle::Arena& a, const Shape& shape) {
  std::vector<Value*> dims;
  for (int64_t d : shape) dims.push_back(a.Int(d));
  return a.Object(ObjectOp::kReduce, a.Global("torch", "Size"),
                  a.Tuple({a.Tuple(std::move(dims))}));
}

Value* FragmentAddress(pickle::Arena& a, int64_t numel, int64_t start) {
  Value* o =
      a.Object(ObjectOp::kNewObj,
               a.Global("deepspeed.utils.tensor_fragment", "fragment_address"),
               a.Tuple({}));
  o->state =
      a.Dict({{a.Str("numel"), a.Int(numel)}, {a.Str("start"), a.Int(start)}});
  return o;
}

Value* ZeroStage(pickle::Arena& a, int stage) {
  const char* name = stage == 1   ? "optimizer_states"
                     : stage == 2 ? "gradients"
                     : stage == 3 ? "weights"
                                  : "disabled";
  return a.Object(
      ObjectOp::kReduce, a.Global("__builtin__", "getattr"),
      a.Tuple({a.Global("deepspeed.runtime.zero.config", "ZeroStageEnum"),
               a.Str(name)}));
}

Value* DefaultLossScaler(pickle::Arena& a) {
  Value* o =
      a.Object(ObjectOp::kNewObj,
               a.Global("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
               a.Tuple({}));
  o->state = a.Dict(
      {{a.Str("cur_scale"), a.Float(1.0)}, {a.Str("dynamic"), a.Bool(false)}});
  return o;
}

FileBuild::FileBuild(std::filesystem::path p) : path(std::move(p)) {
  writer = std::make_unique<torchfile::TorchWriter>(path);
  importer = std::make_unique<formats::GraphImporter>(*writer);
}

Value* FileBuild::AddTensor(reshape::TargetTensor tensor) {
  torchfile::TensorSpec spec;
  spec.dtype = tensor.dtype;
  spec.shape = tensor.shape;
  Value* node = writer->NewTensor(spec);
  reshape::Job job;
  job.tensor = std::move(tensor);
  sinks.emplace_back(*writer, node);
  job.sink = &sinks.back();
  jobs.push_back(std::move(job));
  return node;
}

Value* FileBuild::AddConstant(DType dtype, const Shape& shape,
                              std::vector<std::byte> bytes) {
  torchfile::TensorSpec spec;
  spec.dtype = dtype;
  spec.shape = shape;
  Value* node = writer->NewTensor(spec);
  constants.emplace_back(node, std::move(bytes));
  return node;
}

void FileBuild::Begin(const Value* root) {
  writer->Begin(root);
  importer->WriteTensors();
  for (const auto& [node, bytes] : constants)
    writer->WriteTensorData(node, 0, bytes);
}

uint64_t RunAndCommit(const universal::UniversalInput& input,
                      std::vector<std::unique_ptr<FileBuild>>& files,
                      const reshape::ExecutorOptions& executor,
                      const std::string& label) {
  std::vector<reshape::Job> jobs;
  for (auto& f : files)
    for (reshape::Job& j : f->jobs) jobs.push_back(std::move(j));
  uint64_t total = 0;
  for (const reshape::Job& j : jobs) total += reshape::NumBytes(j.tensor);
  Progress progress(label, total);
  reshape::ExecutorOptions o = executor;
  o.progress = &progress;
  input.Run(jobs, o);
  progress.Finish();
  uint64_t bytes = 0;
  for (auto& f : files) {
    try {
      f->writer->Commit();
    } catch (Error& e) {
      e.AddContext("rank file ", f->path.string());
      throw;
    }
    std::error_code ec;
    bytes += std::filesystem::file_size(f->path, ec);
  }
  return bytes;
}

}  // namespace ucp::deepspeed::internal
