// Reading a torch_dist checkpoint into universal content (torch_dist.h): the
// DCP chunks of every model and optimizer key mapped onto Megatron's
// canonical params (a stacked key's layer slices onto its layers, vocabulary
// padding rows onto pad atoms), the common state as the "megatron" driver
// keeps a legacy checkpoint's.

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/source_table.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/buffer_layout.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron/param_groups.h"
#include "engine/formats/megatron_torch_dist/keys.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"
#include "layouts/layout.h"
#include "layouts/placement.h"

namespace ucp::torch_dist {
namespace {

namespace fs = std::filesystem;
using layouts::Layout;
using layouts::Rule;
using pickle::Kind;
using pickle::Value;

struct Param {
  std::string name;     // canonical
  std::string key;      // model key
  int64_t layer = -1;   // a stacked key's layer
  int64_t expert = -1;  // an expert key's global expert
  const Rule* rule = nullptr;
  Shape full_shape;  // true vocabulary rows for vocab rules
  int64_t pad_rows = 0;
  DType dtype = DType::kFloat32;
  bool buffer = false;
};

// A model key of the metadata, listed once (CollectParams): a tensor, or an
// object (a layer's extra state) kept opaque.
struct ListedKey {
  std::string key;
  bool stacked = false;  // a decoder key stacked over the layers
  bool opaque = false;
  int64_t experts = 0;  // an expert key's expert count, else 0
  const dcp::Entry* entry = nullptr;
};
// The model keys in the canonical order's three runs: the keys before the
// first stacked one, the stacked keys, the rest.
struct ListedKeys {
  std::vector<ListedKey> before, layer, after;
  int64_t stacked_layers = -1;  // the stacked keys' layer count; -1: none
};

// The object a ShardedObject's item holds (saved as torch.save([object])).
const Value* ObjectRoot(const torchfile::TorchFile& f) {
  const Value* v = f.root();
  if (v != nullptr && v->kind == Kind::kList && v->items.size() == 1)
    return v->items[0];
  return v;
}

// A ChainedOptimizer's halves in the common state's `optimizer`: a list, or
// the {0: dense, 1: expert} dict dist_checkpointing keeps (its
// sharded_state_dict's dict of the two); empty for one optimizer.
std::vector<const Value*> ChainedHalves(const Value* opt) {
  std::vector<const Value*> halves;
  if (opt != nullptr && opt->kind == Kind::kList) {
    halves.assign(opt->items.begin(), opt->items.end());
  } else if (opt != nullptr && opt->IsDictLike() && !opt->entries.empty() &&
             std::all_of(
                 opt->entries.begin(), opt->entries.end(), [&](const auto& kv) {
                   return kv.first != nullptr && kv.first->kind == Kind::kInt &&
                          kv.first->i == &kv - &opt->entries.front();
                 })) {
    for (const auto& kv : opt->entries) halves.push_back(kv.second);
  }
  return halves;
}

class Planner {
 public:
  Planner(const Checkpoint& c, const SourceOptions& o) : c_(c), o_(o) {}
  universal::SourcePlan Run();

 private:
  void ReadSettings();
  void CollectParams();
  // CollectParams' steps: every model key once, in runs (num_layers_ and
  // experts_ set; FormatError for layer counts that disagree), and the model
  // variables, the args' else what the shapes tell (vocab_source_ and
  // true_vocab_known_ set).
  ListedKeys ListModelKeys();
  layouts::Variables ModelVariables(const ListedKeys& keys);
  void PlanTensor(const dcp::Entry& e, const KeyInfo& k);
  // Mixture of experts: the expert count on expert keys' axes, and every
  // expert of every MoE layer held exactly once (model and optimizer).
  void CheckExpertCounts() const;
  void CheckExpertsCovered() const;
  // PlanTensor's steps. The local tensor's shape when optimizer key `e`
  // holds flattened ranges (fully_sharded_model_space), absent when it has
  // its model key's shape; FormatError naming `where` otherwise.
  std::optional<Shape> FlattenedLocal(const dcp::Entry& e, const KeyInfo& k,
                                      const std::string& where) const;
  // The atom kind optimizer key `e` fills (fp32, exp_avg, exp_avg_sq);
  // FormatError for a state or dtype ucp does not read.
  std::string StateKind(const dcp::Entry& e, const KeyInfo& k) const;
  // A box of the model key's global tensor an item holds: its source, offset
  // and size (the key's prepended layer / expert axes included).
  struct KeyBox {
    reshape::SourceTensor src;
    Shape offset, size;
  };
  // The boxes chunk `chunk` (read from `whole`) holds: itself, or when its
  // key holds flattened ranges of local tensors of shape `flat`, the boxes
  // its range covers.
  static std::vector<KeyBox> ChunkBoxes(const reshape::SourceTensor& whole,
                                        const dcp::Chunk& chunk,
                                        const std::optional<Shape>& flat,
                                        const std::string& iw);
  // A box's slices along the prepended axes as fragments of the params they
  // are (a stacked key's layers, an expert key's global experts), into atom
  // `kind` (a model key: the param's own).
  void PlaceBox(const KeyBox& box, const dcp::Entry& e, const KeyInfo& k,
                const std::string& kind, const std::string& iw);
  // Box {off, sub} of param p's tensor, read from `src`, as fragments of
  // `atom` (rows beyond the true vocabulary to its pad rows).
  static void AddFragments(const Param& p, universal::AtomPlan& atom,
                           const reshape::SourceTensor& src, const Shape& off,
                           const Shape& sub, const std::string& iw);
  void PlanBuckets();
  // PlanBuckets' steps.
  // A buffer member: a param, or a tied copy's original (shared).
  struct BufferMember {
    Param* param;
    bool shared = false;
  };
  // A run of a bucket's float32 state: `n` elements at bucket offset `o`.
  struct BucketRun {
    int64_t o = 0, n = 0;
    reshape::SourceTensor src;
    std::string where;
  };
  // dp_reshardable keys by (group, buffer, bucket, state).
  // (chain, group, buffer, bucket, state); chain -1 without a chained
  // optimizer.
  using BucketKeys =
      std::map<std::tuple<int64_t, int64_t, int64_t, int64_t, std::string>,
               const dcp::Entry*>;
  using ChunkMembers =
      std::map<std::pair<int64_t, int64_t>, std::vector<BufferMember>>;
  // One model-parallel group's buffers (model chunk v: members(v)), their
  // buckets' state placed; tp_rank: the group's (expert) tensor-parallel
  // rank, dp the (expert) data-parallel size.
  void PlanBufferGroup(const BucketKeys& keys, int64_t chain, int64_t group,
                       int64_t dp, int64_t pp, int64_t tp_rank,
                       const std::vector<std::vector<BufferMember>>& members);
  // The expert half's buffer members of each (pp, ep) rank, per chunk, in
  // the model's named_parameters() order.
  std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<BufferMember>>>
  ExpertMembers();
  BucketKeys CollectBucketKeys() const;
  std::map<std::pair<int64_t, int64_t>, std::vector<BufferMember>>
  BufferMembers();
  std::vector<BucketRun> ZeroBucketRuns(
      const std::shared_ptr<const torchfile::TorchFile>& zf, const Value* world,
      const megatron::BufferLayout& lay, size_t b, int64_t world_at,
      const std::string& skey, const std::string& bwhere);
  std::vector<BucketRun> KeyBucketRuns(const BucketKeys& keys, int64_t chain,
                                       int64_t group, int64_t v,
                                       const megatron::BufferLayout& lay,
                                       size_t b, const std::string& skey,
                                       const std::string& bwhere);
  void PlaceBucket(const std::vector<BufferMember>& members,
                   const std::vector<layouts::LocalShard>& shards,
                   const megatron::BufferLayout& lay, size_t b,
                   const std::string& kind, const std::vector<BucketRun>& runs);
  // dp_zero_gather_scatter: the param_state object of model-parallel group
  // `group`, opened, and its dict of model chunk `v`'s buffer ({param,
  // exp_avg, exp_avg_sq, numel_unpadded}). Throws FormatError naming it.
  std::pair<std::shared_ptr<const torchfile::TorchFile>, const Value*>
  ZeroBuffer(int64_t group, int64_t v, const std::string& where);
  universal::AtomPlan& AtomFor(Param& p, const std::string& kind,
                               const std::string& where);
  void PlanGroups();
  void PlanCommonStep();
  void PlanOpaque();
  void PlanRoot();
  std::string Where(const dcp::Entry& e) const {
    return StrCat(c_.iter_dir.string(), " > ", e.fqn);
  }
  Param& ParamAt(const std::string& key, int64_t layer, int64_t expert,
                 const std::string& w);

  const Checkpoint& c_;
  const SourceOptions& o_;
  universal::SourcePlan plan_;
  formats::SourceTable sources_{plan_};
  dcp::FileCache files_;
  std::vector<std::shared_ptr<const torchfile::TorchFile>> open_;
  // dp_zero_gather_scatter's param_state objects by model-parallel group.
  std::map<int64_t, std::shared_ptr<const torchfile::TorchFile>> zero_objects_;

  const Value* args_ = nullptr;
  std::optional<megatron::RunConfig> run_;
  bool local_spec_ = false;
  std::optional<Layout> layout_;
  layouts::Variables vars_;
  bool true_vocab_known_ = false;
  std::string vocab_source_;
  int64_t num_layers_ = 0;
  bool has_optimizer_ = false;
  bool has_step_ = false;  // the non-distributed optimizer's common_step

  std::vector<Param> params_;
  // (model key, layer of a stacked key, global expert of an expert key).
  std::map<std::tuple<std::string, int64_t, int64_t>, size_t> param_of_;
  bool experts_ = false;  // some key holds routed experts
  // Elements of each expert param stored, by (param index, "model" or the
  // optimizer state's name): CheckExpertsCovered.
  std::map<std::pair<size_t, std::string>, int64_t> expert_cover_;
  // The optimizer states read by key (fully_reshardable, non-distributed):
  // every expert must have each (its half of the optimizer lost shows).
  std::set<std::string> states_read_;
  std::vector<std::pair<std::string, std::string>> entries_;
  std::map<std::pair<std::string, std::string>, size_t> atoms_;
  std::map<std::string, const dcp::Entry*> entry_of_;  // tensor keys
  std::vector<int64_t> group_of_;
  std::vector<const Value*> group_dicts_;
  const torchfile::TorchFile* groups_file_ = nullptr;  // else the common's
  std::vector<megatron::GroupKey> group_keys_;
};

void Planner::ReadSettings() {
  args_ = pickle::DictGet(c_.common, "args");
  if (args_ != nullptr) {
    run_ = megatron::ReadRunConfig(
        megatron::ArgsView(args_, StrCat(c_.iter_dir.string(), " > ",
                                         c_.common_in, " > args")),
        /*experts=*/true);
  }
  std::string impl = o_.transformer_impl;
  if (impl.empty() && args_ != nullptr) {
    impl = megatron::ArgsView(args_, "args")
               .Str("transformer_impl")
               .value_or("transformer_engine");
  }
  if (impl.empty()) impl = "transformer_engine";
  if (impl != "local" && impl != "transformer_engine") {
    throw UsageError("transformer implementation '", impl,
                     "': use local or transformer_engine");
  }
  local_spec_ = impl == "local";
  static constexpr std::string_view kRead[] = {"fully_reshardable",
                                               "dp_reshardable",
                                               "dp_zero_gather_scatter",
                                               "fully_sharded_model_space",
                                               "fully_sharded_bucket_space",
                                               "non_distributed",
                                               "none"};
  if (std::find(std::begin(kRead), std::end(kRead), c_.optimizer) ==
      std::end(kRead)) {
    throw FormatError(
        c_.iter_dir.string(), ": the optimizer's state is in the '",
        c_.optimizer,
        "' form, which ucp does not read (fully_reshardable, dp_reshardable, "
        "dp_zero_gather_scatter, fully_sharded_model_space and "
        "fully_sharded_bucket_space are); convert without it with "
        "--no-optimizer");
  }
}

Param& Planner::ParamAt(const std::string& key, int64_t layer, int64_t expert,
                        const std::string& where) {
  auto it = param_of_.find({key, layer, expert});
  if (it == param_of_.end()) {
    throw FormatError(where, ": optimizer state of ", key,
                      layer >= 0 ? StrCat(" (layer ", layer, ")") : "",
                      expert >= 0 ? StrCat(" (expert ", expert, ")") : "",
                      ", which the checkpoint's model has no tensor for");
  }
  return params_[it->second];
}

// The model keys once each: the keys before the first stacked one, every
// stacked key, then the rest; the layer count.
ListedKeys Planner::ListModelKeys() {
  ListedKeys out;
  std::set<std::string> seen;
  bool any_stacked = false;
  int64_t& stacked_layers = out.stacked_layers;
  for (const dcp::Entry& e : c_.dcp.metadata.entries) {
    const KeyInfo k = ClassifyKey(e.fqn, e.tensor);
    ListedKey l;
    l.entry = &e;
    const KeyAxes axes = AxesOf(k.model_key);
    if (k.kind == KeyInfo::kModel) {
      l.key = k.model_key;
      l.stacked = axes.stacked;
      if (e.size.size() < axes.count()) {
        throw FormatError(Where(e), ": ", e.size.size(), " dims, fewer than ",
                          "its layer and expert axes");
      }
      if (axes.experts) l.experts = e.size[axes.stacked ? 1 : 0];
      if (l.stacked) {
        if (e.size.empty()) {
          throw FormatError(Where(e), ": a decoder layer key without a layer ",
                            "dim (0-d)");
        }
        if (stacked_layers >= 0 && e.size[0] != stacked_layers) {
          throw FormatError(Where(e), ": ", e.size[0],
                            " layers, other decoder keys have ",
                            stacked_layers);
        }
        stacked_layers = e.size[0];
      }
    } else if (k.kind == KeyInfo::kObject &&
               k.model_key.ends_with("._extra_state")) {
      l.key = k.model_key;
      l.opaque = true;
      l.stacked = axes.stacked;
      if (axes.experts) {
        if (k.grid.size() != axes.count()) {
          throw FormatError(Where(e), ": an expert's object without its ",
                            axes.count(), "-d (layer, expert) grid");
        }
        l.experts = k.grid.back();
      }
    } else {
      continue;
    }
    if (!seen.insert(l.key).second) continue;
    any_stacked = any_stacked || l.stacked;
    experts_ = experts_ || l.experts > 0;
    (l.stacked ? out.layer : any_stacked ? out.after : out.before).push_back(l);
  }
  // Per-layer keys (a decoder of dense and MoE layers): the layer count is
  // the highest layer number + 1.
  int64_t listed_layers = -1;
  for (const std::vector<ListedKey>* v : {&out.before, &out.after})
    for (const ListedKey& l : *v)
      listed_layers = std::max(listed_layers, AxesOf(l.key).layer + 1);
  if (stacked_layers >= 0 && listed_layers > stacked_layers) {
    throw FormatError(c_.iter_dir.string(), ": per-layer keys up to layer ",
                      listed_layers - 1, " beside keys stacked over ",
                      stacked_layers, " layers");
  }
  num_layers_ = std::max<int64_t>({0, stacked_layers, listed_layers});
  if (run_) {
    const int64_t args_layers = run_->variables.Get("num_layers");
    if (stacked_layers >= 0 && args_layers != stacked_layers) {
      throw FormatError(c_.iter_dir.string(), ": args say ", args_layers,
                        " layers, the decoder keys hold ", stacked_layers);
    }
    if (listed_layers > args_layers) {
      throw FormatError(c_.iter_dir.string(), ": args say ", args_layers,
                        " layers, a decoder key names layer ",
                        listed_layers - 1);
    }
  }
  return out;
}

// Model variables: the args', else what the shapes tell; the vocabulary's
// size from the option, the args' tokenizer, else the stored rows.
layouts::Variables Planner::ModelVariables(const ListedKeys& keys) {
  layouts::Variables vars;
  if (run_) vars = run_->variables;
  const dcp::Entry* emb =
      c_.dcp.metadata.Find("embedding.word_embeddings.weight");
  if (!run_) {
    vars.Set("num_layers", num_layers_);
    vars.Set("tied", c_.dcp.metadata.Find("output_layer.weight") ? 0 : 1);
    if (emb != nullptr && emb->size.size() == 2)
      vars.Set("hidden_size", emb->size[1]);
    const dcp::Entry* fc1 =
        c_.dcp.metadata.Find("decoder.layers.mlp.linear_fc1.weight");
    const dcp::Entry* fc2 =
        c_.dcp.metadata.Find("decoder.layers.mlp.linear_fc2.weight");
    if (fc1 && fc2 && fc1->size.size() == 3 && fc2->size.size() == 3)
      vars.Set("swiglu", fc1->size[1] == 2 * fc2->size[2] ? 1 : 0);
  }
  // Without num_experts in the args: the expert axis of the first expert
  // key (every other one is checked against it, CheckExpertCounts).
  if (!vars.Has("num_moe_experts")) {
    for (const std::vector<ListedKey>* v :
         {&keys.before, &keys.layer, &keys.after})
      for (const ListedKey& l : *v)
        if (l.experts > 0 && !vars.Has("num_moe_experts"))
          vars.Set("num_moe_experts", l.experts);
  }
  std::optional<int64_t> vocab = o_.true_vocab_size;
  vocab_source_ = "option";
  if (!vocab && run_ && run_->true_vocab_size) {
    vocab = run_->true_vocab_size;
    vocab_source_ = "tokenizer (NullTokenizer vocab_size + 1)";
  }
  true_vocab_known_ = vocab.has_value();
  if (!vocab && emb != nullptr && !emb->size.empty()) {
    vocab = emb->size[0];
    vocab_source_ = "the stored rows (true size unknown)";
  }
  if (vocab) vars.Set("vocab_size", *vocab);
  return vars;
}

// Names, shapes and the canonical entry order: the keys before the first
// stacked one, every layer's stacked keys (and their extra states) in the
// order the metadata lists them, then the rest. An expert key names one
// param per global expert (layouts/README.md, "Mixture of experts").
void Planner::CollectParams() {
  const ListedKeys keys = ListModelKeys();

  // Canonical names in order (for the layout and the entry list).
  struct Named {
    std::string name;
    std::string key;
    int64_t layer;
    int64_t expert;
    bool opaque;
    const dcp::Entry* entry;
  };
  std::vector<Named> names;
  auto add = [&](const ListedKey& l, int64_t g) {
    for (int64_t x = l.experts > 0 ? 0 : -1; x < l.experts; ++x) {
      names.push_back({CanonicalName(l.key, g, x, local_spec_), l.key, g, x,
                       l.opaque, l.entry});
      if (x < 0) break;
    }
  };
  for (const ListedKey& l : keys.before) add(l, -1);
  for (int64_t g = 0; g < num_layers_; ++g)
    for (const ListedKey& l : keys.layer) add(l, g);
  for (const ListedKey& l : keys.after) add(l, -1);

  std::vector<std::string> all;
  for (const Named& n : names) all.push_back(n.name);
  layout_ = Layout::FromSpec(o_.layout, all);
  const Layout& layout = *layout_;
  vars_ = layout.Resolve(ModelVariables(keys));

  for (const Named& n : names) {
    const Rule* rule = nullptr;
    try {
      rule = &layout.Match(n.name, vars_);
    } catch (Error& e) {
      e.AddContext(Where(*n.entry), " > param ", n.name);
      throw;
    }
    if (n.opaque) {
      entries_.emplace_back(n.name, "opaque");
      continue;
    }
    const bool buffer = rule->entry == layouts::EntryKind::kBuffer;
    entries_.emplace_back(n.name, buffer ? "buffer" : "param");
    Param p;
    p.name = n.name;
    p.key = n.key;
    p.layer = n.layer;
    p.expert = n.expert;
    p.rule = rule;
    p.dtype = n.entry->dtype;
    p.buffer = buffer;
    p.full_shape = n.entry->size;
    p.full_shape.erase(
        p.full_shape.begin(),
        p.full_shape.begin() + static_cast<ptrdiff_t>(AxesOf(n.key).count()));
    if (rule->tp.split && rule->tp.vocab) {
      const size_t d = static_cast<size_t>(rule->tp.dim);
      const int64_t stored = d < p.full_shape.size() ? p.full_shape[d] : 0;
      const int64_t rows = vars_.Find("vocab_size").value_or(stored);
      if (rows > stored) {
        throw FormatError(Where(*n.entry), ": ", stored,
                          " rows, fewer than the vocabulary's ", rows, " (",
                          vocab_source_, ")");
      }
      p.pad_rows = stored - rows;
      p.full_shape[d] = rows;
    }
    param_of_[{n.key, n.layer, n.expert}] = params_.size();
    params_.push_back(std::move(p));
  }
  if (experts_) CheckExpertCounts();
}

void Planner::CheckExpertCounts() const {
  const Layout& layout = *layout_;
  if (!layout.experts()) {
    throw FormatError(c_.iter_dir.string(), ": routed experts (", kExpertsInfix,
                      " keys), but layout '", layout.name(),
                      "' has no experts section");
  }
  const int64_t num = layout.NumExperts(vars_);
  std::set<std::string> told;
  for (const Param& p : params_) {
    if (p.expert < 0 || !told.insert(p.key).second) continue;
    const dcp::Entry* e = c_.dcp.metadata.Find(p.key);
    const KeyAxes axes = AxesOf(p.key);
    const int64_t held = e != nullptr ? e->size[axes.stacked ? 1 : 0] : num;
    if (held != num) {
      // Too few: the experts past the axis are lost (a save of each rank's
      // local experts only); too many: experts the model does not have.
      std::string layers = axes.layer >= 0 ? StrCat("layer ", axes.layer)
                                           : std::string("every layer");
      std::string listed;
      for (int64_t x = std::min(held, num); x < std::max(held, num); ++x)
        listed += StrCat(listed.empty() ? "" : ", ", x);
      throw FormatError(c_.iter_dir.string(), " > ", p.key, ": ", layers,
                        ": global experts ", listed,
                        held < num ? " missing" : " beyond the model's",
                        " (its ", "expert axis holds ", held,
                        " experts, the model has ", num, " (num_experts))");
    }
  }
}

// Every expert param of every MoE layer, and each optimizer state read for
// experts, stored exactly once across the rank files: a save that lost
// experts (a per-rank naming bug keeps only the local ones) or holds one
// twice is refused naming the layer and the global expert indices.
void Planner::CheckExpertsCovered() const {
  const Layout& layout = *layout_;
  std::map<std::string, size_t> index;
  std::map<std::string, std::string> templates;  // suffix -> a name
  std::set<std::string> labels = states_read_;
  labels.insert("model");
  for (size_t i = 0; i < params_.size(); ++i) {
    index.emplace(params_[i].name, i);
    if (params_[i].expert < 0) continue;
    const std::optional<layouts::ExpertName> x =
        layout.SplitExpert(params_[i].name);
    if (!x) continue;
    templates.emplace(x->suffix, params_[i].name);
    // The layout's other expert params (a key lost entirely): its expert
    // rules' patterns with this expert's layer and index.
    for (const Rule& rule : layout.rules()) {
      if (!rule.expert || rule.entry != layouts::EntryKind::kParam) continue;
      for (const layouts::Glob& g : rule.match) {
        for (const std::string& alt : g.alternatives()) {
          const size_t star = alt.rfind('*');
          if (star == std::string::npos) continue;
          const std::string suffix = alt.substr(star + 1);
          if (suffix.find_first_of("*#{") != std::string::npos ||
              templates.count(suffix))
            continue;
          const std::string name =
              x->prefix + std::to_string(x->index) + suffix;
          if (layout.Find(name, vars_) == &rule)
            templates.emplace(suffix, name);
        }
      }
    }
    if (!layout.IsMoeLayer(x->layer, vars_)) {
      throw FormatError(c_.iter_dir.string(), " > ", params_[i].key, ": layer ",
                        x->layer,
                        " holds routed experts, but "
                        "the model's MoE layers (moe_layer_freq) make it "
                        "dense");
    }
  }
  const int64_t num = layout.NumExperts(vars_);
  std::vector<std::string> problems;
  for (int64_t l = 0; l < num_layers_; ++l) {
    if (!layout.IsMoeLayer(l, vars_)) continue;
    for (const auto& [suffix, name] : templates) {
      for (const std::string& label : labels) {
        std::vector<int64_t> missing, twice;
        for (int64_t e = 0; e < num; ++e) {
          const std::string n = layout.WithExpert(layout.WithLayer(name, l), e);
          const auto it = index.find(n);
          int64_t held = 0, want = 1;
          if (it != index.end()) {
            want = NumElements(params_[it->second].full_shape);
            const auto c = expert_cover_.find({it->second, label});
            if (c != expert_cover_.end()) held = c->second;
          }
          if (held < want) missing.push_back(e);
          if (held > want) twice.push_back(e);
        }
        if (missing.empty() && twice.empty()) continue;
        auto list = [](const std::vector<int64_t>& v) {
          std::string out;
          for (int64_t e : v) out += StrCat(out.empty() ? "" : ", ", e);
          return out;
        };
        problems.push_back(StrCat(
            "layer ", l, " ", layout.experts()->infix, "*", suffix,
            label == "model" ? "" : StrCat(" (optimizer state ", label, ")"),
            ": ",
            missing.empty() ? ""
                            : StrCat("global experts ", list(missing),
                                     " missing or incomplete"),
            !missing.empty() && !twice.empty() ? ", " : "",
            twice.empty() ? ""
                          : StrCat("global experts ", list(twice),
                                   " stored more than once")));
      }
    }
  }
  if (!problems.empty()) {
    throw FormatError(
        c_.iter_dir.string(), ": ", problems.front(), " (of ", num,
        " experts; every expert of every MoE layer must be stored exactly "
        "once across the rank files)",
        problems.size() > 1
            ? StrCat(" (and ", problems.size() - 1, " more problems)")
            : "");
  }
}

universal::AtomPlan& Planner::AtomFor(Param& p, const std::string& kind,
                                      const std::string& where) {
  const DType dtype = kind == "param" ? p.dtype : DType::kFloat32;
  auto [it, fresh] = atoms_.try_emplace({p.name, kind}, plan_.atoms.size());
  if (!fresh) {
    if (plan_.atoms[it->second].dtype != dtype) {
      throw FormatError(where, ": param ", p.name, "'s '", kind, "' is ",
                        DTypeName(dtype), " here, ",
                        DTypeName(plan_.atoms[it->second].dtype),
                        " in another key");
    }
    return plan_.atoms[it->second];
  }
  universal::AtomPlan a;
  a.param = p.name;
  a.state_kind = kind;
  a.dtype = dtype;
  a.shape = p.full_shape;
  if (p.pad_rows > 0) {
    a.pad_shape = p.full_shape;
    a.pad_shape[static_cast<size_t>(p.rule->tp.dim)] = p.pad_rows;
  }
  plan_.atoms.push_back(std::move(a));
  return plan_.atoms.back();
}

std::optional<Shape> Planner::FlattenedLocal(const dcp::Entry& e,
                                             const KeyInfo& k,
                                             const std::string& where) const {
  auto m = entry_of_.find(k.model_key);
  if (m == entry_of_.end()) {
    throw FormatError(where, ": no model key '", k.model_key,
                      "' for this optimizer state");
  }
  const Shape& g = m->second->size;
  if (IsFlattenedState(e.size, g)) {
    Shape local;
    for (size_t d = 0; d < g.size(); ++d) {
      if (e.size[d] <= 0 || g[d] % e.size[d] != 0) {
        throw FormatError(where, ": flattened shape ", ShapeString(e.size),
                          " is no chunk grid of the model key's ",
                          ShapeString(g));
      }
      local.push_back(g[d] / e.size[d]);
    }
    if (NumElements(local) != e.size.back()) {
      throw FormatError(where, ": flattened shape ", ShapeString(e.size),
                        " holds ", e.size.back(),
                        " elements per local tensor, its grid makes ",
                        ShapeString(local));
    }
    return local;
  }
  if (e.size != g) {
    throw FormatError(where, ": shape ", ShapeString(e.size),
                      ", the model key's is ", ShapeString(g));
  }
  return std::nullopt;
}

void Planner::AddFragments(const Param& p, universal::AtomPlan& atom,
                           const reshape::SourceTensor& src, const Shape& off,
                           const Shape& sub, const std::string& iw) {
  if (p.pad_rows == 0) {
    atom.fragments.push_back({src, Box::Whole(sub), Box{off, sub}, false, iw});
    return;
  }
  // Rows below the vocabulary to the atom, the rest to its pad rows.
  const size_t d = static_cast<size_t>(p.rule->tp.dim);
  const int64_t rows = p.full_shape[d];
  const int64_t lo = off[d], hi = off[d] + sub[d];
  if (lo < rows) {
    Box s = Box::Whole(sub), a{off, sub};
    s.size[d] = a.size[d] = std::min(hi, rows) - lo;
    atom.fragments.push_back({src, s, a, false, iw});
  }
  if (hi > rows) {
    const int64_t from = std::max(lo, rows);
    Box s = Box::Whole(sub), a{off, sub};
    s.offset[d] = from - lo;
    s.size[d] = a.size[d] = hi - from;
    a.offset[d] = from - rows;
    atom.fragments.push_back({src, s, a, true, iw});
  }
}

std::string Planner::StateKind(const dcp::Entry& e, const KeyInfo& k) const {
  std::string kind;
  if (k.state == "param" || k.state == "fp32_param") {
    kind = "fp32";
  } else if (k.state == "exp_avg" || k.state == "exp_avg_sq") {
    kind = k.state;
  } else {
    throw FormatError(Where(e), ": optimizer state '", k.state,
                      "' is not read (param, fp32_param, exp_avg, "
                      "exp_avg_sq are)");
  }
  if (e.dtype != DType::kFloat32) {
    throw FormatError(Where(e), ": optimizer state in ", DTypeName(e.dtype),
                      ", expected float32");
  }
  return kind;
}

std::vector<Planner::KeyBox> Planner::ChunkBoxes(
    const reshape::SourceTensor& whole, const dcp::Chunk& chunk,
    const std::optional<Shape>& flat, const std::string& iw) {
  if (!flat) return {{whole, chunk.offsets, chunk.sizes}};
  std::vector<KeyBox> boxes;
  const size_t n = flat->size();
  const int64_t start = chunk.offsets[n];
  for (const FlatBox& fb : FlatBoxes(*flat, start, start + chunk.sizes[n])) {
    const reshape::SourceTensor piece =
        reshape::FlatView(whole, fb.first - start, fb.box.size, iw);
    Shape at(n);
    for (size_t d = 0; d < n; ++d)
      at[d] = chunk.offsets[d] * (*flat)[d] + fb.box.offset[d];
    boxes.push_back({piece, at, fb.box.size});
  }
  return boxes;
}

void Planner::PlaceBox(const KeyBox& box, const dcp::Entry& e, const KeyInfo& k,
                       const std::string& kind, const std::string& iw) {
  const bool model = k.kind == KeyInfo::kModel;
  const KeyAxes axes = AxesOf(k.model_key);
  const size_t lead = axes.count();
  const Shape& bo = box.offset;
  const Shape& bs = box.size;
  Shape sub(bs.begin() + static_cast<ptrdiff_t>(lead), bs.end());
  Shape off(bo.begin() + static_cast<ptrdiff_t>(lead), bo.end());
  // Element strides of the prepended axes in the item's tensor.
  std::vector<int64_t> step(lead);
  int64_t inner = NumElements(sub);
  for (size_t d = lead; d-- > 0;) {
    step[d] = box.src.stride.empty() ? inner : box.src.stride[d];
    inner *= bs[d];
  }
  const int64_t count =
      lead == 0 ? 1
                : NumElements(Shape(bs.begin(),
                                    bs.begin() + static_cast<ptrdiff_t>(lead)));
  for (int64_t i = 0; i < count; ++i) {
    // Index i over the prepended axes (the last fastest).
    std::vector<int64_t> at(lead);
    int64_t rest = i, elems = 0;
    for (size_t d = lead; d-- > 0;) {
      at[d] = rest % bs[d];
      rest /= bs[d];
      elems += at[d] * step[d];
    }
    const int64_t layer = axes.stacked ? bo[0] + at[0] : -1;
    const int64_t expert = axes.experts ? bo[lead - 1] + at[lead - 1] : -1;
    Param& p = model ? params_[param_of_.at({k.model_key, layer, expert})]
                     : ParamAt(k.model_key, layer, expert, Where(e));
    std::string ak = kind;
    if (model) {
      const bool low = p.dtype != DType::kFloat32;
      ak = p.buffer ? "param" : (low && has_optimizer_ ? "param" : "fp32");
    }
    universal::AtomPlan& atom = AtomFor(p, ak, Where(e));
    reshape::SourceTensor src = box.src;
    src.byte_offset += static_cast<uint64_t>(elems) * ElementSize(e.dtype);
    if (!src.stride.empty())
      src.stride.erase(src.stride.begin(),
                       src.stride.begin() + static_cast<ptrdiff_t>(lead));
    src.shape = sub;
    AddFragments(p, atom, src, off, sub, iw);
    if (p.expert >= 0) {
      expert_cover_[{static_cast<size_t>(&p - params_.data()),
                     model ? std::string("model") : k.state}] +=
          NumElements(sub);
    }
  }
}

void Planner::PlanTensor(const dcp::Entry& e, const KeyInfo& k) {
  const bool model = k.kind == KeyInfo::kModel;
  if (!model) states_read_.insert(k.state);
  const std::string kind = model ? std::string() : StateKind(e, k);
  const std::string where = Where(e);
  // fully_sharded_model_space (core <= 0.14) stores an N-D key's flattened
  // ranges reformulated: global [grid..., local numel], where the grid is
  // the model key's chunk grid and local its chunk's shape; a range of
  // local chunk c is a chunk at (*c, start) of size (1, ..., 1, len)
  // (reference: megatron.md 4.4). 1-D keys keep their shape.
  // the local tensor's shape, when flattened
  const std::optional<Shape> flat =
      model ? std::nullopt : FlattenedLocal(e, k, where);
  for (const dcp::Chunk& chunk : e.chunks) {
    if (chunk.sizes.size() != e.size.size() ||
        chunk.offsets.size() != e.size.size()) {
      throw FormatError(where, ": chunk ", dcp::BoxString(chunk),
                        " has another rank than the key's shape ",
                        ShapeString(e.size));
    }
    for (size_t d = 0; d < e.size.size(); ++d) {
      if (chunk.offsets[d] < 0 || chunk.sizes[d] < 0 ||
          chunk.offsets[d] + chunk.sizes[d] > e.size[d] ||
          (flat && d + 1 < e.size.size() && chunk.sizes[d] != 1)) {
        throw FormatError(where, ": chunk ", dcp::BoxString(chunk),
                          " is not a box ", flat ? "of one local tensor " : "",
                          "inside ", ShapeString(e.size));
      }
    }
    if (NumElements(chunk.sizes) == 0) continue;
    const dcp::ItemKey key{e.fqn, chunk.offsets};
    auto items = c_.dcp.items.find(key);
    if (items == c_.dcp.items.end() || items->second.empty()) {
      throw FormatError(where, ": no item for chunk ", dcp::BoxString(chunk));
    }
    for (const dcp::Item& item : items->second) {
      const std::string iw = StrCat("rank file ", item.file.string(), " > ",
                                    e.fqn, " > chunk ", dcp::BoxString(chunk));
      try {
        open_.push_back(dcp::OpenItem(item, key, files_));
        const torchfile::TorchFile& f = *open_.back();
        const torchfile::TensorInfo* t = f.FindTensor(f.root());
        if (t == nullptr) throw FormatError("the item is not a tensor");
        if (t->dtype != e.dtype || t->shape != chunk.sizes) {
          throw FormatError("the item holds a ", DTypeName(t->dtype), " ",
                            ShapeString(t->shape),
                            " tensor, the metadata says ", DTypeName(e.dtype),
                            " ", ShapeString(chunk.sizes));
        }
        // Every param this key holds must have its shape.
        const reshape::SourceTensor whole =
            sources_.Tensor(open_.back(), *t, iw);
        for (const KeyBox& box : ChunkBoxes(whole, chunk, flat, iw))
          PlaceBox(box, e, k, kind, iw);
      } catch (Error& err) {
        if (std::string_view(err.what()).find(item.file.string()) ==
            std::string_view::npos)
          err.AddContext(iw);
        throw;
      }
    }
  }
}

// dp_reshardable: each DDP bucket's state as one 1-D key per state kind, DP
// rank r's slice of the bucket at r * (padded bucket / dp); a param's state
// lies at its buffer range minus the bucket's start (fully_sharded_bucket_
// space, core <= 0.14: the same keys and offsets, of the padded size, the
// params' flattened ranges stored as 1-D chunks). dp_zero_gather_scatter:
// one object per model-parallel group, the legacy distrib_optim.pt dict
// ({buckets_coalesced: True, chunk: {(dtypes): {param, exp_avg, exp_avg_sq,
// numel_unpadded}}}) whose 1-D tensors are the chunk's buckets, unpadded,
// one after the other. The param -> range map is not stored: it is the
// buffer layout of the rank's params (megatron/buffer_layout.h), checked
// against every key's (or tensor's) size.
void Planner::PlanBuckets() {
  if (experts_ && c_.optimizer != "dp_reshardable") {
    throw FormatError(c_.iter_dir.string(), ": ", c_.optimizer,
                      " optimizer state of a mixture-of-experts model is not "
                      "read (fully_reshardable and dp_reshardable are); "
                      "convert with --no-optimizer");
  }
  if (!run_) {
    throw FormatError(c_.iter_dir.string(), ": ", c_.optimizer,
                      " optimizer state without args in the common state: "
                      "the bucket layout cannot be rebuilt");
  }
  const bool zero = c_.optimizer == "dp_zero_gather_scatter";
  const BucketKeys keys = zero ? BucketKeys{} : CollectBucketKeys();
  // A mixture-of-experts model's ChainedOptimizer: chained_0 the dense half
  // (its buffers over DP), chained_1 the expert half (over expert DP, one
  // group per expert model-parallel rank etp + ETP * (ep + EP * pp)).
  // At EP 1 the experts are in the dense optimizer (not chained).
  const bool chained = experts_ && c_.topology.ep > 1;
  const int64_t dense_chain = chained ? 0 : -1;
  ChunkMembers chunks = BufferMembers();
  const layouts::Topology& t = c_.topology;
  for (int64_t pp = 0; pp < t.pp; ++pp) {
    std::vector<std::vector<BufferMember>> members;
    for (int64_t v = 0; v < t.vpp; ++v) members.push_back(chunks[{pp, v}]);
    for (int64_t tp = 0; tp < t.tp; ++tp)
      PlanBufferGroup(keys, dense_chain, tp + t.tp * pp, t.dp, pp, tp, members);
  }
  if (!chained) return;
  auto experts = ExpertMembers();
  const int64_t etp = t.ExpertTp();
  for (int64_t pp = 0; pp < t.pp; ++pp)
    for (int64_t ep = 0; ep < t.ep; ++ep)
      for (int64_t x = 0; x < etp; ++x)
        PlanBufferGroup(keys, 1, x + etp * (ep + t.ep * pp), t.ExpertDp(), pp,
                        x, experts[{pp, ep}]);
}

void Planner::PlanBufferGroup(
    const BucketKeys& keys, int64_t chain, int64_t group, int64_t dp,
    int64_t pp, int64_t tp_rank,
    const std::vector<std::vector<BufferMember>>& members_of) {
  static constexpr std::pair<const char*, const char*> kStates[] = {
      {"param", "fp32"}, {"exp_avg", "exp_avg"}, {"exp_avg_sq", "exp_avg_sq"}};
  const layouts::Topology& t = c_.topology;
  const bool zero = c_.optimizer == "dp_zero_gather_scatter";
  // Each member's local shard at this (expert) TP rank.
  auto shard_of = [&](const Param& p) {
    const size_t d = static_cast<size_t>(p.rule->tp.dim);
    const int64_t padded =
        p.rule->tp.split && p.rule->tp.vocab ? p.full_shape[d] + p.pad_rows : 0;
    return layouts::ShardFor(
        *p.rule, p.full_shape,
        p.rule->tp.split ? layouts::TpSizeFor(*p.rule, t) : 1,
        p.rule->tp.split ? tp_rank : 0, padded, p.pad_rows);
  };
  int64_t local_params = 0;
  for (const std::vector<BufferMember>& members : members_of)
    for (const BufferMember& m : members)
      local_params += NumElements(shard_of(*m.param).local_shape);
  for (size_t vi = 0; vi < members_of.size(); ++vi) {
    const int64_t v = static_cast<int64_t>(vi);
    const std::vector<BufferMember>& members = members_of[vi];
    if (members.empty()) continue;
    std::vector<megatron::BufferParam> bparams;
    std::vector<layouts::LocalShard> shards;
    for (const BufferMember& m : members) {
      shards.push_back(shard_of(*m.param));
      bparams.push_back(
          {m.param->name, NumElements(shards.back().local_shape), m.shared});
    }
    megatron::BufferOptions options =
        run_->DistributedBufferOptions(t.dp, pp, v, local_params);
    options.dp = std::max<int64_t>(
        1, run_->OptimizerDp(dp));  // the expert half: expert DP
    const megatron::BufferLayout lay =
        megatron::ComputeBufferLayout(bparams, options);
    const std::string bwhere =
        StrCat(c_.iter_dir.string(), " > ",
               chain >= 0 ? StrCat("chained_", chain, ".") : "",
               "optimizer.distributed.dp_group_idx_", group, ".gbuf_idx_", v);
    std::shared_ptr<const torchfile::TorchFile> zf;
    const Value* world = nullptr;
    if (zero) std::tie(zf, world) = ZeroBuffer(group, v, bwhere);
    int64_t world_at = 0;  // bucket b's start in the coalesced tensors
    for (size_t b = 0; b < lay.buckets.size(); ++b) {
      for (const auto& [skey, kind] : kStates) {
        const std::vector<BucketRun> runs =
            zero ? ZeroBucketRuns(zf, world, lay, b, world_at, skey, bwhere)
                 : KeyBucketRuns(keys, chain, group, v, lay, b, skey, bwhere);
        PlaceBucket(members, shards, lay, b, kind, runs);
      }
      world_at += lay.buckets[b].numel_unpadded;
    }
  }
}

// The routed experts of each (pp rank, ep rank), per model chunk, in the
// order named_parameters() lists them: per layer, SequentialMLP's local
// experts one after the other (linear_fc1, linear_fc2 of each), grouped
// GEMM's linear_fc1.weight<i> of every expert, then linear_fc2.
std::map<std::pair<int64_t, int64_t>,
         std::vector<std::vector<Planner::BufferMember>>>
Planner::ExpertMembers() {
  const layouts::Topology& t = c_.topology;
  const Layout& layout = *layout_;
  const layouts::LayerPlacement placement(layout.NumLayers(vars_), t);
  const layouts::ExpertPlacement experts(layout.NumExperts(vars_), t.ep);
  const bool grouped = megatron::ArgsView(args_, "args")
                           .Bool("moe_grouped_gemm")
                           .value_or(false);
  struct Sorted {
    int64_t layer, expert;
    size_t index;
    int64_t pp, v, ep;
  };
  std::vector<Sorted> all;
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    if (p.buffer || !p.rule->expert) continue;
    const std::optional<layouts::ExpertName> x = layout.SplitExpert(p.name);
    UCP_CHECK(x.has_value(), "expert param without expert index: ", p.name);
    const layouts::Home h = layouts::HomeOf(layout, *p.rule, p.name, placement);
    all.push_back({x->layer, x->index, i, h.pp_rank, h.vp_chunk,
                   experts.Locate(x->index).ep_rank});
  }
  std::sort(all.begin(), all.end(), [&](const Sorted& a, const Sorted& b) {
    if (a.layer != b.layer) return a.layer < b.layer;
    if (!grouped && a.expert != b.expert) return a.expert < b.expert;
    // Within an expert (or, grouped, within a layer): the key order, then
    // the expert.
    const std::string& ka = params_[a.index].key;
    const std::string& kb = params_[b.index].key;
    if (ka != kb) return a.index < b.index;
    return a.expert < b.expert;
  });
  std::map<std::pair<int64_t, int64_t>, std::vector<std::vector<BufferMember>>>
      out;
  for (const Sorted& s : all) {
    std::vector<std::vector<BufferMember>>& chunks = out[{s.pp, s.ep}];
    chunks.resize(static_cast<size_t>(t.vpp));
    chunks[static_cast<size_t>(s.v)].push_back({&params_[s.index], false});
  }
  return out;
}

Planner::BucketKeys Planner::CollectBucketKeys() const {
  BucketKeys keys;
  std::map<std::tuple<int64_t, int64_t, int64_t>, std::string> dtypes;
  for (const dcp::Entry& e : c_.dcp.metadata.entries) {
    if (!e.tensor) continue;
    const auto k = ParseBucketKey(e.fqn);
    if (!k) {
      if (ClassifyKey(e.fqn, true).kind == KeyInfo::kBucket)
        throw FormatError(Where(e), ": not a dp_reshardable bucket key");
      continue;
    }
    auto [it, fresh] =
        dtypes.try_emplace({k->chain, k->group, k->gbuf}, k->dtype);
    if (!fresh && it->second != k->dtype) {
      throw FormatError(Where(e), ": buffer ", k->gbuf, " of group ", k->group,
                        " has buckets of two dtypes (", it->second, ", ",
                        k->dtype, "): not supported");
    }
    if (e.dtype != DType::kFloat32 || e.size.size() != 1) {
      throw FormatError(Where(e), ": expected a 1-D float32 tensor, got ",
                        DTypeName(e.dtype), " ", ShapeString(e.size));
    }
    keys[{k->chain, k->group, k->gbuf, k->bucket, k->state}] = &e;
  }
  return keys;
}

// The params of each (pp rank, chunk) in model order; where a tied copy
// exists, the copy (last stage) as the original, both marked shared.
std::map<std::pair<int64_t, int64_t>, std::vector<Planner::BufferMember>>
Planner::BufferMembers() {
  const layouts::Topology& t = c_.topology;
  const Layout& layout = *layout_;
  const layouts::LayerPlacement placement(layout.NumLayers(vars_), t);
  std::map<std::pair<int64_t, int64_t>, std::vector<BufferMember>> chunks;
  // Experts: ExpertMembers, but at EP 1 (no expert parallelism) in the dense
  // buffers, in their places sorted as ExpertMembers sorts them.
  const bool dense_experts = experts_ && t.ep == 1;
  for (Param& p : params_) {
    if (p.buffer || (p.rule->expert && !dense_experts)) continue;
    const layouts::Home h = layouts::HomeOf(layout, *p.rule, p.name, placement);
    chunks[{h.pp_rank, h.vp_chunk}].push_back({&p, false});
  }
  if (dense_experts) {
    std::map<const Param*, size_t> order;
    for (const auto& [pe, per_chunk] : ExpertMembers())
      for (const std::vector<BufferMember>& members : per_chunk)
        for (const BufferMember& m : members)
          order.emplace(m.param, order.size());
    for (auto& [hk, members] : chunks) {
      std::vector<size_t> at;
      std::vector<BufferMember> sorted;
      for (size_t i = 0; i < members.size(); ++i) {
        if (!members[i].param->rule->expert) continue;
        at.push_back(i);
        sorted.push_back(members[i]);
      }
      std::stable_sort(sorted.begin(), sorted.end(),
                       [&](const BufferMember& a, const BufferMember& b) {
                         return order.at(a.param) < order.at(b.param);
                       });
      for (size_t i = 0; i < at.size(); ++i) members[at[i]] = sorted[i];
    }
  }
  // named_parameters() lists a module's own params before its children's
  // (SharedExpertMLP's gate_weight before its linear_fc1 / linear_fc2);
  // the sharded state dict, so the metadata, lists them after.
  for (auto& [hk, members] : chunks) {
    for (size_t i = 0; i < members.size(); ++i) {
      const std::string& name = members[i].param->name;
      const size_t dot = name.rfind('.');
      if (dot == std::string::npos) continue;
      const std::string module = name.substr(0, dot + 1);
      for (size_t j = 0; j < i; ++j) {
        const std::string& other = members[j].param->name;
        if (other.starts_with(module) &&
            other.find('.', module.size()) != std::string::npos) {
          std::rotate(members.begin() + static_cast<ptrdiff_t>(j),
                      members.begin() + static_cast<ptrdiff_t>(i),
                      members.begin() + static_cast<ptrdiff_t>(i) + 1);
          break;
        }
      }
    }
  }
  for (const Rule& rule : layout.rules()) {
    if (!rule.tied_to || !rule.Exists(vars_, t)) continue;
    auto orig =
        std::find_if(params_.begin(), params_.end(),
                     [&](const Param& p) { return p.name == *rule.tied_to; });
    if (orig == params_.end()) continue;
    for (const layouts::Glob& g : rule.match) {
      for (const std::string& name : g.alternatives()) {
        if (name.find('*') != std::string::npos ||
            layout.Find(name, vars_) != &rule)
          continue;
        const layouts::Home h = layouts::HomeOf(layout, rule, name, placement);
        chunks[{h.pp_rank, h.vp_chunk}].push_back({&*orig, true});
        for (auto& [hk, members] : chunks)
          for (BufferMember& m : members)
            if (m.param == &*orig) m.shared = true;
      }
    }
  }
  return chunks;
}

// dp_zero_gather_scatter: bucket b's `skey` state, a range of the chunk's
// coalesced tensor (buckets one after the other, from `world_at`).
std::vector<Planner::BucketRun> Planner::ZeroBucketRuns(
    const std::shared_ptr<const torchfile::TorchFile>& zf, const Value* world,
    const megatron::BufferLayout& lay, size_t b, int64_t world_at,
    const std::string& skey, const std::string& bwhere) {
  const std::string zw = StrCat(bwhere, " > ", skey);
  const Value* tv = pickle::DictGet(world, skey);
  const torchfile::TensorInfo* ti =
      tv == nullptr ? nullptr : zf->FindTensor(tv);
  int64_t total = 0;
  for (const megatron::Bucket& x : lay.buckets) total += x.numel_unpadded;
  if (ti == nullptr || ti->dtype != DType::kFloat32 ||
      ti->shape != Shape{total}) {
    throw FormatError(zw, ": not a float32 [", total,
                      "] tensor (the buffer layout of this rank's params, "
                      "Megatron-core v0.13+ rules, dp ",
                      run_->OptimizerDp(c_.topology.dp), ", gives ",
                      lay.buckets.size(), " buckets of ", total, " elements)");
  }
  const megatron::Bucket& bucket = lay.buckets[b];
  BucketRun r{0, bucket.numel_unpadded, sources_.Tensor(zf, *ti, zw), zw};
  r.src = reshape::FlatView(r.src, world_at, {bucket.numel_unpadded}, zw);
  return {std::move(r)};
}

// dp_reshardable / fully_sharded_bucket_space: bucket b's `skey` key of
// group `group`, buffer `v`, its chunks (one per DP rank) at their offsets.
std::vector<Planner::BucketRun> Planner::KeyBucketRuns(
    const BucketKeys& keys, int64_t chain, int64_t group, int64_t v,
    const megatron::BufferLayout& lay, size_t b, const std::string& skey,
    const std::string& bwhere) {
  const megatron::Bucket& bucket = lay.buckets[b];
  auto kit = keys.find({chain, group, v, static_cast<int64_t>(b), skey});
  if (kit == keys.end()) {
    throw FormatError(bwhere, ": no bucket ", b, " '", skey,
                      "' key (the buffer layout of this rank's params has ",
                      lay.buckets.size(), " buckets)");
  }
  const dcp::Entry& e = *kit->second;
  // dp_reshardable: the unpadded bucket; fully_sharded_bucket_space (core
  // <= 0.14): the padded one, the same offsets.
  if (e.size[0] != bucket.numel_unpadded &&
      e.size[0] != bucket.end - bucket.start) {
    throw FormatError(Where(e), ": ", e.size[0],
                      " elements, but the buffer layout of this rank's params "
                      "(Megatron-core v0.13+ rules, dp ",
                      run_->OptimizerDp(c_.topology.dp), ") gives bucket ", b,
                      " ", bucket.numel_unpadded, " (padded ",
                      bucket.end - bucket.start, ")");
  }
  std::vector<BucketRun> runs;
  for (const dcp::Chunk& chunk : e.chunks) {
    const dcp::ItemKey key{e.fqn, chunk.offsets};
    const auto items = c_.dcp.items.find(key);
    if (items == c_.dcp.items.end() || items->second.empty())
      throw FormatError(Where(e), ": no item for chunk ",
                        dcp::BoxString(chunk));
    const dcp::Item& item = items->second.front();
    const std::string iw = StrCat("rank file ", item.file.string(), " > ",
                                  e.fqn, " > chunk ", dcp::BoxString(chunk));
    open_.push_back(dcp::OpenItem(item, key, files_));
    const torchfile::TorchFile& f = *open_.back();
    const torchfile::TensorInfo* ti = f.FindTensor(f.root());
    if (ti == nullptr || ti->dtype != DType::kFloat32 ||
        ti->shape != chunk.sizes) {
      throw FormatError(iw, ": the item is not a float32 ",
                        ShapeString(chunk.sizes), " tensor");
    }
    runs.push_back({chunk.offsets[0], chunk.sizes[0],
                    sources_.Tensor(open_.back(), *ti, iw), iw});
  }
  return runs;
}

// The fragments of state `kind` of bucket b's members: each member's range
// of the bucket, cut by the runs that hold it, as boxes of its local shard
// and so of its whole param.
void Planner::PlaceBucket(const std::vector<BufferMember>& members,
                          const std::vector<layouts::LocalShard>& shards,
                          const megatron::BufferLayout& lay, size_t b,
                          const std::string& kind,
                          const std::vector<BucketRun>& runs) {
  const megatron::Bucket& bucket = lay.buckets[b];
  for (size_t i = 0; i < members.size(); ++i) {
    const megatron::ParamRange& r = lay.ranges[i];
    if (r.bucket != static_cast<int64_t>(b)) continue;
    Param& p = *members[i].param;
    universal::AtomPlan& atom = AtomFor(p, kind, runs.front().where);
    const int64_t s0 = r.start - bucket.start;
    const int64_t s1 = r.end - bucket.start;
    const layouts::LocalShard& shard = shards[i];
    for (const BucketRun& run : runs) {
      const int64_t lo = std::max(s0, run.o), hi = std::min(s1, run.o + run.n);
      if (lo >= hi) continue;
      const std::string iw = StrCat(run.where, " > param ", p.name);
      for (const FlatBox& fb : FlatBoxes(shard.local_shape, lo - s0, hi - s0)) {
        const reshape::SourceTensor src =
            reshape::FlatView(run.src, s0 + fb.first - run.o, fb.box.size, iw);
        for (const layouts::Piece& piece : shard.pieces) {
          std::optional<Box> in = Intersect(piece.local, fb.box);
          if (!in) continue;
          Box sb = *in, ab = *in;
          for (size_t d = 0; d < sb.offset.size(); ++d) {
            sb.offset[d] -= fb.box.offset[d];
            ab.offset[d] += piece.global.offset[d] - piece.local.offset[d];
          }
          atom.fragments.push_back(
              {src, sb, ab, piece.region == layouts::Region::kPad, iw});
        }
      }
    }
  }
}

std::pair<std::shared_ptr<const torchfile::TorchFile>, const Value*>
Planner::ZeroBuffer(int64_t group, int64_t v, const std::string& where) {
  const std::string name =
      StrCat("optimizer.distributed.dp_group_idx_", group, ".param_state");
  const dcp::ItemKey key{
      ObjectKey(name, std::vector<int64_t>{0}, std::vector<int64_t>{1}),
      std::nullopt};
  const auto it = c_.dcp.items.find(key);
  if (it == c_.dcp.items.end() || it->second.empty()) {
    throw FormatError(c_.iter_dir.string(), " > ", name,
                      ": missing (dp_zero_gather_scatter keeps each model-"
                      "parallel group's optimizer state in that object)");
  }
  // Opened once for all the group's model chunks.
  std::shared_ptr<const torchfile::TorchFile>& f = zero_objects_[group];
  if (f == nullptr) {
    f = dcp::OpenItem(it->second.front(), key, files_);
    open_.push_back(f);
  }
  const std::string ow =
      StrCat("rank file ", it->second.front().file.string(), " > ", name);
  const Value* root = ObjectRoot(*f);
  const Value* coalesced = pickle::DictGet(root, "buckets_coalesced");
  if (coalesced == nullptr || coalesced->kind != Kind::kBool || !coalesced->b) {
    throw FormatError(ow,
                      ": no 'buckets_coalesced': True (the per-bucket form "
                      "of Megatron-core before v0.7 is not supported)");
  }
  const Value* gbuf = nullptr;
  for (const auto& [k, val] : root->entries)
    if (k != nullptr && k->kind == Kind::kInt && k->i == v) gbuf = val;
  if (gbuf == nullptr || !gbuf->IsDictLike() || gbuf->entries.size() != 1) {
    throw FormatError(ow, " > buffer ", v, " (", where,
                      "): missing, or holding several dtype buffers");
  }
  const Value* world = gbuf->entries.front().second;
  if (world == nullptr || !world->IsDictLike())
    throw FormatError(ow, " > buffer ", v, ": not a dict");
  return {std::move(f), world};
}

// Megatron's groups (param_groups.h) in named_parameters() order; the
// stored group dicts (without params) from the common state.
void Planner::PlanGroups() {
  const Value* opt = pickle::DictGet(c_.common, "optimizer");
  const Value* inner = pickle::DictGet(opt, "optimizer");
  const Value* groups = pickle::DictGet(inner, "param_groups");
  // A mixture-of-experts model's ChainedOptimizer: the dense and the expert
  // DistributedOptimizer's state dicts, a list (the common state keeps it as
  // a dict {0: ..., 1: ...}), each with its groups, or (dp_reshardable) the
  // groups in each half's chained_<i>.optimizer.distributed.dp_group_idx_0.
  // optimizer object.
  pickle::Arena chained_arena;
  const std::vector<const Value*> halves = ChainedHalves(opt);
  if (experts_ && !halves.empty()) {
    std::vector<Value*> all;
    for (size_t i = 0; i < halves.size(); ++i) {
      const Value* g = pickle::DictGet(pickle::DictGet(halves[i], "optimizer"),
                                       "param_groups");
      if (g == nullptr) {
        const dcp::ItemKey key{
            ObjectKey(StrCat("chained_", i,
                             ".optimizer.distributed.dp_group_idx_0.optimizer"),
                      std::vector<int64_t>{0}, std::vector<int64_t>{1}),
            std::nullopt};
        if (auto it = c_.dcp.items.find(key);
            it != c_.dcp.items.end() && !it->second.empty()) {
          open_.push_back(dcp::OpenItem(it->second.front(), key, files_));
          g = pickle::DictGet(ObjectRoot(*open_.back()), "param_groups");
          groups_file_ = open_.back().get();
        }
      }
      if (g == nullptr || g->kind != Kind::kList) {
        throw FormatError(c_.iter_dir.string(), " > ", c_.common_in,
                          " > optimizer: part ", i,
                          " of the chained optimizer without its param "
                          "groups");
      }
      for (const Value* x : g->items) all.push_back(const_cast<Value*>(x));
    }
    groups = chained_arena.List(std::move(all));
  }
  if (groups == nullptr) {
    // dp_reshardable keeps the optimizer's own state dict as an object of
    // each model-parallel group (all equal): group 0's.
    const dcp::ItemKey key{
        ObjectKey("optimizer.distributed.dp_group_idx_0.optimizer",
                  std::vector<int64_t>{0}, std::vector<int64_t>{1}),
        std::nullopt};
    if (auto it = c_.dcp.items.find(key);
        it != c_.dcp.items.end() && !it->second.empty()) {
      open_.push_back(dcp::OpenItem(it->second.front(), key, files_));
      groups = pickle::DictGet(ObjectRoot(*open_.back()), "param_groups");
      groups_file_ = open_.back().get();
    }
  }
  std::vector<megatron::GroupKey> keys;
  std::vector<size_t> trainable;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].buffer) continue;
    trainable.push_back(i);
    keys.push_back(megatron::DefaultGroupKey(params_[i].name,
                                             params_[i].full_shape.size()));
    // megatron-core marks expert params allreduce=False (their own half of
    // the optimizer) only with expert parallelism.
    keys.back().is_expert_parallel =
        params_[i].rule->expert && c_.topology.ep > 1;
  }
  const megatron::Grouping g = megatron::GroupParams(keys);
  group_of_.assign(params_.size(), -1);
  // Groups saved by Megatron carry its keys (wd_mult, ...); groups without
  // them (torch's plain ones, which ucp writes for a source that had no
  // Megatron groups, and megatron-core loads) are in Megatron's group order.
  const bool megatron_groups =
      groups != nullptr && groups->kind == Kind::kList &&
      std::any_of(groups->items.begin(), groups->items.end(),
                  [](const Value* d) {
                    return d != nullptr && d->IsDictLike() &&
                           d->Get("wd_mult") != nullptr;
                  });
  if (experts_ && megatron_groups && groups->items.size() == g.keys.size()) {
    // The chained halves' groups, matched to Megatron's keys by their own
    // (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr).
    for (size_t j = 0; j < trainable.size(); ++j)
      group_of_[trainable[j]] = static_cast<int64_t>(g.group_of[j]);
    for (const megatron::GroupKey& key : g.keys) {
      const Value* found = nullptr;
      for (const Value* d : groups->items) {
        megatron::GroupKey stored;
        try {
          stored = megatron::StoredGroupKey(d);
        } catch (Error& e) {
          e.AddContext(c_.iter_dir.string(), " > ", c_.common_in,
                       " > optimizer");
          throw;
        }
        if (stored == key) found = d;
      }
      if (found == nullptr) {
        throw FormatError(c_.iter_dir.string(), " > ", c_.common_in,
                          " > optimizer: no param group ", key.ToString(),
                          ", which Megatron's rule makes for this model");
      }
      group_dicts_.push_back(found);
      group_keys_.push_back(key);
    }
  } else if (groups != nullptr && groups->kind == Kind::kList &&
             groups->items.size() == g.keys.size()) {
    for (size_t j = 0; j < trainable.size(); ++j)
      group_of_[trainable[j]] = static_cast<int64_t>(g.group_of[j]);
    for (size_t j = 0; j < g.keys.size(); ++j) {
      group_dicts_.push_back(groups->items[j]);
      group_keys_.push_back(g.keys[j]);
    }
  } else if (auto one = megatron::SingleStoredGroup(
                 std::span<const Value* const>(&groups, 1), g.keys.size())) {
    // One group for every param (not Megatron's default grouping).
    for (size_t i : trainable) group_of_[i] = 0;
    group_dicts_.push_back(groups->items[0]);
    group_keys_.push_back(*one);
  } else if (groups != nullptr && groups->kind == Kind::kList) {
    throw FormatError(
        c_.iter_dir.string(), " > ", c_.common_in,
        " > optimizer.optimizer.param_groups: ", groups->items.size(),
        " groups, Megatron's rule makes ", g.keys.size(), " for this model");
  } else {
    for (size_t j = 0; j < trainable.size(); ++j)
      group_of_[trainable[j]] = static_cast<int64_t>(g.group_of[j]);
    group_keys_ = g.keys;
  }
}

// The non-distributed optimizer's torch Adam step: Megatron saves the one
// step every param shares as optimizer.optimizer.state.common_step of the
// common state (optimizer.py, Float16OptimizerWithFloat16Params /
// FP32Optimizer sharded_state_dict); kept as a scalar 'step' atom of each
// param with state, as the legacy reader keeps torch Adam's per-param step.
// A mixture-of-experts model's ChainedOptimizer (EP > 1) keeps one per half,
// optimizer[i].optimizer.state.common_step: the dense half's (0) for the
// dense params, the expert half's (1) for the experts. A half without it
// (megatron-core saves none for a half holding no state) gives its params
// no step. A python number there (an optimizer of another kind) stays in the
// common state's opaque copy.
void Planner::PlanCommonStep() {
  struct Step {
    reshape::SourceTensor src;
    DType dtype;
    std::string where;
  };
  const Value* opt = pickle::DictGet(c_.common, "optimizer");
  const std::vector<const Value*> halves = ChainedHalves(opt);
  const bool chained = experts_ && c_.topology.ep > 1 && !halves.empty();
  // Half h's step (the one optimizer's without a chain); absent: nullopt.
  auto step_of = [&](size_t h) -> std::optional<Step> {
    const Value* o = !chained ? opt : h < halves.size() ? halves[h] : nullptr;
    const Value* step = pickle::DictGet(
        pickle::DictGet(pickle::DictGet(o, "optimizer"), "state"),
        "common_step");
    if (step == nullptr || c_.common_file == nullptr) return std::nullopt;
    const torchfile::TensorInfo* t = c_.common_file->FindTensor(step);
    if (t == nullptr) return std::nullopt;
    const std::string where =
        StrCat(c_.iter_dir.string(), " > ", c_.common_in, " > optimizer",
               chained ? StrCat("[", h, "]") : std::string(),
               ".optimizer.state.common_step");
    if (t->numel != 1) {
      throw FormatError(where, ": a tensor of shape ", ShapeString(t->shape),
                        ", expected one number");
    }
    reshape::SourceTensor src = sources_.Tensor(c_.common_file, *t, where);
    src.shape = {};
    return Step{std::move(src), t->dtype, where};
  };
  const std::optional<Step> dense = step_of(0);
  const std::optional<Step> expert = chained ? step_of(1) : std::nullopt;
  for (const Param& p : params_) {
    if (p.buffer || atoms_.count({p.name, "exp_avg"}) == 0) continue;
    const std::optional<Step>& s = chained && p.rule->expert ? expert : dense;
    if (!s) continue;
    universal::AtomPlan a;
    a.param = p.name;
    a.state_kind = "step";
    a.dtype = s->dtype;
    a.fragments.push_back(
        {s->src, Box::Whole({}), Box::Whole({}), false, s->where});
    atoms_.emplace(std::make_pair(p.name, std::string("step")),
                   plan_.atoms.size());
    plan_.atoms.push_back(std::move(a));
    has_step_ = true;
  }
}

void Planner::PlanOpaque() {
  auto add = [&](std::string key, std::string bytes) {
    plan_.opaque.push_back({std::move(key), std::move(bytes)});
  };
  // Objects: extra states (one per layer, TP rank 0's shard) and rng states.
  for (const auto& [key, items] : c_.dcp.items) {
    if (key.offset || items.empty()) continue;
    const KeyInfo k = ClassifyKey(key.fqn, false);
    if (k.kind != KeyInfo::kObject) continue;
    const bool extra = k.model_key.ends_with("._extra_state");
    const bool rng = k.model_key == "rng_state" && k.offsets.size() == 2;
    if (!extra && !rng) continue;
    std::shared_ptr<const torchfile::TorchFile> f =
        dcp::OpenItem(items.front(), key, files_);
    const Value* v = ObjectRoot(*f);
    if (extra) {
      // Offsets: a stacked key's layer, then an expert key's global expert.
      const KeyAxes axes = AxesOf(k.model_key);
      const int64_t layer =
          axes.stacked && !k.offsets.empty() ? k.offsets[0] : -1;
      const int64_t expert = axes.experts && k.offsets.size() == axes.count()
                                 ? k.offsets.back()
                                 : -1;
      add("extra_state/" +
              CanonicalName(k.model_key, layer, expert, local_spec_),
          formats::SaveBlob(f.get(), v));
    } else {
      add(megatron::RngStateKey(k.offsets[1], k.offsets[0]),
          formats::SaveBlob(f.get(), v));
    }
  }
  if (c_.common == nullptr) return;
  const torchfile::TorchFile* cf = c_.common_file.get();
  for (const auto& [kv, v] : c_.common->entries) {
    if (kv == nullptr || kv->kind != Kind::kStr) continue;
    const std::string& key = kv->s;
    if (key == "args") {
      add("args", formats::SaveBlob(cf, v));
    } else if (key == "optimizer") {
      if (const Value* gs = pickle::DictGet(v, "grad_scaler"))
        add("grad_scaler", formats::SaveBlob(cf, gs));
    } else if (key == "rerun_state_machine") {
      add(key, formats::SaveBlob(cf, v));
    } else if (key == "model" || key.starts_with("model") ||
               key == "rng_state") {
      continue;
    } else {
      add("top_level/" + key, formats::SaveBlob(cf, v));
    }
  }
  if (has_optimizer_ && !group_dicts_.empty()) {
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
    add("optimizer/param_groups",
        formats::SaveBlob(groups_file_ != nullptr ? groups_file_ : cf,
                          arena.List(std::move(list))));
  }
}

void Planner::PlanRoot() {
  universal::Model& model = plan_.model;
  const Value* it = pickle::DictGet(c_.common, "iteration");
  model.iteration =
      it != nullptr && it->kind == Kind::kInt ? it->i : c_.iteration;
  model.consumed_samples =
      run_ ? run_->consumed_train_samples.value_or(-1) : -1;
  const layouts::Topology& t = c_.topology;
  std::set<std::string> dtypes;
  for (const Param& p : params_) dtypes.insert(std::string(DTypeName(p.dtype)));

  universal::SourceInfo& src = model.source;
  src.framework = "megatron-lm";
  src.framework_version = "megatron-core (torch_dist)";
  src.format = "torch_dist";
  src.tp = t.tp;
  src.pp = t.pp;
  src.vpp = t.vpp;
  src.dp = t.dp;
  src.cp = run_ ? run_->cp : 1;
  src.ep = t.ep;
  if (experts_) src.other["etp"] = t.ExpertTp();
  src.distributed_optimizer = c_.optimizer == "fully_reshardable" ||
                              c_.optimizer == "dp_reshardable" ||
                              c_.optimizer == "dp_zero_gather_scatter" ||
                              c_.optimizer == "fully_sharded_bucket_space" ||
                              c_.optimizer == "fully_sharded_model_space";
  src.other["optimizer_sharding"] = c_.optimizer;
  src.other["vocab_size_from"] = vocab_source_;
  src.dtypes = std::vector<std::string>(dtypes.begin(), dtypes.end());
  src.layout = layout_->name();
  src.other["iteration_dir"] = c_.iter_dir.filename().string();
  src.other["transformer_impl"] = local_spec_ ? "local" : "transformer_engine";

  for (const auto& [k, v] : vars_.values()) model.variables.Set(k, v);
  if (auto v = vars_.Find("vocab_size"))
    model.variables.Set("true_vocab_size", *v);
  model.layout_yaml = layout_->yaml();

  universal::OptimizerInfo& opt = model.optimizer;
  opt.type = run_ ? run_->optimizer : std::string("adam");
  opt.groups.emplace();
  for (size_t i = 0; i < group_keys_.size(); ++i) {
    universal::ParamGroup& g = opt.groups->emplace_back();
    g.other["key"] = group_keys_[i].ToJson();
    if (i < group_dicts_.size() && group_dicts_[i]->IsDictLike()) {
      for (const auto& [k, v] : group_dicts_[i]->entries) {
        if (k == nullptr || k->kind != Kind::kStr || k->s == "params") continue;
        g.Set(k->s, megatron::ValueToJson(v));
      }
    }
  }
  opt.state_kinds.emplace();
  if (has_optimizer_)
    opt.state_kinds = std::vector<std::string>{"fp32", "exp_avg", "exp_avg_sq"};
  const Value* sched = pickle::DictGet(c_.common, "opt_param_scheduler");
  model.scheduler =
      sched != nullptr ? megatron::ValueToJson(sched) : json::Value::Object();
  model.args = args_ != nullptr
                   ? megatron::ArgsToJson(megatron::ArgsView(args_, "args"))
                   : json::Value::Object();

  // The Megatron family's record (megatron_format.h), so that either
  // Megatron format can be written.
  megatron::MegatronExtras meta;
  meta.top_level_keys = std::vector<std::string>(
      std::begin(megatron::kTopLevelKeys), std::end(megatron::kTopLevelKeys));
  meta.entries = entries_;
  meta.release = c_.release;
  meta.gpus_per_node = 8;
  const bool float16 = std::any_of(
      params_.begin(), params_.end(),
      [](const Param& p) { return !p.buffer && p.dtype != DType::kFloat32; });
  meta.optimizer_format = !has_optimizer_ ? "none"
                          : c_.optimizer == "non_distributed"
                              ? (float16 ? "float16" : "fp32")
                              : "distributed";
  meta.state_keys.emplace();
  if (has_step_) meta.state_keys->push_back("step");  // torch Adam's order
  if (has_optimizer_) {
    meta.state_keys->push_back("exp_avg");
    meta.state_keys->push_back("exp_avg_sq");
  }
  meta.grad_dtype = "float32";
  meta.vocab_size_known = true_vocab_known_;
  megatron::WriteMegatronExtras(meta, model);

  WriteTorchDistExtras({.content_metadata = c_.content_metadata,
                        .common_in = c_.common_in,
                        .optimizer = c_.optimizer},
                       model);

  universal::TrainingInfo& training = universal::NewTraining(
      model, dtypes.size() == 1 ? *dtypes.begin() : std::string("mixed"));
  training.global_samples = model.consumed_samples;
  for (const Param& p : params_) training.param_order->push_back(p.name);
}

universal::SourcePlan Planner::Run() {
  ReadSettings();
  CollectParams();
  has_optimizer_ = c_.optimizer != "none";
  for (const dcp::Entry& e : c_.dcp.metadata.entries)
    if (e.tensor) entry_of_.emplace(e.fqn, &e);
  // Model tensors first (their params), then optimizer state.
  for (int pass = 0; pass < 2; ++pass) {
    for (const dcp::Entry& e : c_.dcp.metadata.entries) {
      if (!e.tensor) continue;
      const KeyInfo k = ClassifyKey(e.fqn, true);
      const bool want = pass == 0 ? k.kind == KeyInfo::kModel
                                  : k.kind == KeyInfo::kOptimizerState;
      if (!want) continue;
      PlanTensor(e, k);
    }
  }
  if (experts_) CheckExpertsCovered();
  if (c_.optimizer == "dp_reshardable" ||
      c_.optimizer == "dp_zero_gather_scatter" ||
      c_.optimizer == "fully_sharded_bucket_space")
    PlanBuckets();
  if (c_.optimizer == "non_distributed") PlanCommonStep();
  PlanGroups();
  for (size_t i = 0; i < params_.size(); ++i) {
    const Param& p = params_[i];
    plan_.params.push_back(formats::ParamRow({.fqn = p.name,
                                              .shape = p.full_shape,
                                              .dtype = p.dtype,
                                              .rule = p.rule->name,
                                              .buffer = p.buffer,
                                              .group = group_of_[i],
                                              .order = static_cast<int64_t>(i),
                                              .frozen = false,
                                              .tied_copies = {}}));
  }
  PlanOpaque();
  PlanRoot();
  return std::move(plan_);
}

}  // namespace

universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const SourceOptions& options) {
  return Planner(checkpoint, options).Run();
}

}  // namespace ucp::torch_dist
