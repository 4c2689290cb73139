#include "engine/formats/megatron/torch_step.h"

#include <cstring>
#include <vector>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/formats/common/sinks.h"
#include "engine/formats/common/torch_blob.h"

namespace ucp::megatron {

std::optional<TorchStep> FindTorchStep(
    const universal::UniversalInput& input, bool atoms,
    const reshape::ExecutorOptions& executor) {
  const atoms::DatasetInfo* d = nullptr;
  if (atoms) {
    for (const atoms::StoredParam& p : input.params()) {
      d = input.FindAtom(p.info.fqn, "step");
      if (d != nullptr) break;
    }
  }
  if (d == nullptr) {
    formats::BlobCache blobs(input);
    std::shared_ptr<const torchfile::TorchFile> f =
        blobs.Find("optimizer/param_groups");
    const pickle::Value* groups = f != nullptr ? f->root() : nullptr;
    if (groups == nullptr || groups->kind != pickle::Kind::kList)
      return std::nullopt;
    for (const pickle::Value* g : groups->items) {
      const pickle::Value* step =
          g != nullptr && g->IsDictLike() ? g->Get("step") : nullptr;
      if (step != nullptr && step->kind == pickle::Kind::kFloat)
        return TorchStep{step->f, false, false};
      // Transformer Engine's / apex's FusedAdam: int(step).
      if (step != nullptr && step->kind == pickle::Kind::kInt)
        return TorchStep{static_cast<double>(step->i), true, false};
    }
    return std::nullopt;
  }
  if (!d->shape.empty()) {
    throw FormatError("universal file ", input.path().string(), " > ", d->path,
                      ": per-param 'step' of shape ", ShapeString(d->shape),
                      ", expected a scalar");
  }
  const bool integral = d->dtype == DType::kInt64;
  const DType read = integral ? DType::kInt64 : DType::kFloat64;
  if (!integral && !CanConvert(d->dtype, read)) {
    throw FormatError("universal file ", input.path().string(), " > ", d->path,
                      ": per-param 'step' of dtype ", DTypeName(d->dtype));
  }
  formats::MemorySink sink(8);
  std::vector<reshape::Job> jobs(1);
  jobs[0].tensor = reshape::TargetTensor{
      d->path,
      read,
      {},
      {{input.Tensor(*d), Box::Whole({}), Box::Whole({}), 0, {}}}};
  jobs[0].sink = &sink;
  input.Run(jobs, executor);
  TorchStep out;
  out.integral = integral;
  out.from_atoms = true;
  if (integral) {
    int64_t v;
    std::memcpy(&v, sink.bytes().data(), 8);
    out.value = static_cast<double>(v);
  } else {
    std::memcpy(&out.value, sink.bytes().data(), 8);
  }
  return out;
}

}  // namespace ucp::megatron
