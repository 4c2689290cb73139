#include "engine/formats/deepspeed/graph.h"

#include "engine/core/error.h"

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

}  // namespace ucp::deepspeed::internal
