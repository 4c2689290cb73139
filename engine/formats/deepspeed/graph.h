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
#include "engine/formats/target_plan.h"
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

/// A torch.save file of the target, planned (formats/target_plan.h).
using FileBuild = formats::TorchSaveFile;

}  // namespace ucp::deepspeed::internal
