// Reading ZeRO 1-3 and BF16_Optimizer: the flat fp32 partitions and
// optimizer state of every data-parallel rank's optimizer file
// (deepspeed_format.h; flat layouts: flat_layout.h).

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

void Planner::FlatGroup(const FilePtr& f,
                        const std::vector<std::string>& members,
                        const std::vector<Window>& windows,
                        const reshape::SourceTensor& fp32,
                        const std::string& fp32_name, const Value* state,
                        int64_t length, const std::string& what,
                        const std::string& where, size_t index) {
  std::vector<std::pair<std::string, reshape::SourceTensor>> kinds;
  if (state != nullptr) {
    for (const std::string& k : Keys(state, "state")) {
      if (k == "step") continue;
      const TensorInfo& t = TensorAt(f, Get(state, k), where + " > " + k);
      if (t.numel != length || t.dtype != DType::kFloat32) {
        throw FormatError(what, " > ", k, ": ", t.numel, " ",
                          DTypeName(t.dtype), " elements, expected ", length,
                          " float32");
      }
      kinds.emplace_back(k, Tensor(f, t, where + " > " + k));
      state_kinds_.insert(k);
    }
  }
  for (const Window& w : windows) {
    const std::string& n = members[w.member];
    const Param& p = params_[index_[n]];
    try {
      AddFlat(Atom(p, "fp32", DType::kFloat32, false), p, fp32, w.dst, w.begin,
              w.end, where + " > " + fp32_name);
      for (const auto& [k, src] : kinds)
        AddFlat(Atom(p, k, DType::kFloat32, false), p, src, w.dst, w.begin,
                w.end, where + " > " + k);
      if (state != nullptr)
        PlanStep(p, f, state, StrCat(where, " > state[", index, "]"));
    } catch (Error& e) {
      e.AddContext("param ", n);
      throw;
    }
  }
}

void Planner::PlanFlat() {
  const int64_t W = c_.dp;
  for (int64_t r = 0; r < W; ++r) {
    const FilePtr& f = optims_[static_cast<size_t>(r)];
    const std::string where0 = StrCat("rank file ", c_.optim_files[r].string());
    try {
      const Value* osd = Require(f->root(), "optimizer_state_dict");
      const Value* base = Require(osd, "base_optimizer_state");
      const Value* state = RequireDict(base, "state");
      const auto& pgroups =
          Items(Require(base, "param_groups"), "param_groups");
      const auto& fp32 = Items(Require(osd, "single_partition_of_fp32_groups"),
                               "single_partition_of_fp32_groups");
      const auto& counts =
          Items(Require(osd, "partition_count"), "partition_count");
      if (fp32.size() != groups_.size() || pgroups.size() != groups_.size()) {
        throw FormatError(fp32.size(), " fp32 partitions and ", pgroups.size(),
                          " param groups, but param_shapes has ",
                          groups_.size(), " groups");
      }
      if (counts.size() != groups_.size()) {
        throw FormatError("partition_count has ", counts.size(),
                          " entries, but param_shapes has ", groups_.size(),
                          " groups");
      }
      for (size_t g = 0; g < groups_.size(); ++g) {
        if (r == 0) group_dicts_.push_back(pgroups[g]);
        // An expert group (MoE) is partitioned over the expert-data-parallel
        // ranks (dp / ep), each holding its expert-parallel rank's experts
        // (DeepSpeed's groups: ep rank = rank % ep, edp rank = rank / ep).
        auto eg = expert_groups_.find(g);
        const bool expert = eg != expert_groups_.end();
        const int64_t Wg = expert ? W / eg->second.ep : W;
        const int64_t part = expert ? r / eg->second.ep : r;
        if (Int(counts.at(g), "partition_count") != Wg) {
          throw FormatError(
              "partition_count[", g, "] is ",
              Int(counts.at(g), "partition_count"), " but ",
              expert ? StrCat("the expert group's expert-data-parallel size "
                              "is ",
                              Wg, " (dp_world_size ", W,
                              " / expert-parallel size ", eg->second.ep, ")")
                     : StrCat("dp_world_size is ", W),
              " (files from mixed world sizes?)");
        }
        const std::vector<std::string>& members =
            expert ? eg->second.names[static_cast<size_t>(r % eg->second.ep)]
                   : groups_[g];
        const std::vector<int64_t> numels =
            expert ? eg->second.numels : Numels(groups_[g]);
        const ZeroGroup layout = ZeroLayout(numels, Wg);
        const int64_t ps = layout.partition;
        const std::string gw = StrCat(where0, " > group ", g);
        // fp32 partition: ZeRO strips the padding, BF16_Optimizer keeps it.
        const TensorInfo& ft = TensorAt(f, fp32[g], gw + " > fp32 partition");
        const int64_t want =
            c_.wrapper == Wrapper::kBf16 ? ps : layout.Real(part);
        if (ft.numel != want || ft.dtype != DType::kFloat32 ||
            ft.shape.size() != 1) {
          throw FormatError(
              "group ", g, ": fp32 partition of ", ft.numel, " ",
              DTypeName(ft.dtype), " elements, expected ", want, " float32 (",
              layout.numel, " elements over ", Wg, " ranks, partition ", ps,
              ", as the param_shapes of ", c_.model_files[0].string(), " say)");
        }
        FlatGroup(f, members, ZeroWindows(numels, layout, part),
                  Tensor(f, ft, gw), "fp32 partition",
                  GetIndex(state, static_cast<int64_t>(g)), ps,
                  StrCat("group ", g), gw, g);
      }
    } catch (Error& e) {
      AddContextOnce(e, where0);
      throw;
    }
  }
}

void Planner::PlanStage3() {
  const int64_t W = c_.dp;
  for (int64_t r = 0; r < W; ++r) {
    const FilePtr& f = optims_[static_cast<size_t>(r)];
    const std::string where0 = StrCat("rank file ", c_.optim_files[r].string());
    try {
      const Value* osd = Require(f->root(), "optimizer_state_dict");
      if (Int(Require(osd, "partition_count"), "partition_count") != W) {
        throw FormatError("partition_count is ",
                          Int(Get(osd, "partition_count"), "partition_count"),
                          " but dp_world_size is ", W,
                          " (files from mixed world sizes?)");
      }
      const Value* inner = Require(osd, "optimizer_state_dict");
      const Value* state = RequireDict(inner, "state");
      const auto& pgroups =
          Items(Require(inner, "param_groups"), "param_groups");
      const auto& flats =
          Items(Require(osd, "fp32_flat_groups"), "fp32_flat_groups");
      if (flats.size() != groups_.size()) {
        throw FormatError(flats.size(),
                          " fp32 flat groups, but param_shapes "
                          "has ",
                          groups_.size(), " sub-groups");
      }
      if (r == 0) {
        // Sub-groups are enumerated param group by param group; each
        // group's 'params' lists its sub-groups.
        sub_to_group_.assign(groups_.size(), -1);
        for (size_t k = 0; k < pgroups.size(); ++k) {
          group_dicts_.push_back(pgroups[k]);
          for (const Value* id :
               Items(Require(pgroups[k], "params"), "params")) {
            const int64_t sg = Int(id, "sub-group id");
            if (sg < 0 || sg >= static_cast<int64_t>(groups_.size()) ||
                sub_to_group_[static_cast<size_t>(sg)] >= 0) {
              throw FormatError("param_groups[", k, "] names sub-group ", sg,
                                " (", groups_.size(), " in param_shapes)");
            }
            sub_to_group_[static_cast<size_t>(sg)] = static_cast<int64_t>(k);
          }
        }
        for (size_t sg = 0; sg < sub_to_group_.size(); ++sg) {
          if (sub_to_group_[sg] < 0)
            throw FormatError("sub-group ", sg, " is in no param group");
        }
      }
      for (size_t s = 0; s < groups_.size(); ++s) {
        const std::string gw = StrCat(where0, " > sub-group ", s);
        const TensorInfo& ft = TensorAt(f, flats[s], gw + " > fp32");
        int64_t total = 0;
        const std::vector<Window> windows =
            Zero3Windows(Numels(groups_[s]), W, r, &total);
        if (ft.numel != total || ft.dtype != DType::kFloat32) {
          throw FormatError("sub-group ", s, ": fp32 flat group of ", ft.numel,
                            " elements, expected ", total, " (", W, " ranks)");
        }
        FlatGroup(f, groups_[s], windows, Tensor(f, ft, gw), "fp32",
                  GetIndex(state, static_cast<int64_t>(s)), total,
                  StrCat("sub-group ", s), gw, s);
      }
    } catch (Error& e) {
      AddContextOnce(e, where0);
      throw;
    }
  }
}

// ZeRO-3: from sub-groups to the optimizer's param groups.
void Planner::RegroupSubGroups() {
  std::vector<std::vector<std::string>> groups(group_dicts_.size());
  for (size_t sg = 0; sg < groups_.size(); ++sg) {
    const auto k = static_cast<size_t>(sub_to_group_[sg]);
    for (const std::string& n : groups_[sg]) {
      params_[index_[n]].group = static_cast<int64_t>(k);
      groups[k].push_back(n);
    }
  }
  sub_groups_ = static_cast<int64_t>(groups_.size());
  groups_ = std::move(groups);
}

}  // namespace ucp::deepspeed::internal
