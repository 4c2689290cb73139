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
    // ids: torch numbers params over the groups in order. Groups are the
    // module's params filtered (weight decay or not, ...): each group takes
    // the module's params in order, skipping those taken by earlier groups
    // and those whose shape differs from the id's state (frozen params,
    // which the optimizer does not hold).
    std::vector<bool> taken(params_.size(), false);
    groups_.assign(groups.size(), {});
    for (size_t g = 0; g < groups.size(); ++g) {
      size_t next = 0;
      group_dicts_.push_back(groups[g]);
      for (const Value* id : Items(Require(groups[g], "params"), "params")) {
        const int64_t key = Int(id, "param id");
        const Value* st = GetIndex(state, key);
        std::optional<Shape> shape;
        if (st != nullptr) {
          for (const std::string& k : Keys(st, "state")) {
            const TensorInfo* t =
                k == "step" ? nullptr : models_[0]->FindTensor(Get(st, k));
            if (t != nullptr) {
              shape = t->shape;
              break;
            }
          }
        }
        while (next < params_.size() &&
               (params_[next].buffer || taken[next] ||
                (shape && params_[next].shape != *shape)))
          ++next;
        if (next >= params_.size()) {
          throw FormatError(
              "param_groups[", g, "] names param id ", key,
              shape ? StrCat(" (state of shape ", ShapeString(*shape), ")")
                    : std::string(),
              " but no module param is left to match it");
        }
        taken[next] = true;
        Param& p = params_[next++];
        p.group = static_cast<int64_t>(g);
        groups_[g].push_back(p.name);
        if (st == nullptr) continue;  // never stepped
        const std::string where = StrCat(where0, " > state[", key, "]");
        for (const std::string& k : Keys(st, "state")) {
          if (k == "step") continue;
          const TensorInfo& t =
              TensorAt(models_[0], Get(st, k), where + " > " + k);
          state_kinds_.insert(k);
          Whole(Atom(p, k, t.dtype, false), Tensor(models_[0], t, where),
                where + " > " + k);
        }
        PlanStep(p, models_[0], st, where);
      }
    }
    MarkFrozen(taken);
  } catch (Error& e) {
    AddContextOnce(e, where0);
    throw;
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
