// Reading DeepSpeed rank files into a universal SourcePlan (deepspeed.h;
// formats and flat layouts: deepspeed_format.h): what every optimizer
// wrapping shares (the module, steps, frozen params, opaque entries, the
// root), the order of the steps (Planner::Run), and model-parallel
// checkpoints. Each wrapping's optimizer state is read in its own file:
// reader_torch.cc (ZeRO 0, torch optimizer), reader_fp16.cc (ZeRO 0,
// FP16_Optimizer), reader_zero.cc (ZeRO 1-3, BF16_Optimizer),
// universal_folder.cc (universal folders).

#include "engine/formats/deepspeed/reader.h"

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <tuple>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/source_table.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/flat_layout.h"
#include "engine/formats/deepspeed/model_parallel.h"
#include "engine/formats/deepspeed/pickled.h"
#include "engine/json/json.h"
#include "engine/reshape/slot_plan.h"
#include "engine/universal/sources.h"

namespace ucp::deepspeed {
namespace internal {
namespace {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;
using torchfile::TensorInfo;
using torchfile::TorchFile;

// Keys of the model-states dict that the driver rebuilds; the others are
// kept verbatim (/opaque/top_level/<key>).
const std::set<std::string> kModelRebuilt = {"module",
                                             "buffer_names",
                                             "optimizer",
                                             "param_shapes",
                                             "frozen_param_shapes",
                                             "shared_params",
                                             "frozen_param_fragments"};
// Keys of optimizer_state_dict holding tensors or layout (rebuilt).
const std::set<std::string> kOptimRebuilt = {
    "base_optimizer_state", "single_partition_of_fp32_groups",
    "group_paddings",       "partition_count",
    "param_slice_mappings", "optimizer_state_dict",
    "fp32_flat_groups",     "fp32_groups_flat",
    "fp32_groups"};

}  // namespace

const TensorInfo& Planner::TensorAt(const FilePtr& f, const Value* v,
                                    const std::string& what) {
  const TensorInfo* t = v != nullptr ? f->FindTensor(v) : nullptr;
  if (t == nullptr) throw FormatError(what, " is not a tensor");
  return *t;
}

reshape::SourceTensor Planner::Tensor(const FilePtr& f, const TensorInfo& t,
                                      const std::string& what) {
  return sources_.Tensor(f, t, what);
}

universal::AtomPlan& Planner::Atom(const Param& p, const std::string& kind,
                                   DType dtype, bool scalar) {
  auto key = std::make_pair(p.name, kind);
  auto it = atoms_.find(key);
  if (it != atoms_.end()) {
    universal::AtomPlan& a = plan_.atoms[it->second];
    if (a.dtype != dtype) {
      throw FormatError("param ", p.name, " > ", kind, ": ", DTypeName(dtype),
                        " here but ", DTypeName(a.dtype), " in another file");
    }
    return a;
  }
  universal::AtomPlan a;
  a.param = p.name;
  a.state_kind = kind;
  a.dtype = dtype;
  if (!scalar) a.shape = p.shape;
  atoms_.emplace(key, plan_.atoms.size());
  plan_.atoms.push_back(std::move(a));
  return plan_.atoms.back();
}

void Planner::AddFlat(universal::AtomPlan& atom, const Param& p,
                      const reshape::SourceTensor& flat, int64_t src_elem,
                      int64_t begin, int64_t end, const std::string& where) {
  if (begin >= end) return;
  const int64_t numel = NumElements(flat.shape);
  if (src_elem < 0 || src_elem + (end - begin) > numel) {
    throw FormatError(where, ": elements [", src_elem, ", ",
                      src_elem + (end - begin), ") of param ", p.name,
                      " lie outside the flat tensor of ", numel, " elements");
  }
  int64_t at = src_elem;
  for (const Box& box : reshape::FlatRangeBoxes(p.shape, begin, end)) {
    universal::Fragment f;
    f.src = reshape::FlatView(flat, at, box.size, where);
    f.src_box = Box::Whole(box.size);
    f.atom_box = box;
    f.where = where;
    at += box.NumElements();
    atom.fragments.push_back(std::move(f));
  }
}

void Planner::Whole(universal::AtomPlan& atom, const reshape::SourceTensor& src,
                    const std::string& where) {
  if (src.shape != atom.shape) {
    throw FormatError(where, ": shape ", ShapeString(src.shape), ", expected ",
                      ShapeString(atom.shape));
  }
  universal::Fragment f;
  f.src = src;
  f.src_box = Box::Whole(src.shape);
  f.atom_box = f.src_box;
  f.where = where;
  atom.fragments.push_back(std::move(f));
}

FilePtr Planner::Open(const fs::path& p) {
  // Discover opened the first model and optimizer files already.
  for (const FilePtr& known : {c_.first_model, c_.first_optim})
    if (known != nullptr && known->path() == p) return known;
  FilePtr& f = cache_[p];
  if (f == nullptr) f = std::make_shared<const TorchFile>(TorchFile::Open(p));
  return f;
}

void Planner::ReadModel() {
  for (const fs::path& p : c_.model_files) models_.push_back(Open(p));
  for (const fs::path& p : c_.optim_files) optims_.push_back(Open(p));
  model_ = models_[0]->root();
  ReadExperts();  // its errors name the expert files
  const std::string where0 = StrCat("rank file ", c_.model_files[0].string());
  try {
    if (!view_.pipeline) {
      const Value* module = Require(model_, "module");
      for (const std::string& k : Keys(module, "module")) {
        entries_.push_back(
            {k, models_[0], Get(module, k), StrCat(where0, " > module > ", k)});
      }
    } else {
      for (const LayerEntry& le : view_.layer_entries) {
        const FilePtr f = Open(le.file);
        entries_.push_back(
            {le.name, f, Get(f->root(), le.key),
             StrCat("rank file ", le.file.string(), " > ", le.key)});
      }
    }
    entries_.insert(entries_.end(), expert_entries_.begin(),
                    expert_entries_.end());
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (!entry_index_.emplace(entries_[i].name, i).second)
        throw FormatError("module entry ", entries_[i].name, " twice");
      module_keys_.push_back(entries_[i].name);
    }
    std::set<std::string> buffers;
    if (const Value* b = Get(model_, "buffer_names"); !IsNone(b)) {
      for (const Value* n : Items(b, "buffer_names"))
        buffers.insert(Str(n, "buffer name"));
    }
    if (const Value* sp = Get(model_, "shared_params"); !IsNone(sp)) {
      for (const std::string& k : Keys(sp, "shared_params"))
        shared_[k] = Str(Get(sp, k), "shared_params value");
    } else if (!view_.pipeline) {
      // ZeRO 0 without bf16 saves no shared_params: tied params are module
      // entries viewing the same storage the same way (the first name is
      // the param, as named_parameters() dedups).
      std::map<std::tuple<const torchfile::StorageInfo*, int64_t, Shape,
                          std::vector<int64_t>, DType>,
               std::string>
          seen;
      for (const Entry& e : entries_) {
        const TensorInfo* t = e.file->FindTensor(e.value);
        if (t == nullptr || buffers.count(e.name) || t->numel == 0) continue;
        auto [it, fresh] =
            seen.emplace(std::make_tuple(t->storage, t->storage_offset,
                                         t->shape, t->stride, t->dtype),
                         e.name);
        if (!fresh) shared_[e.name] = it->second;
      }
    }
    // The lp dtype: of the first floating module tensor that is a param.
    for (const Entry& e : entries_) {
      if (buffers.count(e.name)) continue;
      const TensorInfo* t = e.file->FindTensor(e.value);
      if (t != nullptr && IsFloatingPoint(t->dtype)) {
        lp_ = t->dtype;
        break;
      }
    }
    CollectTrainable(buffers);
    ExpandExpertGroups();
    CollectUntrained(buffers);
  } catch (Error& e) {
    AddContextOnce(e, where0);
    throw;
  }
}

void Planner::CollectTrainable(const std::set<std::string>& buffers) {
  // Trainable params: param_shapes (flat-buffer order, per group), or at
  // ZeRO 0 fp32 the module's params in order.
  const Value* shapes = Get(model_, "param_shapes");
  if (!IsNone(shapes)) {
    const auto& list = Items(shapes, "param_shapes");
    for (size_t g = 0; g < list.size(); ++g) {
      groups_.emplace_back();
      for (const std::string& n : Keys(list[g], "param_shapes group")) {
        Param p;
        p.name = n;
        p.shape =
            SizeOf(Get(list[g], n), StrCat("param_shapes[", g, "][", n, "]"));
        p.dtype = lp_;
        p.group = static_cast<int64_t>(g);
        groups_.back().push_back(n);
        index_[n] = params_.size();
        params_.push_back(std::move(p));
      }
    }
  } else if (!ShapesFromMappings()) {
    if (c_.wrapper != Wrapper::kTorch) {
      throw FormatError(
          "param_shapes is None but the checkpoint has "
          "optimizer files");
    }
    if (const Value* opt = Get(model_, "optimizer"); !IsNone(opt)) {
      if (Get(opt, "fp32_groups_flat") != nullptr) {
        fp16_ = Fp16::kFlat;
      } else if (Get(opt, "fp32_groups") != nullptr) {
        fp16_ = Fp16::kUnfused;
      }
    }
    groups_.emplace_back();
    for (const Entry& e : entries_) {
      const std::string& k = e.name;
      if (buffers.count(k) || shared_.count(k)) continue;
      const TensorInfo& t = TensorAt(e.file, e.value, e.where);
      Param p;
      p.name = k;
      p.shape = t.shape;
      p.dtype = t.dtype;
      p.group = 0;
      groups_.back().push_back(k);
      index_[k] = params_.size();
      params_.push_back(std::move(p));
    }
  }
}

void Planner::CollectUntrained(const std::set<std::string>& buffers) {
  // Frozen params (ZeRO >= 2 records them).
  if (const Value* fs = Get(model_, "frozen_param_shapes"); !IsNone(fs)) {
    for (const std::string& n : Keys(fs, "frozen_param_shapes")) {
      Param p;
      p.name = n;
      p.shape = SizeOf(Get(fs, n), StrCat("frozen_param_shapes[", n, "]"));
      p.dtype = lp_;
      p.frozen = true;
      index_[n] = params_.size();
      params_.push_back(std::move(p));
    }
  }
  // Buffers and module entries that are neither (frozen params at ZeRO
  // 0/1, which DeepSpeed does not record: kept as frozen params).
  for (const Entry& e : entries_) {
    const std::string& k = e.name;
    if (index_.count(k) || shared_.count(k)) continue;
    const TensorInfo* t = e.file->FindTensor(e.value);
    if (t == nullptr) {
      throw FormatError(e.where, " is not a tensor");
    }
    Param p;
    p.name = k;
    p.shape = t->shape;
    p.dtype = t->dtype;
    p.buffer = buffers.count(k) > 0;
    p.frozen = !p.buffer;
    if (c_.stage == 3 && !p.buffer) {
      throw FormatError("module[", k,
                        "] is neither a partitioned param nor a buffer");
    }
    index_[k] = params_.size();
    params_.push_back(std::move(p));
  }
  for (const auto& [alias, src] : shared_) {
    auto it = index_.find(src);
    if (it == index_.end()) {
      throw FormatError("shared_params: ", alias, " points to ", src,
                        ", which is not a param");
    }
    params_[it->second].aliases.push_back(alias);
  }
  // Canonical order: the module's order (aliases skipped), then the rest.
  std::map<std::string, int64_t> pos;
  for (size_t i = 0; i < module_keys_.size(); ++i)
    pos.emplace(module_keys_[i], static_cast<int64_t>(i));
  for (Param& p : params_) {
    auto it = pos.find(p.name);
    p.order = it != pos.end()
                  ? it->second
                  : static_cast<int64_t>(module_keys_.size() + index_[p.name]);
  }
}

void Planner::PlanModule() {
  // lp weights of params (stage 0-2, when not fp32), buffers, and stage 0/1
  // frozen params, from the module (rank 0's, or the stage's layer files).
  for (const Param& p : params_) {
    const Entry* e = FindEntry(p.name);
    const std::string where =
        e != nullptr ? e->where
                     : StrCat("rank file ", c_.model_files[0].string(),
                              " > module > ", p.name);
    try {
      const bool needed = p.buffer || (p.frozen && c_.stage < 2) ||
                          (!p.frozen && c_.stage != 3);
      if (!needed) continue;
      if (e == nullptr) {
        // A pipeline stage's copy of a tied module has no layer file.
        if (view_.pipeline && !p.buffer) continue;
        throw FormatError(where, ": missing");
      }
      const TensorInfo& t = TensorAt(e->file, e->value, where);
      if (p.buffer || (p.frozen && c_.stage < 2)) {
        Whole(Atom(p, "param", t.dtype, false), Tensor(e->file, t, where),
              where);
      } else if (c_.wrapper == Wrapper::kTorch && fp16_ == Fp16::kNone) {
        // No separate master: the module holds the fp32 weights.
        Whole(Atom(p, "fp32", t.dtype, false), Tensor(e->file, t, where),
              where);
      } else if (t.dtype != DType::kFloat32) {
        Whole(Atom(p, "param", t.dtype, false), Tensor(e->file, t, where),
              where);
      }
    } catch (Error& e2) {
      e2.AddContext("param ", p.name);
      throw;
    }
  }
}

void Planner::PlanStep(const Param& p, const FilePtr& f, const Value* state,
                       const std::string& where) {
  const Value* step = Get(state, "step");
  if (step == nullptr) return;
  if (const TensorInfo* t = f->FindTensor(step)) {
    step_kind_ = "tensor";
    if (!t->shape.empty()) {
      throw FormatError(where, " > step: shape ", ShapeString(t->shape),
                        ", expected a scalar");
    }
    universal::AtomPlan& a = Atom(p, "step", t->dtype, true);
    Whole(a, Tensor(f, *t, where + " > step"), where + " > step");
  } else if (step->kind == Kind::kInt && step->big.empty()) {
    step_kind_ = "int";  // FusedAdam / DeepSpeedCPUAdam: a Python int
    step_value_ = static_cast<double>(step->i);
  } else if (step->kind == Kind::kFloat) {
    step_kind_ = "float";
    step_value_ = step->f;
  }
}

void Planner::PlanFrozen() {
  if (c_.stage < 2) return;
  const int64_t W = c_.stage == 3 ? c_.dp : 1;
  for (int64_t r = 0; r < W; ++r) {
    const FilePtr& f = models_[static_cast<size_t>(r)];
    const std::string where0 = StrCat("rank file ", c_.model_files[r].string(),
                                      " > frozen_param_fragments");
    const Value* frags = Get(f->root(), "frozen_param_fragments");
    for (const Param& p : params_) {
      if (!p.frozen) continue;
      const std::string where = where0 + " > " + p.name;
      try {
        const Value* v = Get(frags, p.name);
        if (v == nullptr) throw FormatError(where, ": missing");
        const TensorInfo& t = TensorAt(f, v, where);
        universal::AtomPlan& a = Atom(p, "param", t.dtype, false);
        if (c_.stage == 2) {
          Whole(a, Tensor(f, t, where), where);
        } else {
          const int64_t num = NumElements(p.shape);
          const int64_t part = Zero3Piece(num, W);
          const reshape::SourceTensor src =
              reshape::FlatView(Tensor(f, t, where), 0, {t.numel}, where);
          AddFlat(a, p, src, 0, std::min(num, r * part),
                  std::min(num, (r + 1) * part), where);
        }
      } catch (Error& e) {
        AddContextOnce(e, "param ", p.name);
        throw;
      }
    }
  }
}

void Planner::PlanOpaque() {
  auto add = [&](std::string key, const TorchFile* f, const Value* v) {
    plan_.opaque.push_back({std::move(key), formats::SaveBlob(f, v)});
  };
  for (const auto& [k, v] : model_->entries) {
    if (k == nullptr || k->kind != Kind::kStr || kModelRebuilt.count(k->s))
      continue;
    add("top_level/" + k->s, models_[0].get(), v);
  }
  if (!c_.zero_dir.empty()) {
    for (const auto& [k, v] : zero_state_->root()->entries) {
      if (k == nullptr || k->kind != Kind::kStr || k->s == "param_groups" ||
          kOptimRebuilt.count(k->s))
        continue;
      add("optim/" + k->s, zero_state_.get(), v);
    }
  }
  if (fp16_ != Fp16::kNone) {
    // The loss scale and clip settings of FP16_Optimizer.
    for (const auto& [k, v] : Get(model_, "optimizer")->entries) {
      if (k == nullptr || k->kind != Kind::kStr || kOptimRebuilt.count(k->s))
        continue;
      add("optim/" + k->s, models_[0].get(), v);
    }
  }
  if (!optims_.empty()) {
    const Value* root = optims_[0]->root();
    for (const auto& [k, v] : root->entries) {
      if (k == nullptr || k->kind != Kind::kStr ||
          k->s == "optimizer_state_dict")
        continue;
      add("optim_top/" + k->s, optims_[0].get(), v);
    }
    const Value* osd = Get(root, "optimizer_state_dict");
    for (const auto& [k, v] : osd->entries) {
      if (k == nullptr || k->kind != Kind::kStr || kOptimRebuilt.count(k->s))
        continue;
      add("optim/" + k->s, optims_[0].get(), v);
    }
  }
  if (!group_dicts_.empty()) {
    pickle::Arena arena;
    std::vector<Value*> list;
    for (const Value* d : group_dicts_) {
      Value* copy = arena.Dict();
      for (const auto& [k, v] : d->entries) {
        if (k != nullptr && k->kind == Kind::kStr && k->s == "params") continue;
        copy->entries.emplace_back(const_cast<Value*>(k),
                                   const_cast<Value*>(v));
      }
      list.push_back(copy);
    }
    add("optimizer/param_groups", nullptr, arena.List(std::move(list)));
  }
}

void Planner::PlanRoot() {
  universal::Model& model = plan_.model;
  const Value* gs = Get(model_, "global_steps");
  model.iteration = gs != nullptr && gs->AsInt() ? *gs->AsInt() : 0;
  const Value* samples = Get(model_, "global_samples");
  model.consumed_samples =
      samples != nullptr && samples->AsInt() ? *samples->AsInt() : -1;
  universal::SourceInfo& src = model.source;
  src.framework = "deepspeed";
  src.driver = "deepspeed";
  const Value* ver = Get(model_, "ds_version");
  src.framework_version = ver != nullptr && ver->kind == Kind::kStr
                              ? ver->s
                              : std::string("unknown");
  src.tp = 1;
  src.pp = 1;
  src.vpp = 1;
  src.dp = c_.dp;
  src.ep = moe_ ? moe_->ep : 1;
  src.zero_stage = c_.stage;
  src.distributed_optimizer = false;
  src.dtype = std::string(DTypeName(lp_));
  src.other["tag"] = c_.tag;
  universal::OptimizerInfo& opt = model.optimizer;
  opt.type = "torch.optim";
  opt.groups.emplace();
  for (size_t g = 0; g < groups_.size(); ++g) {
    universal::ParamGroup& j = opt.groups->emplace_back();
    j.params = groups_[g];
    const Value* d = g < group_dicts_.size() ? group_dicts_[g] : nullptr;
    if (d != nullptr && d->IsDictLike())
      for (const auto& [k, v] : d->entries)
        if (k != nullptr && k->kind == Kind::kStr)
          formats::AddGroupHyperparam(k->s, v, j);
  }
  opt.state_kinds = std::vector<std::string>{"fp32"};
  for (const std::string& k : state_kinds_) opt.state_kinds->push_back(k);
  opt.step = model.iteration;

  universal::TrainingInfo& training =
      universal::NewTraining(model, std::string(DTypeName(lp_)));
  training.global_samples = model.consumed_samples;
  for (const Param& p : params_)
    if (p.frozen) training.frozen->push_back(p.name);
  for (const auto& [a, s] : shared_) (*training.shared)[a] = s;
  training.param_order =
      std::vector<std::string>(module_keys_.begin(), module_keys_.end());

  DeepSpeedExtras meta;
  meta.tag = c_.tag;
  meta.stage = c_.stage;
  meta.wrapper = fp16_ == Fp16::kFlat            ? "fp16"
                 : fp16_ == Fp16::kUnfused       ? "fp16_unfused"
                 : c_.wrapper == Wrapper::kTorch ? "torch"
                 : c_.wrapper == Wrapper::kBf16  ? "bf16"
                                                 : "zero";
  meta.bf16_prefix = c_.bf16_prefix;
  meta.groups = groups_;
  meta.module_keys = module_keys_;
  meta.model_keys = Keys(model_, "model states");
  meta.step_kind = step_kind_;
  meta.step_value = step_value_;
  if (sub_groups_ > 0) meta.zero3_sub_groups = sub_groups_;
  meta.lp_dtype = std::string(DTypeName(lp_));
  meta.moe = moe_;
  WriteDeepSpeedExtras(meta, model);
}

universal::SourcePlan Planner::Run() {
  ReadModel();
  if (!c_.zero_dir.empty()) {
    PlanModule();
    PlanZeroFolder();
  } else if (c_.wrapper == Wrapper::kTorch) {
    // ZeRO 0 without bf16: the optimizer says which module params are
    // trainable (the others are frozen) before the module is planned.
    if (moe_) {
      PlanTorchMoe();
    } else if (fp16_ != Fp16::kNone) {
      PlanFp16Optimizer();
    } else {
      PlanTorchOptimizer();
    }
    PlanModule();
  } else {
    PlanModule();
    if (c_.stage == 3) {
      PlanStage3();
      RegroupSubGroups();
    } else {
      PlanFlat();
    }
  }
  PlanFrozen();
  for (const Param& p : params_) {
    plan_.params.push_back(formats::ParamRow(
        {.fqn = p.name,
         .shape = p.shape,
         .dtype = p.dtype,
         .rule = p.buffer ? "buffer" : (p.frozen ? "frozen" : "dp"),
         .buffer = p.buffer,
         .group = p.group,
         .order = p.order,
         .frozen = p.frozen,
         .tied_copies = p.aliases}));
  }
  PlanOpaque();
  PlanRoot();
  return std::move(plan_);
}

}  // namespace internal

namespace {

namespace fs = std::filesystem;
using namespace internal;
using pickle::Kind;
using pickle::Value;
using torchfile::TensorInfo;
using torchfile::TorchFile;

// The trainable / frozen param names a model-states file lists.
std::set<std::string> ListedParams(const TorchFile& f) {
  std::set<std::string> out;
  const Value* root = f.root();
  try {
    if (const Value* shapes = Get(root, "param_shapes"); !IsNone(shapes)) {
      for (const Value* g : Items(shapes, "param_shapes"))
        for (const std::string& n : Keys(g, "param_shapes group"))
          out.insert(n);
    }
    if (const Value* fr = Get(root, "frozen_param_shapes"); !IsNone(fr)) {
      for (const std::string& n : Keys(fr, "frozen_param_shapes"))
        out.insert(n);
    }
  } catch (Error& e) {
    e.AddContext("rank file ", f.path().string());
    throw;
  }
  return out;
}

// Pipeline: which stage holds which layer file, and the param name of each
// layer-file key. A layer index belongs to the stage whose params carry it
// ("5.mlp..."); a layer file without such params (the tied embedding, a
// parameter-free layer) to the stage of the nearest lower index (stage 0 at
// the start). Keys are named "<index>.<key>", or "tied_modules.<k>.<key>"
// when the stage lists that tied param and not the former.
// ZeRO 0 without bf16 saves no param_shapes: the stages are those of
// Megatron-DeepSpeed's GPTModelPipe, DeepSpeed's 'type:transformer'
// partition (the layers with "self_attention." keys spread evenly, what
// precedes them on the first stage, what follows on the last), and the
// embedding is the tied module "tied_modules.embed" of the first and the
// last stage unless args.untie_embeddings_and_output_weights. The optimizer
// then confirms it: every master must match a stage's fp16 weights.
// Returns the params each stage lists, the layer index -> stage map and the
// tied layer indices; throws FormatError if pp does not divide the layers.
void InferStages(const Checkpoint& c, FileCache& cache, const TorchFile& first,
                 std::vector<std::set<std::string>>& listed,
                 std::map<int64_t, int64_t>& owner, std::set<int64_t>& tied) {
  const Value* args = Get(first.root(), "args");
  const Value* untie = args != nullptr
                           ? args->Attr("untie_embeddings_and_output_weights")
                           : nullptr;
  const bool tie =
      untie == nullptr || (untie->kind == Kind::kBool && !untie->b);
  std::map<int64_t, std::vector<std::string>> keys;  // of tp rank 0's files
  std::vector<int64_t> transformer;
  for (const auto& [idx, file] : c.layer_files[0]) {
    FilePtr& f = cache[file];
    if (f == nullptr)
      f = std::make_shared<const TorchFile>(TorchFile::Open(file));
    try {
      keys[idx] = Keys(f->root(), "layer state dict");
    } catch (Error& e) {
      e.AddContext("rank file ", file.string());
      throw;
    }
    for (const std::string& k : keys[idx]) {
      if (k.starts_with("self_attention.")) {
        transformer.push_back(idx);
        break;
      }
      if (tie && k == "word_embeddings.weight") tied.insert(idx);
    }
  }
  const auto L = static_cast<int64_t>(transformer.size());
  if (L == 0 || L % c.pp != 0) {
    throw FormatError(
        first.path().string(),
        ": no param_shapes (ZeRO stage 0 without "
        "bf16), so the stages are taken as DeepSpeed's 'type:transformer' "
        "partition, but pp ",
        c.pp, " does not divide the ", L, " transformer layers");
  }
  listed.assign(static_cast<size_t>(c.pp), {});
  for (const auto& [idx, ks] : keys) {
    const int64_t stage = TransformerStage(transformer, c.pp, idx);
    owner[idx] = stage;
    for (const std::string& k : ks) {
      if (tied.count(idx)) {
        listed.front().insert("tied_modules.embed." + k);
        listed.back().insert("tied_modules.embed." + k);
      } else {
        listed[static_cast<size_t>(stage)].insert(StrCat(idx, ".", k));
      }
    }
  }
}

std::vector<RankView> PipelineViews(const Checkpoint& c, FileCache& cache) {
  std::vector<std::set<std::string>> listed;
  std::map<int64_t, int64_t> owner;  // layer index -> stage
  std::set<int64_t> tied_idx;        // inferred tied layers (no param_shapes)
  for (int64_t p = 0; p < c.pp; ++p) {
    const fs::path& mf =
        c.mp_ranks[static_cast<size_t>(p * c.tp)].model_files[0];
    FilePtr& f = cache[mf];
    if (f == nullptr) {
      f = c.first_model != nullptr && c.first_model->path() == mf
              ? c.first_model
              : std::make_shared<const TorchFile>(TorchFile::Open(mf));
    }
    if (IsNone(Get(f->root(), "param_shapes"))) {
      InferStages(c, cache, *f, listed, owner, tied_idx);
      break;
    }
    listed.push_back(ListedParams(*f));
    for (const std::string& n : listed.back()) {
      if (auto idx = LayerIndex(n)) {
        auto [it, fresh] = owner.emplace(*idx, p);
        if (!fresh && it->second != p) {
          throw FormatError("rank file ", mf.string(), " > param ", n,
                            ": layer ", *idx,
                            " also belongs to pipeline "
                            "stage ",
                            it->second);
        }
      }
    }
  }
  std::vector<RankView> views(static_cast<size_t>(c.pp * c.tp));
  for (int64_t t = 0; t < c.tp; ++t) {
    int64_t stage = 0;
    for (const auto& [idx, file] : c.layer_files[static_cast<size_t>(t)]) {
      if (auto it = owner.find(idx); it != owner.end()) stage = it->second;
      const std::set<std::string>& names = listed[static_cast<size_t>(stage)];
      FilePtr& f = cache[file];
      if (f == nullptr)
        f = std::make_shared<const TorchFile>(TorchFile::Open(file));
      if (f->root() == nullptr || !f->root()->IsDictLike())
        throw FormatError("rank file ", file.string(), ": not a state dict");
      RankView& v = views[static_cast<size_t>(stage * c.tp + t)];
      for (const std::string& k : Keys(f->root(), "layer state dict")) {
        std::string name = StrCat(idx, ".", k);
        if (!names.count(name)) {
          std::vector<std::string> tied;
          for (const std::string& n : names) {
            if (n.starts_with("tied_modules.")) {
              const size_t dot = n.find('.', 13);
              if (dot != std::string::npos && n.substr(dot + 1) == k)
                tied.push_back(n);
            }
          }
          if (tied.size() > 1) {
            throw FormatError("rank file ", file.string(), " > ", k,
                              ": matches tied params ", tied[0], " and ",
                              tied[1]);
          }
          if (tied.size() == 1) name = tied[0];
        }
        v.layer_entries.push_back({name, file, k, idx});
        // Inferred ties: the last stage's copy reads the same file (its
        // masters are matched to those weights).
        if (tied_idx.count(idx) && c.pp > 1) {
          views[static_cast<size_t>((c.pp - 1) * c.tp + t)]
              .layer_entries.push_back({name, file, k, idx});
        }
      }
    }
  }
  for (RankView& v : views) v.pipeline = true;
  return views;
}

// Model variables for the layout: Megatron-DeepSpeed's args and
// universal_checkpoint_info in mp rank 0's model states.
layouts::Variables ModelVariables(const TorchFile& f,
                                  const formats::SourceOptions& options,
                                  std::string& vocab_source) {
  layouts::Variables vars;
  const Value* root = f.root();
  auto int_attr = [](const Value* ns, const char* k) -> std::optional<int64_t> {
    const Value* v = ns != nullptr ? ns->Attr(k) : nullptr;
    if (v == nullptr) return std::nullopt;
    if (v->kind == Kind::kBool) return v->b ? 1 : 0;
    return v->AsInt();
  };
  const Value* args = Get(root, "args");
  for (const auto& [var, attr] :
       std::vector<std::pair<const char*, const char*>>{
           {"num_layers", "num_layers"},
           {"num_attention_heads", "num_attention_heads"},
           {"num_query_groups", "num_key_value_heads"},
           {"make_vocab_size_divisible_by", "make_vocab_size_divisible_by"},
           {"swiglu", "swiglu"}}) {
    if (auto v = int_attr(args, attr)) vars.Set(var, *v);
  }
  if (auto untie = int_attr(args, "untie_embeddings_and_output_weights"))
    vars.Set("tied", *untie ? 0 : 1);
  if (!vars.Has("make_vocab_size_divisible_by"))
    vars.Set("make_vocab_size_divisible_by", 1);
  if (options.true_vocab_size) {
    vars.Set("vocab_size", *options.true_vocab_size);
    vocab_source = "--vocab-size";
  } else if (const Value* info = Get(root, "universal_checkpoint_info");
             info != nullptr && info->IsDictLike()) {
    if (const Value* v = Get(info, "original_vocab_size");
        v != nullptr && v->AsInt()) {
      vars.Set("vocab_size", *v->AsInt());
      vocab_source = "universal_checkpoint_info.original_vocab_size";
    }
  }
  return vars;
}

}  // namespace

namespace {

// A model-parallel checkpoint's mp ranks, each planned alone, and how to
// merge them (mp.layout is left for the caller to point at `layout`).
struct RankPlans {
  std::vector<universal::SourcePlan> plans;
  internal::ModelParallel mp;
  std::optional<layouts::Layout> layout;
  std::vector<std::string> names;  // every rank's params, in rank order
};

RankPlans PlanRanks(const Checkpoint& c,
                    const formats::SourceOptions& options) {
  FileCache cache;
  std::vector<RankView> views = c.pipeline
                                    ? PipelineViews(c, cache)
                                    : std::vector<RankView>(c.mp_ranks.size());
  RankPlans r;
  internal::ModelParallel& mp = r.mp;
  mp.tp = c.tp;
  mp.pp = c.pp;
  mp.pipeline = c.pipeline;
  // The layer index of each tied module's file (what a writer names it).
  for (const RankView& v : views) {
    for (const LayerEntry& e : v.layer_entries) {
      if (!e.name.starts_with("tied_modules.")) continue;
      const size_t dot = e.name.find('.', 13);
      if (dot != std::string::npos)
        mp.tied_layers[e.name.substr(0, dot)] = e.layer;
    }
  }
  for (size_t k = 0; k < c.mp_ranks.size(); ++k) {
    Checkpoint one = c;
    one.model_files = c.mp_ranks[k].model_files;
    one.optim_files = c.mp_ranks[k].optim_files;
    mp.model_files.push_back(one.model_files[0]);
    Planner planner(one, cache, std::move(views[k]));
    r.plans.push_back(planner.Run());
  }
  // The layout: required to merge tp ranks; at tp 1 it only tells the
  // vocabulary padding, so a model no built-in layout knows is fine.
  const FilePtr& f0 =
      cache.count(mp.model_files[0]) ? cache[mp.model_files[0]] : c.first_model;
  mp.vars = ModelVariables(*f0, options, mp.vocab_source);
  for (const universal::SourcePlan& p : r.plans)
    for (const atoms::ParamInfo& i : p.params) r.names.push_back(i.fqn);
  if (c.tp > 1 || !options.layout.empty()) {
    try {
      r.layout = layouts::Layout::FromSpec(options.layout, r.names);
    } catch (Error& e) {
      e.AddContext("model-parallel DeepSpeed checkpoint ", c.tag_dir.string());
      throw;
    }
  } else if (!layouts::Layout::DetectBuiltins(r.names).empty()) {
    r.layout = layouts::Layout::DetectBuiltin(r.names);
  }
  if (!r.layout) return r;
  mp.vars = r.layout->Resolve(mp.vars);
  if (!mp.vars.Has("vocab_size")) {
    // The padded rows of the first vocabulary-split param: no padding.
    for (const atoms::ParamInfo& i : r.plans[0].params) {
      const layouts::Rule& rule = r.layout->Match(i.fqn, mp.vars);
      if (rule.tp.split && rule.tp.vocab &&
          static_cast<size_t>(rule.tp.dim) < i.shape.size()) {
        mp.vars.Set("vocab_size",
                    i.shape[static_cast<size_t>(rule.tp.dim)] * c.tp);
        mp.vocab_source = "the rank files' rows (true size unknown)";
        break;
      }
    }
  }
  return r;
}

bool IsModelParallel(const Checkpoint& c) {
  return c.mp_ranks.size() > 1 || c.pipeline;
}

}  // namespace

universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const formats::SourceOptions& options) {
  // A Megatron-DeepSpeed checkpoint at TP 1 without pipeline looks like a
  // plain one; --layout reads it as model-parallel (names placed, padding
  // rows apart) so that it can be written for another TP size.
  if (!IsModelParallel(checkpoint) && options.layout.empty()) {
    FileCache cache;
    Planner planner(checkpoint, cache);
    return planner.Run();
  }
  RankPlans r = PlanRanks(checkpoint, options);
  r.mp.layout = r.layout ? &*r.layout : nullptr;
  return internal::MergeModelParallel(std::move(r.plans), r.mp);
}

formats::Source::NameListing ListNames(const Checkpoint& checkpoint,
                                       const formats::SourceOptions& options) {
  if (!IsModelParallel(checkpoint)) {
    throw UsageError(
        "DeepSpeed checkpoints without tensor or pipeline parallelism name "
        "every parameter in full: no layout descriptor applies");
  }
  RankPlans r = PlanRanks(checkpoint, options);
  if (!r.layout) r.layout = layouts::Layout::DetectBuiltin(r.names);
  formats::Source::NameListing out;
  std::set<std::string> seen;
  for (const std::string& n : r.names)
    if (seen.insert(n).second) out.names.push_back(n);
  out.variables = r.mp.vars;
  out.layout_name = r.layout->name();
  out.layout_yaml = r.layout->yaml();
  return out;
}

}  // namespace ucp::deepspeed
