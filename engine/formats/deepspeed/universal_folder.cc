// DeepSpeed universal checkpoint folders (ds_to_universal's output, what
// `load_universal` reads), as a source and as a target (deepspeed.h).
//
//   <save>/latest_universal             the folder's name (written last)
//   <save>/<tag>_universal/
//     mp_rank_00_model_states.pt        (ZeRO 3: zero_pp_rank_D_... each)
//     zero/optimizer_state.pt           non-sharded optimizer entries +
//                                       param_groups (ZeRO 3: also
//                                       optimizer_state_dict with each
//                                       group's step, which DeepSpeed's
//                                       ZeRO-3 universal load reads)
//     zero/<param>/fp32.pt, exp_avg.pt, exp_avg_sq.pt
//                                       {'param': full fp32 tensor,
//                                        'cat_dim': 0}; from a ZeRO-3
//                                       checkpoint the fp32 tensor alone
//                                       (ds_to_universal's form there)
//     zero/<param>/step.pt              the raw step (0-d tensor or int)

#include <algorithm>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/pickled.h"
#include "engine/formats/deepspeed/reader.h"
#include "engine/formats/deepspeed/writer_base.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;
using namespace internal;
using pickle::Kind;
using pickle::Value;

// The data-parallel size of the model states files a universal folder
// holds: the source's (ds_to_universal copies its model states files), 1
// when the universal content was not made from a data-parallel checkpoint.
formats::TargetOptions FolderOptions(const universal::UniversalInput& input,
                                     formats::TargetOptions options) {
  options.topology = layouts::Topology{};
  options.topology.dp = universal::SourceInfo::SizeOr1(input.model().source.dp);
  return options;
}

// The folder as a plan: one unit per file (the model states, the optimizer
// state, each param's state files), latest_universal last.
class UniversalFolderWriter : public WriterBase {
 public:
  UniversalFolderWriter(const universal::UniversalInput& input,
                        const formats::TargetOptions& options)
      : WriterBase(input, FolderOptions(input, options)) {
    Prepare();
    name_ = tag_ + "_universal";
    const int64_t n = stage_ == 3 ? W_ : 1;
    for (int64_t r = 0; r < n; ++r)
      files_.push_back({FileKind::kModelStates, r});
    files_.push_back({FileKind::kOptimizerState});
    for (const auto& group : groups_) {
      for (size_t i : group) {
        std::vector<std::string> kinds = {"fp32"};
        kinds.insert(kinds.end(), state_kinds_.begin(), state_kinds_.end());
        for (const std::string& kind : kinds)
          files_.push_back({FileKind::kState, 0, i, kind});
        files_.push_back({FileKind::kStep, 0, i});
      }
    }
    files_.push_back({FileKind::kLatest});
  }
  size_t size() const { return files_.size(); }
  const std::string& name() const { return name_; }
  std::unique_ptr<formats::PlannedFile> PlanFile(size_t i);
  formats::TargetSummary Summary() const;

 private:
  enum class FileKind { kModelStates, kOptimizerState, kState, kStep, kLatest };
  struct FileSpec {
    FileKind kind;
    int64_t rank = 0;
    size_t param = 0;
    std::string state;
  };
  std::unique_ptr<FileBuild> OptimizerState(const fs::path& zero);

  std::string name_;
  std::vector<FileSpec> files_;
};

std::unique_ptr<FileBuild> UniversalFolderWriter::OptimizerState(
    const fs::path& zero) {
  auto f = std::make_unique<FileBuild>(zero / "optimizer_state.pt");
  pickle::Arena& a = f->arena();
  Value* root = a.Dict();
  auto blob_or = [&](const std::string& key, Value* fallback) -> Value* {
    if (Value* v = ImportBlob(*f, "optim/" + key)) return v;
    return fallback;
  };
  const bool bf16 = wrapper_ == Wrapper::kBf16;
  if (!bf16) {
    formats::AppendEntry(a, root, "loss_scaler", LossScalerNode(*f));
    formats::AppendEntry(a, root, "dynamic_loss_scale",
                         blob_or("dynamic_loss_scale", a.Bool(false)));
    formats::AppendEntry(a, root, "overflow",
                         blob_or("overflow", a.Bool(false)));
  }
  formats::AppendEntry(a, root, "clip_grad",
                       blob_or("clip_grad", a.Float(0.0)));
  if (!bf16)
    formats::AppendEntry(a, root, "zero_stage",
                         ZeroStage(a, std::max(stage_, 1)));
  std::vector<Value*> pads, counts;
  auto groups = [&] {
    std::vector<Value*> out;
    for (size_t g = 0; g < groups_.size(); ++g) {
      Value* d =
          group_templates_ != nullptr && g < group_templates_->items.size()
              ? f->Import(group_file_, group_templates_->items[g])
              : a.Dict();
      AppendOrReplace(a, d, "params", a.List({a.Int(static_cast<int64_t>(g))}));
      out.push_back(d);
    }
    return a.List(std::move(out));
  };
  for (size_t g = 0; g < groups_.size(); ++g) {
    pads.push_back(a.Int(0));
    counts.push_back(a.Int(W_));
  }
  formats::AppendEntry(a, root, "group_paddings", a.List(std::move(pads)));
  formats::AppendEntry(a, root, "partition_count", a.List(std::move(counts)));
  formats::AppendEntry(a, root, "ds_version", DsVersion(*f));
  formats::AppendEntry(a, root, "param_groups", groups());
  if (stage_ == 3) {
    // DeepSpeed's ZeRO-3 universal load takes the step from the base
    // optimizer's state of group 0 (stage3.py,
    // load_hp_checkpoint_state_from_checkpoint_dir_stage3), where
    // ds_to_universal leaves rank 0's optimizer_state_dict: each group's
    // step, and the param groups.
    Value* state = a.Dict();
    for (size_t g = 0; g < groups_.size(); ++g) {
      if (groups_[g].empty()) continue;
      const TParam& p = params_[groups_[g].front()];
      Value* step = StepNode(*f, p, StrCat("zero/", p.name, "/step"));
      if (step == nullptr) continue;
      state->entries.emplace_back(a.Int(static_cast<int64_t>(g)),
                                  a.Dict({{a.Str("step"), step}}));
    }
    Value* inner = a.Dict();
    formats::AppendEntry(a, inner, "state", state);
    formats::AppendEntry(a, inner, "param_groups", groups());
    formats::AppendEntry(a, root, "optimizer_state_dict", inner);
  }
  f->SetRoot(root);
  return f;
}

std::unique_ptr<formats::PlannedFile> UniversalFolderWriter::PlanFile(
    size_t i) {
  const FileSpec& spec = files_.at(i);
  const fs::path folder = name_;
  const fs::path zero = folder / "zero";
  switch (spec.kind) {
    case FileKind::kModelStates: {
      // Model states (read by load_universal for the client / engine state).
      const std::string file = stage_ == 3
                                   ? StrCat("zero_pp_rank_", spec.rank,
                                            "_mp_rank_00_model_states.pt")
                                   : std::string("mp_rank_00_model_states.pt");
      auto f = std::make_unique<FileBuild>(folder / file);
      ModelStatesOptions o;
      o.rank = spec.rank;
      o.universal_folder = true;
      f->SetRoot(ModelStates(*f, o));
      return f;
    }
    case FileKind::kOptimizerState:
      return OptimizerState(zero);
    case FileKind::kState: {
      const TParam& p = params_[spec.param];
      const atoms::DatasetInfo* atom = input_.FindAtom(p.name, spec.state);
      if (atom == nullptr && spec.state == "fp32")
        atom = input_.FindAtom(p.name, "param");
      if (atom == nullptr) return nullptr;
      auto f =
          std::make_unique<FileBuild>(zero / p.name / (spec.state + ".pt"));
      if (stage_ == 3) {
        // As ds_to_universal writes a ZeRO-3 checkpoint's: the tensor alone
        // (DeepSpeed 0.14's ZeRO-3 load reads nothing else, flattening it;
        // newer ones read both forms).
        f->SetRoot(f->AddTensor(
            WholeTensor(*atom, p.shape, DType::kFloat32,
                        StrCat("zero/", p.name, "/", spec.state))));
        return f;
      }
      pickle::Arena& a = f->arena();
      Value* d = a.Dict();
      formats::AppendEntry(
          a, d, "param",
          f->AddTensor(WholeTensor(*atom, p.shape, DType::kFloat32,
                                   StrCat("zero/", p.name, "/", spec.state))));
      formats::AppendEntry(a, d, "cat_dim", a.Int(0));
      f->SetRoot(d);
      return f;
    }
    case FileKind::kStep: {
      const TParam& p = params_[spec.param];
      auto f = std::make_unique<FileBuild>(zero / p.name / "step.pt");
      Value* step = StepNode(*f, p, StrCat("zero/", p.name, "/step"));
      if (step == nullptr) return nullptr;
      f->SetRoot(step);
      return f;
    }
    case FileKind::kLatest:
      return formats::TextFile(kLatestUniversalFile, name_);
  }
  return nullptr;
}

formats::TargetSummary UniversalFolderWriter::Summary() const {
  formats::TargetSummary summary;
  summary.notes.assign(notes_.begin(), notes_.end());
  summary.resume_hint = StrCat(
      "DeepSpeed: checkpoint {\"load_universal\": true} in the config, then "
      "engine.load_checkpoint(\"<output>\") at any world size, "
      "zero_optimization.stage ",
      stage_);
  summary.details["tag"] = name_;
  summary.details["zero_stage"] = stage_;
  return summary;
}

class UniversalFolderPlan : public formats::TargetPlan {
 public:
  UniversalFolderPlan(const universal::UniversalInput& input,
                      const formats::TargetOptions& options)
      : w_(input, options) {}
  size_t units() const override { return w_.size(); }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t i) const override {
    std::vector<std::unique_ptr<formats::PlannedFile>> out;
    if (auto f = w_.PlanFile(i)) out.push_back(std::move(f));
    return out;
  }
  fs::path checkpoint_dir() const override { return w_.name(); }
  formats::TargetSummary Summary() const override { return w_.Summary(); }
  std::string label() const override { return StrCat("writing ", w_.name()); }

 private:
  mutable UniversalFolderWriter w_;  // its blob cache fills as it plans
};

}  // namespace

std::vector<formats::SavedCheckpoint> ListUniversalFolders(
    const fs::path& dir) {
  std::vector<formats::SavedCheckpoint> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (!it->is_directory(ec) || !fs::is_directory(it->path() / "zero", ec) ||
        !HoldsModelStates(it->path()))
      continue;
    formats::SavedCheckpoint c;
    c.name = it->path().filename().string();
    c.selector.Set(kTagOption, c.name);
    std::string_view tag = c.name;
    if (tag.ends_with("_universal")) tag.remove_suffix(10);
    size_t i = tag.size();
    while (i > 0 && tag[i - 1] >= '0' && tag[i - 1] <= '9') --i;
    if (i < tag.size() && tag.size() - i < 18)
      c.iteration = std::stoll(std::string(tag.substr(i)));
    out.push_back(std::move(c));
  }
  return out;
}

Checkpoint DiscoverUniversal(const fs::path& path, const std::string& tag) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("checkpoint folder ", path.string(),
                  " does not exist or is not a folder");
  }
  Checkpoint c;
  if (fs::is_directory(path / "zero", ec)) {
    c.tag_dir = path;
    c.dir = path.parent_path();
    c.tag = path.filename().string();
  } else {
    std::string name = tag;
    if (name.empty()) {
      if (!fs::exists(path / kLatestUniversalFile, ec)) {
        throw UsageError("no '", kLatestUniversalFile, "' file in ",
                         path.string(), " and no --tag given");
      }
      name = std::string(
          TrimWhitespace(ReadSmallFile(path / kLatestUniversalFile, 4096)));
    }
    c.dir = path;
    c.tag = name;
    c.tag_dir = path / name;
  }
  c.zero_dir = c.tag_dir / "zero";
  if (!fs::is_directory(c.zero_dir, ec)) {
    throw FormatError(c.tag_dir.string(),
                      ": not a DeepSpeed universal folder (no zero/ folder)");
  }
  if (!fs::is_regular_file(c.zero_dir / "optimizer_state.pt", ec)) {
    throw FormatError(c.zero_dir.string(), ": missing optimizer_state.pt");
  }
  // Model files and the stage.
  if (fs::is_regular_file(c.tag_dir / "mp_rank_00_model_states.pt", ec)) {
    c.model_files = {c.tag_dir / "mp_rank_00_model_states.pt"};
  }
  for (int64_t d = 0;; ++d) {
    const fs::path p =
        c.tag_dir / StrCat("zero_pp_rank_", d, "_mp_rank_00_model_states.pt");
    if (!fs::is_regular_file(p, ec)) break;
    if (d == 0 && !c.model_files.empty()) break;
    c.model_files.push_back(p);
    c.stage = 3;
  }
  if (c.model_files.empty()) {
    throw FormatError(c.tag_dir.string(), ": no mp_rank_00_model_states.pt");
  }
  torchfile::TorchFile m = torchfile::TorchFile::Open(c.model_files[0]);
  try {
    c.dp = Int(Require(m.root(), "dp_world_size"), "dp_world_size");
    if (Int(Require(m.root(), "mp_world_size"), "mp_world_size") != 1) {
      throw FormatError(
          "model parallelism is not supported for DeepSpeed "
          "checkpoints yet");
    }
  } catch (Error& e) {
    e.AddContext("rank file ", c.model_files[0].string());
    throw;
  }
  torchfile::TorchFile o =
      torchfile::TorchFile::Open(c.zero_dir / "optimizer_state.pt");
  const Value* zs = Get(o.root(), "zero_stage");
  if (c.stage != 3) {
    if (zs == nullptr) {
      c.wrapper = Wrapper::kBf16;
      c.stage = 0;
    } else {
      const std::optional<int64_t> v = ZeroStageOf(zs);
      if (!v || *v < 1 || *v > 3) {
        throw FormatError((c.zero_dir / "optimizer_state.pt").string(),
                          ": unknown ZeRO stage ", pickle::Repr(zs, 60));
      }
      c.wrapper = Wrapper::kZero;
      c.stage = static_cast<int>(*v);
    }
  } else {
    c.wrapper = Wrapper::kZero;
  }
  if (c.tag.size() > 10 && c.tag.ends_with("_universal"))
    c.tag = c.tag.substr(0, c.tag.size() - 10);
  return c;
}

std::unique_ptr<formats::TargetPlan> PlanUniversalFolder(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options) {
  return std::make_unique<UniversalFolderPlan>(input, options);
}

namespace internal {

using torchfile::TensorInfo;
using torchfile::TorchFile;

// The universal folder as a source: each param's zero/<param>/<kind>.pt
// files whole, the param groups from zero/optimizer_state.pt.
void Planner::PlanZeroFolder() {
  const fs::path state_path = c_.zero_dir / "optimizer_state.pt";
  zero_state_ = std::make_shared<const TorchFile>(TorchFile::Open(state_path));
  try {
    const Value* groups = Get(zero_state_->root(), "param_groups");
    if (groups != nullptr)
      for (const Value* g : Items(groups, "param_groups"))
        group_dicts_.push_back(g);
  } catch (Error& e) {
    e.AddContext("rank file ", state_path.string());
    throw;
  }
  for (const auto& names : groups_) {
    for (const std::string& n : names) {
      const Param& p = params_[index_[n]];
      const fs::path dir = c_.zero_dir / n;
      std::error_code ec;
      if (!fs::is_directory(dir, ec)) {
        throw FormatError(c_.zero_dir.string(), ": no folder for param ", n);
      }
      std::vector<fs::path> files;
      for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
           it.increment(ec))
        if (it->path().extension() == ".pt") files.push_back(it->path());
      std::sort(files.begin(), files.end());
      for (const fs::path& file : files) {
        const std::string kind = file.stem().string();
        const std::string where = StrCat("rank file ", file.string());
        auto f = std::make_shared<const TorchFile>(TorchFile::Open(file));
        zero_files_.push_back(f);
        try {
          const Value* root = f->root();
          if (kind == "step") {
            if (const TensorInfo* t = f->FindTensor(root)) {
              step_kind_ = "tensor";
              Whole(Atom(p, "step", t->dtype, true), Tensor(f, *t, where),
                    where);
            } else if (root != nullptr && root->kind == Kind::kInt &&
                       root->big.empty()) {
              step_kind_ = "int";
              step_value_ = static_cast<double>(root->i);
            } else if (root != nullptr && root->kind == Kind::kFloat) {
              step_kind_ = "float";
              step_value_ = root->f;
            }
            continue;
          }
          const Value* tv = f->FindTensor(root) ? root : Get(root, "param");
          const TensorInfo& t = TensorAt(f, tv, where + " > param");
          if (t.numel != NumElements(p.shape) || t.dtype != DType::kFloat32) {
            throw FormatError(
                "param ", n, ": ", t.numel, " ", DTypeName(t.dtype),
                " elements, expected float32 ", ShapeString(p.shape));
          }
          const reshape::SourceTensor src =
              reshape::FlatView(Tensor(f, t, where), 0, p.shape, where);
          if (kind != "fp32") state_kinds_.insert(kind);
          Whole(Atom(p, kind, DType::kFloat32, false), src, where + " > param");
        } catch (Error& e) {
          e.AddContext(where);
          throw;
        }
      }
    }
  }
}

}  // namespace internal
}  // namespace ucp::deepspeed
