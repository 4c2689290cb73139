// Reading a mixture-of-experts DeepSpeed checkpoint (deepspeed.moe.layer.MoE;
// deepspeed_format.h): the expert files, each expert of each MoE layer once,
// and the optimizer groups of the experts, whose flat partitions ZeRO spreads
// over the expert-data-parallel ranks with every rank's own local experts.

#include <algorithm>
#include <map>
#include <set>

#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/pickled.h"
#include "engine/formats/deepspeed/reader.h"

namespace ucp::deepspeed::internal {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

namespace {

// "layer_3_expert_5_mp_rank_00_model_states.pt" (DeepSpeed's
// _get_expert_ckpt_name; the legacy name without a layer).
std::string ExpertFileName(int64_t layer, int64_t expert) {
  return StrCat(layer < 0 ? "" : StrCat("layer_", layer, "_"), "expert_",
                expert, "_mp_rank_00_model_states.pt");
}

}  // namespace

void Planner::ReadExperts() {
  const Value* counts = Get(model_, "num_experts");
  if (c_.expert_files.empty()) {
    if (counts != nullptr && !IsNone(counts)) {
      throw FormatError("num_experts is ", pickle::Repr(counts, 40),
                        " but the tag folder has no expert file (missing ",
                        ExpertFileName(0, 0), ")");
    }
    return;
  }
  DeepSpeedMoe m;
  if (counts == nullptr || IsNone(counts)) {
    throw FormatError("expert files (",
                      c_.expert_files.begin()->second.string(),
                      ") but no num_experts");
  }
  if (counts->kind == Kind::kList || counts->kind == Kind::kTuple) {
    for (const Value* n : Items(counts, "num_experts"))
      m.num_experts.push_back(Int(n, "num_experts"));
  } else {
    m.num_experts.push_back(Int(counts, "num_experts"));
  }
  for (int64_t e : m.num_experts)
    if (e < 1) throw FormatError("num_experts ", e);
  const auto layers = static_cast<int64_t>(m.num_experts.size());
  m.layers.assign(m.num_experts.size(), std::string());
  std::map<std::string, std::string> seen;     // name -> its file
  std::set<std::pair<int64_t, int64_t>> held;  // (L, G) with params
  for (const auto& [key, path] : c_.expert_files) {
    const auto [file_layer, expert] = key;
    const FilePtr f = Open(path);
    const std::string where = StrCat("rank file ", path.string());
    if (f->root() == nullptr || !f->root()->IsDictLike())
      throw FormatError(where, ": not a state dict");
    if (file_layer >= layers) {
      throw FormatError(where, ": MoE layer ", file_layer,
                        ", but num_experts lists ", layers, " MoE layers");
    }
    m.legacy_names |= file_layer < 0;
    for (const std::string& k : Keys(f->root(), "expert state dict")) {
      const std::optional<ExpertName> x = SplitExpertName(k);
      if (!x) {
        throw FormatError(where, " > ", k, ": not an expert param (no '",
                          kExpertInfix, "<id>.')");
      }
      if (x->expert != expert) {
        throw FormatError(where, " > ", k, ": a param of expert ", x->expert,
                          " in expert ", expert,
                          "'s file (an expert saved twice?)");
      }
      int64_t layer = file_layer;
      if (layer < 0) {  // legacy: the layers in the order they come
        auto it = std::find(m.layers.begin(), m.layers.end(), x->layer);
        if (it == m.layers.end())
          it = std::find(m.layers.begin(), m.layers.end(), std::string());
        if (it == m.layers.end()) {
          throw FormatError(where, " > ", k, ": more MoE layers than the ",
                            layers, " num_experts lists");
        }
        layer = it - m.layers.begin();
      }
      std::string& module = m.layers[static_cast<size_t>(layer)];
      if (module.empty()) module = x->layer;
      if (module != x->layer) {
        throw FormatError(where, " > ", k, ": MoE layer ", layer,
                          " is module '", module, "' in other expert files");
      }
      if (expert >= m.num_experts[static_cast<size_t>(layer)]) {
        throw FormatError(where, ": expert ", expert, ", but MoE layer ", layer,
                          " has ", m.num_experts[static_cast<size_t>(layer)],
                          " experts (num_experts)");
      }
      if (auto [it, fresh] = seen.emplace(k, path.string()); !fresh) {
        throw FormatError("expert ", expert, " of MoE layer ", layer,
                          " saved twice: ", k, " in ", it->second, " and in ",
                          path.string());
      }
      held.emplace(layer, expert);
      expert_entries_.push_back(
          {k, f, Get(f->root(), k), StrCat(where, " > ", k)});
    }
  }
  // Every expert of every MoE layer, once.
  for (int64_t l = 0; l < layers; ++l) {
    const int64_t count = m.num_experts[static_cast<size_t>(l)];
    for (int64_t g = 0; g < count; ++g) {
      if (held.count({l, g})) continue;
      const bool legacy = c_.expert_files.count({-1, g}) > 0;
      throw FormatError(
          c_.tag_dir.string(), ": expert ", g, " of MoE layer ", l,
          " is missing (",
          legacy ? StrCat("no params of that layer in ", ExpertFileName(-1, g))
                 : StrCat("no ", ExpertFileName(l, g)),
          "; num_experts says ", count, " experts)");
    }
  }
  for (int64_t l = 0; l < layers; ++l)
    moe_layer_of_[m.layers[static_cast<size_t>(l)]] = l;
  moe_ = std::move(m);
}

bool Planner::ShapesFromMappings() {
  if (!moe_ || c_.wrapper != Wrapper::kZero || optims_.empty()) return false;
  std::vector<std::vector<std::string>> names;
  for (size_t r = 0; r < optims_.size(); ++r) {
    const std::string where = StrCat("rank file ", c_.optim_files[r].string());
    try {
      const Value* osd = Require(optims_[r]->root(), "optimizer_state_dict");
      const auto& maps =
          Items(Require(osd, "param_slice_mappings"), "param_slice_mappings");
      if (r == 0) names.resize(maps.size());
      if (maps.size() != names.size()) {
        throw FormatError("param_slice_mappings has ", maps.size(),
                          " groups, rank 0's has ", names.size());
      }
      for (size_t g = 0; g < maps.size(); ++g) {
        for (const std::string& n :
             Keys(maps[g], "param_slice_mappings group")) {
          if (std::find(names[g].begin(), names[g].end(), n) == names[g].end())
            names[g].push_back(n);
        }
      }
    } catch (Error& e) {
      AddContextOnce(e, where);
      throw;
    }
  }
  for (size_t g = 0; g < names.size(); ++g) {
    groups_.emplace_back();
    for (const std::string& n : names[g]) {
      // A local expert i is ep rank 0's global expert i.
      const Entry* e = FindEntry(n);
      if (e == nullptr) {
        throw FormatError("rank file ", c_.optim_files[0].string(),
                          " > param_slice_mappings names ", n,
                          ", which neither the module nor an expert file "
                          "holds");
      }
      Param p;
      p.name = n;
      p.shape = TensorAt(e->file, e->value, e->where).shape;
      p.dtype = lp_;
      p.group = static_cast<int64_t>(g);
      groups_.back().push_back(n);
      index_[n] = params_.size();
      params_.push_back(std::move(p));
    }
  }
  return true;
}

void Planner::ExpandExpertGroups() {
  // ZeRO 0 has no param_shapes: PlanTorchMoe groups the module's params.
  if (!moe_ || c_.wrapper == Wrapper::kTorch) return;
  std::vector<Param> local = std::move(params_);
  std::map<std::string, size_t> local_index = std::move(index_);
  params_.clear();
  index_.clear();
  auto add = [&](Param p) {
    if (!index_.emplace(p.name, params_.size()).second)
      throw FormatError("param ", p.name, " twice in param_shapes");
    params_.push_back(std::move(p));
  };
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<std::string>& names = groups_[g];
    size_t experts = 0;
    for (const std::string& n : names) experts += SplitExpertName(n) ? 1 : 0;
    if (experts == 0) {
      for (const std::string& n : names) add(local[local_index.at(n)]);
      continue;
    }
    const std::string where = StrCat("param_shapes[", g, "]");
    if (experts != names.size()) {
      throw FormatError(where, ": expert params and others in one group");
    }
    // Local experts per MoE layer on a rank: ep = num_experts / that.
    std::map<int64_t, int64_t> per_rank;  // MoE layer -> local experts
    for (const std::string& n : names) {
      const ExpertName x = *SplitExpertName(n);
      auto it = moe_layer_of_.find(x.layer);
      if (it == moe_layer_of_.end()) {
        throw FormatError(where, " > ", n, ": module '", x.layer,
                          "' has no expert files");
      }
      per_rank[it->second] = std::max(per_rank[it->second], x.expert + 1);
    }
    ExpertGroup eg;
    eg.ep = 0;
    for (const auto& [layer, count] : per_rank) {
      const int64_t total = moe_->num_experts[static_cast<size_t>(layer)];
      if (total % count != 0 || (eg.ep != 0 && total / count != eg.ep)) {
        throw FormatError(where, ": ", count, " local experts of MoE layer ",
                          layer, " (", total,
                          " experts) do not give one expert-parallel size");
      }
      eg.ep = total / count;
    }
    if (c_.dp % eg.ep != 0) {
      throw FormatError(where, ": expert-parallel size ", eg.ep,
                        " does not divide dp_world_size ", c_.dp);
    }
    if (moe_->expert_groups.empty()) {
      moe_->ep = eg.ep;
    } else if (moe_->ep != eg.ep) {
      throw FormatError(where, ": expert-parallel size ", eg.ep,
                        ", another expert group's is ", moe_->ep,
                        " (several expert-parallel sizes are not supported)");
    }
    moe_->expert_groups.push_back(static_cast<int64_t>(g));
    for (const std::string& n : names)
      eg.numels.push_back(NumElements(local[local_index.at(n)].shape));
    std::vector<std::string> global;
    eg.names.resize(static_cast<size_t>(eg.ep));
    for (int64_t e = 0; e < eg.ep; ++e) {
      for (const std::string& n : names) {
        const ExpertName x = *SplitExpertName(n);
        const int64_t count = per_rank[moe_layer_of_.at(x.layer)];
        Param p = local[local_index.at(n)];
        p.name = ExpertParamName(x.layer, e * count + x.expert, x.rest);
        eg.names[static_cast<size_t>(e)].push_back(p.name);
        global.push_back(p.name);
        add(std::move(p));
      }
    }
    names = std::move(global);
    expert_groups_[g] = std::move(eg);
  }
}

void Planner::PlanTorchMoe() {
  if (fp16_ != Fp16::kNone) {
    throw FormatError(
        "mixture-of-experts at ZeRO stage 0 with fp16 or bf16 "
        "(FP16_Optimizer) is not supported yet");
  }
  const std::map<int64_t, fs::path>& files = c_.expert_optim_files;
  const auto ep = static_cast<int64_t>(files.size());
  for (int64_t e = 0; e < std::max<int64_t>(ep, 1); ++e) {
    if (!files.count(e)) {
      throw FormatError(c_.tag_dir.string(), ": missing expp_rank_", e,
                        "_mp_rank_00_optim_states.pt (ZeRO stage 0 keeps "
                        "each expert-parallel rank's optimizer there; ",
                        ep, " such files)");
    }
  }
  for (size_t l = 0; l < moe_->num_experts.size(); ++l) {
    if (moe_->num_experts[l] % ep != 0) {
      throw FormatError(c_.tag_dir.string(), ": ", ep,
                        " expp_rank files do not divide the ",
                        moe_->num_experts[l], " experts of MoE layer ", l);
    }
  }
  // The ep rank holding param i, -1 for a param of no expert.
  auto rank_of = [&](const Param& p) -> int64_t {
    const std::optional<ExpertName> x = SplitExpertName(p.name);
    if (!x) return -1;
    auto it = moe_layer_of_.find(x->layer);
    if (it == moe_layer_of_.end()) return -2;  // in no expert group
    const size_t l = static_cast<size_t>(it->second);
    return x->expert / (moe_->num_experts[l] / ep);
  };
  std::vector<bool> taken(params_.size(), false);
  for (int64_t e = 0; e < ep; ++e) {
    const FilePtr f = Open(files.at(e));
    const std::string where0 =
        StrCat("rank file ", files.at(e).string(), " > optimizer");
    try {
      const Value* opt = Require(f->root(), "optimizer");
      if (IsNone(opt)) throw FormatError("None at ZeRO stage 0");
      const Value* state = RequireDict(opt, "state");
      const auto& groups = Items(Require(opt, "param_groups"), "param_groups");
      if (e == 0) {
        groups_.assign(groups.size(), {});
      } else if (groups.size() != groups_.size()) {
        throw FormatError(groups.size(), " param groups, expp_rank_0's has ",
                          groups_.size());
      }
      // Ids number the params over the groups in order. A dense group
      // takes the module's params of no expert in order (every ep rank
      // holds a copy: rank 0's is read), an expert group ('moe': True)
      // this ep rank's experts in module order; each id the next one whose
      // shape is its state's (the others are frozen).
      for (size_t g = 0; g < groups.size(); ++g) {
        const Value* moe = Get(groups[g], "moe");
        const bool expert =
            moe != nullptr && moe->kind == Kind::kBool && moe->b;
        const auto& ids = Items(Require(groups[g], "params"), "params");
        if (e == 0) {
          group_dicts_.push_back(groups[g]);
          if (expert) {
            moe_->expert_groups.push_back(static_cast<int64_t>(g));
            expert_groups_[g].ep = ep;
          }
        }
        if (!expert && e > 0) continue;
        std::vector<size_t> candidates;
        for (size_t i = 0; i < params_.size(); ++i)
          if (!params_[i].buffer && rank_of(params_[i]) == (expert ? e : -1))
            candidates.push_back(i);
        MatchTorchGroup(
            f, state, g, ids, candidates,
            expert ? StrCat("expert of ep rank ", e) : std::string("dense"),
            taken, where0);
      }
    } catch (Error& err) {
      AddContextOnce(err, where0);
      throw;
    }
  }
  moe_->ep = ep;
  MarkFrozen(taken);
}

}  // namespace ucp::deepspeed::internal
