// Writing a mixture-of-experts model as DeepSpeed files (deepspeed.moe.layer.
// MoE; deepspeed_format.h): which target expert-parallel rank holds which
// global expert, and under which local name.

#include <algorithm>
#include <map>
#include <tuple>

#include "engine/core/error.h"
#include "engine/formats/deepspeed/writer_base.h"

namespace ucp::deepspeed::internal {

void WriterBase::PlaceExperts(bool native) {
  const int64_t ep = options_.topology.ep;
  if (!meta_ || !meta_->moe) return;  // --ep: ReadTopology
  const DeepSpeedMoe& moe = *meta_->moe;
  if (!native) {
    throw UsageError(
        "a mixture-of-experts model's DeepSpeed universal folder is not "
        "written yet: use --format deepspeed");
  }
  const bool torch = wrapper_ == Wrapper::kTorch && stage_ == 0;
  if (!torch && (wrapper_ != Wrapper::kZero || (stage_ != 1 && stage_ != 2))) {
    throw UsageError("--zero-stage ", stage_,
                     ": mixture-of-experts DeepSpeed checkpoints are written "
                     "for ZeRO stage 1 or 2, or 0 with fp32 training");
  }
  if (W_ % ep != 0) {
    throw UsageError("--ep ", ep, " does not divide --dp ", W_,
                     " (DeepSpeed's expert-parallel groups split the "
                     "data-parallel ranks)");
  }
  std::map<std::string, int64_t> layer_of;
  for (size_t l = 0; l < moe.layers.size(); ++l) {
    if (moe.num_experts[l] % ep != 0) {
      throw UsageError("--ep ", ep, " does not divide the ", moe.num_experts[l],
                       " experts of MoE layer ", l, " (", moe.layers[l], ")");
    }
    layer_of[moe.layers[l]] = static_cast<int64_t>(l);
  }
  ep_ = ep;
  moe_ = moe;
  const std::string where = StrCat("universal input ", input_.path().string());
  // Every expert param (trained or not): its MoE layer, global expert, the
  // target ep rank holding it and its local name there.
  std::map<size_t, std::tuple<int64_t, int64_t, int64_t>> key;  // e, L, G
  for (size_t i = 0; i < params_.size(); ++i) {
    const std::optional<ExpertName> x = SplitExpertName(params_[i].name);
    if (!x) continue;
    auto it = layer_of.find(x->layer);
    if (it == layer_of.end()) {
      throw FormatError(where, " > param ", params_[i].name, ": module '",
                        x->layer, "' is no MoE layer of the record");
    }
    const int64_t total = moe.num_experts[static_cast<size_t>(it->second)];
    if (x->expert >= total) {
      throw FormatError(where, " > param ", params_[i].name, ": expert ",
                        x->expert, " of ", total);
    }
    const int64_t per_rank = total / ep;
    expert_of_[i] = {it->second, x->expert};
    local_name_[i] = ExpertParamName(x->layer, x->expert % per_rank, x->rest);
    key[i] = {x->expert / per_rank, it->second, x->expert};
  }
  for (int64_t g : moe.expert_groups) {
    if (g < 0 || g >= static_cast<int64_t>(groups_.size())) {
      throw FormatError(where, ": expert group ", g, " of ", groups_.size());
    }
    std::vector<size_t> members = groups_[static_cast<size_t>(g)];
    for (size_t i : members) {
      if (!key.count(i)) {
        throw FormatError(where, " > param ", params_[i].name,
                          ": not an expert param, but in expert group ", g);
      }
    }
    // A rank's flat order: its MoE layers in order, each one's local
    // experts in order, each expert's params as the source had them.
    std::stable_sort(members.begin(), members.end(),
                     [&](size_t a, size_t b) { return key[a] < key[b]; });
    std::vector<std::vector<size_t>> per(static_cast<size_t>(ep));
    for (size_t i : members)
      per[static_cast<size_t>(std::get<0>(key[i]))].push_back(i);
    for (const std::vector<size_t>& r : per) {
      if (Numels(r) != Numels(per[0])) {
        throw FormatError(where, ": expert group ", g,
                          " does not hold the same params for every expert");
      }
    }
    expert_members_[static_cast<size_t>(g)] = std::move(per);
  }
}

const std::vector<size_t>& WriterBase::RankMembers(size_t g,
                                                   int64_t rank) const {
  auto it = expert_members_.find(g);
  if (it == expert_members_.end()) return groups_[g];
  return it->second[static_cast<size_t>(rank % ep_)];
}

const std::string& WriterBase::RankName(size_t i) const {
  auto it = local_name_.find(i);
  return it == local_name_.end() ? params_[i].name : it->second;
}

}  // namespace ucp::deepspeed::internal
