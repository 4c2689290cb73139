// Reading ZeRO 0 with the plain torch optimizer (fp32 training): its state
// in the model states, keyed by param id (deepspeed_format.h).

#include <algorithm>
#include <map>
#include <memory>
#include <set>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/flat_layout.h"
#include "engine/formats/deepspeed/pickled.h"
#include "engine/formats/deepspeed/reader.h"

namespace ucp::deepspeed::internal {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;
using torchfile::TensorInfo;
using torchfile::TorchFile;

void Planner::PlanTorchOptimizer() {
  const Value* opt = Get(model_, "optimizer");
  const std::string where0 =
      StrCat("rank file ", c_.model_files[0].string(), " > optimizer");
  try {
    const Value* state = RequireDict(opt, "state");
    const auto& groups = Items(Require(opt, "param_groups"), "param_groups");
    // Groups are the module's params filtered (weight decay or not, ...):
    // each group takes the module's params in order.
    std::vector<size_t> module;
    for (size_t i = 0; i < params_.size(); ++i)
      if (!params_[i].buffer) module.push_back(i);
    std::vector<bool> taken(params_.size(), false);
    groups_.assign(groups.size(), {});
    for (size_t g = 0; g < groups.size(); ++g) {
      group_dicts_.push_back(groups[g]);
      MatchTorchGroup(models_[0], state, g,
                      Items(Require(groups[g], "params"), "params"), module,
                      "module", taken, where0);
    }
    MarkFrozen(taken);
  } catch (Error& e) {
    AddContextOnce(e, where0);
    throw;
  }
}

void Planner::MatchTorchGroup(const FilePtr& f, const Value* state, size_t g,
                              const std::vector<Value*>& ids,
                              const std::vector<size_t>& candidates,
                              std::string_view who, std::vector<bool>& taken,
                              const std::string& where0) {
  // torch numbers params over the groups in order: each id is the next
  // candidate not taken by an earlier id whose shape is its state's (a
  // frozen param, which the optimizer does not hold, is skipped).
  size_t next = 0;
  for (const Value* id : ids) {
    const int64_t key = Int(id, "param id");
    const Value* st = GetIndex(state, key);
    std::optional<Shape> shape;
    if (st != nullptr) {
      for (const std::string& k : Keys(st, "state")) {
        const TensorInfo* t = k == "step" ? nullptr : f->FindTensor(Get(st, k));
        if (t != nullptr) {
          shape = t->shape;
          break;
        }
      }
    }
    while (next < candidates.size() &&
           (taken[candidates[next]] ||
            (shape && params_[candidates[next]].shape != *shape)))
      ++next;
    if (next >= candidates.size()) {
      throw FormatError(
          "param_groups[", g, "] names param id ", key,
          shape ? StrCat(" (state of shape ", ShapeString(*shape), ")")
                : std::string(),
          " but no ", who, " param is left to match it");
    }
    const size_t i = candidates[next++];
    taken[i] = true;
    Param& p = params_[i];
    p.group = static_cast<int64_t>(g);
    groups_[g].push_back(p.name);
    if (st == nullptr) continue;  // never stepped
    const std::string where = StrCat(where0, " > state[", key, "]");
    for (const std::string& k : Keys(st, "state")) {
      if (k == "step") continue;
      const TensorInfo& t = TensorAt(f, Get(st, k), where + " > " + k);
      state_kinds_.insert(k);
      Whole(Atom(p, k, t.dtype, false), Tensor(f, t, where), where + " > " + k);
    }
    PlanStep(p, f, st, where);
  }
}

void Planner::MarkFrozen(const std::vector<bool>& taken) {
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].buffer || taken[i]) continue;
    params_[i].frozen = true;
    params_[i].group = -1;
  }
}

}  // namespace ucp::deepspeed::internal
