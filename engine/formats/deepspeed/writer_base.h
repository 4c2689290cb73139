#pragma once
// What the native and universal-folder writers share (internal): the
// target's params, groups and settings read from the universal content, and
// the model-states file.

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/flat_layout.h"
#include "engine/formats/deepspeed/graph.h"
#include "engine/reshape/slot_plan.h"
#include "layouts/layout.h"
#include "layouts/variables.h"

namespace ucp::deepspeed::internal {

struct TParam {
  std::string name;
  Shape shape;        // as every target rank holds it (its TP shard)
  int64_t numel = 0;  // of `shape`
  DType dtype = DType::kFloat32;  // stored training dtype
  int64_t group = 0;
  bool frozen = false;
  bool buffer = false;
  std::vector<std::string> aliases;
  // Tensor parallelism (Megatron-DeepSpeed targets): the placement rule,
  // the stored (true) shape, the padded size of a vocabulary dim and the
  // padding rows stored at the end of the main atom.
  const layouts::Rule* rule = nullptr;
  Shape full;
  int64_t padded = 0;
  int64_t stored_pad = 0;
  int64_t pad_rows = 0;         // padding rows the universal content holds
  std::vector<int64_t> stages;  // pipeline stages holding it (pipeline only)
};

class WriterBase {
 public:
  WriterBase(const universal::UniversalInput& input,
             const formats::TargetOptions& options)
      : input_(input), options_(options), blobs_(input) {}

 protected:
  /// Reads the universal content's params, groups, dtype, stage, tag.
  /// With `tensor_parallel`, a Megatron-DeepSpeed source (without pipeline
  /// layer files) may be written for any TP size (its layout places the
  /// params). Throws UsageError for pp > 1, tp > 1 otherwise, or a stage
  /// outside 0-3; LayoutError if the TP size does not fit the model;
  /// FormatError for missing master weights.
  void Prepare(bool tensor_parallel = false);
  // Prepare's steps, in order.
  /// The target sizes, the source's record and, for a Megatron-DeepSpeed
  /// source, its layout and variables. Throws UsageError for --ep > 1 without
  /// DeepSpeed MoE layers.
  void ReadTopology(bool tensor_parallel);
  /// The training dtype, the ZeRO stage and the optimizer wrapper.
  void ChooseOptimizer();
  /// The tag folder (--tag, the source's, else global_step<iteration>).
  void ChooseTag();
  /// params_ in canonical order, placed on the TP size (and the pipeline
  /// stages); their index by name.
  std::map<std::string, size_t> CollectParams();
  /// groups_: the source's flat order when it was DeepSpeed, else
  /// canonical.
  void AssignGroups(const std::map<std::string, size_t>& index);
  /// state_kinds_ and step_kind_; whether the content holds optimizer state.
  bool CollectStateKinds();
  /// module_keys_: the source's module order if it names exactly our params.
  void OrderModuleKeys();
  /// sub_group_size_ from the saved ds_config.
  void ReadSubGroupSize();
  /// group_templates_: the source's pickled groups, else made from the
  /// optimizer attribute.
  void MakeGroupTemplates(bool any_state);

  /// The pieces of param `p`'s local tensor on TP rank tp_rank_ (the whole
  /// atom without TP), filled from `atom` of state `kind` and its padding
  /// rows.
  std::vector<reshape::SlotPiece> Pieces(const TParam& p,
                                         const atoms::DatasetInfo& atom,
                                         const std::string& kind) const;
  /// The local tensor of `p` (Pieces) as a target tensor of `dtype`.
  reshape::TargetTensor LocalTensor(const TParam& p,
                                    const atoms::DatasetInfo& atom,
                                    const std::string& kind, DType dtype,
                                    const std::string& name) const;
  /// "mp_rank_03" for mp rank pp_rank_ x tp_ + tp_rank_ = 3.
  std::string MpRank() const;
  /// Pipeline: every param's stages (DeepSpeed's 'type:transformer'
  /// partition: the transformer layers spread evenly, what precedes them on
  /// the first stage, what follows on the last, tied modules on both).
  /// Throws UsageError if pp does not divide the transformer layers.
  void PartitionStages();
  /// The layer file index and the key in it of a pipeline param.
  std::pair<int64_t, std::string> LayerKey(const TParam& p) const;
  /// Sets p's rule, stored shape and local (TP shard) shape.
  void PlaceOnTp(TParam& p);
  void PatchTpArgs(pickle::Arena& a, pickle::Value* root) const;
  void AddTpPatterns(pickle::Arena& a, pickle::Value* info) const;

  /// The atom (converted to `dtype`) as a whole tensor of `shape`.
  reshape::TargetTensor WholeTensor(const atoms::DatasetInfo& atom,
                                    const Shape& shape, DType dtype,
                                    const std::string& name) const;
  /// A flat float32 tensor of `length` elements holding the windows of
  /// state kind `kind` (zeros elsewhere and where a param lacks the atom);
  /// a window's member indexes `members` (param indices).
  reshape::TargetTensor FlatTensor(const std::string& kind,
                                   const std::vector<size_t>& members,
                                   const std::vector<Window>& windows,
                                   int64_t length,
                                   const std::string& name) const;
  /// The lp weights of a param (its `param` atom when it has the training
  /// dtype, else its master converted); buffers / frozen: as stored.
  const atoms::DatasetInfo& WeightAtom(const TParam& p, DType* dtype) const;
  /// The optimizer step of the param's group as the source kept it (a 0-d
  /// tensor from its `step` atom, an int), nullptr if none.
  pickle::Value* StepNode(FileBuild& f, const TParam& p,
                          const std::string& where);
  /// FP16_Optimizer's loss-scale entry `name` (dynamic_loss_scale,
  /// cur_scale, cur_iter, last_overflow_iter, scale_factor, scale_window):
  /// the source's own, else its loss_scaler's attribute, else DeepSpeed's
  /// fp16 default (dynamic, 2^16, window 1000, factor 2).
  pickle::Value* LossScaleField(FileBuild& f, const std::string& name);
  // Stage 0 bf16 without a pipeline as FP16_UnfusedOptimizer (DeepSpeed
  // >= 0.17.6, or a source trained so) rather than BF16_Optimizer.
  bool UnfusedBf16() const;
  /// ZeRO's loss_scaler object: the source's, else a (Dynamic)LossScaler
  /// made of an FP16_Optimizer source's fields, else a static 1.0.
  pickle::Value* LossScalerNode(FileBuild& f);
  /// A copy of blob `key` in f's graph; nullptr if the content has none.
  pickle::Value* ImportBlob(FileBuild& f, const std::string& key);
  pickle::Value* DsVersion(FileBuild& f);
  pickle::Value* DsConfig(FileBuild& f);
  static void AppendOrReplace(pickle::Arena& a, pickle::Value* dict,
                              const std::string& key, pickle::Value* v);

  /// Mixture of experts (writer_moe.cc), after AssignGroups: the target's
  /// expert-parallel size (--ep) and, per expert group, the params of each
  /// ep rank in its flat order; the local name of every expert param on
  /// the rank holding it. Throws UsageError for an --ep not dividing --dp
  /// or an expert count, a stage other than 1 or 2 (or 0 with fp32), or a
  /// universal folder (`native` false); FormatError for a record that does
  /// not fit the params.
  void PlaceExperts(bool native);
  /// Group g's params on dp rank `rank` (an expert group: its ep rank's).
  const std::vector<size_t>& RankMembers(size_t g, int64_t rank) const;
  /// The name param i has in its rank's module (experts: local index).
  const std::string& RankName(size_t i) const;
  bool IsExpert(size_t i) const { return expert_of_.count(i) > 0; }
  bool IsExpertGroup(size_t g) const { return expert_members_.count(g) > 0; }

  /// ZeRO-3 sub-groups (stage3.py): walking each group's params, a
  /// sub-group closes when its partitions reach sub_group_size_ or at the
  /// group's last param.
  std::vector<std::vector<size_t>> SubGroups() const;
  /// The numels of params (indices into params_).
  std::vector<int64_t> Numels(const std::vector<size_t>& members) const;

  struct ModelStatesOptions {
    int64_t rank = 0;                    // ZeRO-3 file's dp rank
    pickle::Value* optimizer = nullptr;  // torch optimizer (ZeRO 0 fp32)
    bool universal_folder = false;
  };
  /// The model-states dict (mp_rank_00 / ZeRO-3 zero_pp_rank_D).
  pickle::Value* ModelStates(FileBuild& f, const ModelStatesOptions& o);
  /// Its `module`: the lp weights by module key (aliases: the same node;
  /// ZeRO-3: empty placeholders, buffers real).
  pickle::Value* ModuleDict(FileBuild& f,
                            const std::map<std::string, const TParam*>& by_name,
                            const std::map<std::string, std::string>& alias_of);
  /// Its `frozen_param_fragments`: stage 2 whole, stage 3 dp rank `rank`'s
  /// partition, None at stages 0 and 1.
  pickle::Value* FrozenFragments(FileBuild& f, int64_t rank);

  const universal::UniversalInput& input_;
  formats::TargetOptions options_;
  formats::BlobCache blobs_;

  std::optional<DeepSpeedExtras> meta_;  // the source's "deepspeed" record
  DType lp_ = DType::kFloat32;
  int stage_ = 0;
  Wrapper wrapper_ = Wrapper::kZero;
  bool fp16_unfused_ = false;  // kFp16: FP16_UnfusedOptimizer (fp16 or bf16)
  int64_t W_ = 1;
  int64_t tp_ = 1;       // target tensor-parallel size
  int64_t tp_rank_ = 0;  // the TP rank whose files are being built
  std::optional<layouts::Layout> layout_;
  layouts::Variables vars_;
  int64_t padded_vocab_ = 0;  // of the target TP size, 0 if no vocab rule
  bool pipeline_ = false;     // Megatron-DeepSpeed PipelineModule (layer files)
  int64_t pp_ = 1;
  int64_t pp_rank_ = 0;  // the stage whose files are being built
  std::map<std::string, int64_t> tied_layers_;  // "tied_modules.embed" -> 1
  std::string tag_;
  std::filesystem::path tag_dir_;            // relative to the output folder
  std::vector<TParam> params_;               // canonical order
  std::vector<std::vector<size_t>> groups_;  // trainable, per group
  std::vector<std::string> state_kinds_;     // besides fp32 and step
  std::vector<std::string> module_keys_;     // incl. aliases
  std::string step_kind_ = "none";
  /// ZeRO-3 sub-group size: the source's ds_config zero_optimization.
  /// sub_group_size, else DeepSpeed's default 1e9.
  int64_t sub_group_size_ = 1'000'000'000;
  std::shared_ptr<const torchfile::TorchFile> group_file_;
  /// The source's pickled groups, else those made from the optimizer
  /// attribute (in json_groups_; group_file_ null).
  const pickle::Value* group_templates_ = nullptr;
  pickle::Arena json_groups_;
  std::set<std::string> notes_;
  // Mixture of experts (PlaceExperts).
  std::optional<DeepSpeedMoe> moe_;
  int64_t ep_ = 1;
  std::map<size_t, std::pair<int64_t, int64_t>> expert_of_;  // i -> (L, G)
  std::map<size_t, std::string> local_name_;                 // i -> name
  std::map<size_t, std::vector<std::vector<size_t>>> expert_members_;
};

}  // namespace ucp::deepspeed::internal
