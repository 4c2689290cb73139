// Planning a torch_dist checkpoint from universal content (torch_dist.h).
//
// Keys and chunks, for a target TP x PP (x VPP) x DP:
//   every param of the layout (tied copies are not stored) under its model
//   key (ModelKeyOf: decoder layers stacked, global layer numbers); the
//   chunks of TP rank r are its local tensor's pieces (layouts::ShardFor):
//   a replicated tensor is one chunk (TP rank 0's), a split one a chunk per
//   piece at the piece's offsets in the global tensor (SwiGLU's fc1: a gate
//   and an up chunk), a vocabulary-padded one the rank's padded rows; a
//   stacked key's chunk is [1, ...] at [layer, ...];
//   without it, the non-distributed optimizer's optimizer.state.{fp32_param,
//   exp_avg, exp_avg_sq}.<model key> with the same chunks and its torch Adam
//   step as common_step of the common state; with the distributed
//   optimizer, optimizer.state.{param, exp_avg,
//   exp_avg_sq}.<model key> with the same chunks (fully_reshardable), or
//   on request the DDP buckets' state (dp_reshardable: per (tp, pp) group,
//   model chunk and bucket, 1-D keys of the bucket's unpadded size; DP rank
//   r writes its slice, a chunk per contiguous piece of a param, zero chunks
//   for the gaps; the buffer layout of megatron/buffer_layout.h for the
//   target DP, as the legacy writer lays out distrib_optim.pt);
//   extra states and rng states as Megatron's ShardedObjects; common.pt and
//   the common_state item (the args patched for the target).
// Mixture of experts (a layout with experts; EP / ETP of the topology):
//   routed experts under .mlp.experts.experts. with the global expert axis
//   after the layer axis ([L, E, ...]; with a dense layer or a list-valued
//   or > 1 moe_layer_freq every layer key per layer, decoder.layers.<g>.…
//   [E, ...], as TransformerBlock's non_homogeneous_layers), each expert's
//   matrices split over ETP (TpSizeFor), its chunks in the files of its EP
//   rank's expert-DP ranks; one _extra_state object per (layer, global
//   expert); at EP > 1 the chained optimizer: common state {0: dense, 1:
//   expert} with each half's groups (is_expert_parallel), dp_reshardable
//   buckets chained_0.… (dense, over DP) and chained_1.…dp_group_idx_<etp +
//   ETP * (ep + EP * pp)> (experts of that EP rank in named_parameters()
//   order, over expert DP); at EP 1 the experts are dense params of the one
//   optimizer (megatron-core marks them expert-parallel only at EP > 1).
// Files: global rank R = tp + TP * (dp + DP * pp) writes __R_0.distcp; each
// chunk goes to the DP rank of its (tp, pp) with the fewest bytes so far
// (the fully parallel save's spreading), objects first in each file. Units:
// one per rank file, then common.pt and .metadata, then metadata.json, then
// the tracker.

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <span>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/common/train_state.h"
#include "engine/formats/dcp/items.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron/param_groups.h"
#include "engine/formats/megatron/target.h"
#include "engine/formats/megatron/torch_step.h"
#include "engine/formats/megatron_torch_dist/keys.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"
#include "engine/formats/placed_target.h"
#include "layouts/layout.h"
#include "layouts/placement.h"

namespace ucp::torch_dist {
namespace {

namespace fs = std::filesystem;
using layouts::Layout;
using layouts::Rule;
using pickle::Kind;
using pickle::Value;

// The optimizer state keys by model key and their atoms: the distributed
// optimizer's fully_reshardable form, the non-distributed optimizer's.
constexpr std::pair<const char*, const char*> kStateKeys[] = {
    {"param", "fp32"}, {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}};
constexpr std::pair<const char*, const char*> kNonDistributedKeys[] = {
    {"fp32_param", "fp32"},
    {"exp_avg", "exp_avg"},
    {"exp_avg_sq", "exp_avg_sq"}};

std::vector<std::byte> FloatBytes(float v) {
  std::vector<std::byte> b(sizeof v);
  std::memcpy(b.data(), &v, sizeof v);
  return b;
}

class TorchDistPlan : public formats::TargetPlan {
 public:
  TorchDistPlan(const universal::UniversalInput& input,
                const TargetOptions& options)
      : input_(input), options_(options), blobs_(input) {
    ReadMetadata();
    PlanKeys();
  }
  size_t units() const override { return static_cast<size_t>(world_) + 3; }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t i) const override;
  fs::path checkpoint_dir() const override { return iter_dir_; }
  formats::TargetSummary Summary() const override;
  std::string label() const override { return "writing torch_dist files"; }

 private:
  void ReadMetadata();
  // experts_, per_layer_, te_moe_norm_, the expert placement.
  void ReadExpertSettings();
  void PlanKeys();
  // A trainable param of a (pp rank, chunk) buffer, in model order.
  struct Member {
    const atoms::StoredParam* param;
    const Rule* rule;
    int64_t pp_rank;
    int64_t chunk;
    bool shared;  // shared_embedding: a tied copy or its original
    // A routed expert's (layer, global expert, ep rank); -1 for the rest.
    int64_t layer = -1, expert = -1, ep_rank = -1;
  };
  // The target key of a canonical name: ModelKeyOf's, the layer put back
  // into a per-layer key (per_layer_), and with a Transformer Engine MoE
  // layer spec its pre_mlp_layernorm kept; `lead`: the offsets on the
  // prepended axes (layer of a stacked key, then the global expert).
  struct TargetKey {
    std::string key;
    int64_t layer = -1;   // the global layer (names with one)
    int64_t expert = -1;  // the global expert (routed experts)
    std::vector<int64_t> lead;
    std::vector<int64_t> grid;  // the prepended axes' sizes
  };
  TargetKey KeyOf(const std::string& name) const;
  void PlanBuckets(std::vector<Member>& members);
  void AddTo(int64_t rank, dcp::PlannedItem item, bool object);
  // The optimizer's state dict object of a dp_reshardable group (chained
  // optimizer: of half `half`, 0 dense, 1 experts; -1 not chained).
  std::string GroupsObjectBytes(int half) const;
  size_t KeyIndex(const std::string& fqn, bool tensor, DType dtype,
                  const Shape& shape);
  // Adds `item` to the file of the (expert) data-parallel rank of (tp_rank,
  // pp_rank) (with ep_rank >= 0: of (etp rank tp_rank, ep_rank, pp_rank))
  // holding the fewest bytes so far.
  void AddItem(int64_t tp_rank, int64_t pp_rank, dcp::PlannedItem item,
               uint64_t bytes, bool object, int64_t ep_rank = -1);
  // The local tensor of TP rank `tp_rank` of a param's `kind`: its shard
  // and one op per piece (from the atom or its pad atom; destination: the
  // piece's box of the local tensor); the padded rows of a vocab rule.
  struct ShardOps {
    layouts::LocalShard shard;
    std::vector<reshape::CopyOp> ops;
    int64_t padded = 0;
  };
  ShardOps OpsOf(const atoms::StoredParam& p, const Rule& rule,
                 const std::string& kind, int64_t tp_rank) const;
  // The chunks of TP rank `tp_rank` of a param's `kind` (ops from its atom
  // and pad atom); prefixed with the key's prepended axes (`lead`: a stacked
  // key's layer, an expert key's global expert).
  std::vector<dcp::PlannedItem> Chunks(const atoms::StoredParam& p,
                                       const Rule& rule,
                                       const std::string& kind, int64_t tp_rank,
                                       std::span<const int64_t> lead) const;
  std::string ObjectBytes(const std::string& blob_key) const;

  // PlanKeys' steps.
  // The entries in canonical order: the source's list, else the params and
  // the extra states.
  std::vector<std::pair<std::string, std::string>> Entries() const;
  // Plans entry `name` of `kind` ("param", "buffer" or "opaque"): a tied
  // copy only joins `members` (as its original), an extra state becomes its
  // object, a param or buffer PlanParam's. Returns whether it planned an
  // extra state.
  bool PlanEntry(const std::string& name, const std::string& kind,
                 std::vector<Member>& members);
  // A param's (or buffer's) model key and each TP rank's chunks of it, and
  // unless the state goes to buckets its optimizer state keys and chunks; a
  // trainable param joins `members`.
  void PlanParam(const std::string& name, const Rule& rule,
                 const TargetKey& key, int64_t pp_rank, int64_t vp_chunk,
                 std::vector<Member>& members);
  // Chunks(p, rule, kind, tp_rank, lead) as items of key `key`, spread
  // over the (expert) DP ranks of (tp_rank, pp_rank) (ep_rank: AddItem).
  void AddChunks(const atoms::StoredParam& p, const Rule& rule,
                 const std::string& kind, int64_t tp_rank,
                 std::span<const int64_t> lead, int64_t pp_rank,
                 int64_t ep_rank, size_t key, uint64_t element_size);
  // The rng state objects of every (tp, pp), notes on fallbacks.
  void PlanRngStates();
  // The common_state object (in a file of TP rank 0 of the first stage).
  void PlanCommonState();

  // PlanBuckets' steps.
  // The local tensors of one TP rank's members, each kind's made once.
  class MemberOps {
   public:
    MemberOps(const TorchDistPlan& plan, int64_t tp_rank)
        : plan_(plan), tp_rank_(tp_rank) {}
    const ShardOps& Get(const Member& m, const std::string& kind);

   private:
    const TorchDistPlan& plan_;
    int64_t tp_rank_;
    std::map<std::pair<const Member*, std::string>, ShardOps> ops_;
  };
  // One model chunk's buffer of a (tp, pp) group.
  struct ChunkBuffer {
    int64_t tp = 0, pp = 0, v = 0;
    // The expert half's ep rank (its tp: the etp rank); -1: dense.
    int64_t ep = -1;
    int64_t dp = 1;  // the data-parallel size of the optimizer's sharding
    // [chained_<i>.]optimizer.distributed.dp_group_idx_<group>
    std::string prefix;
    std::string dtype;  // (torch.<param dtype>, torch.<grad dtype>)
    DType param_dtype = DType::kBFloat16;
    std::vector<const Member*> members;  // the buffer's, in model order
    megatron::BufferLayout layout;       // indexed like `members`
  };
  // A member's range in its bucket (offsets from the bucket's start).
  struct BucketMember {
    int64_t start, end;
    const Member* member;
  };
  using BucketMembers = std::vector<BucketMember>;
  // The global rank of data-parallel rank `r` of `buf`'s group.
  int64_t BufferRank(const ChunkBuffer& buf, int64_t r) const {
    return buf.ep >= 0 ? layouts::ExpertRank(placed_->topology, buf.tp, buf.ep,
                                             r, buf.pp)
                       : Rank(buf.tp, r, buf.pp);
  }
  // The buckets of group (tp, pp) (with ep >= 0: the expert half's group
  // (etp rank tp, ep, pp) of the chained optimizer), then its objects (DP
  // rank 0's).
  void PlanBucketGroup(const std::vector<const Member*>& members,
                       const megatron::RunConfig& run, int64_t tp, int64_t pp,
                       int64_t ep);
  // Model chunk `v`'s members and buffer layout into `buf` (its tp and pp
  // set); `local_params` counts the elements of the stage's members.
  void LayOutChunk(const std::vector<const Member*>& members,
                   const megatron::RunConfig& run, int64_t local_params,
                   int64_t v, MemberOps& ops, ChunkBuffer& buf) const;
  // Bucket `b` of `buf`: a key per state kind, each DP rank's slice of it.
  void PlanBucket(const ChunkBuffer& buf, size_t b, MemberOps& ops);
  // The items of global rank `rank` for elements [lo, hi) of bucket key
  // `key`: a chunk per flat box of each member piece, zeros in the gaps.
  void PlanBucketSlice(const BucketMembers& order, const std::string& kind,
                       size_t key, int64_t rank, int64_t lo, int64_t hi,
                       MemberOps& ops);
  // The optimizer's entry of the common dict (chained optimizer: half
  // `half`).
  Value* OptimizerCommon(
      pickle::Arena& arena,
      const std::function<Value*(const std::string&)>& import,
      const std::function<Value*(float)>& scalar, int half) const;
  // The common dict; `scalar` makes a float32 scalar tensor node.
  pickle::Value* BuildCommon(
      pickle::Arena& arena,
      const std::function<Value*(const std::string&)>& import,
      const std::function<Value*(float)>& scalar) const;
  // The stored param groups (blob "optimizer/param_groups", through
  // `import`) for the target's optimizer: 'step' on each group for the
  // distributed optimizer (its state_dict keeps torch Adam's step there),
  // none for the non-distributed one (the step is common_step) unless the
  // step is FusedAdam's, whose groups keep it.
  // With `half` >= 0 only the groups of that half of the chained optimizer
  // of a mixture-of-experts model (0: not is_expert_parallel, 1: is).
  std::vector<Value*> TargetGroups(
      pickle::Arena& arena,
      const std::function<Value*(const std::string&)>& import,
      int half = -1) const;
  std::vector<Value*> DefaultGroups(pickle::Arena& arena) const;
  const char* Sharding() const {
    return non_distributed_  ? "non_distributed"
           : dp_reshardable_ ? "dp_reshardable"
                             : "fully_reshardable";
  }
  int64_t Rank(int64_t tp, int64_t dp, int64_t pp) const {
    return tp + placed_->topology.tp * (dp + placed_->topology.dp * pp);
  }

  const universal::UniversalInput& input_;
  TargetOptions options_;
  mutable formats::BlobCache blobs_;
  // The layout, variables, vocabulary rows, topology and placement.
  std::optional<formats::PlacedTarget> placed_;
  megatron::MegatronExtras meta_;  // the Megatron family's record
  int64_t source_tp_ = 1, source_pp_ = 1, source_vpp_ = 1, cp_ = 1;
  bool write_optimizer_ = false;
  bool dp_reshardable_ = false;
  // Mixture of experts: routed experts placed by EP / ETP; every layer key
  // per layer (Megatron's non_homogeneous_layers: a moe_layer_freq list or
  // > 1); the MoE pre-MLP norm as pre_mlp_layernorm (Transformer Engine's
  // layer spec; the local spec's is mlp.linear_fc1.layer_norm_weight).
  bool experts_ = false;
  // Experts in their own half of a ChainedOptimizer (EP > 1: megatron-core
  // marks expert params allreduce=False only with expert parallelism; at
  // EP 1 they are in the dense optimizer's groups and buffers).
  bool expert_parallel_ = false;
  bool per_layer_ = false;
  bool te_moe_norm_ = false;
  std::optional<layouts::ExpertPlacement> expert_placement_;
  bool non_distributed_ = false;
  // The Adam step (the iteration when the content holds none).
  megatron::TorchStep step_;
  // FusedAdam's (an int on the groups, none per param): a non-distributed
  // target's groups keep it beside common_step.
  bool FusedStep() const { return !step_.from_atoms && step_.integral; }
  int64_t world_ = 1;
  fs::path iter_dir_;
  bool release_ = false;  // iter_dir_ is release/ (and the tracker says so)

  std::vector<dcp::PlannedKey> keys_;
  std::map<std::string, size_t> key_index_;
  std::vector<size_t> entry_order_;
  std::vector<std::vector<dcp::PlannedItem>> objects_, tensors_;
  std::vector<uint64_t> rank_bytes_;
  std::optional<dcp::ItemFiles> files_;
  mutable std::set<std::string> notes_;
};

void TorchDistPlan::ReadMetadata() {
  const universal::Model& model = input_.model();
  megatron::MegatronTarget target = megatron::PlaceMegatronTarget(
      input_, options_.topology, options_.true_vocab_size);
  meta_ = std::move(target.meta);
  placed_ = std::move(target.placed);
  ReadExpertSettings();
  const universal::SourceInfo& source = model.source;
  source_tp_ = universal::SourceInfo::SizeOr1(source.tp);
  source_pp_ = universal::SourceInfo::SizeOr1(source.pp);
  source_vpp_ = universal::SourceInfo::SizeOr1(source.vpp);
  cp_ = universal::SourceInfo::SizeOr1(source.cp);
  world_ = placed_->topology.tp * placed_->topology.pp * placed_->topology.dp;
  // Content without Megatron args (a transformers folder's import) gets
  // them built (BuildCommon); at iteration 0 as `release`, the only
  // iteration 0 Megatron-LM's read_metadata takes.
  // A release source stays one.
  release_ = meta_.release.value_or(false);
  if (model.iteration == 0 && input_.FindOpaque("args") == nullptr) {
    pickle::Arena probe;
    release_ = release_ || megatron::NewArgs(probe, model, *placed_) != nullptr;
  }
  iter_dir_ = megatron::IterDirName(model.iteration, release_);

  bool any_state = false;
  for (const atoms::DatasetInfo& d : input_.datasets())
    if (d.kind == atoms::DatasetKind::kAtom &&
        (d.state_kind == "exp_avg" || d.state_kind == "exp_avg_sq"))
      any_state = true;
  write_optimizer_ = any_state && !options_.no_optimizer;
  const std::string sharding =
      options_.optimizer_sharding.value_or("fully_reshardable");
  if (sharding != "fully_reshardable" && sharding != "dp_reshardable") {
    throw UsageError("--optimizer-sharding '", sharding,
                     "': use fully_reshardable or dp_reshardable");
  }
  if (options_.optimizer_sharding && !options_.distributed_optimizer) {
    throw UsageError("--optimizer-sharding ", sharding,
                     " is a form of the distributed optimizer's state: add "
                     "--distributed-optimizer (without it the optimizer "
                     "state takes the non-distributed optimizer's form)");
  }
  dp_reshardable_ = sharding == "dp_reshardable";  // (implies distributed)
  non_distributed_ = write_optimizer_ && !options_.distributed_optimizer;
  if (write_optimizer_) {
    if (auto step =
            megatron::FindTorchStep(input_, true, reshape::ExecutorOptions{})) {
      step_ = *step;
    } else {
      const int64_t source_step = formats::OptimizerStep(model);
      step_.value = static_cast<double>(source_step);
      notes_.insert(StrCat(
          "the universal content holds no Adam step: the optimizer's step "
          "is set to the source optimizer's (else the iteration), ",
          source_step));
    }
  }
}

void TorchDistPlan::ReadExpertSettings() {
  const Layout& layout = placed_->layout;
  if (!layout.experts()) return;
  experts_ = true;
  layouts::Topology& t = placed_->topology;
  t.etp = t.ExpertTp();  // the args record it
  expert_parallel_ = t.ep > 1;
  expert_placement_.emplace(layout.NumExperts(placed_->vars), t.ep);
  // TransformerBlock.sharded_state_dict: per-layer keys with a list-valued
  // moe_layer_freq or one > 1; the universal content's variables say which
  // layers are dense when there are no args.
  std::optional<megatron::ArgsView> args;
  if (std::shared_ptr<const torchfile::TorchFile> a = blobs_.Find("args")) {
    try {
      args.emplace(a->root(), "args");
    } catch (const FormatError&) {
    }
  }
  const pickle::Value* freq = args ? args->Find("moe_layer_freq") : nullptr;
  if (freq != nullptr) {
    per_layer_ = freq->kind == Kind::kList || freq->kind == Kind::kTuple ||
                 (freq->kind == Kind::kInt && freq->i > 1);
  }
  for (int64_t l = 0; l < placed_->placement.num_layers(); ++l)
    if (!layout.IsMoeLayer(l, placed_->vars)) per_layer_ = true;
  // gpt_layer_specs: the local spec's MoE layer keeps its pre-MLP norm as
  // mlp.linear_fc1.layer_norm_weight in the sharded state dict (its
  // sharded_state_dict_keys_map), Transformer Engine's as pre_mlp_layernorm.
  std::optional<std::string> impl;
  if (args) {
    try {
      impl = args->Str("transformer_impl");
    } catch (const FormatError&) {
    }
  }
  te_moe_norm_ = impl && *impl == "transformer_engine";
}

TorchDistPlan::TargetKey TorchDistPlan::KeyOf(const std::string& name) const {
  const KeyOfName k = ModelKeyOf(name);
  TargetKey out;
  out.key = k.key;
  out.layer = k.layer;
  out.expert = k.expert;
  constexpr std::string_view kDecoder = "decoder.layers.";
  if (k.layer >= 0 && te_moe_norm_ &&
      name.find(".pre_mlp_layernorm.") != std::string::npos)
    out.key = StrCat(kDecoder, name.substr(name.find("pre_mlp_layernorm.")));
  if (k.layer >= 0 && !IsStacked(out.key))
    throw FormatError("a layer name torch_dist cannot stack");
  if (k.layer >= 0) {
    if (per_layer_) {
      out.key = StrCat(kDecoder, k.layer, ".", out.key.substr(kDecoder.size()));
    } else {
      out.lead.push_back(k.layer);
      out.grid.push_back(placed_->placement.num_layers());
    }
  }
  if (k.expert >= 0) {
    out.lead.push_back(k.expert);
    if (!expert_placement_)
      throw FormatError("a routed expert's param in a layout without experts");
    out.grid.push_back(expert_placement_->num_experts());
  }
  return out;
}

std::vector<Value*> TorchDistPlan::TargetGroups(
    pickle::Arena& arena,
    const std::function<Value*(const std::string&)>& import, int half) const {
  std::vector<Value*> groups;
  if (Value* list = import("optimizer/param_groups");
      list != nullptr && list->kind == Kind::kList)
    groups.assign(list->items.begin(), list->items.end());
  else if (write_optimizer_)
    groups = DefaultGroups(arena);
  if (experts_) {
    // Each half's groups (not chained, EP 1: the dense ones); a source
    // without expert parallelism has no expert groups: the expert half's
    // are its dense groups of the keys Megatron's rule gives the routed
    // experts, marked is_expert_parallel.
    auto is_expert = [](const Value* g) {
      const Value* x = g != nullptr && g->IsDictLike()
                           ? pickle::DictGet(g, "is_expert_parallel")
                           : nullptr;
      return x != nullptr && x->kind == Kind::kBool && x->b;
    };
    std::vector<Value*> dense, expert;
    for (Value* g : groups) (is_expert(g) ? expert : dense).push_back(g);
    if (half == 1 && expert.empty()) {
      std::vector<megatron::GroupKey> wanted;
      for (const atoms::StoredParam& p : input_.params()) {
        const Rule* r = placed_->layout.Find(p.info.fqn, placed_->vars);
        if (r == nullptr || !r->expert ||
            p.info.kind != atoms::ParamKind::kParam)
          continue;
        megatron::GroupKey k =
            megatron::DefaultGroupKey(p.info.fqn, p.info.shape.size());
        k.is_expert_parallel = true;
        if (std::find(wanted.begin(), wanted.end(), k) == wanted.end())
          wanted.push_back(k);
      }
      for (const megatron::GroupKey& k : wanted) {
        for (Value* g : dense) {
          megatron::GroupKey d = megatron::StoredGroupKey(g);
          d.is_expert_parallel = true;
          if (d != k) continue;
          Value* copy = arena.Dict();
          for (const auto& [key, v] : g->entries) {
            const bool flag = key != nullptr && key->kind == Kind::kStr &&
                              key->s == "is_expert_parallel";
            copy->entries.emplace_back(key, flag ? arena.Bool(true) : v);
          }
          expert.push_back(copy);
          break;
        }
      }
    }
    groups = half == 1 ? expert : dense;
  }
  for (Value*& g : groups) {
    if (g == nullptr || !g->IsDictLike()) continue;
    Value* copy = arena.Dict();
    bool has = false;
    for (const auto& [k, v] : g->entries) {
      const bool step = k != nullptr && k->kind == Kind::kStr && k->s == "step";
      if (step && non_distributed_ && !FusedStep()) continue;
      has = has || step;
      copy->entries.emplace_back(k, v);
    }
    if (!has && !non_distributed_) {
      copy->entries.emplace_back(
          arena.Str("step"), step_.integral
                                 ? arena.Int(static_cast<int64_t>(step_.value))
                                 : arena.Float(step_.value));
    }
    g = copy;
  }
  return groups;
}

// Megatron's groups (param_groups.h) of the first stage's params, for
// content from another framework (no stored groups): each group's
// hyper-parameters those of the source's group holding its first param
// (torch Adam's defaults where the source has none), 'params' numbered as
// torch's state_dict numbers them (Megatron's load takes the group count and
// hyper-parameters, and its own params).
std::vector<Value*> TorchDistPlan::DefaultGroups(pickle::Arena& arena) const {
  const universal::OptimizerInfo& optimizer = input_.model().optimizer;
  std::map<std::string, const universal::ParamGroup*> source_group;
  if (optimizer.groups) {
    for (const universal::ParamGroup& g : *optimizer.groups)
      if (g.params)
        for (const std::string& p : *g.params) source_group.emplace(p, &g);
  }
  std::vector<const atoms::StoredParam*> params;
  std::vector<megatron::GroupKey> keys;
  for (const atoms::StoredParam& p : input_.params()) {
    if (p.info.kind != atoms::ParamKind::kParam || p.info.frozen) continue;
    const Rule* r = placed_->layout.Find(p.info.fqn, placed_->vars);
    if (r == nullptr ||
        layouts::HomeOf(placed_->layout, *r, p.info.fqn, placed_->placement)
                .pp_rank != 0)
      continue;
    params.push_back(&p);
    keys.push_back(megatron::DefaultGroupKey(p.info.fqn, p.info.shape.size()));
    keys.back().is_expert_parallel = r->expert && expert_parallel_;
  }
  const megatron::Grouping grouping = megatron::GroupParams(keys);
  std::vector<Value*> out;
  int64_t index = 0;
  bool defaults = false;
  for (size_t i = 0; i < grouping.keys.size(); ++i) {
    const megatron::GroupKey& key = grouping.keys[i];
    const auto it =
        source_group.find(params[grouping.members[i].front()]->info.fqn);
    const universal::ParamGroup* src =
        it != source_group.end() ? it->second : nullptr;
    auto number = [&](std::optional<double> universal::ParamGroup::*k,
                      double def) {
      const bool have = src != nullptr && (src->*k).has_value();
      defaults = defaults || !have;
      return have ? *(src->*k) : def;
    };
    auto flag = [&](const char* k) {
      const json::Value* v =
          src != nullptr ? universal::FindMember(src->other, k) : nullptr;
      return v != nullptr && v->is_bool() && v->AsBool();
    };
    double b1 = 0.9, b2 = 0.999;
    if (src != nullptr && src->betas) {
      b1 = (*src->betas)[0];
      b2 = (*src->betas)[1];
    } else {
      defaults = true;
    }
    std::vector<Value*> members;
    for (size_t n = 0; n < grouping.members[i].size(); ++n)
      members.push_back(arena.Int(index++));
    Value* g = arena.Dict();
    auto put = [&](const char* k, Value* v) {
      g->entries.emplace_back(arena.Str(k), v);
    };
    put("lr", arena.Float(number(&universal::ParamGroup::lr, 1e-3)));
    put("betas", arena.Tuple({arena.Float(b1), arena.Float(b2)}));
    put("eps", arena.Float(number(&universal::ParamGroup::eps, 1e-8)));
    put("weight_decay",
        arena.Float(number(&universal::ParamGroup::weight_decay, 0.0)));
    put("amsgrad", arena.Bool(flag("amsgrad")));
    put("maximize", arena.Bool(flag("maximize")));
    put("foreach", arena.None());
    put("capturable", arena.Bool(false));
    put("differentiable", arena.Bool(false));
    put("fused", arena.None());
    put("wd_mult", arena.Float(key.wd_mult));
    put("lr_mult", arena.Float(key.lr_mult));
    put("is_expert_parallel", arena.Bool(key.is_expert_parallel));
    put("is_decoupled_lr", arena.Bool(key.is_decoupled_lr));
    put("params", arena.List(std::move(members)));
    out.push_back(g);
  }
  notes_.insert(StrCat(
      "the source keeps no Megatron param groups: wrote Megatron's ",
      out.size(), " (weight decay by its rule)",
      defaults ? ", with torch Adam's defaults for the hyper-parameters the "
                 "source does not record (Megatron's scheduler sets lr and "
                 "weight decay at every step)"
               : ""));
  return out;
}

size_t TorchDistPlan::KeyIndex(const std::string& fqn, bool tensor, DType dtype,
                               const Shape& shape) {
  auto [it, fresh] = key_index_.try_emplace(fqn, keys_.size());
  if (fresh) {
    dcp::PlannedKey k;
    k.fqn = fqn;
    k.tensor = tensor;
    k.dtype = dtype;
    k.shape = shape;
    keys_.push_back(std::move(k));
    entry_order_.push_back(it->second);
  } else if (keys_[it->second].shape != shape ||
             keys_[it->second].dtype != dtype) {
    throw FormatError("universal input ", input_.path().string(), " > ", fqn,
                      ": its layers disagree on shape or dtype (",
                      ShapeString(shape), " ", DTypeName(dtype), " against ",
                      ShapeString(keys_[it->second].shape), " ",
                      DTypeName(keys_[it->second].dtype), ")");
  }
  return it->second;
}

void TorchDistPlan::AddItem(int64_t tp_rank, int64_t pp_rank,
                            dcp::PlannedItem item, uint64_t bytes, bool object,
                            int64_t ep_rank) {
  const layouts::Topology& t = placed_->topology;
  auto rank = [&](int64_t d) {
    return ep_rank >= 0 ? layouts::ExpertRank(t, tp_rank, ep_rank, d, pp_rank)
                        : Rank(tp_rank, d, pp_rank);
  };
  int64_t best = rank(0);
  for (int64_t d = 1; d < (ep_rank >= 0 ? t.ExpertDp() : t.dp); ++d) {
    const int64_t r = rank(d);
    if (rank_bytes_[static_cast<size_t>(r)] <
        rank_bytes_[static_cast<size_t>(best)])
      best = r;
  }
  rank_bytes_[static_cast<size_t>(best)] += std::max<uint64_t>(bytes, 1);
  (object ? objects_ : tensors_)[static_cast<size_t>(best)].push_back(
      std::move(item));
}

TorchDistPlan::ShardOps TorchDistPlan::OpsOf(const atoms::StoredParam& p,
                                             const Rule& rule,
                                             const std::string& kind,
                                             int64_t tp_rank) const {
  const atoms::DatasetInfo* atom = input_.FindAtom(p.info.fqn, kind);
  if (atom == nullptr) {
    throw FormatError("universal input ", input_.path().string(), " > param ",
                      p.info.fqn, ": no '", kind, "' atom");
  }
  const atoms::DatasetInfo* pad = input_.FindPadAtom(p.info.fqn, kind);
  if (pad == nullptr && kind == "param")
    pad = input_.FindPadAtom(p.info.fqn, "fp32");
  Shape full = p.info.shape;
  int64_t pad_rows = 0, stored_pad = 0;
  ShardOps out;
  const size_t dim = static_cast<size_t>(rule.tp.dim);
  if (std::optional<int64_t> pd =
          layouts::PaddedDimSize(rule, placed_->vars, placed_->topology.tp)) {
    out.padded = *pd;
    if (placed_->vocab_rows && *placed_->vocab_rows < full.at(dim)) {
      stored_pad = full[dim] - *placed_->vocab_rows;
      full[dim] = *placed_->vocab_rows;
    }
    if (out.padded < full[dim]) {
      throw LayoutError("param ", p.info.fqn, ": the padded vocabulary (",
                        out.padded, " rows for tp ", placed_->topology.tp,
                        ") is smaller than the stored ", full[dim], " rows");
    }
    pad_rows = stored_pad;
    if (pad != nullptr && dim < pad->shape.size()) pad_rows = pad->shape[dim];
  }
  out.shard = layouts::ShardFor(
      rule, full,
      rule.tp.split ? layouts::TpSizeFor(rule, placed_->topology) : 1,
      rule.tp.split ? tp_rank : 0, out.padded, pad_rows);
  const reshape::SourceTensor main = input_.Tensor(*atom);
  for (const layouts::Piece& piece : out.shard.pieces) {
    reshape::CopyOp op;
    op.src = main;
    op.src_box = piece.global;
    if (piece.region == layouts::Region::kPad) {
      if (stored_pad > 0) {
        op.src_box.offset[dim] += full[dim];
      } else {
        op.src = input_.Tensor(*pad);
      }
    }
    op.dst_box = piece.local;
    out.ops.push_back(std::move(op));
  }
  return out;
}

std::vector<dcp::PlannedItem> TorchDistPlan::Chunks(
    const atoms::StoredParam& p, const Rule& rule, const std::string& kind,
    int64_t tp_rank, std::span<const int64_t> lead) const {
  ShardOps so = OpsOf(p, rule, kind, tp_rank);
  const layouts::LocalShard& shard = so.shard;
  const size_t dim = static_cast<size_t>(rule.tp.dim);
  const int64_t padded = so.padded;
  std::vector<dcp::PlannedItem> out;
  if (padded > 0) {
    // The rank's rows of the padded tensor, one chunk.
    dcp::PlannedItem it;
    it.chunk.offsets.assign(shard.local_shape.size(), 0);
    it.chunk.offsets[dim] = tp_rank * shard.local_shape[dim];
    it.chunk.sizes = shard.local_shape;
    it.ops = std::move(so.ops);
    out.push_back(std::move(it));
  } else {
    for (size_t i = 0; i < shard.pieces.size(); ++i) {
      const layouts::Piece& piece = shard.pieces[i];
      if (piece.region != layouts::Region::kMain) continue;
      dcp::PlannedItem it;
      it.chunk.offsets = piece.global.offset;
      it.chunk.sizes = piece.global.size;
      reshape::CopyOp op = so.ops[i];
      op.dst_box = Box::Whole(piece.global.size);
      it.ops.push_back(std::move(op));
      out.push_back(std::move(it));
    }
  }
  if (!lead.empty()) {  // [1, .., 1, ...] at [lead..., ...], filled as [...]
    for (dcp::PlannedItem& it : out) {
      it.ops_shape = it.chunk.sizes;
      it.chunk.offsets.insert(it.chunk.offsets.begin(), lead.begin(),
                              lead.end());
      it.chunk.sizes.insert(it.chunk.sizes.begin(), lead.size(), 1);
    }
  }
  return out;
}

std::string TorchDistPlan::ObjectBytes(const std::string& blob_key) const {
  std::shared_ptr<const torchfile::TorchFile> f = blobs_.Get(blob_key);
  // Megatron saves a ShardedObject as torch.save([data]).
  return formats::SaveGraph(
      [&](torchfile::TorchWriter& w, formats::GraphImporter& imp) {
        return w.arena().List({imp.Import(f, f->root())});
      });
}

void TorchDistPlan::PlanKeys() {
  objects_.assign(static_cast<size_t>(world_), {});
  tensors_.assign(static_cast<size_t>(world_), {});
  rank_bytes_.assign(static_cast<size_t>(world_), 0);

  bool extra_states = false;
  std::vector<Member> members;
  for (const auto& [name, kind] : Entries()) {
    try {
      if (PlanEntry(name, kind, members)) extra_states = true;
    } catch (Error& e) {
      e.AddContext("universal input ", input_.path().string(), " > ", name);
      throw;
    }
  }
  if (!extra_states) {
    notes_.insert(
        "the universal content has no Transformer Engine / Megatron "
        "_extra_state entries: none written (a model whose layers have them "
        "loads this checkpoint with --dist-ckpt-strictness log_all)");
  }
  if (write_optimizer_ && dp_reshardable_) PlanBuckets(members);
  // Model keys first, then the optimizer's, in the order met.
  std::stable_partition(
      entry_order_.begin(), entry_order_.end(),
      [&](size_t k) { return !keys_[k].fqn.starts_with("optimizer."); });
  PlanRngStates();
  PlanCommonState();

  std::vector<std::vector<dcp::PlannedItem>> items(static_cast<size_t>(world_));
  for (size_t r = 0; r < items.size(); ++r) {
    items[r] = std::move(objects_[r]);
    for (dcp::PlannedItem& it : tensors_[r]) items[r].push_back(std::move(it));
  }
  files_.emplace(std::move(keys_), std::move(items), std::move(entry_order_),
                 iter_dir_);
}

std::vector<std::pair<std::string, std::string>> TorchDistPlan::Entries()
    const {
  std::vector<std::pair<std::string, std::string>> entries;
  if (meta_.entries) entries = *meta_.entries;
  if (!entries.empty()) return entries;
  for (const atoms::StoredParam& p : input_.params())
    entries.emplace_back(p.info.fqn, p.info.kind == atoms::ParamKind::kBuffer
                                         ? "buffer"
                                         : "param");
  for (const atoms::DatasetInfo& d : input_.datasets())
    if (d.kind == atoms::DatasetKind::kOpaque &&
        d.fqn.starts_with("extra_state/"))
      entries.emplace_back(d.fqn.substr(12), "opaque");
  return entries;
}

bool TorchDistPlan::PlanEntry(const std::string& name, const std::string& kind,
                              std::vector<Member>& members) {
  const Layout& layout = placed_->layout;
  const Rule& rule = layout.Match(name, placed_->vars);
  const layouts::Home home =
      layouts::HomeOf(layout, rule, name, placed_->placement);
  if (rule.tied_to) {  // never stored; a buffer member of its stage
    if (const atoms::StoredParam* o = input_.FindParam(*rule.tied_to);
        o != nullptr && rule.Exists(placed_->vars, placed_->topology))
      members.push_back({o, &layout.Match(*rule.tied_to, placed_->vars),
                         home.pp_rank, home.vp_chunk, true});
    return false;
  }
  const TargetKey key = KeyOf(name);
  if (kind != "opaque") {
    PlanParam(name, rule, key, home.pp_rank, home.vp_chunk, members);
    return false;
  }
  // output_layer._extra_state: Megatron drops it for GPT.
  if (name == "output_layer._extra_state") return false;
  if (!input_.FindOpaque("extra_state/" + name)) return false;
  // One object per layer of a stacked key (and per global expert of an
  // expert key); shard_0_1 otherwise.
  const std::string fqn =
      key.lead.empty()
          ? ObjectKey(key.key, std::vector<int64_t>{0}, std::vector<int64_t>{1})
          : ObjectKey(key.key, key.lead, key.grid);
  dcp::PlannedItem it;
  it.key = KeyIndex(fqn, false, DType::kUInt8, {});
  keys_[it.key].bytes = ObjectBytes("extra_state/" + name);
  const uint64_t size = keys_[it.key].bytes.size();
  AddItem(0, home.pp_rank, std::move(it), size, true,
          key.expert >= 0 ? expert_placement_->Locate(key.expert).ep_rank : -1);
  return true;
}

void TorchDistPlan::PlanParam(const std::string& name, const Rule& rule,
                              const TargetKey& key, int64_t pp_rank,
                              int64_t vp_chunk, std::vector<Member>& members) {
  const atoms::StoredParam* p = input_.FindParam(name);
  if (p == nullptr) throw FormatError("the universal input has no such param");
  const std::string weights =
      input_.FindAtom(name, "param") != nullptr ? "param" : "fp32";
  Shape global = p->info.shape;
  if (std::optional<int64_t> pd =
          layouts::PaddedDimSize(rule, placed_->vars, placed_->topology.tp))
    global[static_cast<size_t>(rule.tp.dim)] = *pd;
  global.insert(global.begin(), key.grid.begin(), key.grid.end());
  const size_t mk = KeyIndex(key.key, true, p->info.dtype, global);
  const int64_t ep_rank =
      key.expert >= 0 ? expert_placement_->Locate(key.expert).ep_rank : -1;
  if (p->info.kind != atoms::ParamKind::kBuffer) {
    members.push_back({p, &rule, pp_rank, vp_chunk, false});
    if (key.expert >= 0) {
      members.back().layer = key.layer;
      members.back().expert = key.expert;
      members.back().ep_rank = ep_rank;
    }
  }
  const bool with_state = write_optimizer_ && !dp_reshardable_ &&
                          p->info.kind != atoms::ParamKind::kBuffer &&
                          input_.FindAtom(name, "exp_avg") != nullptr;
  const int64_t tp =
      rule.tp.split ? layouts::TpSizeFor(rule, placed_->topology) : 1;
  for (int64_t r = 0; r < tp; ++r) {
    AddChunks(*p, rule, weights, r, key.lead, pp_rank, ep_rank, mk,
              ElementSize(p->info.dtype));
    if (!with_state) continue;
    for (const auto& [skey, atom] : non_distributed_
                                        ? std::span(kNonDistributedKeys)
                                        : std::span(kStateKeys)) {
      if (input_.FindAtom(name, atom) == nullptr) {
        throw FormatError("no '", atom,
                          "' atom (its optimizer state is "
                          "incomplete)");
      }
      const size_t sk = KeyIndex(StrCat("optimizer.state.", skey, ".", key.key),
                                 true, DType::kFloat32, global);
      AddChunks(*p, rule, atom, r, key.lead, pp_rank, ep_rank, sk, 4);
    }
  }
}

void TorchDistPlan::AddChunks(const atoms::StoredParam& p, const Rule& rule,
                              const std::string& kind, int64_t tp_rank,
                              std::span<const int64_t> lead, int64_t pp_rank,
                              int64_t ep_rank, size_t key,
                              uint64_t element_size) {
  for (dcp::PlannedItem& it : Chunks(p, rule, kind, tp_rank, lead)) {
    it.key = key;
    const uint64_t bytes =
        static_cast<uint64_t>(NumElements(it.chunk.sizes)) * element_size;
    AddItem(tp_rank, pp_rank, std::move(it), bytes, false, ep_rank);
  }
}

void TorchDistPlan::PlanRngStates() {
  bool rng_fallback = false, rng_missing = false;
  for (int64_t pp = 0; pp < placed_->topology.pp; ++pp) {
    for (int64_t tp = 0; tp < placed_->topology.tp; ++tp) {
      std::string rk = megatron::RngStateKey(tp, pp);
      if (input_.FindOpaque(rk) == nullptr) {
        rk = megatron::RngStateKey(tp % source_tp_, pp % source_pp_);
        if (input_.FindOpaque(rk) == nullptr) {
          rng_missing = true;
          continue;
        }
        rng_fallback = true;
      }
      dcp::PlannedItem it;
      it.key = KeyIndex(ObjectKey("rng_state", std::vector<int64_t>{pp, tp},
                                  std::vector<int64_t>{placed_->topology.pp,
                                                       placed_->topology.tp}),
                        false, DType::kUInt8, {});
      keys_[it.key].bytes = ObjectBytes(rk);
      const uint64_t size = keys_[it.key].bytes.size();
      AddItem(tp, pp, std::move(it), size, true);
    }
  }
  if (rng_fallback) {
    notes_.insert(StrCat(
        "rng states: target ranks without a source rank of the same (tp, pp) "
        "got the state of source rank (tp_rank % ",
        source_tp_, ", pp_rank % ", source_pp_,
        "); their random streams repeat another rank's"));
  }
  if (rng_missing) {
    notes_.insert(
        "no rng states in the universal content: none written (load with "
        "--no-load-rng)");
  }
}

void TorchDistPlan::PlanCommonState() {
  dcp::PlannedItem it;
  it.key = KeyIndex(ObjectKey("common_state", std::vector<int64_t>{0},
                              std::vector<int64_t>{1}),
                    false, DType::kUInt8, {});
  keys_[it.key].bytes = formats::SaveGraph(
      [&](torchfile::TorchWriter& w, formats::GraphImporter& imp) {
        Value* common = BuildCommon(
            w.arena(),
            [&](const std::string& k) {
              std::shared_ptr<const torchfile::TorchFile> f = blobs_.Find(k);
              return f != nullptr ? imp.Import(f, f->root()) : nullptr;
            },
            [&](float v) {
              return imp.Constant(DType::kFloat32, {}, FloatBytes(v));
            });
        return w.arena().List({common});
      });
  const uint64_t size = keys_[it.key].bytes.size();
  AddItem(0, 0, std::move(it), size, true);
}

void TorchDistPlan::AddTo(int64_t rank, dcp::PlannedItem item, bool object) {
  (object ? objects_ : tensors_)[static_cast<size_t>(rank)].push_back(
      std::move(item));
}

std::string TorchDistPlan::GroupsObjectBytes(int half) const {
  // The optimizer's own state dict without its state: {'param_groups': [...]}.
  return formats::SaveGraph([&](torchfile::TorchWriter& w,
                                formats::GraphImporter& imp) {
    pickle::Arena& a = w.arena();
    Value* d = a.Dict();
    formats::AppendEntry(
        a, d, "param_groups",
        a.List(TargetGroups(
            a,
            [&](const std::string& k) -> Value* {
              std::shared_ptr<const torchfile::TorchFile> f = blobs_.Find(k);
              return f != nullptr ? imp.Import(f, f->root()) : nullptr;
            },
            half)));
    return a.List({d});
  });
}

// The item of the flat elements `fb` of a local tensor whose ops are `ops`,
// the tensor starting at `start` of key `key`'s bucket: a 1-D chunk, each
// op clipped to the box and its destination moved into it.
dcp::PlannedItem FlatItem(const std::vector<reshape::CopyOp>& ops,
                          const FlatBox& fb, int64_t start, size_t key) {
  dcp::PlannedItem it;
  it.key = key;
  it.chunk = {{start + fb.first}, {NumElements(fb.box.size)}};
  it.ops_shape = fb.box.size;
  for (const reshape::CopyOp& op : ops) {
    const std::optional<Box> in = Intersect(op.dst_box, fb.box);
    if (!in) continue;
    reshape::CopyOp o = op;
    for (size_t d = 0; d < in->offset.size(); ++d) {
      o.src_box.offset[d] += in->offset[d] - op.dst_box.offset[d];
      o.dst_box.offset[d] = in->offset[d] - fb.box.offset[d];
    }
    o.src_box.size = in->size;
    o.dst_box.size = in->size;
    it.ops.push_back(std::move(o));
  }
  return it;
}

// The bucket sizes object: [{(param dtype, grad dtype): [numel...]}] per
// buffer (model chunk).
std::string BucketSizesBytes(
    const std::vector<std::vector<int64_t>>& lists,
    const std::vector<std::pair<DType, std::string>>& dtypes) {
  return formats::SaveGraph([&](torchfile::TorchWriter& w,
                                formats::GraphImporter&) {
    pickle::Arena& a = w.arena();
    std::vector<Value*> buffers;
    for (size_t v = 0; v < lists.size(); ++v) {
      std::vector<Value*> ns;
      for (int64_t x : lists[v]) ns.push_back(a.Int(x));
      Value* d = a.Dict();
      d->entries.emplace_back(
          a.Tuple({a.Global("torch", std::string(DTypeName(dtypes[v].first))),
                   a.Global("torch", dtypes[v].second)}),
          a.List(std::move(ns)));
      buffers.push_back(d);
    }
    return a.List({a.List(std::move(buffers))});
  });
}

const TorchDistPlan::ShardOps& TorchDistPlan::MemberOps::Get(
    const Member& m, const std::string& kind) {
  auto [it, fresh] = ops_.try_emplace({&m, kind});
  if (fresh) it->second = plan_.OpsOf(*m.param, *m.rule, kind, tp_rank_);
  return it->second;
}

void TorchDistPlan::PlanBuckets(std::vector<Member>& members) {
  // A param with a tied copy on another stage is shared_embedding too.
  for (Member& m : members)
    for (const Member& c : members)
      if (c.shared && c.param == m.param) m.shared = true;
  megatron::RunConfig run;
  run.grad_reduce_in_fp32 = true;
  bool grouped_gemm = false;
  if (std::shared_ptr<const torchfile::TorchFile> a = blobs_.Find("args")) {
    try {
      const megatron::ArgsView args(a->root(), "args");
      run = megatron::ReadRunConfig(args, experts_);
      grouped_gemm = args.Bool("moe_grouped_gemm").value_or(false);
    } catch (const FormatError&) {
    }
  }
  run.cp = cp_;
  std::vector<const Member*> dense, routed;
  for (const Member& m : members)
    (m.expert >= 0 && expert_parallel_ ? routed : dense).push_back(&m);
  if (experts_ && !expert_parallel_ &&
      placed_->topology.ExpertTp() != placed_->topology.tp) {
    throw UsageError(
        "dp_reshardable optimizer state of a mixture-of-experts model at ep "
        "1 with etp ",
        placed_->topology.ExpertTp(), " != tp ", placed_->topology.tp,
        " is not written (the experts share the dense buffers): use "
        "fully_reshardable");
  }
  // named_parameters() lists a module's own params before its children's
  // (SharedExpertMLP's gate_weight before its linear_fc1 / linear_fc2),
  // the sharded state dict (so the source's entries) after them.
  for (size_t i = 0; i < dense.size(); ++i) {
    const std::string& name = dense[i]->param->info.fqn;
    const size_t dot = name.rfind('.');
    if (dot == std::string::npos) continue;
    const std::string module = name.substr(0, dot + 1);
    for (size_t j = 0; j < i; ++j) {
      const std::string& other = dense[j]->param->info.fqn;
      if (dense[j]->pp_rank == dense[i]->pp_rank &&
          dense[j]->chunk == dense[i]->chunk && other.starts_with(module) &&
          other.find('.', module.size()) != std::string::npos) {
        std::rotate(dense.begin() + static_cast<ptrdiff_t>(j),
                    dense.begin() + static_cast<ptrdiff_t>(i),
                    dense.begin() + static_cast<ptrdiff_t>(i) + 1);
        break;
      }
    }
  }
  // Each layer's routed experts in named_parameters() order, SequentialMLP's
  // local experts one after the other (each one's keys in the source's
  // order: linear_fc1, linear_fc2), grouped GEMM's linear_fc1.weight<i> of
  // every expert, then linear_fc2.
  std::map<std::string, size_t> key_rank;
  for (const Member& m : members)
    if (m.expert >= 0)
      key_rank.try_emplace(ModelKeyOf(m.param->info.fqn).key, key_rank.size());
  auto order = [&](const Member* m) {
    const auto k =
        static_cast<int64_t>(key_rank.at(ModelKeyOf(m->param->info.fqn).key));
    return grouped_gemm ? std::tuple(m->layer, k, m->expert)
                        : std::tuple(m->layer, m->expert, k);
  };
  auto by_order = [&](const Member* x, const Member* y) {
    return order(x) < order(y);
  };
  // Without expert parallelism the experts are in the dense buffers: sorted
  // in the places they hold there.
  std::vector<size_t> at;
  std::vector<const Member*> sorted;
  for (size_t i = 0; i < dense.size(); ++i) {
    if (dense[i]->expert < 0) continue;
    at.push_back(i);
    sorted.push_back(dense[i]);
  }
  std::stable_sort(sorted.begin(), sorted.end(), by_order);
  for (size_t i = 0; i < at.size(); ++i) dense[at[i]] = sorted[i];
  for (int64_t pp = 0; pp < placed_->topology.pp; ++pp)
    for (int64_t tp = 0; tp < placed_->topology.tp; ++tp)
      PlanBucketGroup(dense, run, tp, pp, -1);
  if (!expert_parallel_) return;
  // The expert half.
  std::stable_sort(routed.begin(), routed.end(), by_order);
  const layouts::Topology& t = placed_->topology;
  for (int64_t pp = 0; pp < t.pp; ++pp) {
    for (int64_t ep = 0; ep < t.ep; ++ep) {
      std::vector<const Member*> mine;
      for (const Member* m : routed)
        if (m->pp_rank == pp && m->ep_rank == ep) mine.push_back(m);
      for (int64_t x = 0; x < t.ExpertTp(); ++x)
        PlanBucketGroup(mine, run, x, pp, ep);
    }
  }
}

void TorchDistPlan::PlanBucketGroup(const std::vector<const Member*>& members,
                                    const megatron::RunConfig& run, int64_t tp,
                                    int64_t pp, int64_t ep) {
  const layouts::Topology& t = placed_->topology;
  const std::string grad = meta_.grad_dtype.value_or("float32");
  MemberOps ops(*this, tp);
  int64_t local_params = 0;
  for (const Member* m : members)
    if (m->pp_rank == pp)
      local_params += NumElements(ops.Get(*m, "fp32").shard.local_shape);
  ChunkBuffer buf;
  buf.tp = tp;
  buf.pp = pp;
  buf.ep = ep;
  buf.dp = ep >= 0 ? t.ExpertDp() : t.dp;
  // A mixture-of-experts model's ChainedOptimizer: chained_0 the dense half
  // (group tp + TP * pp), chained_1 the expert half (group etp + ETP * (ep +
  // EP * pp), the expert model-parallel rank).
  const int half = !expert_parallel_ ? -1 : ep >= 0 ? 1 : 0;
  buf.prefix =
      StrCat(half >= 0 ? StrCat("chained_", half, ".") : std::string(),
             "optimizer.distributed.dp_group_idx_",
             ep >= 0 ? tp + t.ExpertTp() * (ep + t.ep * pp) : tp + t.tp * pp);
  std::vector<std::vector<int64_t>> per_bucket, per_bucket_unpadded;
  std::vector<std::pair<DType, std::string>> dtypes;
  for (int64_t v = 0; v < t.vpp; ++v) {
    LayOutChunk(members, run, local_params, v, ops, buf);
    if (ep >= 0 && buf.members.empty()) continue;  // no expert buffer
    dtypes.emplace_back(buf.param_dtype, grad);
    buf.dtype =
        StrCat("(torch.", DTypeName(buf.param_dtype), ", torch.", grad, ")");
    std::vector<int64_t> padded, unpadded;
    for (size_t b = 0; b < buf.layout.buckets.size(); ++b) {
      const megatron::Bucket& bucket = buf.layout.buckets[b];
      padded.push_back(bucket.end - bucket.start);
      unpadded.push_back(bucket.numel_unpadded);
      PlanBucket(buf, b, ops);
    }
    per_bucket.push_back(std::move(padded));
    per_bucket_unpadded.push_back(std::move(unpadded));
  }
  // The group's objects, written by DP rank 0: the optimizer's state dict
  // and the bucket sizes.
  auto object = [&](const std::string& name, std::string bytes) {
    dcp::PlannedItem it;
    it.key =
        KeyIndex(ObjectKey(StrCat(buf.prefix, ".", name),
                           std::vector<int64_t>{0}, std::vector<int64_t>{1}),
                 false, DType::kUInt8, {});
    keys_[it.key].bytes = std::move(bytes);
    AddTo(BufferRank(buf, 0), std::move(it), true);
  };
  object("optimizer", GroupsObjectBytes(half));
  object("per_bucket_numel", BucketSizesBytes(per_bucket, dtypes));
  object("per_bucket_numel_unpadded",
         BucketSizesBytes(per_bucket_unpadded, dtypes));
}

void TorchDistPlan::LayOutChunk(const std::vector<const Member*>& members,
                                const megatron::RunConfig& run,
                                int64_t local_params, int64_t v, MemberOps& ops,
                                ChunkBuffer& buf) const {
  buf.v = v;
  buf.members.clear();
  std::vector<megatron::BufferParam> bparams;
  for (const Member* m : members) {
    if (m->pp_rank != buf.pp || m->chunk != v) continue;
    buf.members.push_back(m);
    bparams.push_back({m->param->info.fqn,
                       NumElements(ops.Get(*m, "fp32").shard.local_shape),
                       m->shared});
  }
  // The expert half's buckets are padded for the expert data-parallel size
  // (the bucket size rule still the dense DP's, as get_model sets it).
  megatron::BufferOptions bo = run.DistributedBufferOptions(
      placed_->topology.dp, buf.pp, v, local_params);
  if (buf.ep >= 0) bo.dp = std::max<int64_t>(1, run.OptimizerDp(buf.dp));
  if (bo.dp != buf.dp) {
    throw UsageError(
        "dp_reshardable optimizer state with the optimizer sharded over ",
        bo.dp, " ranks at data-parallel size ", buf.dp,
        " (context parallelism or several distributed-optimizer "
        "instances) is not written");
  }
  buf.layout = megatron::ComputeBufferLayout(bparams, bo);
  buf.param_dtype = buf.members.empty() ? DType::kBFloat16
                                        : buf.members[0]->param->info.dtype;
  for (const Member* m : buf.members) {
    if (m->param->info.dtype != buf.param_dtype) {
      throw FormatError(
          "dp_reshardable: params of two dtypes in model "
          "chunk ",
          v, " of pipeline stage ", buf.pp,
          " (one buffer per dtype is not written)");
    }
  }
}

void TorchDistPlan::PlanBucket(const ChunkBuffer& buf, size_t b,
                               MemberOps& ops) {
  const megatron::Bucket& bucket = buf.layout.buckets[b];
  const int64_t dp = buf.dp;
  const int64_t L = (bucket.end - bucket.start) / dp;
  const int64_t n = bucket.numel_unpadded;
  BucketMembers order;  // by start in the bucket
  for (size_t i = 0; i < buf.members.size(); ++i)
    if (buf.layout.ranges[i].bucket == static_cast<int64_t>(b))
      order.push_back({buf.layout.ranges[i].start - bucket.start,
                       buf.layout.ranges[i].end - bucket.start,
                       buf.members[i]});
  std::stable_sort(order.begin(), order.end(),
                   [](const BucketMember& x, const BucketMember& y) {
                     return x.start < y.start;
                   });
  for (const auto& [skey, kind] : kStateKeys) {
    const size_t key =
        KeyIndex(StrCat(buf.prefix, ".gbuf_idx_", buf.v, ".dtype_", buf.dtype,
                        ".bucket_idx_", b, ".", skey),
                 true, DType::kFloat32, {n});
    for (int64_t r = 0; r < dp; ++r) {
      PlanBucketSlice(order, kind, key, BufferRank(buf, r), std::min(r * L, n),
                      std::min((r + 1) * L, n), ops);
    }
  }
}

void TorchDistPlan::PlanBucketSlice(const BucketMembers& order,
                                    const std::string& kind, size_t key,
                                    int64_t rank, int64_t lo, int64_t hi,
                                    MemberOps& ops) {
  int64_t at = lo;
  auto gap = [&](int64_t end) {  // zeros (no op covers them)
    if (end <= at) return;
    dcp::PlannedItem it;
    it.key = key;
    it.chunk = {{at}, {end - at}};
    AddTo(rank, std::move(it), false);
  };
  for (const BucketMember& m : order) {
    const int64_t a = std::max(m.start, lo), z = std::min(m.end, hi);
    if (a >= z) continue;
    gap(a);
    const ShardOps& so = ops.Get(*m.member, kind);
    for (const FlatBox& fb :
         FlatBoxes(so.shard.local_shape, a - m.start, z - m.start))
      AddTo(rank, FlatItem(so.ops, fb, m.start, key), false);
    at = z;
  }
  gap(hi);
}

pickle::Value* TorchDistPlan::OptimizerCommon(
    pickle::Arena& arena,
    const std::function<Value*(const std::string&)>& import,
    const std::function<Value*(float)>& scalar, int half) const {
  // The optimizer's own state dict without its per-param state (the
  // groups' 'params' are not saved: each rank's own at load); the
  // non-distributed optimizer's with {'state': {'common_step': tensor}}
  // (torch Adam cannot load a state without a per-param step).
  Value* opt = arena.Dict();
  Value* inner = arena.Dict();
  if (non_distributed_) {
    Value* state = arena.Dict();
    formats::AppendEntry(arena, state, "common_step",
                         scalar(static_cast<float>(step_.value)));
    formats::AppendEntry(arena, inner, "state", state);
  }
  formats::AppendEntry(arena, inner, "param_groups",
                       arena.List(TargetGroups(arena, import, half)));
  // dp_reshardable keeps the optimizer's own state dict (and the grad
  // scaler's) as objects of each model-parallel group instead.
  if (!dp_reshardable_) {
    formats::AppendEntry(arena, opt, "optimizer", inner);
    if (Value* gs = import("grad_scaler"))
      formats::AppendEntry(arena, opt, "grad_scaler", gs);
  }
  if (!non_distributed_) {
    formats::AppendEntry(arena, opt, "param_state_sharding_type",
                         arena.Str(Sharding()));
  }
  return opt;
}

// The common dict of generate_state_dict, in its order.
pickle::Value* TorchDistPlan::BuildCommon(
    pickle::Arena& arena,
    const std::function<Value*(const std::string&)>& import,
    const std::function<Value*(float)>& scalar) const {
  Value* root = arena.Dict();
  auto add = [&](const std::string& key, Value* v) {
    if (v != nullptr) formats::AppendEntry(arena, root, key, v);
  };
  // No stored args (another framework's model, a transformers folder):
  // built from the model variables when they describe a Megatron-core GPT.
  Value* args = import("args");
  if (args == nullptr)
    args = megatron::NewArgs(arena, input_.model(), *placed_);
  if (args != nullptr) {
    megatron::ArgsPatch patch;
    patch.topology = placed_->topology;
    patch.cp = cp_;
    patch.distributed_optimizer = options_.distributed_optimizer;
    patch.num_layers = placed_->placement.num_layers();
    patch.tp_rank = 0;
    patch.pp_rank = 0;
    patch.source_vpp = source_vpp_;
    patch.source_tp = source_tp_;
    patch.padded_vocab_size = placed_->PaddedVocabSize();
    megatron::PatchArgs(arena, args, patch);
    {
      Value* fields = args->state != nullptr ? args->state : args;
      if (fields->IsDictLike()) {
        for (auto& [k, v] : fields->entries) {
          if (k != nullptr && k->kind == Kind::kStr && k->s == "ckpt_format")
            v = arena.Str("torch_dist");
          if (k != nullptr && k->kind == Kind::kStr &&
              k->s == "dist_ckpt_optim_fully_reshardable" &&
              options_.distributed_optimizer)
            v = arena.Bool(true);
        }
      }
    }
    add("args", args);
  }
  Value* version = import("top_level/checkpoint_version");
  add("checkpoint_version", version != nullptr ? version : arena.Float(3.0));
  add("iteration", arena.Int(input_.model().iteration));
  if (write_optimizer_) {
    // A mixture-of-experts model's ChainedOptimizer: {0: the dense half's,
    // 1: the expert half's} (its sharded_state_dict's dict of the two).
    Value* opt =
        OptimizerCommon(arena, import, scalar, expert_parallel_ ? 0 : -1);
    if (expert_parallel_) {
      Value* halves = arena.Dict();
      halves->entries.emplace_back(arena.Int(0), opt);
      halves->entries.emplace_back(arena.Int(1),
                                   OptimizerCommon(arena, import, scalar, 1));
      opt = halves;
    }
    add("optimizer", opt);
    add("opt_param_scheduler", import("top_level/opt_param_scheduler"));
  }
  add("rerun_state_machine", import("rerun_state_machine"));
  Value* flops = import("top_level/num_floating_point_operations_so_far");
  add("num_floating_point_operations_so_far",
      flops != nullptr ? flops : arena.Int(0));
  // content_metadata: what this checkpoint holds.
  // Training names the distributed optimizer's sharding only for it.
  Value* cm = arena.Dict();
  if (!non_distributed_) {
    formats::AppendEntry(arena, cm, "distrib_optim_sharding_type",
                         arena.Str(Sharding()));
    formats::AppendEntry(arena, cm,
                         "distrib_optim_fully_reshardable_mem_efficient",
                         arena.Bool(false));
  }
  formats::AppendEntry(arena, cm, "singleton_local_shards", arena.Bool(false));
  formats::AppendEntry(arena, cm, "chained_optim_avoid_prefix",
                       arena.Bool(true));
  add("content_metadata", cm);
  return root;
}

std::vector<std::unique_ptr<formats::PlannedFile>> TorchDistPlan::Plan(
    size_t u) const {
  std::vector<std::unique_ptr<formats::PlannedFile>> out;
  const size_t w = static_cast<size_t>(world_);
  if (u < w) {
    out.push_back(files_->RankFile(static_cast<int64_t>(u)));
  } else if (u == w) {
    auto common =
        std::make_unique<formats::TorchSaveFile>(iter_dir_ / kCommonFile);
    formats::TorchArchive& a = common->archive();
    a.SetRoot(BuildCommon(
        a.arena(),
        [&](const std::string& k) -> Value* {
          std::shared_ptr<const torchfile::TorchFile> f = blobs_.Find(k);
          return f != nullptr ? a.Import(f, f->root()) : nullptr;
        },
        [&](float v) {
          return a.AddConstant(DType::kFloat32, {}, FloatBytes(v));
        }));
    out.push_back(std::move(common));
    out.push_back(files_->MetadataFile());
  } else if (u == w + 1) {
    out.push_back(formats::TextFile(
        iter_dir_ / kMetadataJson,
        "{\"sharded_backend\": \"torch_dist\", \"sharded_backend_version\": "
        "1, \"common_backend\": \"torch\", \"common_backend_version\": 1}"));
  } else {
    out.push_back(
        formats::TextFile(std::string(megatron::kTrackerFile),
                          release_ ? std::string(megatron::kReleaseDir)
                                   : std::to_string(input_.model().iteration)));
  }
  return out;
}

formats::TargetSummary TorchDistPlan::Summary() const {
  formats::TargetSummary s;
  s.notes.assign(notes_.begin(), notes_.end());
  s.resume_hint = StrCat(
      "Megatron-LM: --load <output> --ckpt-format torch_dist "
      "--tensor-model-parallel-size ",
      placed_->topology.tp, " --pipeline-model-parallel-size ",
      placed_->topology.pp,
      placed_->topology.vpp > 1
          ? StrCat(" --num-virtual-stages-per-pipeline-rank ",
                   placed_->topology.vpp)
          : std::string(),
      experts_ ? StrCat(" --expert-model-parallel-size ", placed_->topology.ep,
                        " --expert-tensor-parallel-size ",
                        placed_->topology.ExpertTp())
               : std::string(),
      options_.distributed_optimizer ? " --use-distributed-optimizer" : "",
      write_optimizer_ && options_.distributed_optimizer && !dp_reshardable_
          ? " --dist-ckpt-optim-fully-reshardable"
          : "",
      " on ", world_, " GPUs");
  s.details["world_size"] = world_;
  s.details["optimizer_sharding"] = write_optimizer_ ? Sharding() : "none";
  return s;
}

}  // namespace

std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input, const TargetOptions& options) {
  return std::make_unique<TorchDistPlan>(input, options);
}

}  // namespace ucp::torch_dist
