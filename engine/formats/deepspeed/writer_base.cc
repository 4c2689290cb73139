#include "engine/formats/deepspeed/writer_base.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/common/train_state.h"
#include "engine/formats/placed_target.h"
#include "engine/reshape/slot_plan.h"
#include "layouts/placement.h"

namespace ucp::deepspeed::internal {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

namespace {

const char* kDefaultModelKeys[] = {"module",
                                   "buffer_names",
                                   "optimizer",
                                   "param_shapes",
                                   "frozen_param_shapes",
                                   "shared_params",
                                   "frozen_param_fragments",
                                   "lr_scheduler",
                                   "data_sampler",
                                   "random_ltd",
                                   "sparse_tensor_module_names",
                                   "skipped_steps",
                                   "global_steps",
                                   "global_samples",
                                   "dp_world_size",
                                   "mp_world_size",
                                   "ds_config",
                                   "ds_version"};

}  // namespace

void WriterBase::AppendOrReplace(pickle::Arena& a, Value* dict,
                                 const std::string& key, Value* v) {
  for (auto& [k, old] : dict->entries) {
    if (k != nullptr && k->kind == Kind::kStr && k->s == key) {
      old = v;
      return;
    }
  }
  formats::AppendEntry(a, dict, key, v);
}

void WriterBase::Prepare(bool tensor_parallel) {
  ReadTopology(tensor_parallel);
  ChooseOptimizer();
  ChooseTag();
  const std::map<std::string, size_t> index = CollectParams();
  AssignGroups(index);
  PlaceExperts(/*native=*/tensor_parallel);
  const bool any_state = CollectStateKinds();
  OrderModuleKeys();
  ReadSubGroupSize();
  MakeGroupTemplates(any_state);
}

void WriterBase::ReadTopology(bool tensor_parallel) {
  const layouts::Topology& t = options_.topology;
  if (t.vpp != 1) {
    throw UsageError(
        "DeepSpeed targets have no virtual pipeline: pass --vpp 1");
  }
  W_ = t.dp;
  tp_ = t.tp;
  pp_ = t.pp;
  meta_ = ReadDeepSpeedExtras(input_.model(), input_.path());
  if (t.ep != 1 && !(meta_ && meta_->moe)) {
    throw UsageError("--ep ", t.ep,
                     ": the model has no DeepSpeed mixture-of-experts layers "
                     "(deepspeed.moe), so DeepSpeed's files have no expert "
                     "parallelism for it");
  }
  const DeepSpeedModelParallel* mp =
      meta_ && meta_->model_parallel ? &*meta_->model_parallel : nullptr;
  if (mp != nullptr) {
    pipeline_ = mp->pipeline;
    if (mp->tied_layers) tied_layers_ = *mp->tied_layers;
    if (!tensor_parallel) {
      throw UsageError(input_.path().string(),
                       ": the source is a Megatron-DeepSpeed checkpoint with "
                       "tensor parallelism; this format is written without "
                       "it (use --format deepspeed)");
    }
    if (!mp->layout_yaml) {
      throw UsageError(input_.path().string(),
                       ": the universal content lacks the layout of its "
                       "Megatron-DeepSpeed source (made by an older ucp: "
                       "convert from the checkpoint again)");
    }
    // The target facts every layout-placed writer starts from (layout,
    // resolved variables, validated topology): formats::PlaceParams, on the
    // layout and variables of the Megatron-DeepSpeed record.
    layouts::Variables given;
    if (mp->variables)
      for (const auto& [k, x] : *mp->variables) given.Set(k, x);
    std::vector<layouts::ParamShape> shapes;
    for (const atoms::StoredParam& p : input_.params())
      shapes.push_back({p.info.fqn, p.info.shape});
    // The layout places the dense TP / PP / DP; DeepSpeed's own experts
    // (deepspeed.moe) are not the layout's.
    formats::PlaceRequest request;
    request.topology.tp = tp_;
    request.topology.pp = pp_;
    request.topology.dp = W_;
    // Vocabulary rows stored beyond vocab_size are the source's padding kept
    // as real rows (PlaceOnTp): placed as padding again.
    request.true_vocab_size = given.Find("vocab_size");
    request.vocab_size_known = false;
    formats::PlacedTarget placed = formats::PlaceParams(
        layouts::Layout::ParseStored(*mp->layout_yaml, input_.path()),
        std::move(given), shapes, request);
    layout_ = std::move(placed.layout);
    vars_ = std::move(placed.vars);
  } else if (tp_ != 1 || pp_ != 1) {
    throw UsageError(
        "--tp ", tp_, " --pp ", pp_,
        ": a DeepSpeed target is model-parallel only for a Megatron-DeepSpeed "
        "source (whose layout places the params); pass --tp 1 --pp 1");
  }
}

void WriterBase::ChooseOptimizer() {
  const universal::Model& model = input_.model();
  // Training dtype.
  std::string lp = meta_ ? meta_->lp_dtype : std::string();
  if (lp.empty() && model.training && model.training->dtype)
    lp = *model.training->dtype;
  if (!lp.empty()) {
    if (auto d = DTypeFromName(lp)) lp_ = *d;
  } else {
    for (const atoms::StoredParam& p : input_.params()) {
      if (p.info.kind == atoms::ParamKind::kParam) {
        lp_ = p.info.dtype;
        break;
      }
    }
  }
  // Stage and optimizer wrapper.
  if (const std::optional<int64_t> z = options_.values.Int(kZeroStageOption)) {
    stage_ = static_cast<int>(*z);
  } else if (meta_) {
    stage_ = static_cast<int>(meta_->stage);
  } else {
    throw UsageError(
        "the universal content was not made from a DeepSpeed "
        "checkpoint: pass --zero-stage 0-3");
  }
  if (stage_ < 0 || stage_ > 3) {
    throw UsageError("--zero-stage ", stage_, ": DeepSpeed has stages 0-3");
  }
  if (stage_ >= 1) {
    wrapper_ = Wrapper::kZero;
  } else if (lp_ == DType::kBFloat16 && !pipeline_ && UnfusedBf16()) {
    // DeepSpeed >= 0.17.6 trains bf16 at stage 0 without a pipeline with
    // FP16_UnfusedOptimizer (its PR 7515; BF16_Optimizer is for pipelines
    // there), and loads nothing else there.
    wrapper_ = Wrapper::kFp16;
    fp16_unfused_ = true;
  } else if (lp_ == DType::kBFloat16) {
    wrapper_ = Wrapper::kBf16;
  } else if (lp_ == DType::kFloat32) {
    wrapper_ = Wrapper::kTorch;
  } else if (lp_ == DType::kFloat16) {
    wrapper_ = Wrapper::kFp16;
    fp16_unfused_ = meta_ && meta_->wrapper == "fp16_unfused";
  } else {
    throw UsageError("ZeRO stage 0 with ", DTypeName(lp_),
                     " training: DeepSpeed trains in fp32, fp16 or bf16");
  }
  if (const std::optional<std::string> o =
          options_.values.String(kFp16OptimizerOption)) {
    if (*o != "fused" && *o != "unfused") {
      throw UsageError("--", kFp16OptimizerOption, " ", *o,
                       ": fused (FP16_Optimizer) or unfused "
                       "(FP16_UnfusedOptimizer)");
    }
    if (wrapper_ != Wrapper::kFp16 || lp_ != DType::kFloat16) {
      throw UsageError("--", kFp16OptimizerOption,
                       ": only for a ZeRO stage 0 fp16 target");
    }
    fp16_unfused_ = *o == "unfused";
  }
  if (!pipeline_ && pp_ != 1) {
    throw UsageError("--pp ", pp_,
                     ": the source has no pipeline (Megatron-DeepSpeed "
                     "GPTModel): pass --pp 1");
  }
  const bool bf16_pipe = pipeline_ && stage_ == 0 && wrapper_ == Wrapper::kBf16;
  const bool fp16 = stage_ == 0 && wrapper_ == Wrapper::kFp16;
  if (layout_ && stage_ != 1 && stage_ != 2 && !bf16_pipe && !fp16) {
    throw UsageError("--zero-stage ", stage_,
                     ": Megatron-DeepSpeed targets are written for ZeRO "
                     "stage 1 or 2 (or 0 with bf16 and a pipeline: "
                     "BF16_Optimizer; or 0 with fp16: FP16_Optimizer)");
  }
}

void WriterBase::ChooseTag() {
  const universal::Model& model = input_.model();
  tag_ = options_.values.String(kTagOption).value_or("");
  if (tag_.empty() && meta_) tag_ = meta_->tag;
  if (tag_.empty()) tag_ = StrCat("global_step", model.iteration);
  if (tag_.find('/') != std::string::npos || tag_ == "." || tag_ == "..")
    throw UsageError("--tag ", tag_, ": not a folder name");
  tag_dir_ = tag_;
}

std::map<std::string, size_t> WriterBase::CollectParams() {
  std::map<std::string, size_t> index;
  for (const atoms::StoredParam& sp : input_.params()) {
    TParam p;
    p.name = sp.info.fqn;
    p.shape = sp.info.shape;
    p.numel = NumElements(p.shape);
    p.dtype = sp.info.dtype;
    p.group = std::max<int64_t>(sp.info.group, 0);
    p.frozen = sp.info.frozen;
    p.buffer = sp.info.kind == atoms::ParamKind::kBuffer;
    if (meta_) p.aliases = sp.info.tied_copies;
    if (!p.buffer && !p.frozen && input_.FindAtom(p.name, "fp32") == nullptr &&
        input_.FindAtom(p.name, "param") == nullptr) {
      throw FormatError("universal input ", input_.path().string(), " > param ",
                        p.name, ": no master weights ('fp32' atom)");
    }
    if (layout_) PlaceOnTp(p);
    index[p.name] = params_.size();
    params_.push_back(std::move(p));
  }
  if (layout_) {
    // The model fits the TP size (heads, groups, divisible dims): checked
    // by PlaceParams (ReadTopology) before any param is cut.
    for (TParam& p : params_) {
      if (p.rule == nullptr) continue;
      p.shape = layouts::ShardFor(*p.rule, p.full, tp_, 0, p.padded, p.pad_rows)
                    .local_shape;
      p.numel = NumElements(p.shape);
    }
    if (pipeline_) PartitionStages();
  }
  return index;
}

void WriterBase::AssignGroups(const std::map<std::string, size_t>& index) {
  int64_t ngroups = 0;
  for (const TParam& p : params_)
    if (!p.buffer && !p.frozen) ngroups = std::max(ngroups, p.group + 1);
  groups_.assign(static_cast<size_t>(std::max<int64_t>(ngroups, 1)), {});
  bool used_meta = false;
  if (meta_ && meta_->groups) {
    const std::vector<std::vector<std::string>>& g = *meta_->groups;
    std::vector<std::vector<size_t>> from(g.size());
    size_t count = 0;
    bool ok = true;
    for (size_t k = 0; k < g.size() && ok; ++k) {
      for (const std::string& n : g[k]) {
        auto it = index.find(n);
        if (it == index.end()) {
          ok = false;
          break;
        }
        from[k].push_back(it->second);
        ++count;
      }
    }
    size_t trainable = 0;
    for (const TParam& p : params_) trainable += !p.buffer && !p.frozen;
    if (ok && count == trainable) {
      groups_ = std::move(from);
      for (size_t k = 0; k < groups_.size(); ++k)
        for (size_t i : groups_[k]) params_[i].group = static_cast<int64_t>(k);
      used_meta = true;
    }
  }
  if (!used_meta) {
    for (size_t i = 0; i < params_.size(); ++i)
      if (!params_[i].buffer && !params_[i].frozen)
        groups_[static_cast<size_t>(params_[i].group)].push_back(i);
  }
}

bool WriterBase::CollectStateKinds() {
  std::set<std::string> kinds;
  bool any_state = false;
  for (const atoms::DatasetInfo& d : input_.datasets()) {
    if (d.kind != atoms::DatasetKind::kAtom) continue;
    if (d.state_kind == "fp32" || d.state_kind == "param") continue;
    if (d.state_kind == "step") {
      if (step_kind_ == "none") step_kind_ = "tensor";
      continue;
    }
    kinds.insert(d.state_kind);
    any_state = true;
  }
  for (const char* k : {"exp_avg", "exp_avg_sq"}) {
    if (kinds.erase(k)) state_kinds_.push_back(k);
  }
  state_kinds_.insert(state_kinds_.end(), kinds.begin(), kinds.end());
  if (meta_ && meta_->step_kind) step_kind_ = *meta_->step_kind;
  if (!any_state && !options_.no_optimizer) {
    notes_.insert(
        "the universal content holds no optimizer state (Adam "
        "moments): the optimizer files hold zero moments (ZeRO 0: no "
        "per-param state, as a fresh Adam holds it)");
    state_kinds_ = {"exp_avg", "exp_avg_sq"};
  }
  return any_state;
}

void WriterBase::OrderModuleKeys() {
  if (meta_ && meta_->module_keys) {
    std::set<std::string> known;
    for (const TParam& p : params_) {
      known.insert(p.name);
      known.insert(p.aliases.begin(), p.aliases.end());
    }
    bool ok = true;
    for (const std::string& k : *meta_->module_keys) {
      if (!known.count(k)) ok = false;
      if (ok) module_keys_.push_back(k);
    }
    if (!ok) module_keys_.clear();
  }
  if (module_keys_.empty()) {
    for (const TParam& p : params_) {
      module_keys_.push_back(p.name);
      for (const std::string& a : p.aliases) module_keys_.push_back(a);
    }
  }
}

void WriterBase::ReadSubGroupSize() {
  for (const char* key : {"top_level/ds_config", "optim_top/ds_config"}) {
    std::shared_ptr<const torchfile::TorchFile> b = blobs_.Find(key);
    const Value* cfg = b != nullptr ? b->root() : nullptr;
    const Value* zero = cfg != nullptr && cfg->IsDictLike()
                            ? cfg->Get("zero_optimization")
                            : nullptr;
    const Value* sgs = zero != nullptr && zero->IsDictLike()
                           ? zero->Get("sub_group_size")
                           : nullptr;
    std::optional<double> v = sgs != nullptr ? sgs->AsFloat() : std::nullopt;
    if (v && *v >= 1) {
      sub_group_size_ = static_cast<int64_t>(*v);
      break;
    }
  }
}

void WriterBase::MakeGroupTemplates(bool any_state) {
  group_file_ = blobs_.Find("optimizer/param_groups");
  if (group_file_ != nullptr) {
    const Value* list = group_file_->root();
    if (list != nullptr && list->kind == Kind::kList) group_templates_ = list;
  }
  if (group_templates_ == nullptr && !options_.no_optimizer) {
    // No pickled groups (a MindSpore or DCP-less source): the groups the
    // optimizer attribute keeps, with torch Adam's defaults for what the
    // source does not record (torch's load_state_dict takes them whole).
    std::vector<pickle::Value*> made;
    if (any_state) {
      for (const universal::ParamGroup& g :
           formats::AdamGroups(input_.model(), notes_))
        made.push_back(formats::GroupHyperparamsDict(g, json_groups_));
    } else if (!input_.model().optimizer.groups) {
      // No optimizer at all (a model-only source: a Hugging Face folder):
      // groups of torch Adam's defaults, each said in a note. Groups without
      // them load, but torch's optimizer then fails at its first step
      // (KeyError 'betas': load_state_dict takes the saved groups whole).
      for (size_t g = 0; g < std::max<size_t>(groups_.size(), 1); ++g) {
        universal::ParamGroup group;
        formats::CompleteAdamGroup(group, formats::kAdamHyperparams, notes_);
        made.push_back(formats::GroupHyperparamsDict(group, json_groups_));
      }
    }
    if (std::any_of(made.begin(), made.end(),
                    [](const pickle::Value* v) { return v != nullptr; })) {
      for (pickle::Value*& v : made)
        if (v == nullptr) v = json_groups_.Dict();
      group_templates_ = json_groups_.List(std::move(made));
    } else {
      notes_.insert(
          "no optimizer param groups in the universal content: "
          "wrote groups without hyper-parameters");
    }
  }
}

reshape::TargetTensor WriterBase::WholeTensor(const atoms::DatasetInfo& atom,
                                              const Shape& shape, DType dtype,
                                              const std::string& name) const {
  reshape::TargetTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = shape;
  reshape::CopyOp op;
  op.src = input_.Tensor(atom);
  op.src.shape = shape;  // flat universal-folder atoms view as the param
  op.src_box = Box::Whole(shape);
  op.dst_box = op.src_box;
  t.ops.push_back(std::move(op));
  return t;
}

std::vector<int64_t> WriterBase::Numels(
    const std::vector<size_t>& members) const {
  std::vector<int64_t> out;
  for (size_t i : members) out.push_back(params_[i].numel);
  return out;
}

reshape::TargetTensor WriterBase::FlatTensor(const std::string& kind,
                                             const std::vector<size_t>& members,
                                             const std::vector<Window>& windows,
                                             int64_t length,
                                             const std::string& name) const {
  reshape::TargetTensor t;
  t.name = name;
  t.dtype = DType::kFloat32;
  t.shape = {length};
  for (const Window& w : windows) {
    const TParam& p = params_[members[w.member]];
    const atoms::DatasetInfo* atom = input_.FindAtom(p.name, kind);
    if (atom == nullptr && kind == "fp32")
      atom = input_.FindAtom(p.name, "param");
    if (atom == nullptr) continue;  // zeros (never stepped)
    reshape::Slot slot;
    slot.local_shape = p.shape;
    slot.pieces = Pieces(p, *atom, kind);
    slot.begin = w.begin;
    slot.end = std::min(w.end, w.begin + (length - w.dst));
    slot.dst_offset = w.dst;
    for (reshape::CopyOp& op : reshape::PlanSlot(slot))
      t.ops.push_back(std::move(op));
  }
  return t;
}

const atoms::DatasetInfo& WriterBase::WeightAtom(const TParam& p,
                                                 DType* dtype) const {
  const atoms::DatasetInfo* param = input_.FindAtom(p.name, "param");
  const atoms::DatasetInfo* fp32 = input_.FindAtom(p.name, "fp32");
  if (p.buffer || p.frozen) {
    const atoms::DatasetInfo* d = param != nullptr ? param : fp32;
    if (d == nullptr) {
      throw FormatError("universal input ", input_.path().string(), " > param ",
                        p.name, ": no tensor");
    }
    *dtype = d->dtype;
    return *d;
  }
  *dtype = wrapper_ == Wrapper::kTorch ? DType::kFloat32 : lp_;
  if (param != nullptr && param->dtype == *dtype) return *param;
  if (fp32 != nullptr) return *fp32;
  if (param != nullptr) return *param;
  throw FormatError("universal input ", input_.path().string(), " > param ",
                    p.name, ": no weights");
}

bool WriterBase::UnfusedBf16() const {
  if (meta_ && meta_->wrapper == "fp16_unfused")
    return true;  // the source was trained so
  const universal::SourceInfo& source = input_.model().source;
  if (source.framework != "deepspeed" || !source.framework_version)
    return false;
  // "major.minor.patch[...]" >= 0.17.6
  int64_t part[3] = {0, 0, 0};
  const std::string& text = *source.framework_version;
  size_t i = 0;
  for (int k = 0; k < 3 && i < text.size(); ++k) {
    while (i < text.size() && text[i] >= '0' && text[i] <= '9')
      part[k] = part[k] * 10 + (text[i++] - '0');
    if (i < text.size() && text[i] == '.') ++i;
  }
  return std::make_tuple(part[0], part[1], part[2]) >=
         std::make_tuple(int64_t{0}, int64_t{17}, int64_t{6});
}

Value* WriterBase::LossScaleField(FileBuild& f, const std::string& name) {
  pickle::Arena& a = f.arena();
  if (Value* v = ImportBlob(f, "optim/" + name)) return v;
  // The attribute alone, not a copy of the whole scaler per field.
  if (std::shared_ptr<const torchfile::TorchFile> b =
          blobs_.Find("optim/loss_scaler")) {
    const Value* ls = b->root();
    if (ls != nullptr && ls->state != nullptr && ls->state->IsDictLike()) {
      const std::string attr = name == "dynamic_loss_scale" ? "dynamic" : name;
      if (const Value* v = ls->state->Get(attr)) return f.Import(b, v);
    }
  }
  // bf16 scales no loss (DeepSpeed's LossScaleConfig: static, 1.0).
  const bool bf16 = lp_ == DType::kBFloat16;
  if (name == "dynamic_loss_scale") return a.Bool(!bf16);
  if (name == "cur_scale") return a.Float(bf16 ? 1.0 : 65536.0);
  if (name == "cur_iter") return a.Int(input_.model().iteration);
  if (name == "last_overflow_iter") return a.Int(-1);
  if (name == "scale_factor") return a.Float(2.0);
  if (name == "scale_window") return a.Int(1000);
  throw InternalError("no loss-scale field ", name);
}

Value* WriterBase::LossScalerNode(FileBuild& f) {
  pickle::Arena& a = f.arena();
  if (Value* v = ImportBlob(f, "optim/loss_scaler")) return v;
  if (blobs_.Find("optim/cur_scale") == nullptr) return DefaultLossScaler(a);
  // From FP16_Optimizer's fields (loss_scaler.py's attributes).
  const Value* dyn = LossScaleField(f, "dynamic_loss_scale");
  const bool dynamic = dyn->kind == Kind::kBool && dyn->b;
  Value* o = a.Object(pickle::ObjectOp::kNewObj,
                      a.Global("deepspeed.runtime.fp16.loss_scaler",
                               dynamic ? "DynamicLossScaler" : "LossScaler"),
                      a.Tuple({}));
  std::vector<std::pair<Value*, Value*>> st;
  st.emplace_back(a.Str("cur_scale"), LossScaleField(f, "cur_scale"));
  st.emplace_back(a.Str("dynamic"), a.Bool(dynamic));
  if (dynamic) {
    for (const char* k :
         {"cur_iter", "last_overflow_iter", "scale_factor", "scale_window"})
      st.emplace_back(a.Str(k), LossScaleField(f, k));
    st.emplace_back(a.Str("min_scale"), a.Int(1));
    st.emplace_back(a.Str("delayed_shift"), a.Int(1));
    st.emplace_back(a.Str("cur_hysteresis"), a.Int(1));
    st.emplace_back(a.Str("consecutive_hysteresis"), a.Bool(false));
    st.emplace_back(a.Str("raise_error_at_min_scale"), a.Bool(true));
    st.emplace_back(a.Str("dtype"), a.Global("torch", "float16"));
  }
  o->state = a.Dict(std::move(st));
  return o;
}

Value* WriterBase::StepNode(FileBuild& f, const TParam& p,
                            const std::string& where) {
  pickle::Arena& a = f.arena();
  if (const atoms::DatasetInfo* d = input_.FindAtom(p.name, "step")) {
    reshape::TargetTensor t;
    t.name = where + " > step";
    t.dtype = d->dtype;
    reshape::CopyOp op;
    op.src = input_.Tensor(*d);
    t.ops.push_back(std::move(op));
    return f.AddTensor(std::move(t));
  }
  int64_t step = formats::OptimizerStep(input_.model());
  if (meta_ && meta_->step_value) {
    if (step_kind_ == "float") return a.Float(*meta_->step_value);
    step = static_cast<int64_t>(*meta_->step_value);
  }
  if (step_kind_ == "int") return a.Int(step);
  if (step_kind_ == "float") return a.Float(static_cast<double>(step));
  if (step_kind_ == "tensor" || step_kind_ == "none") {
    // torch.optim.Adam keeps a 0-d float step; the content has none for
    // this param (e.g. a Megatron FusedAdam source): the iteration.
    if (step_kind_ == "none")
      notes_.insert(
          StrCat("the optimizer step was not stored per param: "
                 "set to the iteration ",
                 step));
    const float v = static_cast<float>(step);
    std::vector<std::byte> bytes(4);
    std::memcpy(bytes.data(), &v, 4);
    return f.AddConstant(DType::kFloat32, {}, std::move(bytes));
  }
  return nullptr;
}

std::vector<std::vector<size_t>> WriterBase::SubGroups() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& g : groups_) {
    std::vector<size_t> cur;
    int64_t sum = 0;
    for (size_t k = 0; k < g.size(); ++k) {
      cur.push_back(g[k]);
      sum += Zero3Piece(params_[g[k]].numel, W_);
      if (sum >= sub_group_size_ || k + 1 == g.size()) {
        out.push_back(std::move(cur));
        cur.clear();
        sum = 0;
      }
    }
  }
  return out;
}

Value* WriterBase::ImportBlob(FileBuild& f, const std::string& key) {
  std::shared_ptr<const torchfile::TorchFile> b = blobs_.Find(key);
  if (b == nullptr) return nullptr;
  return f.Import(b, b->root());
}

Value* WriterBase::DsVersion(FileBuild& f) {
  for (const char* k :
       {"optim/ds_version", "optim_top/ds_version", "top_level/ds_version"})
    if (Value* v = ImportBlob(f, k)) return v;
  return f.arena().Str("0.14.5");
}

Value* WriterBase::DsConfig(FileBuild& f) {
  for (const char* k : {"optim_top/ds_config", "top_level/ds_config"}) {
    Value* v = ImportBlob(f, k);
    if (v == nullptr) continue;
    // The saved config says which stage wrote the files: the target's.
    Value* zero = v->IsDictLike() ? v->Get("zero_optimization") : nullptr;
    if (zero != nullptr && zero->IsDictLike()) {
      if (Value* st = zero->Get("stage");
          st != nullptr && st->kind == Kind::kInt)
        AppendOrReplace(f.arena(), zero, "stage", f.arena().Int(stage_));
    }
    return v;
  }
  return f.arena().Dict();
}

Value* WriterBase::ModelStates(FileBuild& f, const ModelStatesOptions& o) {
  pickle::Arena& a = f.arena();
  std::vector<std::string> keys;
  if (meta_ && meta_->model_keys) keys = *meta_->model_keys;
  if (keys.empty())
    keys.assign(std::begin(kDefaultModelKeys), std::end(kDefaultModelKeys));
  // Client state blobs not in the list go last.
  for (const atoms::DatasetInfo& d : input_.datasets()) {
    if (d.kind == atoms::DatasetKind::kOpaque &&
        d.fqn.rfind("top_level/", 0) == 0) {
      const std::string k = d.fqn.substr(10);
      if (std::find(keys.begin(), keys.end(), k) == keys.end())
        keys.push_back(k);
    }
  }
  std::map<std::string, const TParam*> by_name;
  std::map<std::string, std::string> alias_of;
  for (const TParam& p : params_) {
    by_name[p.name] = &p;
    for (const std::string& al : p.aliases) alias_of[al] = p.name;
  }
  // ZeRO 0 without bf16 records neither param_shapes nor shared_params.
  const bool torch = wrapper_ == Wrapper::kTorch || wrapper_ == Wrapper::kFp16;
  Value* root = a.Dict();
  for (const std::string& key : keys) {
    Value* v = nullptr;
    if (key == "module" && pipeline_) {
      v = a.None();  // PipelineEngine: the weights are in the layer files
    } else if (key == "module") {
      v = ModuleDict(f, by_name, alias_of);
    } else if (key == "buffer_names") {
      std::vector<Value*> names;
      for (const std::string& k : module_keys_)
        if (by_name.count(k) && by_name[k]->buffer) names.push_back(a.Str(k));
      v = a.List(std::move(names));
    } else if (key == "optimizer") {
      v = o.optimizer != nullptr ? o.optimizer : a.None();
    } else if (key == "param_shapes") {
      if (torch && !o.universal_folder) {
        v = a.None();
      } else {
        std::vector<Value*> list;
        std::vector<std::vector<size_t>> groups = groups_;
        // ZeRO-3 files list sub-groups; a universal folder lists the
        // optimizer's param groups (its optimizer_state.pt names those).
        if (stage_ == 3 && !o.universal_folder) groups = SubGroups();
        for (size_t k = 0; k < groups.size(); ++k) {
          // Experts: rank 0's, under their local names.
          const std::vector<size_t>& g =
              stage_ == 3 ? groups[k] : RankMembers(k, 0);
          Value* d = formats::NewOrderedDict(a);
          for (size_t i : g)
            formats::AppendEntry(a, d, RankName(i),
                                 TorchSize(a, params_[i].shape));
          list.push_back(d);
        }
        v = a.List(std::move(list));
      }
    } else if (key == "frozen_param_shapes") {
      if (stage_ >= 2) {
        v = formats::NewOrderedDict(a);
        for (const TParam& p : params_)
          if (p.frozen)
            formats::AppendEntry(a, v, p.name, TorchSize(a, p.shape));
      } else {
        v = a.None();
      }
    } else if (key == "shared_params") {
      if (torch) {
        v = a.None();
      } else {
        v = a.Dict();
        if (o.rank == 0)
          for (const auto& [al, src] : alias_of)
            formats::AppendEntry(a, v, al, a.Str(src));
      }
    } else if (key == "frozen_param_fragments") {
      v = FrozenFragments(f, o.rank);
    } else if (key == "dp_world_size") {
      v = a.Int(W_);
    } else if (key == "mp_world_size") {
      v = a.Int(tp_ * pp_);
    } else if (key == "ds_config") {
      v = DsConfig(f);
    } else if (key == "ds_version") {
      v = DsVersion(f);
    } else if (Value* b = ImportBlob(f, "top_level/" + key)) {
      v = b;
    } else if (key == "global_steps") {
      v = a.Int(input_.model().iteration);
    } else if (key == "global_samples") {
      v = a.Int(std::max<int64_t>(input_.model().consumed_samples, 0));
    } else if (key == "skipped_steps") {
      v = a.Int(0);
    } else if (key == "sparse_tensor_module_names") {
      v = a.Set({});
    } else if (key == "lr_scheduler" || key == "data_sampler" ||
               key == "random_ltd") {
      v = a.None();
    } else {
      continue;
    }
    formats::AppendEntry(a, root, key, v);
  }
  if (layout_) PatchTpArgs(a, root);
  return root;
}

Value* WriterBase::ModuleDict(
    FileBuild& f, const std::map<std::string, const TParam*>& by_name,
    const std::map<std::string, std::string>& alias_of) {
  pickle::Arena& a = f.arena();
  const std::string fw = StrCat("rank file ", f.path().string());
  Value* m = formats::NewOrderedDict(a);
  std::map<std::string, Value*> nodes;
  for (const std::string& k : module_keys_) {
    if (auto al = alias_of.find(k); al != alias_of.end()) {
      auto n = nodes.find(al->second);
      if (n != nodes.end()) formats::AppendEntry(a, m, k, n->second);
      continue;
    }
    const TParam& p = *by_name.at(k);
    if (IsExpert(static_cast<size_t>(&p - params_.data())))
      continue;  // in the expert files
    Value* node;
    if (stage_ == 3 && !p.buffer) {
      node = f.AddConstant(lp_, {0}, {});  // a released partition
    } else {
      DType dt;
      const atoms::DatasetInfo& atom = WeightAtom(p, &dt);
      node = f.AddTensor(
          LocalTensor(p, atom, atom.state_kind, dt, fw + " > module > " + k));
    }
    nodes[k] = node;
    formats::AppendEntry(a, m, k, node);
  }
  return m;
}

Value* WriterBase::FrozenFragments(FileBuild& f, int64_t rank) {
  pickle::Arena& a = f.arena();
  const std::string fw = StrCat("rank file ", f.path().string());
  if (stage_ != 2 && stage_ != 3) return a.None();
  Value* v = formats::NewOrderedDict(a);
  for (const TParam& p : params_) {
    if (!p.frozen) continue;
    DType dt;
    const atoms::DatasetInfo& atom = WeightAtom(p, &dt);
    if (stage_ == 2) {
      formats::AppendEntry(
          a, v, p.name,
          f.AddTensor(LocalTensor(p, atom, atom.state_kind, dt,
                                  fw + " > frozen > " + p.name)));
      continue;
    }
    const int64_t part = Zero3Piece(p.numel, W_);
    reshape::TargetTensor t;
    t.name = fw + " > frozen > " + p.name;
    t.dtype = dt;
    t.shape = {part};
    reshape::Slot slot;
    slot.local_shape = p.shape;
    slot.pieces = Pieces(p, atom, atom.state_kind);
    slot.begin = std::min(p.numel, rank * part);
    slot.end = std::min(p.numel, (rank + 1) * part);
    t.ops = reshape::PlanSlot(slot);
    formats::AppendEntry(a, v, p.name, f.AddTensor(std::move(t)));
  }
  return v;
}

void WriterBase::PlaceOnTp(TParam& p) {
  p.full = p.shape;
  try {
    p.rule = &layout_->Match(p.name, vars_);
    int64_t pad_rows = 0;
    if (std::optional<int64_t> pd =
            layouts::PaddedDimSize(*p.rule, vars_, tp_)) {
      const size_t dim = static_cast<size_t>(p.rule->tp.dim);
      p.padded = *pd;
      const atoms::DatasetInfo* pad = input_.FindPadAtom(p.name, "fp32");
      const std::optional<int64_t> rows = vars_.Find("vocab_size");
      if (rows && *rows < p.full.at(dim) && pad == nullptr) {
        p.stored_pad = p.full[dim] - *rows;  // rows kept as real rows
        p.full[dim] = *rows;
      }
      if (p.padded < p.full[dim]) {
        throw LayoutError("the padded vocabulary (", p.padded, " rows for tp ",
                          tp_, ") is smaller than the stored ", p.full[dim],
                          " rows");
      }
      pad_rows = p.stored_pad;
      if (pad != nullptr && dim < pad->shape.size()) pad_rows = pad->shape[dim];
      padded_vocab_ = p.padded;
    }
    p.pad_rows = pad_rows;
  } catch (Error& e) {
    e.AddContext("param ", p.name);
    throw;
  }
}

std::vector<reshape::SlotPiece> WriterBase::Pieces(
    const TParam& p, const atoms::DatasetInfo& atom,
    const std::string& kind) const {
  std::vector<reshape::SlotPiece> out;
  if (p.rule == nullptr) {
    reshape::SlotPiece piece;
    piece.local = Box::Whole(p.shape);
    piece.src = input_.Tensor(atom);
    piece.src.shape = p.shape;  // flat universal-folder atoms view as the param
    piece.src_box = piece.local;
    out.push_back(std::move(piece));
    return out;
  }
  const size_t dim = static_cast<size_t>(p.rule->tp.dim);
  const atoms::DatasetInfo* pad = input_.FindPadAtom(p.name, kind);
  if (pad == nullptr && kind == "param")
    pad = input_.FindPadAtom(p.name, "fp32");
  const layouts::LocalShard shard =
      layouts::ShardFor(*p.rule, p.full, tp_, tp_rank_, p.padded, p.pad_rows);
  for (const layouts::Piece& piece : shard.pieces) {
    reshape::SlotPiece sp;
    sp.local = piece.local;
    sp.src = input_.Tensor(atom);
    sp.src_box = piece.global;
    if (piece.region == layouts::Region::kPad) {
      if (p.stored_pad > 0) {
        sp.src_box.offset[dim] += p.full[dim];
      } else if (pad != nullptr) {
        sp.src = input_.Tensor(*pad);
      } else {
        continue;  // zeros
      }
    }
    out.push_back(std::move(sp));
  }
  return out;
}

reshape::TargetTensor WriterBase::LocalTensor(const TParam& p,
                                              const atoms::DatasetInfo& atom,
                                              const std::string& kind,
                                              DType dtype,
                                              const std::string& name) const {
  if (p.rule == nullptr) return WholeTensor(atom, p.shape, dtype, name);
  reshape::TargetTensor t;
  t.name = name;
  t.dtype = dtype;
  t.shape = p.shape;
  reshape::Slot slot;
  slot.local_shape = p.shape;
  slot.pieces = Pieces(p, atom, kind);
  t.ops = reshape::PlanSlot(slot);
  return t;
}

std::string WriterBase::MpRank() const {
  char buf[32];
  std::snprintf(buf, sizeof buf, "mp_rank_%02lld",
                static_cast<long long>(pp_rank_ * tp_ + tp_rank_));
  return buf;
}

void WriterBase::PartitionStages() {
  std::set<int64_t> layers;  // transformer layers: those with attention
  for (const TParam& p : params_)
    if (p.name.find(".self_attention.") != std::string::npos)
      if (auto idx = LayerIndex(p.name)) layers.insert(*idx);
  const std::vector<int64_t> order(layers.begin(), layers.end());
  if (order.empty() || static_cast<int64_t>(order.size()) % pp_ != 0) {
    throw UsageError("--pp ", pp_, ": the model has ", order.size(),
                     " transformer layers; DeepSpeed spreads them evenly "
                     "('type:transformer'), so pp must divide them");
  }
  for (TParam& p : params_) {
    p.stages.clear();
    if (p.name.starts_with("tied_modules.")) {
      p.stages.push_back(0);
      if (pp_ > 1) p.stages.push_back(pp_ - 1);
      continue;
    }
    const std::optional<int64_t> idx = LayerIndex(p.name);
    if (!idx) {
      throw FormatError("universal input ", input_.path().string(), " > param ",
                        p.name, ": not a pipeline layer name (<index>.<name>)");
    }
    p.stages.push_back(TransformerStage(order, pp_, *idx));
  }
}

std::pair<int64_t, std::string> WriterBase::LayerKey(const TParam& p) const {
  if (p.name.starts_with("tied_modules.")) {
    const size_t dot = p.name.find('.', 13);
    const std::string module = p.name.substr(0, dot);
    auto it = tied_layers_.find(module);
    if (dot == std::string::npos || it == tied_layers_.end()) {
      throw FormatError("universal input ", input_.path().string(), " > param ",
                        p.name,
                        ": the layer file of this tied module is unknown "
                        "(made by an older ucp: convert from the checkpoint "
                        "again)");
    }
    return {it->second, p.name.substr(dot + 1)};
  }
  const size_t dot = p.name.find('.');
  return {*LayerIndex(p.name), p.name.substr(dot + 1)};
}

// The saved Megatron args and universal_checkpoint_info say the target's TP
// size and padded vocabulary (Megatron-DeepSpeed checks them on load, and
// readers size the vocabulary from them).
void WriterBase::PatchTpArgs(pickle::Arena& a, Value* root) const {
  auto set = [&](Value* dict, const char* key, int64_t v) {
    if (dict == nullptr || !dict->IsDictLike()) return;
    for (auto& [k, old] : dict->entries) {
      if (k != nullptr && k->kind == Kind::kStr && k->s == key) {
        old = a.Int(v);
        return;
      }
    }
  };
  Value* args = root->Get("args");
  Value* ns =
      args != nullptr && args->kind == Kind::kObject ? args->state : nullptr;
  set(ns, "tensor_model_parallel_size", tp_);
  set(ns, "pipeline_model_parallel_size", pp_);
  set(ns, "data_parallel_size", W_);
  set(ns, "world_size", tp_ * pp_ * W_);
  if (padded_vocab_ > 0) set(ns, "padded_vocab_size", padded_vocab_);
  Value* info = root->Get("universal_checkpoint_info");
  if (padded_vocab_ > 0) set(info, "padded_vocab_size", padded_vocab_);
  if (info != nullptr && info->IsDictLike() && tp_ > 1) AddTpPatterns(a, info);
}

// DeepSpeed's ds_to_universal merges TP shards by the pattern lists of
// universal_checkpoint_info (deepspeed/checkpoint/ds_to_universal.py,
// merge_tp_slices): slices of a TP-replicated param are one copy, of a
// row-parallel one concatenated on dim 1, of a two-sub-param one (SwiGLU) cut
// in halves first, all others concatenated on dim 0. Megatron-DeepSpeed
// writes the TP lists only at TP > 1, so a source saved at TP 1 has none: the
// lists it lacks are written here from the layout's placements, one exact
// name per param (re.match, the dots escaped).
void WriterBase::AddTpPatterns(pickle::Arena& a, Value* info) const {
  std::vector<Value*> replicated, row, halves;
  for (const TParam& p : params_) {
    // Only params of the optimizer (ds_to_universal asserts that every
    // pattern matches one).
    if (p.rule == nullptr || p.buffer || p.frozen) continue;
    std::string re;
    for (char c : p.name) {
      if (std::string_view(".^$*+?()[]{}|\\").find(c) != std::string::npos)
        re += '\\';
      re += c;
    }
    re += '$';
    const layouts::TpPlacement& tp = p.rule->tp;
    if (!tp.split) {
      replicated.push_back(a.Str(re));
    } else if (tp.vocab) {
      continue;  // the source's vocabulary patterns (Megatron writes them
                 // at every TP size, with original_vocab_size)
    } else if (tp.dim == 1 && tp.segments == 1) {
      row.push_back(a.Str(re));
    } else if (tp.dim == 0 && tp.segments == 2) {
      halves.push_back(a.Str(re));
    }
  }
  auto add = [&](const char* key, std::vector<Value*> names) {
    if (names.empty() || info->Get(key) != nullptr) return;
    formats::AppendEntry(a, info, key, a.List(std::move(names)));
  };
  add("tp_replicated_parameter_patterns", std::move(replicated));
  add("parameter_with_row_parallelism_patterns", std::move(row));
  add("parameter_with_2_sub_params_cat_dim_0", std::move(halves));
}

}  // namespace ucp::deepspeed::internal
