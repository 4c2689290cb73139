#pragma once
// The DeepSpeed reader's planner (internal): one class whose steps read the
// module, each optimizer wrapping's state and the rest of a checkpoint into
// a universal SourcePlan. The steps shared by every wrapping are in
// reader.cc; each wrapping's own in reader_torch.cc, reader_fp16.cc,
// reader_zero.cc and universal_folder.cc.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/common/source_table.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/flat_layout.h"
#include "engine/pickle/value.h"
#include "engine/reshape/plan.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/source_plan.h"

namespace ucp::deepspeed::internal {

// Adds context unless the message already names it (inner messages carry
// their rank file).
template <typename... Args>
void AddContextOnce(Error& e, Args&&... args) {
  const std::string c = StrCat(std::forward<Args>(args)...);
  if (std::string_view(e.what()).find(c) == std::string_view::npos)
    e.AddContext(c);
}

struct Param {
  std::string name;
  Shape shape;
  DType dtype = DType::kFloat32;  // training (lp) dtype
  int64_t group = -1;             // optimizer group (ZeRO-3: sub-group's)
  int64_t order = 0;
  bool frozen = false;
  bool buffer = false;
  std::vector<std::string> aliases;  // shared params pointing here
};

using FilePtr = std::shared_ptr<const torchfile::TorchFile>;
using FileCache = std::map<std::filesystem::path, FilePtr>;

// A module entry of a layer file (PipelineModule): its param name, file and
// key there.
struct LayerEntry {
  std::string name;
  std::filesystem::path file;
  std::string key;
  int64_t layer = 0;  // the file's layer index
};

// One mp rank of a model-parallel checkpoint.
struct RankView {
  bool pipeline = false;
  std::vector<LayerEntry> layer_entries;  // pipeline: this stage's, tp rank's
};

class Planner {
 public:
  Planner(const Checkpoint& c, FileCache& cache, RankView view = {})
      : c_(c), cache_(cache), view_(std::move(view)) {}
  universal::SourcePlan Run();

 private:
  // A module state-dict entry: from the model states' `module`, or from a
  // pipeline layer file.
  struct Entry {
    std::string name;
    FilePtr file;
    const pickle::Value* value = nullptr;
    std::string where;
  };
  FilePtr Open(const std::filesystem::path& p);
  const Entry* FindEntry(const std::string& name) const {
    auto it = entry_index_.find(name);
    return it == entry_index_.end() ? nullptr : &entries_[it->second];
  }
  reshape::SourceTensor Tensor(const FilePtr& f, const torchfile::TensorInfo& t,
                               const std::string& what);
  const torchfile::TensorInfo& TensorAt(const FilePtr& f,
                                        const pickle::Value* v,
                                        const std::string& what);
  universal::AtomPlan& Atom(const Param& p, const std::string& kind,
                            DType dtype, bool scalar);
  // Adds fragments mapping elements [begin, end) of the param's flattening
  // to `src` elements starting at `src_elem`.
  void AddFlat(universal::AtomPlan& atom, const Param& p,
               const reshape::SourceTensor& flat, int64_t src_elem,
               int64_t begin, int64_t end, const std::string& where);
  void Whole(universal::AtomPlan& atom, const reshape::SourceTensor& src,
             const std::string& where);

  void ReadModel();
  // ReadModel's steps: the trainable params (param_shapes in flat-buffer
  // order per group, or at ZeRO 0 the module's params in order), then the
  // frozen params, buffers, aliases and the canonical order.
  void CollectTrainable(const std::set<std::string>& buffers);
  void CollectUntrained(const std::set<std::string>& buffers);
  void PlanModule();
  void PlanTorchOptimizer();
  // ZeRO 0's torch optimizer (plain, and each ep rank's of a mixture of
  // experts): optimizer group `g`'s param `ids` (keys of `state`, file `f`)
  // matched to `candidates` (indices into params_, module order), each id
  // the next candidate not `taken` whose shape is its state's; the members
  // join groups_[g] and their state is planned. Throws FormatError for an id
  // no candidate is left for (`who` names the candidates: "module").
  void MatchTorchGroup(const FilePtr& f, const pickle::Value* state, size_t g,
                       const std::vector<pickle::Value*>& ids,
                       const std::vector<size_t>& candidates,
                       std::string_view who, std::vector<bool>& taken,
                       const std::string& where0);
  void PlanFp16Optimizer();  // FP16_Optimizer / FP16_UnfusedOptimizer
  // ZeRO 0: module params the optimizer does not hold (not `taken`) were
  // not given to it: frozen.
  void MarkFrozen(const std::vector<bool>& taken);
  // FP16_Optimizer: the first unassigned trainable param, from `hint` on in
  // module order (wrapping around), whose shape fits (`numel` elements
  // fit, or exactly `shape` when given) and whose stored lp weights equal
  // the fp32 master elements `elem` of `master` rounded; -1 if none.
  int64_t MatchMaster(const FilePtr& f, const torchfile::TensorInfo& master,
                      int64_t elem, int64_t room, const Shape* shape,
                      size_t hint, const std::vector<bool>& taken);
  void PlanFlat();  // ZeRO 1/2, BF16_Optimizer
  // The fragments of one flat group of a rank's optimizer file (ZeRO 1-3):
  // each window's slice of the fp32 flat tensor and of every state kind in
  // `state` (`length` float32 elements each, else FormatError naming
  // `what`), and the step. `where` names the group, `index` its state.
  void FlatGroup(const FilePtr& f, const std::vector<std::string>& members,
                 const std::vector<Window>& windows,
                 const reshape::SourceTensor& fp32,
                 const std::string& fp32_name, const pickle::Value* state,
                 int64_t length, const std::string& what,
                 const std::string& where, size_t index);
  void PlanStage3();
  void PlanZeroFolder();
  void RegroupSubGroups();
  std::vector<int64_t> Numels(const std::vector<std::string>& names) {
    std::vector<int64_t> out;
    for (const std::string& n : names)
      out.push_back(NumElements(params_[index_[n]].shape));
    return out;
  }
  // Mixture of experts (reader_moe.cc): the expert files' params as module
  // entries under their global names, every expert of every MoE layer once
  // (moe_, moe_layer_of_); then the expert groups of param_shapes (local
  // names, the same on every rank) as every rank's global names.
  void ReadExperts();
  void ExpandExpertGroups();
  // DeepSpeed before 0.16 saves a MoE checkpoint's model states without
  // param_shapes (_save_moe_checkpoint): each group's params are then those
  // its param_slice_mappings name, rank after rank (flat order), shaped as
  // the module's and the expert files' tensors. False if not such a case.
  bool ShapesFromMappings();
  // ZeRO 0 (fp32): the torch optimizer of each expert-parallel rank E in
  // expp_rank_E_mp_rank_00_optim_states.pt; its dense groups as every
  // rank's (rank 0's read), its expert groups ('moe': True) over rank E's
  // experts.
  void PlanTorchMoe();
  struct ExpertGroup {
    int64_t ep = 1;               // its expert-parallel size
    std::vector<int64_t> numels;  // of the params of one rank, flat order
    /// Per ep rank: the global names of its params, flat order.
    std::vector<std::vector<std::string>> names;
  };
  void PlanStep(const Param& p, const FilePtr& f, const pickle::Value* state,
                const std::string& where);
  void PlanFrozen();
  void PlanOpaque();
  void PlanRoot();

  const Checkpoint& c_;
  FileCache& cache_;
  RankView view_;
  std::vector<Entry> entries_;
  std::map<std::string, size_t> entry_index_;
  universal::SourcePlan plan_;
  formats::SourceTable sources_{plan_};
  std::map<std::pair<std::string, std::string>, size_t> atoms_;
  std::vector<FilePtr> models_;  // per model file
  std::vector<FilePtr> optims_;  // per dp rank
  FilePtr zero_state_;           // universal folder: zero/optimizer_state.pt
  std::vector<FilePtr> zero_files_;       // universal folder: per-param files
  const pickle::Value* model_ = nullptr;  // model states of rank 0
  std::vector<Param> params_;  // in module order, then frozen / buffers
  std::map<std::string, size_t> index_;
  std::vector<std::vector<std::string>> groups_;  // names per group
  std::vector<std::string> module_keys_;
  std::map<std::string, std::string> shared_;  // alias -> source
  DType lp_ = DType::kFloat32;
  std::set<std::string> state_kinds_;
  std::string step_kind_ = "none";    // tensor | int | float | none
  std::optional<double> step_value_;  // int / float steps
  std::vector<const pickle::Value*> group_dicts_;
  std::vector<int64_t> sub_to_group_;  // ZeRO-3: param group of each sub-group
  // ZeRO 0 with fp16: FP16_Optimizer (flat fp32 groups) or
  // FP16_UnfusedOptimizer (per-param fp32 groups) in the model states.
  enum class Fp16 { kNone, kFlat, kUnfused } fp16_ = Fp16::kNone;
  // Sampled lp weights of the trainable params (MatchMaster), by index.
  std::map<size_t, std::vector<uint16_t>> lp_samples_;
  int64_t sub_groups_ = 0;
  std::optional<DeepSpeedMoe> moe_;
  std::vector<Entry> expert_entries_;            // the expert files' params
  std::map<std::string, int64_t> moe_layer_of_;  // module path -> MoE layer
  std::map<size_t, ExpertGroup> expert_groups_;  // by optimizer group
};

}  // namespace ucp::deepspeed::internal
