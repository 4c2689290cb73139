// Writing Megatron rank files for a target topology from a universal file
// (WriteTarget). What is written: megatron_format.h (as Megatron-core v0.13
// saves it); the driver's metadata in the universal file: same header.
//
// Plan per target rank (tp_rank, pp_rank, ep_rank):
//   entries    the universal file's entries in canonical order (+ tied
//              copies where their rule exists) whose home is one of this
//              stage's chunks, renamed to local layer indices and nested by
//              the layout; of the routed experts only the EP rank's, as
//              local_experts.<i>, expert by expert;
//   tensors    one executor job per tensor: its pieces (layouts::ShardFor for
//              the target tp and padded vocabulary) copied from the atoms and
//              pad atoms; elements no piece covers (padding beyond the stored
//              padding rows, buffer alignment gaps) are zero;
//   optimizer  groups recomputed for the rank (param_groups.h), group dicts
//              from /opaque/optimizer/param_groups; distrib_optim.pt world
//              tensors laid out by buffer_layout.h for the target DP; with
//              EP > 1 a ChainedOptimizer's dense and expert halves (the
//              expert one over expert DP).
// The plan (formats::TargetPlan) has one unit per rank, planned on demand:
// distrib_optim.pt before model_optim_rng.pt; the tracker is the last unit.
// The emit stage (formats/emit.h) writes it.

#include <algorithm>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <set>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/sinks.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/emit.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/buffer_layout.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron/param_groups.h"
#include "engine/formats/megatron/target.h"
#include "engine/formats/megatron/torch_step.h"
#include "engine/formats/megatron_legacy/group_step.h"
#include "engine/formats/megatron_legacy/megatron.h"
#include "engine/formats/placed_target.h"
#include "engine/json/json.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/universal/input.h"
#include "layouts/layout.h"
#include "layouts/placement.h"

namespace ucp::megatron {

GroupStepAction TargetGroupStep(bool torch_step, bool distributed, bool stepped,
                                bool has_step) noexcept {
  if (torch_step) {
    if (distributed) return GroupStepAction::kTorchStep;
    return has_step ? GroupStepAction::kDrop : GroupStepAction::kKeep;
  }
  if (!stepped && has_step) return GroupStepAction::kDrop;
  if (stepped && !has_step) return GroupStepAction::kFromAnotherGroup;
  return GroupStepAction::kKeep;
}

namespace {

namespace fs = std::filesystem;
using layouts::EntryKind;
using layouts::Layout;
using layouts::Rule;
using pickle::Kind;
using pickle::Value;

using formats::AppendEntry;
using formats::BlobCache;
using formats::BuildChunk;
using formats::MemorySink;

// How the target keeps its optimizer state (megatron_format.h).
enum class TargetOptimizer { kFp32, kFloat16, kDistributed };

// A param (or tied copy) as the target sees it.
struct TargetParam {
  const atoms::StoredParam* stored = nullptr;  // the original's
  const Rule* rule = nullptr;                  // the entry's own rule
  std::optional<int64_t> padded_rows;          // vocab rules
};

struct Entry {
  std::string name;  // canonical
  enum Kind { kParam, kBuffer, kOpaque, kTiedCopy } kind = kParam;
  const Rule* rule = nullptr;
  layouts::Home home;
  const atoms::StoredParam* param = nullptr;  // original for params/copies
};

// Megatron's SequentialMLP spelling of a layer's local experts
// (megatron_format.h).
constexpr std::string_view kLocalExperts = "local_experts.";

// The target checkpoint as a plan: one unit per target rank (pp, ep, tp)
// with its distrib_optim.pt (distributed optimizer) and model_optim_rng.pt,
// then the tracker.
class MegatronPlan : public formats::TargetPlan {
 public:
  MegatronPlan(const universal::UniversalInput& input,
               const TargetOptions& options,
               const reshape::ExecutorOptions& executor)
      : store_(input), options_(options), executor_(executor) {
    Prepare();
  }

  size_t units() const override {
    const layouts::Topology& t = placed_->topology;
    return static_cast<size_t>(t.pp * t.ep * t.tp) + 1;
  }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t i) const override;
  fs::path checkpoint_dir() const override { return IterDir(); }
  formats::TargetSummary Summary() const override;
  std::string label() const override { return "writing rank files"; }

 private:
  using File = formats::TorchSaveFile;
  void Prepare();
  void ReadMetadata();
  void BuildEntries();
  void ReadTorchStep();
  void NoteUnknownVocab();
  void OrderExperts(std::vector<size_t>& chunk) const;
  fs::path IterDir() const {
    return IterDirName(store_.model().iteration, release_);
  }

  // A param of one rank file, in named_parameters() order (chunk 0 first).
  struct RankParam {
    size_t entry;  // into entries_
    int64_t chunk;
    Shape local_shape;
    std::string local_name;
    bool expert = false;  // a routed expert's (the expert half's)
  };
  // A target rank: its model coordinates (ep_rank 0 without experts).
  struct Rank {
    int64_t tp = 0;
    int64_t pp = 0;
    int64_t ep = 0;
  };
  // One rank's optimizer groups: the stored group dicts (templates, one per
  // group_keys_), the rank's grouping, and which groups hold an element of
  // DP rank 0's shard (all but for the distributed optimizer).
  struct RankGroups {
    std::shared_ptr<const torchfile::TorchFile> file;
    const Value* templates = nullptr;
    Grouping g;
    std::vector<bool> stepped;
  };

  // One rank file's root (model chunks, optimizer, args, rng state, ...,
  // in the source's key order), and its distrib_optim.pt's.
  const Value* BuildRank(const Rank& rank, File& model, File* distrib,
                         BlobCache& blobs) const;
  // Its steps: the model chunks (their params appended to `params`) ...
  std::vector<Value*> BuildModelChunks(const Rank& rank, File& model,
                                       BlobCache& blobs,
                                       std::vector<RankParam>* params) const;
  // ... the optimizer (and the distrib_optim.pt of a distributed one) ...
  Value* BuildOptimizer(const Rank& rank, const std::vector<RankParam>& params,
                        File& model, File* distrib, BlobCache& blobs) const;
  // One optimizer over `params` (all, or one half of a mixture of experts'
  // ChainedOptimizer) sharded over data-parallel size `dp`; with the
  // distributed optimizer its distrib_optim.pt state into `*distrib_root`.
  // `half`: 0 / 1 the dense / expert half of a ChainedOptimizer, -1 the
  // only optimizer.
  Value* BuildOptimizerOf(int64_t tp_rank, int64_t pp_rank,
                          const std::vector<RankParam>& params, int half,
                          int64_t dp, File& model, File* distrib,
                          Value** distrib_root, BlobCache& blobs) const;
  std::vector<GroupKey> GroupKeysOf(const std::vector<RankParam>& params) const;
  std::vector<BufferLayout> DistributedBuffers(
      int64_t pp_rank, const std::vector<RankParam>& params, const Grouping& g,
      int64_t dp, std::vector<bool>* stepped) const;
  std::vector<Value*> GroupDicts(File& model, const RankGroups& groups,
                                 std::vector<std::vector<int64_t>>* ids) const;
  void SetGroupStep(File& model, const RankGroups& groups, size_t gi,
                    Value* group) const;
  Value* BuildDistribOptim(int64_t tp_rank,
                           const std::vector<RankParam>& params,
                           const std::vector<BufferLayout>& buffers,
                           File& distrib) const;
  Value* LocalOptimizer(int64_t tp_rank, const std::vector<RankParam>& params,
                        const RankGroups& groups,
                        const std::vector<Value*>& group_nodes,
                        const std::vector<std::vector<int64_t>>& ids,
                        File& model, BlobCache& blobs) const;
  Value* ParamState(File& model, const Entry& e, int64_t id,
                    int64_t tp_rank) const;
  // ... the args and the rng state (nullptr: none written).
  Value* BuildArgs(const Rank& rank, File& model, BlobCache& blobs) const;
  // The args' expert sizes (and the rank of a folder's writer) for `rank`.
  void PatchExpertArgs(pickle::Arena& arena, Value* args,
                       const Rank& rank) const;
  Value* BuildRngState(const Rank& rank, File& model, BlobCache& blobs) const;
  Value* TensorFor(File& f, const Entry& e, const std::string& kind,
                   DType dtype, int64_t tp_rank, const std::string& name) const;
  std::vector<reshape::CopyOp> OpsFor(const Entry& e, const std::string& kind,
                                      int64_t tp_rank,
                                      Shape* local_shape) const;
  const atoms::DatasetInfo& AtomOf(const atoms::StoredParam& p,
                                   const std::string& kind) const;
  Value* Import(File& f, BlobCache& blobs, const std::string& key) const;
  std::string Where(const File& f) const {
    return StrCat("rank file ", f.path().string());
  }

  const universal::UniversalInput& store_;  // a universal file or a plan
  TargetOptions options_;
  reshape::ExecutorOptions executor_;

  // The layout, variables, vocabulary rows, topology and placement.
  std::optional<formats::PlacedTarget> placed_;
  // Mixture of experts: the routed experts over the target's ep ranks.
  std::optional<layouts::ExpertPlacement> experts_;
  MegatronExtras meta_;
  std::vector<Entry> entries_;
  // chunk_entries_[pp][vp] = indices into entries_
  std::vector<std::vector<std::vector<size_t>>> chunk_entries_;
  bool write_optimizer_ = false;
  TargetOptimizer target_format_ = TargetOptimizer::kFp32;
  std::vector<GroupKey> group_keys_;
  std::vector<std::string> state_keys_;
  std::vector<std::string> top_level_keys_;  // of a rank file, in order
  // (canonical name, "param" | "buffer" | "opaque") from the metadata.
  std::vector<std::pair<std::string, std::string>> meta_entries_;
  // torch.optim.Adam (Megatron without apex / TE) keeps `step` per param, a
  // 0-d float tensor in the state, and the distributed optimizer stores its
  // value as a float on every group; apex / TE FusedAdam keep an int per
  // group. The step when the source used torch Adam; step_atoms_: the
  // universal file holds the per-param tensors.
  std::optional<double> torch_step_;
  bool torch_step_integral_ = false;
  bool step_atoms_ = false;
  std::string grad_dtype_;
  int64_t cp_ = 1;
  RunConfig run_;  // from the stored args
  int64_t source_tp_ = 1, source_pp_ = 1, source_vpp_ = 1;
  int64_t gpus_per_node_ = 8;
  bool release_ = false;
  bool new_args_ = false;  // no stored args: NewArgs builds them
  mutable std::set<std::string> notes_;
};

const atoms::DatasetInfo& MegatronPlan::AtomOf(const atoms::StoredParam& p,
                                               const std::string& kind) const {
  const atoms::DatasetInfo* d = store_.FindAtom(p.info.fqn, kind);
  if (d == nullptr) {
    throw FormatError("universal file ", store_.path().string(), " lacks ",
                      p.info.fqn, "/", kind);
  }
  return *d;
}

void MegatronPlan::ReadMetadata() {
  const universal::Model& model = store_.model();
  // Another framework's model (a transformers folder) has no args: built
  // from its model variables if they describe a Megatron-core GPT.
  const bool no_args = store_.FindOpaque("args") == nullptr;
  auto refuse = [&] {
    return UsageError(
        store_.path().string(),
        " holds no Megatron args (another framework's checkpoint) and its "
        "model variables do not describe a Megatron-core GPT: the legacy "
        "format's rank files carry them; --format megatron-torch-dist "
        "writes it without them");
  };
  if (no_args && !model.layout_yaml.empty() && !DescribesGpt(model))
    throw refuse();
  MegatronTarget target =
      PlaceMegatronTarget(store_, options_.topology, options_.true_vocab_size);
  meta_ = std::move(target.meta);
  placed_ = std::move(target.placed);
  if (no_args) {
    pickle::Arena probe;
    new_args_ = NewArgs(probe, model, *placed_) != nullptr;
    if (!new_args_ && !model.layout_yaml.empty()) throw refuse();
  }
  {
    const layouts::Topology& t = placed_->topology;
    if (!placed_->layout.experts()) {
      if (t.ep > 1 || t.etp) {
        throw UsageError("--ep ", t.ep, t.etp ? StrCat(" --etp ", *t.etp) : "",
                         ": layout '", placed_->layout.name(),
                         "' has no routed experts");
      }
    } else {
      if (t.etp && *t.etp != t.tp) {
        throw UsageError(
            "--etp ", *t.etp, " with --tp ", t.tp,
            ": Megatron's legacy format loads one folder per (tp, pp, ep) "
            "and needs ETP = TP (use --format megatron-torch-dist for ETP "
            "!= TP)");
      }
      experts_.emplace(placed_->layout.NumExperts(placed_->vars), t.ep);
    }
  }
  const universal::SourceInfo& source = model.source;
  source_tp_ = universal::SourceInfo::SizeOr1(source.tp);
  source_pp_ = universal::SourceInfo::SizeOr1(source.pp);
  source_vpp_ = universal::SourceInfo::SizeOr1(source.vpp);
  cp_ = universal::SourceInfo::SizeOr1(source.cp);
  gpus_per_node_ = std::max<int64_t>(meta_.gpus_per_node.value_or(8), 1);
  release_ = meta_.release.value_or(release_);
  // Megatron-LM's read_metadata takes iteration 0 only as `release`.
  if (new_args_ && model.iteration == 0) release_ = true;
  grad_dtype_ = meta_.grad_dtype.value_or(grad_dtype_);
  NoteUnknownVocab();

  // Optimizer: written when the universal file has one and it is wanted.
  const bool has_optimizer =
      meta_.optimizer_format && *meta_.optimizer_format != "none" &&
      store_.FindOpaque("optimizer/param_groups") != nullptr;
  write_optimizer_ = has_optimizer && !options_.no_optimizer;
  if (!has_optimizer && !options_.no_optimizer) {
    // Another framework's Adam state: the legacy format's optimizer is
    // Megatron's param groups' own, which such a source does not keep.
    for (const atoms::DatasetInfo& d : store_.datasets()) {
      if (d.kind == atoms::DatasetKind::kAtom && d.state_kind == "exp_avg") {
        throw UsageError(
            store_.path().string(),
            " holds optimizer state (Adam moments) but not Megatron's param "
            "groups, which the legacy format's optimizer needs: --format "
            "megatron-torch-dist writes it (Megatron's groups laid out), or "
            "--no-optimizer writes the weights only");
      }
    }
  }
  if (!has_optimizer && !options_.no_optimizer &&
      options_.distributed_optimizer)
    notes_.insert(
        "the universal file holds no optimizer state: wrote model weights "
        "only, no distrib_optim.pt");
  bool low_precision = false;
  for (const atoms::StoredParam& p : store_.params())
    low_precision = low_precision || p.info.dtype != DType::kFloat32;
  target_format_ = options_.distributed_optimizer
                       ? TargetOptimizer::kDistributed
                       : (low_precision ? TargetOptimizer::kFloat16
                                        : TargetOptimizer::kFp32);
  // Megatron's groups carry their key; another framework's do not (and
  // are not written: see has_optimizer).
  const universal::OptimizerInfo& optimizer = model.optimizer;
  if (has_optimizer && optimizer.groups) {
    try {
      for (const universal::ParamGroup& g : *optimizer.groups) {
        const json::Value* key = universal::FindMember(g.other, "key");
        if (key == nullptr) throw FormatError("a param group has no key");
        group_keys_.push_back(GroupKey::FromJson(*key));
      }
    } catch (Error& e) {
      e.AddContext("universal file ", store_.path().string(),
                   " > attribute optimizer");
      throw;
    }
  }
  {
    if (meta_.state_keys) {
      state_keys_ = *meta_.state_keys;
    } else if (optimizer.state_kinds) {
      for (const std::string& k : *optimizer.state_kinds)
        if (k != "fp32") state_keys_.push_back(k);
    }
    if (meta_.top_level_keys) {
      top_level_keys_ = *meta_.top_level_keys;
    } else {
      top_level_keys_.assign(std::begin(kTopLevelKeys),
                             std::end(kTopLevelKeys));
    }
    if (meta_.entries) meta_entries_ = *meta_.entries;
  }
}

// Without the true vocabulary size the stored rows (the source's padded
// size P for tp T) count as real; the target's padding is computed from P.
// That is what Megatron computes for every true size in (P - div*T, P] when
// the target tp is a multiple of T, but not for every other tp: say so.
void MegatronPlan::NoteUnknownVocab() {
  if (options_.true_vocab_size || meta_.VocabSizeKnown()) return;
  for (const Rule& r : placed_->layout.rules()) {
    if (!r.tp.split || !r.tp.vocab) continue;
    const int64_t rows = r.tp.vocab->true_size.Evaluate(placed_->vars);
    const int64_t div = r.tp.vocab->divisible_by.Evaluate(placed_->vars);
    const int64_t lo = std::max<int64_t>(1, rows - div * source_tp_ + 1);
    const int64_t padded =
        layouts::PaddedVocabSize(rows, div, placed_->topology.tp);
    const int64_t padded_lo =
        layouts::PaddedVocabSize(lo, div, placed_->topology.tp);
    if (padded_lo != padded) {
      notes_.insert(StrCat(
          "the true vocabulary size is unknown (the source's tokenizer is "
          "not a NullTokenizer): its ",
          rows, " padded rows were kept as real rows and padded to ", padded,
          " for tp ", placed_->topology.tp,
          "; Megatron pads the tokenizer's size to ", padded_lo, "..", padded,
          " rows for that tp: give the tokenizer's vocabulary size "
          "(--vocab-size) to match it"));
    }
    return;
  }
}

void MegatronPlan::ReadTorchStep() {
  if (!write_optimizer_) return;
  const bool atoms = std::find(state_keys_.begin(), state_keys_.end(),
                               "step") != state_keys_.end();
  const std::optional<TorchStep> step = FindTorchStep(store_, atoms, executor_);
  // An int step on the groups is apex's / Transformer Engine's FusedAdam's,
  // whose state holds none per param: the groups keep theirs.
  if (!step || (!step->from_atoms && step->integral)) return;
  torch_step_ = step->value;
  torch_step_integral_ = step->integral;
  step_atoms_ = step->from_atoms;
}

void MegatronPlan::BuildEntries() {
  const Layout& layout = placed_->layout;
  std::vector<std::pair<std::string, std::string>> list = meta_entries_;
  if (list.empty()) {
    for (const atoms::StoredParam& p : store_.params())
      list.emplace_back(p.info.fqn, p.info.kind == atoms::ParamKind::kBuffer
                                        ? "buffer"
                                        : "param");
    for (const atoms::DatasetInfo& d : store_.datasets()) {
      if (d.kind == atoms::DatasetKind::kOpaque &&
          d.fqn.rfind("extra_state/", 0) == 0)
        list.emplace_back(d.fqn.substr(12), "opaque");
    }
  }
  for (const auto& [name, kind] : list) {
    Entry e;
    e.name = name;
    e.kind = kind == "opaque"   ? Entry::kOpaque
             : kind == "buffer" ? Entry::kBuffer
                                : Entry::kParam;
    entries_.push_back(std::move(e));
  }
  // Tied copies (e.g. the last stage's output layer) where they exist.
  for (const Rule& rule : layout.rules()) {
    if (!rule.tied_to) continue;
    const atoms::StoredParam* orig = store_.FindParam(*rule.tied_to);
    if (orig == nullptr) continue;
    for (const layouts::Glob& g : rule.match) {
      for (const std::string& name : g.alternatives()) {
        if (name.find('*') != std::string::npos) continue;
        if (layout.Find(name, placed_->vars) != &rule) continue;
        if (!rule.Exists(placed_->vars, placed_->topology)) continue;
        Entry e;
        e.name = name;
        e.kind = Entry::kTiedCopy;
        const size_t dot = name.rfind('.');
        const std::string prefix =
            dot == std::string::npos ? name : name.substr(0, dot + 1);
        auto pos = std::find_if(
            entries_.begin(), entries_.end(),
            [&](const Entry& x) { return x.name.rfind(prefix, 0) == 0; });
        entries_.insert(pos, std::move(e));
      }
    }
  }
  chunk_entries_.assign(static_cast<size_t>(placed_->topology.pp),
                        std::vector<std::vector<size_t>>(
                            static_cast<size_t>(placed_->topology.vpp)));
  for (size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    try {
      e.rule = &layout.Match(e.name, placed_->vars);
      if (!e.rule->Exists(placed_->vars, placed_->topology)) continue;
      e.home = layouts::HomeOf(layout, *e.rule, e.name, placed_->placement);
      if (e.kind != Entry::kOpaque) {
        e.param = store_.FindParam(e.kind == Entry::kTiedCopy ? *e.rule->tied_to
                                                              : e.name);
        if (e.param == nullptr)
          throw FormatError("the universal file has no such param");
      }
    } catch (Error& e2) {
      e2.AddContext("universal file ", store_.path().string(), " > param ",
                    e.name);
      throw;
    }
    chunk_entries_[static_cast<size_t>(e.home.pp_rank)]
                  [static_cast<size_t>(e.home.vp_chunk)]
                      .push_back(i);
  }
  if (experts_) {
    for (auto& stage : chunk_entries_)
      for (std::vector<size_t>& chunk : stage) OrderExperts(chunk);
  }
}

// A layer's routed experts in the order SequentialMLP's state_dict() and
// named_parameters() list them (the distributed optimizer's buffers follow
// it): expert by expert, each one's entries in their order, where the
// layer's first expert entry is (a torch_dist source lists every expert's
// fc1 before the fc2s).
void MegatronPlan::OrderExperts(std::vector<size_t>& chunk) const {
  const Layout& layout = placed_->layout;
  // Each entry's (layer, expert) once; layer -> (expert, entry) in order.
  std::vector<int64_t> layer_of(chunk.size(), -1);
  std::map<int64_t, std::vector<std::pair<int64_t, size_t>>> layers;
  for (size_t k = 0; k < chunk.size(); ++k) {
    const Entry& e = entries_[chunk[k]];
    if (e.rule == nullptr || !e.rule->expert) continue;
    const std::optional<layouts::ExpertName> x = layout.SplitExpert(e.name);
    if (!x) continue;
    layer_of[k] = x->layer;
    layers[x->layer].emplace_back(x->index, chunk[k]);
  }
  if (layers.empty()) return;
  std::vector<size_t> out;
  out.reserve(chunk.size());
  for (size_t k = 0; k < chunk.size(); ++k) {
    if (layer_of[k] < 0) {
      out.push_back(chunk[k]);
      continue;
    }
    auto it = layers.find(layer_of[k]);
    if (it == layers.end()) continue;  // this layer's experts are out
    std::stable_sort(
        it->second.begin(), it->second.end(),
        [](const auto& a, const auto& b) { return a.first < b.first; });
    for (const auto& [expert, j] : it->second) out.push_back(j);
    layers.erase(it);
  }
  chunk = std::move(out);
}

std::vector<reshape::CopyOp> MegatronPlan::OpsFor(const Entry& e,
                                                  const std::string& kind,
                                                  int64_t tp_rank,
                                                  Shape* local_shape) const {
  const atoms::StoredParam& p = *e.param;
  const atoms::DatasetInfo& atom = AtomOf(p, kind);
  const atoms::DatasetInfo* pad = store_.FindPadAtom(p.info.fqn, kind);
  if (pad == nullptr && kind == "param")
    pad = store_.FindPadAtom(p.info.fqn, "fp32");
  int64_t padded = 0;
  int64_t pad_rows = 0;
  Shape full = p.info.shape;
  int64_t stored_pad = 0;  // padding rows at the end of the main atom
  if (std::optional<int64_t> pd = layouts::PaddedDimSize(
          *e.rule, placed_->vars, placed_->topology.tp)) {
    padded = *pd;
    const size_t dim = static_cast<size_t>(e.rule->tp.dim);
    if (placed_->vocab_rows && *placed_->vocab_rows < full.at(dim)) {
      if (pad != nullptr) {
        throw FormatError("universal file ", store_.path().string(),
                          " > param ", p.info.fqn,
                          ": padding rows stored although the vocabulary "
                          "size was unknown");
      }
      stored_pad = full[dim] - *placed_->vocab_rows;
      full[dim] = *placed_->vocab_rows;
    }
    if (padded < full[dim]) {
      throw LayoutError("param ", p.info.fqn, ": the padded vocabulary (",
                        padded, " rows for tp ", placed_->topology.tp,
                        ") is smaller than the stored ", full[dim], " rows");
    }
    pad_rows = stored_pad;
    if (pad != nullptr && dim < pad->shape.size()) pad_rows = pad->shape[dim];
  }
  layouts::LocalShard shard = layouts::ShardFor(
      *e.rule, full, placed_->topology.tp, tp_rank, padded, pad_rows);
  std::vector<reshape::CopyOp> ops;
  const reshape::SourceTensor main = store_.Tensor(atom);
  for (const layouts::Piece& piece : shard.pieces) {
    reshape::CopyOp op;
    op.src = main;
    op.src_box = piece.global;
    if (piece.region == layouts::Region::kPad) {
      if (stored_pad > 0) {
        op.src_box.offset[static_cast<size_t>(e.rule->tp.dim)] +=
            full[static_cast<size_t>(e.rule->tp.dim)];
      } else {
        op.src = store_.Tensor(*pad);
      }
    }
    op.dst_box = piece.local;
    ops.push_back(std::move(op));
  }
  *local_shape = shard.local_shape;
  return ops;
}

Value* MegatronPlan::TensorFor(File& f, const Entry& e, const std::string& kind,
                               DType dtype, int64_t tp_rank,
                               const std::string& name) const {
  reshape::TargetTensor t;
  t.name = name;
  t.dtype = dtype;
  t.ops = OpsFor(e, kind, tp_rank, &t.shape);
  return f.AddTensor(std::move(t));
}

Value* MegatronPlan::Import(File& f, BlobCache& blobs,
                            const std::string& key) const {
  std::shared_ptr<const torchfile::TorchFile> file = blobs.Get(key);
  return f.Import(file, file->root());
}

std::vector<Value*> MegatronPlan::BuildModelChunks(
    const Rank& rank, File& model, BlobCache& blobs,
    std::vector<RankParam>* params) const {
  const Layout& layout = placed_->layout;
  const layouts::Topology& topo = placed_->topology;
  const int64_t tp_rank = rank.tp;
  std::vector<Value*> chunk_nodes;
  for (int64_t v = 0; v < topo.vpp; ++v) {
    std::vector<std::pair<std::vector<std::string>, Value*>> leaves;
    for (size_t i :
         chunk_entries_[static_cast<size_t>(rank.pp)][static_cast<size_t>(v)]) {
      const Entry& e = entries_[i];
      std::string local =
          layouts::LocalName(layout, e.name, placed_->placement);
      const bool expert = e.rule->expert && experts_;
      if (expert) {
        // This EP rank's experts only, as SequentialMLP's local_experts.<i>.
        const std::optional<layouts::ExpertName> x = layout.SplitExpert(local);
        UCP_CHECK(x.has_value(), "expert entry without expert index: ", local);
        const layouts::ExpertLocation at = experts_->Locate(x->index);
        if (at.ep_rank != rank.ep) continue;
        local = StrCat(x->prefix, kLocalExperts, at.local_index, x->suffix);
      }
      const std::string where =
          StrCat(Where(model), " > ",
                 topo.vpp == 1 ? std::string("model") : StrCat("model", v),
                 " > ", local);
      Value* value;
      if (e.kind == Entry::kOpaque) {
        value = Import(model, blobs, "extra_state/" + e.name);
      } else {
        const atoms::StoredParam& p = *e.param;
        const bool has_param_atom = store_.FindAtom(p.info.fqn, "param");
        value = TensorFor(model, e, has_param_atom ? "param" : "fp32",
                          p.info.dtype, tp_rank, where);
        if (e.kind != Entry::kBuffer) {
          params->push_back(
              {i, v, model.archive().SpecOf(value)->shape, local, expert});
        }
      }
      leaves.emplace_back(layout.KeyPath(local), value);
    }
    chunk_nodes.push_back(BuildChunk(model.arena(), leaves));
  }
  return chunk_nodes;
}

std::vector<GroupKey> MegatronPlan::GroupKeysOf(
    const std::vector<RankParam>& params) const {
  // Each param's group as the universal file records it (a source may
  // group otherwise than Megatron's default rule, e.g. one group for all);
  // the default rule where it records none.
  std::vector<GroupKey> keys;
  for (const RankParam& rp : params) {
    const atoms::StoredParam* sp = entries_[rp.entry].param;
    const int64_t stored = sp != nullptr ? sp->info.group : -1;
    keys.push_back(stored >= 0 &&
                           static_cast<size_t>(stored) < group_keys_.size()
                       ? group_keys_[static_cast<size_t>(stored)]
                       : DefaultGroupKey(rp.local_name, rp.local_shape.size()));
    // Megatron makes routed experts expert-parallel only with EP > 1 (the
    // source's EP may differ).
    if (experts_)
      keys.back().is_expert_parallel = rp.expert && placed_->topology.ep > 1;
  }
  return keys;
}

std::vector<BufferLayout> MegatronPlan::DistributedBuffers(
    int64_t pp_rank, const std::vector<RankParam>& params, const Grouping& g,
    int64_t dp, std::vector<bool>* stepped) const {
  const layouts::Topology& topo = placed_->topology;
  int64_t local_params = 0;
  for (const RankParam& rp : params)
    local_params += NumElements(rp.local_shape);
  stepped->assign(g.keys.size(), false);
  std::vector<BufferLayout> buffers;
  for (int64_t v = 0; v < topo.vpp; ++v) {
    std::vector<BufferParam> bp;
    std::vector<size_t> which;
    for (size_t k = 0; k < params.size(); ++k) {
      if (params[k].chunk != v) continue;
      const Entry& e = entries_[params[k].entry];
      BufferParam b;
      b.name = params[k].local_name;
      b.numel = NumElements(params[k].local_shape);
      bool has_copy = false;
      for (size_t ci : chunk_entries_.back().back()) {
        const Entry& c = entries_[ci];
        has_copy =
            has_copy || (c.kind == Entry::kTiedCopy && c.param == e.param);
      }
      b.shared_embedding =
          e.kind == Entry::kTiedCopy || (has_copy && topo.pp > 1);
      bp.push_back(b);
      which.push_back(k);
    }
    const BufferOptions bo =
        run_.DistributedBufferOptions(dp, pp_rank, v, local_params);
    BufferLayout lay = ComputeBufferLayout(bp, bo);
    for (size_t j = 0; j < which.size(); ++j) {
      if (lay.DpRankHolds(j, bo.dp, 0)) (*stepped)[g.group_of[which[j]]] = true;
    }
    buffers.push_back(std::move(lay));
  }
  return buffers;
}

void MegatronPlan::SetGroupStep(File& model, const RankGroups& groups,
                                size_t gi, Value* group) const {
  pickle::Arena& arena = model.arena();
  auto& entries = group->entries;
  auto step_it = std::find_if(entries.begin(), entries.end(), [](auto& kv) {
    return kv.first && kv.first->kind == Kind::kStr && kv.first->s == "step";
  });
  const bool distributed = target_format_ == TargetOptimizer::kDistributed;
  switch (TargetGroupStep(torch_step_.has_value(), distributed,
                          groups.stepped[gi], step_it != entries.end())) {
    case GroupStepAction::kKeep:
      return;
    case GroupStepAction::kDrop:
      entries.erase(step_it);
      return;
    case GroupStepAction::kTorchStep: {
      // The distributed optimizer without apex / TE stores the torch
      // step's value on every group (distrib_optimizer.py:state_dict,
      // `.item()` of the tensor).
      Value* v = torch_step_integral_
                     ? arena.Int(static_cast<int64_t>(*torch_step_))
                     : arena.Float(*torch_step_);
      if (step_it != entries.end()) {
        step_it->second = v;
      } else {
        entries.emplace_back(arena.Str("step"), v);
      }
      return;
    }
    case GroupStepAction::kFromAnotherGroup:
      break;
  }
  // No source rank stepped this group (a distributed source whose DP rank
  // 0 held none of it). FusedAdam steps every group with params together,
  // so another group's step is this one's.
  for (const Value* t : groups.templates->items) {
    if (t != nullptr && t->IsDictLike() && t->Get("step") != nullptr) {
      entries.emplace_back(arena.Str("step"),
                           model.Import(groups.file, t->Get("step")));
      return;
    }
  }
  entries.emplace_back(arena.Str("step"), arena.Int(store_.model().iteration));
  notes_.insert(StrCat("optimizer group ", groups.g.keys[gi].ToString(),
                       " had no 'step' in the source; set to the iteration ",
                       store_.model().iteration));
}

std::vector<Value*> MegatronPlan::GroupDicts(
    File& model, const RankGroups& groups,
    std::vector<std::vector<int64_t>>* ids) const {
  pickle::Arena& arena = model.arena();
  const Grouping& g = groups.g;
  std::vector<Value*> group_nodes;
  int64_t next_id = 0;
  ids->assign(g.keys.size(), {});
  for (size_t gi = 0; gi < g.keys.size(); ++gi) {
    size_t ci = 0;
    while (ci < group_keys_.size() && !(group_keys_[ci] == g.keys[gi])) ++ci;
    // Experts made expert-parallel (or dense) by another EP than the
    // source's: the group of the same hyper-parameters, the flag changed.
    bool flip = false;
    if (ci == group_keys_.size() && experts_) {
      GroupKey other = g.keys[gi];
      other.is_expert_parallel = !other.is_expert_parallel;
      ci = 0;
      while (ci < group_keys_.size() && !(group_keys_[ci] == other)) ++ci;
      flip = ci < group_keys_.size();
    }
    if (ci == group_keys_.size()) {
      throw FormatError("optimizer group ", g.keys[gi].ToString(),
                        " of this rank is not in the universal file");
    }
    Value* d = model.Import(groups.file, groups.templates->items[ci]);
    if (flip) {
      for (auto& [k, v] : d->entries) {
        if (k != nullptr && k->kind == Kind::kStr &&
            k->s == "is_expert_parallel")
          v = arena.Bool(g.keys[gi].is_expert_parallel);
      }
    }
    SetGroupStep(model, groups, gi, d);
    if (target_format_ != TargetOptimizer::kDistributed) {
      std::vector<Value*> id_nodes;
      for (size_t j = 0; j < g.members[gi].size(); ++j) {
        (*ids)[gi].push_back(next_id);
        id_nodes.push_back(arena.Int(next_id++));
      }
      d->entries.emplace_back(arena.Str("params"), arena.List(id_nodes));
    }
    group_nodes.push_back(d);
  }
  return group_nodes;
}

Value* MegatronPlan::BuildDistribOptim(int64_t tp_rank,
                                       const std::vector<RankParam>& params,
                                       const std::vector<BufferLayout>& buffers,
                                       File& distrib) const {
  pickle::Arena& da = distrib.arena();
  Value* droot = da.Dict();
  AppendEntry(da, droot, "buckets_coalesced", da.Bool(true));
  // No params (a ChainedOptimizer's half without params here): no buffers.
  for (int64_t v = 0; v < placed_->topology.vpp && !params.empty(); ++v) {
    const BufferLayout& lay = buffers[static_cast<size_t>(v)];
    std::vector<size_t> members;
    for (size_t k = 0; k < params.size(); ++k)
      if (params[k].chunk == v) members.push_back(k);
    DType pdtype = DType::kFloat32;
    if (!members.empty())
      pdtype = entries_[params[members[0]].entry].param->info.dtype;
    std::string gdt = grad_dtype_;
    if (gdt.empty()) {
      gdt =
          run_.grad_reduce_in_fp32 ? "float32" : std::string(DTypeName(pdtype));
    }
    Value* world = da.Dict();
    const int64_t n = lay.numel_unpadded();
    for (const auto& [wkey, kind] : kWorldTensors) {
      if (!members.empty() &&
          store_.FindAtom(entries_[params[members[0]].entry].param->info.fqn,
                          kind) == nullptr)
        continue;
      reshape::TargetTensor t;
      t.name = StrCat(Where(distrib), " > buffer ", v, " > ", wkey);
      t.dtype = DType::kFloat32;
      t.shape = {n};
      for (size_t j = 0; j < members.size(); ++j) {
        const RankParam& rp = params[members[j]];
        Shape local;
        for (reshape::CopyOp& op :
             OpsFor(entries_[rp.entry], kind, tp_rank, &local)) {
          op.dst_offset = lay.WorldOffset(j);
          op.dst_shape = local;
          t.ops.push_back(std::move(op));
        }
      }
      AppendEntry(da, world, wkey, distrib.AddTensor(std::move(t)));
    }
    AppendEntry(da, world, "numel_unpadded", da.Int(n));
    Value* key = da.Tuple({da.Global("torch", std::string(DTypeName(pdtype))),
                           da.Global("torch", gdt)});
    Value* per_dtype = da.Dict();
    per_dtype->entries.emplace_back(key, world);
    droot->entries.emplace_back(da.Int(v), per_dtype);
  }
  return droot;
}

Value* MegatronPlan::ParamState(File& model, const Entry& e, int64_t id,
                                int64_t tp_rank) const {
  pickle::Arena& arena = model.arena();
  Value* st = arena.Dict();
  if (torch_step_ && !step_atoms_) {
    // torch Adam's per-param step, first in its state (Adam's
    // _init_group), from a distributed source's group step.
    const float value = static_cast<float>(*torch_step_);
    std::vector<std::byte> bytes(sizeof value);
    std::memcpy(bytes.data(), &value, sizeof value);
    AppendEntry(arena, st, "step",
                model.AddConstant(DType::kFloat32, {}, std::move(bytes)));
  }
  for (const std::string& k : state_keys_) {
    const atoms::DatasetInfo* d = store_.FindAtom(e.param->info.fqn, k);
    if (d == nullptr) continue;
    const std::string name =
        StrCat(Where(model), " > optimizer > state[", id, "][", k, "]");
    Value* node;
    if (d->shape.empty()) {  // per-param scalar (torch Adam's step)
      reshape::TargetTensor t;
      t.name = name;
      t.dtype = d->dtype;
      t.ops.push_back(
          {store_.Tensor(*d), Box::Whole(Shape{}), Box::Whole(Shape{}), 0, {}});
      node = model.AddTensor(std::move(t));
    } else {
      node = TensorFor(model, e, k, d->dtype, tp_rank, name);
    }
    AppendEntry(arena, st, k, node);
  }
  return st;
}

Value* MegatronPlan::LocalOptimizer(
    int64_t tp_rank, const std::vector<RankParam>& params,
    const RankGroups& groups, const std::vector<Value*>& group_nodes,
    const std::vector<std::vector<int64_t>>& ids, File& model,
    BlobCache& blobs) const {
  pickle::Arena& arena = model.arena();
  const Grouping& g = groups.g;
  Value* state = arena.Dict();
  std::vector<Value*> fp32_groups;
  for (size_t gi = 0; gi < g.keys.size(); ++gi) {
    std::vector<Value*> fp32_list;
    for (size_t j = 0; j < g.members[gi].size(); ++j) {
      const Entry& e = entries_[params[g.members[gi][j]].entry];
      const int64_t id = ids[gi][j];
      Value* st = ParamState(model, e, id, tp_rank);
      state->entries.emplace_back(arena.Int(id), st);
      if (target_format_ == TargetOptimizer::kFloat16) {
        fp32_list.push_back(TensorFor(
            model, e, "fp32", DType::kFloat32, tp_rank,
            StrCat(Where(model), " > optimizer > fp32_from_fp16_params[", gi,
                   "][", j, "]")));
      }
    }
    fp32_groups.push_back(arena.List(fp32_list));
  }
  Value* inner = arena.Dict();
  AppendEntry(arena, inner, "state", state);
  AppendEntry(arena, inner, "param_groups", arena.List(group_nodes));
  if (target_format_ == TargetOptimizer::kFp32) return inner;
  Value* optimizer = arena.Dict();
  AppendEntry(arena, optimizer, "optimizer", inner);
  if (store_.FindOpaque("grad_scaler"))
    AppendEntry(arena, optimizer, "grad_scaler",
                Import(model, blobs, "grad_scaler"));
  AppendEntry(arena, optimizer, "fp32_from_fp16_params",
              arena.List(fp32_groups));
  return optimizer;
}

Value* MegatronPlan::BuildOptimizer(const Rank& rank,
                                    const std::vector<RankParam>& params,
                                    File& model, File* distrib,
                                    BlobCache& blobs) const {
  const layouts::Topology& t = placed_->topology;
  if (!experts_ || t.ep == 1) {  // EP 1: experts are dense params
    Value* droot = nullptr;
    Value* opt = BuildOptimizerOf(rank.tp, rank.pp, params, -1, t.dp, model,
                                  distrib, &droot, blobs);
    if (distrib != nullptr) distrib->SetRoot(droot);
    return opt;
  }
  // A ChainedOptimizer: [dense half, expert half] (the expert one over
  // expert DP); distrib_optim.pt [dense state, expert state], the dense
  // state None but in EP rank 0's folders (its DP rank 0 writes it).
  pickle::Arena& arena = model.arena();
  std::vector<Value*> halves, states;
  for (int half = 0; half < 2; ++half) {
    std::vector<RankParam> mine;
    for (const RankParam& rp : params)
      if (rp.expert == (half == 1)) mine.push_back(rp);
    Value* droot = nullptr;
    halves.push_back(BuildOptimizerOf(
        rank.tp, rank.pp, mine, half, half == 0 ? t.dp : t.ExpertDp(), model,
        half == 0 && rank.ep > 0 ? nullptr : distrib, &droot, blobs));
    if (distrib != nullptr)
      states.push_back(droot != nullptr ? droot : distrib->arena().None());
  }
  if (distrib != nullptr) distrib->SetRoot(distrib->arena().List(states));
  return arena.List(halves);
}

Value* MegatronPlan::BuildOptimizerOf(int64_t tp_rank, int64_t pp_rank,
                                      const std::vector<RankParam>& params,
                                      int half, int64_t dp, File& model,
                                      File* distrib, Value** distrib_root,
                                      BlobCache& blobs) const {
  RankGroups groups;
  groups.file = blobs.Get("optimizer/param_groups");
  groups.templates = groups.file->root();
  if (groups.templates == nullptr || groups.templates->kind != Kind::kList ||
      groups.templates->items.size() != group_keys_.size()) {
    throw FormatError("universal file ", store_.path().string(),
                      " > opaque optimizer/param_groups does not hold one "
                      "dict per optimizer group");
  }
  // Megatron-core v0.16+ (its groups carry 'default_config') sorts the
  // groups; earlier versions keep their first appearance (param_groups.h).
  bool sorted_groups = false;
  for (const Value* d : groups.templates->items) {
    sorted_groups = sorted_groups || (d != nullptr && d->IsDictLike() &&
                                      d->Get("default_config") != nullptr);
  }
  const GroupOrder order = sorted_groups ? GroupOrder::kOverridesSorted
                                         : GroupOrder::kFirstAppearance;
  groups.g = GroupParams(GroupKeysOf(params), order);
  if (params.empty() && half >= 0) {
    // A half without params on this rank (a pipeline stage without
    // experts): megatron-core v0.16 keeps the groups the other ranks'
    // half has, empty.
    std::vector<GroupKey> keys;
    for (const Entry& e : entries_) {
      if (e.kind != Entry::kParam || e.param == nullptr || e.rule == nullptr ||
          e.rule->expert != (half == 1))
        continue;
      const int64_t stored = e.param->info.group;
      GroupKey k =
          stored >= 0 && static_cast<size_t>(stored) < group_keys_.size()
              ? group_keys_[static_cast<size_t>(stored)]
              : DefaultGroupKey(e.name, e.param->info.shape.size());
      k.is_expert_parallel = half == 1;
      if (std::find(keys.begin(), keys.end(), k) == keys.end())
        keys.push_back(k);
    }
    groups.g = GroupParams(keys, order);
    for (std::vector<size_t>& m : groups.g.members) m.clear();
    groups.g.group_of.clear();
  }
  // Which groups hold an element of DP rank 0's shard (distributed only).
  groups.stepped.assign(groups.g.keys.size(), true);
  std::vector<BufferLayout> buffers;
  const bool distributed = target_format_ == TargetOptimizer::kDistributed;
  if (distributed) {
    buffers =
        DistributedBuffers(pp_rank, params, groups.g, dp, &groups.stepped);
  }
  std::vector<std::vector<int64_t>> ids;
  const std::vector<Value*> group_nodes = GroupDicts(model, groups, &ids);
  if (!distributed) {
    return LocalOptimizer(tp_rank, params, groups, group_nodes, ids, model,
                          blobs);
  }
  pickle::Arena& arena = model.arena();
  Value* inner = arena.Dict();
  AppendEntry(arena, inner, "param_groups", arena.List(group_nodes));
  Value* optimizer = arena.Dict();
  AppendEntry(arena, optimizer, "optimizer", inner);
  if (store_.FindOpaque("grad_scaler"))
    AppendEntry(arena, optimizer, "grad_scaler",
                Import(model, blobs, "grad_scaler"));
  if (distrib != nullptr)
    *distrib_root = BuildDistribOptim(tp_rank, params, buffers, *distrib);
  return optimizer;
}

Value* MegatronPlan::BuildArgs(const Rank& rank, File& model,
                               BlobCache& blobs) const {
  const int64_t tp_rank = rank.tp, pp_rank = rank.pp;
  Value* args = new_args_ ? NewArgs(model.arena(), store_.model(), *placed_)
                          : Import(model, blobs, "args");
  ArgsPatch patch;
  patch.topology = placed_->topology;
  patch.cp = cp_;
  // What a run with these options saves (also with --no-save-optim).
  patch.distributed_optimizer = options_.distributed_optimizer;
  patch.num_layers = placed_->placement.num_layers();
  patch.tp_rank = tp_rank;
  patch.pp_rank = pp_rank;
  patch.gpus_per_node = gpus_per_node_;
  patch.source_vpp = source_vpp_;
  patch.source_tp = source_tp_;
  patch.padded_vocab_size = placed_->PaddedVocabSize();
  PatchArgs(model.arena(), args, patch);
  if (experts_) PatchExpertArgs(model.arena(), args, rank);
  return args;
}

void MegatronPlan::PatchExpertArgs(pickle::Arena& arena, Value* args,
                                   const Rank& rank) const {
  // argparse.Namespace: an object whose state is its attribute dict.
  Value* dict =
      args != nullptr && args->kind == Kind::kObject ? args->state : nullptr;
  if (dict != nullptr && dict->kind == Kind::kTuple && !dict->items.empty())
    dict = dict->items[0];
  UCP_CHECK(dict != nullptr && dict->kind == Kind::kDict,
            "args has no attribute dict");
  auto set = [&](std::string_view name, Value* value) {
    for (auto& [k, v] : dict->entries) {
      if (k != nullptr && k->kind == Kind::kStr && k->s == name) {
        v = value;
        return;
      }
    }
    dict->entries.emplace_back(arena.Str(std::string(name)), value);
  };
  const layouts::Topology& t = placed_->topology;
  set("expert_model_parallel_size", arena.Int(t.ep));
  set("expert_tensor_parallel_size", arena.Int(t.ExpertTp()));
  // The folder of EP rank e is written by expert-DP rank 0 there, i.e.
  // (ETP = TP) data-parallel rank e: rank tp + TP * (e + DP * pp).
  if (rank.ep > 0) {
    const int64_t global = layouts::DenseRank(t, rank.tp, rank.ep, rank.pp);
    for (auto& [k, v] : dict->entries) {
      if (k == nullptr || k->kind != Kind::kStr || v == nullptr ||
          v->kind != Kind::kInt)
        continue;
      if (k->s == "rank") v = arena.Int(global);
      if (k->s == "local_rank") v = arena.Int(global % gpus_per_node_);
    }
  }
}

Value* MegatronPlan::BuildRngState(const Rank& rank, File& model,
                                   BlobCache& blobs) const {
  const int64_t tp_rank = rank.tp, pp_rank = rank.pp;
  std::string rk = RngStateKey(tp_rank, pp_rank, rank.ep);
  if (rank.ep > 0 && store_.FindOpaque(rk) == nullptr)
    rk = RngStateKey(tp_rank, pp_rank);  // the EP rank 0 folder's
  const bool own = store_.FindOpaque(rk) != nullptr;
  if (!own) {
    rk = RngStateKey(tp_rank % source_tp_, pp_rank % source_pp_);
    if (store_.FindOpaque(rk) == nullptr) return nullptr;
  }
  if (options_.rng_state == RngStateMode::kDrop) {
    // Not imported: its tensors would be written without an entry.
    notes_.insert(RngStateNote(options_.rng_state, {}, true));
    return nullptr;
  }
  if (!own) {
    notes_.insert(
        StrCat("rng states: target ranks without a source rank of the same "
               "(tp, pp) got the state of source rank (tp_rank % ",
               source_tp_, ", pp_rank % ", source_pp_,
               "); their random streams repeat another rank's"));
  }
  Value* rng = Import(model, blobs, rk);
  const NumpyPaths found = ApplyRngStateMode(rng, options_.rng_state);
  if (std::string note = RngStateNote(options_.rng_state, found, true);
      !note.empty())
    notes_.insert(std::move(note));
  return rng;
}

const Value* MegatronPlan::BuildRank(const Rank& rank, File& model,
                                     File* distrib, BlobCache& blobs) const {
  pickle::Arena& arena = model.arena();
  const int64_t vpp = placed_->topology.vpp;
  std::vector<RankParam> params;
  const std::vector<Value*> chunk_nodes =
      BuildModelChunks(rank, model, blobs, &params);
  Value* optimizer = write_optimizer_
                         ? BuildOptimizer(rank, params, model, distrib, blobs)
                         : nullptr;
  // The rank file's root, keys in the source's order.
  Value* root = arena.Dict();
  for (const std::string& key : top_level_keys_) {
    if (key == "model") {
      for (int64_t v = 0; v < vpp; ++v) {
        AppendEntry(arena, root,
                    vpp == 1 ? std::string("model") : StrCat("model", v),
                    chunk_nodes[static_cast<size_t>(v)]);
      }
    } else if (key == "optimizer") {
      if (optimizer != nullptr) AppendEntry(arena, root, key, optimizer);
    } else if (key == "args") {
      AppendEntry(arena, root, key, BuildArgs(rank, model, blobs));
    } else if (key == "rng_state") {
      if (Value* rng = BuildRngState(rank, model, blobs))
        AppendEntry(arena, root, key, rng);
    } else if (key == "opt_param_scheduler" && !write_optimizer_) {
      // checkpointing.py:generate_state_dict: no scheduler without the
      // optimizer (--no-save-optim).
      continue;
    } else if (key == "rerun_state_machine") {
      if (store_.FindOpaque(key))
        AppendEntry(arena, root, key, Import(model, blobs, key));
    } else {
      const std::string bk = "top_level/" + key;
      if (store_.FindOpaque(bk)) {
        AppendEntry(arena, root, key, Import(model, blobs, bk));
      } else if (new_args_ && key == "checkpoint_version") {
        AppendEntry(arena, root, key, arena.Float(3.0));
      } else if (new_args_ && (key == "iteration" ||
                               key == "num_floating_point_operations_so_far")) {
        AppendEntry(
            arena, root, key,
            arena.Int(key == "iteration" ? store_.model().iteration : 0));
      }
    }
  }
  return root;
}

void MegatronPlan::Prepare() {
  ReadMetadata();
  // Settings from the stored args (bucket sizes, grad dtype); defaults for
  // a partial Namespace.
  run_.cp = cp_;
  run_.grad_reduce_in_fp32 = false;
  {
    BlobCache blobs(store_);
    if (auto args = blobs.Find("args")) {
      try {
        run_ = ReadRunConfig(ArgsView(args->root(), "args"), /*experts=*/true);
      } catch (const FormatError&) {
      }
    }
  }
  BuildEntries();
  ReadTorchStep();
}

std::vector<std::unique_ptr<formats::PlannedFile>> MegatronPlan::Plan(
    size_t i) const {
  std::vector<std::unique_ptr<formats::PlannedFile>> files;
  if (i + 1 == units()) {  // the tracker, last
    files.push_back(formats::TextFile(
        kTrackerFile, release_ ? std::string(kReleaseDir)
                               : std::to_string(store_.model().iteration)));
    return files;
  }
  const layouts::Topology& t = placed_->topology;
  Rank rank;
  rank.pp = static_cast<int64_t>(i) / (t.ep * t.tp);
  rank.ep = static_cast<int64_t>(i) % (t.ep * t.tp) / t.tp;
  rank.tp = static_cast<int64_t>(i) % t.tp;
  const fs::path dir =
      IterDir() / RankDirName(rank.tp, rank.pp, t.pp, rank.ep, t.ep);
  File* distrib = nullptr;
  if (target_format_ == TargetOptimizer::kDistributed && write_optimizer_) {
    auto d = std::make_unique<File>(dir / kDistribOptimFile);
    distrib = d.get();
    files.push_back(std::move(d));
  }
  auto model = std::make_unique<File>(dir / kModelFile);
  try {
    // Blobs stay open only while this rank file is planned (their imported
    // tensors keep the ones they need).
    BlobCache blobs(store_);
    model->SetRoot(BuildRank(rank, *model, distrib, blobs));
  } catch (Error& e) {
    e.AddContext(Where(*model));
    throw;
  }
  files.push_back(std::move(model));
  return files;
}

formats::TargetSummary MegatronPlan::Summary() const {
  formats::TargetSummary out;
  out.notes.assign(notes_.begin(), notes_.end());
  const layouts::Topology& t = placed_->topology;
  std::string flags = StrCat("--tensor-model-parallel-size ", t.tp,
                             " --pipeline-model-parallel-size ", t.pp);
  if (t.vpp > 1)
    flags += StrCat(" --num-virtual-stages-per-pipeline-rank ", t.vpp);
  if (experts_) flags += StrCat(" --expert-model-parallel-size ", t.ep);
  if (options_.distributed_optimizer) flags += " --use-distributed-optimizer";
  if (options_.no_optimizer) flags += " --no-load-optim";
  if (options_.rng_state == RngStateMode::kDrop) flags += " --no-load-rng";
  out.details["megatron_flags"] = flags;
  out.resume_hint = "Megatron-LM: --load <output> " + flags;
  return out;
}

}  // namespace

std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input, const TargetOptions& options,
    const reshape::ExecutorOptions& executor) {
  return std::make_unique<MegatronPlan>(input, options, executor);
}

TargetSummary WriteTarget(const universal::UniversalInput& input,
                          const fs::path& out_dir, const TargetOptions& options,
                          const reshape::ExecutorOptions& executor) {
  formats::EmitOptions o;
  o.executor = executor;
  const formats::TargetSummary s =
      formats::Emit(MegatronPlan(input, options, executor), input, out_dir, o);
  return TargetSummary{s.files, s.bytes, s.notes};
}

TargetSummary WriteTarget(const atoms::AtomStoreReader& store,
                          const fs::path& out_dir, const TargetOptions& options,
                          const reshape::ExecutorOptions& executor) {
  return WriteTarget(*universal::StoreInput(store), out_dir, options, executor);
}

}  // namespace ucp::megatron
