// Writing native DeepSpeed rank files for any DP size and ZeRO stage from
// universal content (deepspeed.h; what is written: deepspeed_format.h, the
// flat layouts exactly as DeepSpeed's optimizers build them at that size).

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/graph.h"
#include "engine/formats/deepspeed/writer_base.h"
#include "engine/reshape/slot_plan.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using namespace internal;
using pickle::Kind;
using pickle::Value;

// The native files as a plan: one unit per file, in the order they are
// committed (per stage and TP rank the model states then the optimizer
// files; the pipeline's layer files; `latest` last).
class NativeWriter : public WriterBase {
 public:
  NativeWriter(const universal::UniversalInput& input,
               const formats::TargetOptions& options);
  size_t size() const { return files_.size(); }
  std::unique_ptr<formats::PlannedFile> PlanFile(size_t i);
  formats::TargetSummary Summary() const;
  const std::string& tag() const { return tag_; }

 private:
  enum class FileKind {
    kModelStates,
    kOptim,
    kLayer,
    kExpert,
    kExpertOptim,
    kLatest
  };
  struct FileSpec {
    FileKind kind;
    int64_t pp = 0, tp = 0;
    int64_t rank = 0;   // dp rank (ZeRO-3 model states, optimizer files);
                        // kExpert: the global expert
    int64_t layer = 0;  // layer file index; kExpert: the MoE layer
  };
  // The files of stage pp_rank_ and TP rank tp_rank_ (groups_ narrowed to
  // the stage's params for a pipeline).
  void Select(int64_t pp, int64_t tp);
  std::unique_ptr<FileBuild> ModelStatesFile(int64_t r);
  std::unique_ptr<FileBuild> LayerFile(int64_t idx);
  std::unique_ptr<FileBuild> ExpertFile(int64_t layer, int64_t expert);

  std::vector<FileSpec> files_;
  std::vector<std::vector<size_t>> all_groups_;
  std::map<int64_t, std::vector<size_t>> by_layer_;

  Value* OptimFile(FileBuild& f, int64_t rank);
  /// The torch optimizer's state_dict (ZeRO 0 fp32) as dp rank `rank`
  /// holds it (its ep rank's experts).
  Value* TorchOptimizer(FileBuild& f, int64_t rank = 0);
  Value* Fp16Optimizer(FileBuild& f);
  Value* GroupDict(FileBuild& f, size_t g, Value* params);
  /// An expert group's `name` as the target's ("ep_size_<ep>"); `group`.
  Value* ExpertGroupName(FileBuild& f, size_t g, Value* group);
  /// The inner optimizer's state of one flat group: the step and each
  /// state kind over `windows` of `length` elements.
  Value* FlatState(FileBuild& f, const std::vector<size_t>& members,
                   const std::vector<Window>& windows, int64_t length,
                   const std::string& where);
};

Value* NativeWriter::FlatState(FileBuild& f, const std::vector<size_t>& members,
                               const std::vector<Window>& windows,
                               int64_t length, const std::string& where) {
  pickle::Arena& a = f.arena();
  Value* st = a.Dict();
  if (!members.empty()) {
    if (Value* step = StepNode(f, params_[members[0]], where))
      formats::AppendEntry(a, st, "step", step);
  }
  for (const std::string& k : state_kinds_)
    formats::AppendEntry(a, st, k,
                         f.AddTensor(FlatTensor(k, members, windows, length,
                                                where + " > " + k)));
  return st;
}

Value* NativeWriter::ExpertGroupName(FileBuild& f, size_t g, Value* group) {
  // DeepSpeed names an expert group by its expert-parallel size.
  const Value* name = group->Get("name");
  if (IsExpertGroup(g) && name != nullptr && name->kind == Kind::kStr &&
      name->s.starts_with("ep_size_"))
    AppendOrReplace(f.arena(), group, "name",
                    f.arena().Str(StrCat("ep_size_", ep_)));
  return group;
}

Value* NativeWriter::GroupDict(FileBuild& f, size_t g, Value* params) {
  pickle::Arena& a = f.arena();
  Value* d = nullptr;
  if (group_templates_ != nullptr && g < group_templates_->items.size()) {
    d = f.Import(group_file_, group_templates_->items[g]);
  } else {
    d = a.Dict();
  }
  AppendOrReplace(a, d, "params", params);
  return d;
}

Value* NativeWriter::TorchOptimizer(FileBuild& f, int64_t rank) {
  pickle::Arena& a = f.arena();
  Value* state = a.Dict();
  std::vector<Value*> groups;
  int64_t id = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    std::vector<Value*> ids;
    for (size_t i : RankMembers(g, rank)) {
      const TParam& p = params_[i];
      Value* st = a.Dict();
      const std::string where = StrCat("rank file ", f.path().string(),
                                       " > optimizer > state[", id, "]");
      // A param without any moment (never stepped, or a model-only source)
      // has no state, as in a fresh torch optimizer: a `step` alone would
      // make torch's Adam fail at its first step (KeyError 'exp_avg').
      const bool stateless =
          !state_kinds_.empty() &&
          std::none_of(state_kinds_.begin(), state_kinds_.end(),
                       [&](const std::string& k) {
                         return input_.FindAtom(p.name, k) != nullptr;
                       });
      if (!stateless) {
        if (Value* step = StepNode(f, p, where))
          formats::AppendEntry(a, st, "step", step);
      }
      for (const std::string& k : state_kinds_) {
        const atoms::DatasetInfo* d = input_.FindAtom(p.name, k);
        if (d == nullptr) continue;
        formats::AppendEntry(a, st, k,
                             f.AddTensor(LocalTensor(p, *d, k, DType::kFloat32,
                                                     where + " > " + k)));
      }
      if (!st->entries.empty()) state->entries.emplace_back(a.Int(id), st);
      ids.push_back(a.Int(id++));
    }
    groups.push_back(
        ExpertGroupName(f, g, GroupDict(f, g, a.List(std::move(ids)))));
  }
  Value* opt = a.Dict();
  formats::AppendEntry(a, opt, "state", state);
  formats::AppendEntry(a, opt, "param_groups", a.List(std::move(groups)));
  return opt;
}

// ZeRO 0 with fp16 (deepspeed_format.h): FP16_Optimizer.state_dict(), or
// FP16_UnfusedOptimizer's when the source had one.
Value* NativeWriter::Fp16Optimizer(FileBuild& f) {
  pickle::Arena& a = f.arena();
  const std::string fw =
      StrCat("rank file ", f.path().string(), " > optimizer");
  Value* d = a.Dict();
  auto put = [&](const std::string& key, Value* v) {
    formats::AppendEntry(a, d, key, v);
  };
  Value* dynamic = LossScaleField(f, "dynamic_loss_scale");
  put("dynamic_loss_scale", dynamic);
  for (const char* k : {"cur_scale", "cur_iter"}) put(k, LossScaleField(f, k));
  if (dynamic->kind == Kind::kBool && dynamic->b) {
    for (const char* k : {"last_overflow_iter", "scale_factor", "scale_window"})
      put(k, LossScaleField(f, k));
  }
  if (fp16_unfused_) {
    // The inner torch optimizer over one fp32 master per param.
    put("optimizer_state_dict", TorchOptimizer(f));
    std::vector<Value*> groups;
    for (size_t g = 0; g < groups_.size(); ++g) {
      std::vector<Value*> masters;
      for (size_t i : groups_[g]) {
        const TParam& p = params_[i];
        const atoms::DatasetInfo* fp32 = input_.FindAtom(p.name, "fp32");
        if (fp32 == nullptr) {
          throw FormatError("universal input ", input_.path().string(),
                            " > param ", p.name, ": no 'fp32' atom");
        }
        masters.push_back(
            f.AddTensor(LocalTensor(p, *fp32, "fp32", DType::kFloat32,
                                    StrCat(fw, " > fp32_groups > ", p.name))));
      }
      groups.push_back(a.List(std::move(masters)));
    }
    put("fp32_groups", a.List(std::move(groups)));
    return d;
  }
  Value* state = a.Dict();
  std::vector<Value*> groups, flats;
  for (size_t g = 0; g < groups_.size(); ++g) {
    int64_t length = 0;
    const std::vector<Window> windows =
        ConcatWindows(Numels(groups_[g]), &length);
    const std::string gw = StrCat(fw, " > group ", g);
    flats.push_back(f.AddTensor(
        FlatTensor("fp32", groups_[g], windows, length, gw + " > fp32")));
    state->entries.emplace_back(a.Int(static_cast<int64_t>(g)),
                                FlatState(f, groups_[g], windows, length, gw));
    groups.push_back(GroupDict(f, g, a.List({a.Int(static_cast<int64_t>(g))})));
  }
  Value* osd = a.Dict();
  formats::AppendEntry(a, osd, "state", state);
  formats::AppendEntry(a, osd, "param_groups", a.List(std::move(groups)));
  put("optimizer_state_dict", osd);
  put("fp32_groups_flat", a.List(std::move(flats)));
  Value* clip = ImportBlob(f, "optim/clip_grad");
  put("clip_grad", clip != nullptr ? clip : a.Float(0.0));
  return d;
}

Value* NativeWriter::OptimFile(FileBuild& f, int64_t r) {
  pickle::Arena& a = f.arena();
  const std::string fw = StrCat("rank file ", f.path().string());
  Value* inner = a.Dict();
  auto put = [&](const std::string& key, Value* v) {
    formats::AppendEntry(a, inner, key, v);
  };
  auto blob_or = [&](const std::string& key, Value* fallback) -> Value* {
    if (Value* v = ImportBlob(f, "optim/" + key)) return v;
    return fallback;
  };
  if (stage_ == 3) {
    const std::vector<std::vector<size_t>> subs = SubGroups();
    Value* state = a.Dict();
    std::vector<Value*> flats;
    std::vector<std::vector<Value*>> group_members(groups_.size());
    for (size_t s = 0; s < subs.size(); ++s) {
      int64_t total = 0;
      const std::vector<Window> windows =
          Zero3Windows(Numels(subs[s]), W_, r, &total);
      const std::string sw = StrCat(fw, " > sub-group ", s);
      flats.push_back(f.AddTensor(
          FlatTensor("fp32", subs[s], windows, total, sw + " > fp32")));
      state->entries.emplace_back(a.Int(static_cast<int64_t>(s)),
                                  FlatState(f, subs[s], windows, total, sw));
      group_members[static_cast<size_t>(params_[subs[s][0]].group)].push_back(
          a.Int(static_cast<int64_t>(s)));
    }
    std::vector<Value*> groups;
    for (size_t g = 0; g < groups_.size(); ++g)
      groups.push_back(GroupDict(f, g, a.List(group_members[g])));
    Value* osd = a.Dict();
    formats::AppendEntry(a, osd, "state", state);
    formats::AppendEntry(a, osd, "param_groups", a.List(std::move(groups)));
    put("zero_stage", ZeroStage(a, 3));
    put("loss_scaler", LossScalerNode(f));
    put("dynamic_loss_scale", blob_or("dynamic_loss_scale", a.Bool(false)));
    put("overflow", blob_or("overflow", a.Bool(false)));
    put("partition_count", a.Int(W_));
    put("optimizer_state_dict", osd);
    put("fp32_flat_groups", a.List(std::move(flats)));
  } else {
    const bool bf16 = wrapper_ == Wrapper::kBf16;
    Value* state = a.Dict();
    std::vector<Value*> groups, fp32s, paddings, counts, mappings;
    for (size_t g = 0; g < groups_.size(); ++g) {
      // An expert group: this rank's ep rank's experts, partitioned over the
      // expert-data-parallel ranks (ep rank r % ep, edp rank r / ep).
      const bool expert = IsExpertGroup(g);
      const std::vector<size_t>& members = RankMembers(g, r);
      const int64_t Wg = expert ? W_ / ep_ : W_;
      const int64_t part = expert ? r / ep_ : r;
      const std::vector<int64_t> numels = Numels(members);
      const ZeroGroup layout = ZeroLayout(numels, Wg);
      const int64_t ps = layout.partition;
      const int64_t padding = layout.Padding(part, Wg, bf16);
      const std::vector<Window> windows = ZeroWindows(numels, layout, part);
      const std::string gw = StrCat(fw, " > group ", g);
      // ZeRO strips the padding from the fp32 partition, BF16 keeps it.
      const int64_t lean = bf16 ? ps : layout.Real(part);
      fp32s.push_back(f.AddTensor(
          FlatTensor("fp32", members, windows, lean, gw + " > fp32")));
      state->entries.emplace_back(a.Int(static_cast<int64_t>(g)),
                                  FlatState(f, members, windows, ps, gw));
      groups.push_back(ExpertGroupName(
          f, g, GroupDict(f, g, a.List({a.Int(static_cast<int64_t>(g))}))));
      paddings.push_back(a.Int(padding));
      counts.push_back(a.Int(Wg));
      Value* map = formats::NewOrderedDict(a);
      for (const Window& w : windows)
        formats::AppendEntry(a, map, RankName(members[w.member]),
                             FragmentAddress(a, w.end - w.begin, w.dst));
      mappings.push_back(map);
    }
    Value* base = a.Dict();
    formats::AppendEntry(a, base, "state", state);
    formats::AppendEntry(a, base, "param_groups", a.List(std::move(groups)));
    if (!bf16) {
      put("loss_scaler", LossScalerNode(f));
      put("dynamic_loss_scale", blob_or("dynamic_loss_scale", a.Bool(false)));
      put("overflow", blob_or("overflow", a.Bool(false)));
    }
    put("clip_grad", blob_or("clip_grad", a.Float(0.0)));
    put("base_optimizer_state", base);
    put("single_partition_of_fp32_groups", a.List(std::move(fp32s)));
    if (!bf16) put("zero_stage", ZeroStage(a, stage_));
    put("group_paddings", a.List(std::move(paddings)));
    put("partition_count", a.List(std::move(counts)));
    put("ds_version", DsVersion(f));
    put("param_slice_mappings", a.List(std::move(mappings)));
  }
  Value* root = a.Dict();
  formats::AppendEntry(a, root, "optimizer_state_dict", inner);
  formats::AppendEntry(a, root, "ds_config", DsConfig(f));
  formats::AppendEntry(a, root, "ds_version", DsVersion(f));
  return root;
}

NativeWriter::NativeWriter(const universal::UniversalInput& input,
                           const formats::TargetOptions& options)
    : WriterBase(input, options) {
  Prepare(/*tensor_parallel=*/true);
  all_groups_ = groups_;
  const bool optim_files = wrapper_ != Wrapper::kTorch &&
                           wrapper_ != Wrapper::kFp16 && !options_.no_optimizer;
  for (int64_t pp = 0; pp < pp_; ++pp) {
    for (int64_t tp = 0; tp < tp_; ++tp) {
      for (int64_t r = 0; r < (stage_ == 3 ? W_ : 1); ++r)
        files_.push_back({FileKind::kModelStates, pp, tp, r, 0});
      if (!optim_files) continue;
      for (int64_t r = 0; r < W_; ++r)
        files_.push_back({FileKind::kOptim, pp, tp, r, 0});
    }
  }
  if (moe_ && wrapper_ == Wrapper::kTorch && !options_.no_optimizer) {
    // ZeRO 0: each ep rank's torch optimizer (its experts' state).
    for (int64_t e = 0; e < ep_; ++e)
      files_.push_back({FileKind::kExpertOptim, 0, 0, e, 0});
  }
  if (moe_) {
    // Expert files: one per MoE layer and global expert, whatever the ep.
    for (size_t l = 0; l < moe_->num_experts.size(); ++l)
      for (int64_t g = 0; g < moe_->num_experts[l]; ++g)
        files_.push_back({FileKind::kExpert, 0, 0, g, static_cast<int64_t>(l)});
  }
  if (pipeline_) {
    // Layer files: one per layer index and TP rank, whatever the stages.
    for (size_t i = 0; i < params_.size(); ++i)
      by_layer_[LayerKey(params_[i]).first].push_back(i);
    for (int64_t tp = 0; tp < tp_; ++tp)
      for (const auto& [idx, members] : by_layer_)
        files_.push_back({FileKind::kLayer, 0, tp, 0, idx});
  }
  files_.push_back({FileKind::kLatest});
}

void NativeWriter::Select(int64_t pp, int64_t tp) {
  pp_rank_ = pp;
  tp_rank_ = tp;
  if (!pipeline_) return;
  // This stage's params, in the groups' order.
  for (size_t g = 0; g < groups_.size(); ++g) {
    groups_[g].clear();
    for (size_t i : all_groups_[g]) {
      const std::vector<int64_t>& st = params_[i].stages;
      if (std::find(st.begin(), st.end(), pp_rank_) != st.end())
        groups_[g].push_back(i);
    }
  }
}

std::unique_ptr<FileBuild> NativeWriter::ModelStatesFile(int64_t r) {
  const std::string name = stage_ == 3 ? StrCat("zero_pp_rank_", r, "_",
                                                MpRank(), "_model_states.pt")
                                       : StrCat(MpRank(), "_model_states.pt");
  auto f = std::make_unique<FileBuild>(tag_dir_ / name);
  ModelStatesOptions o;
  o.rank = r;
  // A MoE save of DeepSpeed < 0.16 has no `optimizer` in its model states
  // (the expp_rank files hold it).
  const bool listed = !moe_ || !meta_ || !meta_->model_keys ||
                      std::count(meta_->model_keys->begin(),
                                 meta_->model_keys->end(), "optimizer") > 0;
  if (wrapper_ == Wrapper::kTorch && !options_.no_optimizer && listed)
    o.optimizer = TorchOptimizer(*f);
  if (wrapper_ == Wrapper::kFp16 && !options_.no_optimizer)
    o.optimizer = Fp16Optimizer(*f);
  f->SetRoot(ModelStates(*f, o));
  return f;
}

std::unique_ptr<FileBuild> NativeWriter::LayerFile(int64_t idx) {
  char name[96];
  std::snprintf(name, sizeof name, "layer_%02lld-model_%02lld-model_states.pt",
                static_cast<long long>(idx), static_cast<long long>(tp_rank_));
  auto f = std::make_unique<FileBuild>(tag_dir_ / name);
  pickle::Arena& a = f->arena();
  Value* sd = formats::NewOrderedDict(a);
  for (size_t i : by_layer_.at(idx)) {
    const TParam& p = params_[i];
    DType dt;
    const atoms::DatasetInfo& atom = WeightAtom(p, &dt);
    const std::string key = LayerKey(p).second;
    formats::AppendEntry(
        a, sd, key,
        f->AddTensor(
            LocalTensor(p, atom, atom.state_kind, dt,
                        StrCat("rank file ", f->path().string(), " > ", key))));
  }
  f->SetRoot(sd);
  return f;
}

// layer_{L}_expert_{G}_mp_rank_00_model_states.pt: the expert's params by
// their global names, in the training dtype (DeepSpeed's
// _save_moe_checkpoint).
std::unique_ptr<FileBuild> NativeWriter::ExpertFile(int64_t layer,
                                                    int64_t expert) {
  auto f = std::make_unique<FileBuild>(
      tag_dir_ / StrCat("layer_", layer, "_expert_", expert, "_", MpRank(),
                        "_model_states.pt"));
  pickle::Arena& a = f->arena();
  Value* sd = a.Dict();
  for (const auto& [i, at] : expert_of_) {
    if (at != std::pair{layer, expert}) continue;
    const TParam& p = params_[i];
    DType dt;
    const atoms::DatasetInfo& atom = WeightAtom(p, &dt);
    formats::AppendEntry(
        a, sd, p.name,
        f->AddTensor(LocalTensor(
            p, atom, atom.state_kind, dt,
            StrCat("rank file ", f->path().string(), " > ", p.name))));
  }
  if (sd->entries.empty()) {
    throw FormatError("universal input ", input_.path().string(),
                      ": no params of expert ", expert, " of MoE layer ",
                      layer);
  }
  f->SetRoot(sd);
  return f;
}

std::unique_ptr<formats::PlannedFile> NativeWriter::PlanFile(size_t i) {
  const FileSpec& spec = files_.at(i);
  if (spec.kind == FileKind::kLatest)
    return formats::TextFile(kLatestFile, tag_);
  Select(spec.pp, spec.tp);
  std::unique_ptr<FileBuild> f;
  const fs::path name =
      spec.kind == FileKind::kOptim
          ? tag_dir_ / StrCat(lp_ == DType::kBFloat16 ? "bf16_" : "",
                              "zero_pp_rank_", spec.rank, "_", MpRank(),
                              "_optim_states.pt")
          : fs::path();
  try {
    switch (spec.kind) {
      case FileKind::kModelStates:
        f = ModelStatesFile(spec.rank);
        break;
      case FileKind::kOptim:
        f = std::make_unique<FileBuild>(name);
        f->SetRoot(OptimFile(*f, spec.rank));
        break;
      case FileKind::kLayer:
        f = LayerFile(spec.layer);
        break;
      case FileKind::kExpert:
        f = ExpertFile(spec.layer, spec.rank);
        break;
      case FileKind::kExpertOptim: {
        f = std::make_unique<FileBuild>(
            tag_dir_ /
            StrCat("expp_rank_", spec.rank, "_", MpRank(), "_optim_states.pt"));
        Value* root = f->arena().Dict();
        formats::AppendEntry(f->arena(), root, "optimizer",
                             TorchOptimizer(*f, spec.rank));
        f->SetRoot(root);
        break;
      }
      case FileKind::kLatest:
        break;
    }
  } catch (Error& e) {
    if (f != nullptr || !name.empty())
      e.AddContext("rank file ", (f ? f->path() : name).string());
    throw;
  }
  return f;
}

formats::TargetSummary NativeWriter::Summary() const {
  formats::TargetSummary summary;
  summary.notes.assign(notes_.begin(), notes_.end());
  summary.resume_hint =
      StrCat("DeepSpeed: engine.load_checkpoint(\"<output>\") with ",
             W_ * tp_ * pp_, " ranks",
             tp_ * pp_ > 1 ? StrCat(" (tensor parallel ", tp_, ", pipeline ",
                                    pp_, ", data parallel ", W_, ")")
                           : std::string(),
             ", zero_optimization.stage ", stage_,
             lp_ == DType::kBFloat16  ? ", bf16 enabled"
             : lp_ == DType::kFloat16 ? ", fp16 enabled"
                                      : "");
  summary.details["tag"] = tag_;
  summary.details["zero_stage"] = stage_;
  return summary;
}

class NativePlan : public formats::TargetPlan {
 public:
  NativePlan(const universal::UniversalInput& input,
             const formats::TargetOptions& options)
      : w_(input, options) {}
  size_t units() const override { return w_.size(); }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t i) const override {
    std::vector<std::unique_ptr<formats::PlannedFile>> out;
    out.push_back(w_.PlanFile(i));
    return out;
  }
  fs::path checkpoint_dir() const override { return w_.tag(); }
  formats::TargetSummary Summary() const override { return w_.Summary(); }
  std::string label() const override {
    return StrCat("writing rank files of ", w_.tag());
  }

 private:
  // Planning a file narrows the writer to its stage and TP rank.
  mutable NativeWriter w_;
};

}  // namespace

std::unique_ptr<formats::TargetPlan> PlanNative(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options) {
  return std::make_unique<NativePlan>(input, options);
}

}  // namespace ucp::deepspeed
