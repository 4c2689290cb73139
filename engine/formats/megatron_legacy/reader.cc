// Reading Megatron rank files into a universal SourcePlan (PlanSource) and
// listing their names (ListNames). Formats: megatron_format.h; buffer
// layout: buffer_layout.h; groups: param_groups.h.

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <span>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/source_table.h"
#include "engine/formats/common/state_dict.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/buffer_layout.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron/param_groups.h"
#include "engine/formats/megatron_legacy/megatron.h"
#include "engine/json/json.h"
#include "engine/universal/sources.h"
#include "layouts/layout.h"
#include "layouts/placement.h"

namespace ucp::megatron {
namespace {

namespace fs = std::filesystem;
using formats::ChunkLeaf;
using formats::FlattenChunk;
using formats::SaveBlob;
using layouts::EntryKind;
using layouts::Layout;
using layouts::Rule;
using pickle::Kind;
using pickle::Value;
using torchfile::TensorInfo;
using torchfile::TorchFile;

// ------------------------------------------------------------ loading

struct RankChunk {
  std::string key;  // "model" / "model3"
  std::vector<ChunkLeaf> leaves;
  std::vector<std::string> canonical;  // per leaf
  std::vector<const Rule*> rules;      // per leaf (after matching)
};

struct SourceRank {
  int64_t tp_rank = 0;
  int64_t pp_rank = 0;
  int64_t ep_rank = 0;
  fs::path path;
  fs::path distrib_path;
  std::shared_ptr<const TorchFile> file;
  std::shared_ptr<const TorchFile> distrib;
  const Value* root = nullptr;
  std::vector<RankChunk> chunks;
  std::string Where() const { return StrCat("rank file ", path.string()); }
};

struct Loaded {
  RunConfig run;
  std::vector<SourceRank> ranks;  // pp-major, then ep, tp-minor
  std::optional<Layout> layout;
  // Mixture of experts: the routed experts over the ep ranks (the layout
  // has an experts section).
  std::optional<layouts::ExpertPlacement> experts;
  layouts::Variables vars;
  std::optional<layouts::LayerPlacement> placement;
  bool vocab_known = false;       // vocab_size set (true or padded size)
  bool true_vocab_known = false;  // from the options or the tokenizer
  std::string vocab_source;       // where vocab_size came from

  const layouts::Topology& topology() const { return run.topology; }
  // Megatron makes expert params expert-parallel (allreduce False: their own
  // optimizer groups, buffers and ChainedOptimizer half) only with EP > 1;
  // with EP 1 they are dense params.
  bool Chained() const { return experts && run.topology.ep > 1; }
  SourceRank& Rank(int64_t pp, int64_t tp, int64_t ep = 0) {
    return ranks[static_cast<size_t>(
        (pp * run.topology.ep + ep) * run.topology.tp + tp)];
  }
};

// How a source keeps its optimizer state (megatron_format.h); the names are
// the universal file's "optimizer_format" values.
enum class OptimizerFormat { kNone, kFp32, kFloat16, kDistributed };

const char* OptimizerFormatName(OptimizerFormat f) {
  switch (f) {
    case OptimizerFormat::kNone:
      return "none";
    case OptimizerFormat::kFp32:
      return "fp32";
    case OptimizerFormat::kFloat16:
      return "float16";
    case OptimizerFormat::kDistributed:
      return "distributed";
  }
  return "none";
}

// "model" or "model<i>": a model chunk of a rank file.
bool IsModelKey(std::string_view key) {
  return key.substr(0, 5) == "model" &&
         std::all_of(key.begin() + std::min<size_t>(key.size(), 5), key.end(),
                     [](char c) { return c >= '0' && c <= '9'; });
}

// Megatron's SequentialMLP spelling of expert i of a layer, and the
// canonical one (layouts/README.md, "Mixture of experts").
constexpr std::string_view kLocalExpertsInfix = ".mlp.experts.local_experts.";
constexpr std::string_view kExpertsInfix = ".mlp.experts.";

// Reads rank (p, r)'s args into `L.run` (rank (0, 0)) or checks them against
// it, and flattens its model chunks. Throws FormatError naming no file.
void ReadRankFile(const layouts::Topology& t0, int64_t p, int64_t r,
                  SourceRank& sr, Loaded& L) {
  sr.root = sr.file->root();
  if (sr.root == nullptr || !sr.root->IsDictLike())
    throw FormatError("the file does not hold a dict");
  const ArgsView args(pickle::DictGet(sr.root, "args"), "args");
  RunConfig run = ReadLegacyRunConfig(args);
  if (p == 0 && r == 0 && sr.ep_rank == 0) {
    L.run = run;
  } else if (!(run.topology == L.run.topology) ||
             run.distributed_optimizer != L.run.distributed_optimizer ||
             !(run.variables == L.run.variables)) {
    throw FormatError(
        "args disagree with rank (0, 0): topology ", run.topology.ToString(),
        " vs ", L.run.topology.ToString(), ", model ", run.variables.ToString(),
        " vs ", L.run.variables.ToString());
  }
  if (L.run.topology.tp != t0.tp || L.run.topology.pp != t0.pp ||
      L.run.topology.ep != t0.ep) {
    throw FormatError("args say ", L.run.topology.ToString(),
                      " but the checkpoint was discovered as ", t0.ToString());
  }
  const int64_t vpp = L.run.topology.vpp;
  for (int64_t v = 0; v < vpp; ++v) {
    RankChunk chunk;
    chunk.key = vpp == 1 ? std::string("model") : StrCat("model", v);
    const Value* m = pickle::DictGet(sr.root, chunk.key);
    if (m == nullptr) {
      throw FormatError(
          "no '", chunk.key, "' entry (",
          vpp == 1 ? "no virtual pipeline" : StrCat(vpp, " virtual stages"),
          ")");
    }
    try {
      chunk.leaves = FlattenChunk(*sr.file, m);
    } catch (Error& e) {
      e.AddContext(chunk.key);
      throw;
    }
    // SequentialMLP's local experts under the canonical spelling, still
    // with the local index (NameLeaves makes it global).
    for (ChunkLeaf& leaf : chunk.leaves) {
      const size_t at = leaf.name.find(kLocalExpertsInfix);
      if (at == std::string::npos) continue;
      leaf.name.erase(at + kExpertsInfix.size(),
                      kLocalExpertsInfix.size() - kExpertsInfix.size());
      leaf.key_path = {leaf.name};
    }
    sr.chunks.push_back(std::move(chunk));
  }
}

// Opens every rank file (and its distrib_optim.pt) into `L.ranks`.
void OpenRankFiles(const Checkpoint& c, Loaded& L) {
  const layouts::Topology& t0 = c.topology;
  for (int64_t p = 0; p < t0.pp; ++p) {
    for (int64_t x = 0; x < t0.ep * t0.tp; ++x) {
      const int64_t r = x % t0.tp;
      SourceRank sr;
      sr.tp_rank = r;
      sr.pp_rank = p;
      sr.ep_rank = x / t0.tp;
      sr.path =
          c.rank_files.at(static_cast<size_t>(p)).at(static_cast<size_t>(x));
      // TorchFile's own errors name the file.
      sr.file = std::make_shared<const TorchFile>(TorchFile::Open(sr.path));
      try {
        ReadRankFile(t0, p, r, sr, L);
      } catch (Error& e) {
        e.AddContext(sr.Where());
        throw;
      }
      if (!c.distrib_optim_files.empty()) {
        sr.distrib_path = c.distrib_optim_files.at(static_cast<size_t>(p))
                              .at(static_cast<size_t>(x));
        sr.distrib =
            std::make_shared<const TorchFile>(TorchFile::Open(sr.distrib_path));
      }
      L.ranks.push_back(std::move(sr));
    }
  }
}

// checkpoint_version < 2.0 (0 when absent): Megatron reorders the rows of
// the legacy query_key_value / key_value tensors when loading such files
// (checkpointing.py:fix_query_key_value_ordering); their rows are not in
// the order the layouts describe. Throws FormatError for such a tensor.
void RefuseOldQkvOrder(const Loaded& L) {
  const Value* cv = pickle::DictGet(L.ranks.front().root, "checkpoint_version");
  const double version = cv != nullptr ? cv->AsFloat().value_or(0) : 0;
  if (version >= 2.0) return;
  for (const SourceRank& sr : L.ranks)
    for (const RankChunk& ch : sr.chunks)
      for (const ChunkLeaf& leaf : ch.leaves) {
        const std::string_view n = leaf.name;
        for (std::string_view suffix :
             {".query_key_value.weight", ".query_key_value.bias",
              ".key_value.weight", ".key_value.bias"}) {
          if (n.size() >= suffix.size() &&
              n.substr(n.size() - suffix.size()) == suffix) {
            throw FormatError(
                sr.Where(), " > ", ch.key, " > ", leaf.name,
                ": checkpoint_version ", version,
                " (< 2.0) orders the query/key/value rows differently "
                "(Megatron reorders them when loading); load and save "
                "the checkpoint once with Megatron first");
          }
        }
      }
}

// Every local name of the rank files, first seen first.
std::vector<std::string> LocalNames(const Loaded& L) {
  std::vector<std::string> names;
  std::set<std::string> seen;
  for (const SourceRank& sr : L.ranks)
    for (const RankChunk& ch : sr.chunks)
      for (const ChunkLeaf& leaf : ch.leaves)
        if (seen.insert(leaf.name).second) names.push_back(leaf.name);
  return names;
}

// Model variables; the true vocabulary from the options, the tokenizer
// settings, or (unknown) the padded size. Sets `L.vars` and the placement.
void ResolveVariables(const SourceOptions& options, Loaded& L) {
  layouts::Variables vars = L.run.variables;
  std::optional<int64_t> vocab = options.true_vocab_size;
  L.vocab_source = "option";
  if (!vocab) {
    vocab = L.run.true_vocab_size;
    L.vocab_source = "tokenizer (NullTokenizer vocab_size + 1)";
  }
  L.true_vocab_known = vocab.has_value();
  if (!vocab) {
    vocab = L.run.padded_vocab_size;
    L.vocab_source = "padded_vocab_size (true size unknown)";
  }
  if (vocab) {
    vars.Set("vocab_size", *vocab);
    L.vocab_known = true;
  }
  L.vars = L.layout->Resolve(vars);
  L.placement.emplace(L.layout->NumLayers(L.vars), L.run.topology);
  if (L.layout->experts()) {
    L.experts.emplace(L.layout->NumExperts(L.vars), L.run.topology.ep);
  } else if (L.run.variables.Has("num_moe_experts")) {
    // Args of a mixture-of-experts model over rank files of a dense one.
    throw FormatError(
        L.ranks.front().Where(), ": args say num_experts ",
        L.run.variables.Get("num_moe_experts"), " (expert parallelism ",
        L.run.topology.ep,
        "), a mixture-of-experts model, but the rank files hold no routed "
        "experts (layout '",
        L.layout->name(), "')");
  }
}

// Each leaf's canonical name. Throws LayoutError if a leaf's nesting does
// not follow the layout.
void NameLeaves(Loaded& L) {
  const Layout& layout = *L.layout;
  for (SourceRank& sr : L.ranks) {
    for (size_t v = 0; v < sr.chunks.size(); ++v) {
      RankChunk& ch = sr.chunks[v];
      for (const ChunkLeaf& leaf : ch.leaves) {
        try {
          if (layout.FromKeyPath(leaf.key_path) != leaf.name) {
            throw LayoutError("nesting does not follow layout '", layout.name(),
                              "'");
          }
          std::string name =
              layouts::CanonicalName(layout, leaf.name, *L.placement,
                                     sr.pp_rank, static_cast<int64_t>(v));
          // A local expert index -> global (ep rank * E/EP + local).
          if (const auto x = layout.SplitExpert(name); x && L.experts) {
            const int64_t local = L.experts->local_experts();
            const int64_t global = sr.ep_rank * local + x->index;
            if (global >= L.experts->num_experts()) {
              throw FormatError("layer ", x->layer, ": local expert ", x->index,
                                " of EP rank ", sr.ep_rank,
                                " would be global expert ", global,
                                ", but the model has ",
                                L.experts->num_experts(), " experts (", local,
                                " per EP rank of ", L.run.topology.ep, ")");
            }
            name = layout.WithExpert(name, global);
          }
          ch.canonical.push_back(std::move(name));
        } catch (Error& e) {
          e.AddContext(sr.Where(), " > ", ch.key, " > ", leaf.name);
          throw;
        }
      }
    }
  }
}

// Opens every rank file, flattens its chunks, reads the args, chooses the
// layout (given, or detected from every local name) and computes canonical
// names.
Loaded Load(const Checkpoint& c, const SourceOptions& options) {
  Loaded L;
  OpenRankFiles(c, L);
  RefuseOldQkvOrder(L);
  L.layout = Layout::FromSpec(options.layout, LocalNames(L));
  ResolveVariables(options, L);
  NameLeaves(L);
  return L;
}

// Chunks in global order: (vp 0, pp 0), (vp 0, pp 1), ..., (vp V-1, pp P-1).
template <typename Fn>
void ForChunksInOrder(Loaded& L, Fn&& fn) {
  const layouts::Topology& t = L.topology();
  for (int64_t v = 0; v < t.vpp; ++v)
    for (int64_t p = 0; p < t.pp; ++p) fn(p, v);
}

// ------------------------------------------------------------ planning

// Finds an int-keyed entry of a dict.
const Value* GetInt(const Value* dict, int64_t key) {
  if (dict == nullptr || !dict->IsDictLike()) return nullptr;
  const Value* found = nullptr;
  for (const auto& [k, v] : dict->entries) {
    if (k != nullptr && k->kind == Kind::kInt && k->big.empty() && k->i == key)
      found = v;
  }
  return found;
}

struct ParamState {
  std::string name;
  const Rule* rule = nullptr;
  Shape full_shape;
  DType dtype = DType::kFloat32;
  int64_t padded_rows = 0;  // vocab rules: local rows * tp
  int64_t pad_rows = 0;     // padded_rows - true rows
  int64_t order = 0;
  int64_t group = -1;
  bool buffer = false;
  std::vector<std::string> tied_copies;
};

// One param entry of a rank, in named_parameters() order.
struct RankParam {
  size_t chunk = 0;
  size_t leaf = 0;
  ParamState* state = nullptr;
  bool tied_copy = false;
};

class Planner {
 public:
  Planner(Loaded& L, const Checkpoint& c) : L_(L), c_(c) {}

  universal::SourcePlan Run();

 private:
  reshape::SourceTensor Tensor(const std::shared_ptr<const TorchFile>& file,
                               const TensorInfo& t, const std::string& what);
  universal::AtomPlan& Atom(const ParamState& ps, const std::string& kind,
                            DType dtype, bool scalar);
  void AddFragments(universal::AtomPlan& atom, const reshape::SourceTensor& src,
                    const layouts::LocalShard& shard, const std::string& where);
  layouts::LocalShard ShardOf(const ParamState& ps, const Rule& rule,
                              int64_t tp_rank) const;

  void CollectParams();
  // Mixture of experts: the (rank, leaf index) of chunk (p, v)'s entries in
  // canonical order: TP rank 0 of EP rank 0's, each layer's experts those
  // of every EP rank in EP order.
  std::vector<std::pair<SourceRank*, size_t>> MergedEntries(int64_t p,
                                                            int64_t v);
  // Every expert entry of every MoE layer held once per TP rank across the
  // rank files. Throws FormatError naming the layer and the missing or
  // duplicated global experts.
  void CheckExpertsCovered() const;
  void PlanModel();
  void FindOptimizer();
  void PlanOptimizer();
  void PlanRankOptimizer(SourceRank& sr);
  // The optimizer state of rank file `sr` (its errors name no file): the
  // params for PlanDistributed if it is the distributed optimizer's.
  // `opt` is the 'optimizer' entry, or one half of a ChainedOptimizer's
  // list (`half` 0 dense, 1 expert; -1: all params).
  std::optional<std::vector<RankParam>> PlanRankModelFileOptimizer(
      SourceRank& sr, const Value* opt, int half);
  // PlanRankModelFileOptimizer's steps.
  // The rank's params in named_parameters() order (tied copies are real
  // params here), their group keys appended to `keys`.
  std::vector<RankParam> RankParams(SourceRank& sr, std::vector<GroupKey>& keys,
                                    int half);
  // How a rank file keeps its optimizer state.
  struct RankOptimizer {
    OptimizerFormat format = OptimizerFormat::kNone;
    const Value* inner = nullptr;        // holds param_groups (and state)
    const Value* fp32_groups = nullptr;  // float16: fp32_from_fp16_params
  };
  // The form of optimizer entry `opt`. Throws FormatError if it is unknown,
  // disagrees with the args' use_distributed_optimizer or rank (0, 0).
  RankOptimizer ClassifyOptimizer(const Value* opt);
  // Param `j` of group `gi`: its fp32 copy (item j of `fp32_list`, if not
  // null) and the state dict of id `id` in `state`.
  void PlanParamState(SourceRank& sr, const RankParam& rp, size_t gi, size_t j,
                      const Value* id, const Value* fp32_list,
                      const Value* state);
  // The tensors of state dict `st` (state id `id`) as atoms of their key;
  // returns the keys.
  std::vector<std::string> PlanStateEntries(SourceRank& sr,
                                            const ParamState& ps,
                                            const ChunkLeaf& leaf,
                                            const layouts::LocalShard& shard,
                                            const Value* st, int64_t id);
  // The distributed optimizer's state of rank `sr` from its
  // distrib_optim.pt (errors name that file).
  // `halves`: one entry (no experts) or the dense and the expert half's
  // params (distrib_optim.pt then holds a list of two, an entry None where
  // this rank is not DP rank 0 of that half's group).
  void PlanDistributed(
      SourceRank& sr,
      const std::vector<std::optional<std::vector<RankParam>>>& halves);
  // PlanDistributed's steps: buffer `v` (model chunk v) of `root`.
  // One half's (or the only) state dict `root` over data-parallel size
  // `dp`.
  void PlanDistributedHalf(SourceRank& sr, const std::vector<RankParam>& params,
                           const Value* root, int64_t dp,
                           const std::string& dwhere);
  void PlanDistributedBuffer(SourceRank& sr,
                             const std::vector<RankParam>& params,
                             const Value* root, size_t v, int64_t local_params,
                             int64_t dp, const std::string& dwhere);
  // Checks buffer key `dtkey` is a (param dtype, grad dtype) pair, its
  // param dtype the members'; keeps the first grad dtype.
  void CheckBufferDtypes(const RankChunk& ch,
                         const std::vector<const RankParam*>& members,
                         const Value* dtkey, size_t v);
  // Each world tensor of buffer dict `world`, cut into its members' atoms.
  void PlanWorldTensors(SourceRank& sr,
                        const std::vector<const RankParam*>& members,
                        const BufferLayout& layout, const Value* world,
                        size_t v, const std::string& bwhere);
  void NoteGroups(const Value* groups, const Grouping& g,
                  const std::string& where);
  // Megatron-core v0.16 keeps a group that is empty on a rank when another
  // rank has it (a pipeline stage without experts keeps the expert half's
  // group): `groups` without the stored groups whose key none of the rank's
  // params (`keys`) has and that list no params (the distributed
  // optimizer's list none), and `*fp32_groups` (if not null) without their
  // lists. Returns `groups` itself when nothing is dropped.
  const Value* DropEmptyGroups(const Value* groups,
                               std::span<const GroupKey> keys,
                               const Value** fp32_groups);
  void PlanOpaque();
  void PlanRoot();
  std::string Blob(const TorchFile* file, const Value* v);

  Loaded& L_;
  const Checkpoint& c_;
  universal::SourcePlan plan_;
  formats::SourceTable sources_{plan_};
  std::map<std::pair<std::string, std::string>, size_t> atoms_;
  std::map<std::string, ParamState> params_;
  std::vector<std::string> param_order_;
  std::vector<std::pair<std::string, std::string>> entries_;
  bool has_optimizer_ = false;
  OptimizerFormat optimizer_format_ = OptimizerFormat::kNone;
  std::vector<std::string> state_keys_;
  // Canonical groups: key, the first stored dict seen (and its file).
  std::vector<GroupKey> group_keys_;
  std::vector<const Value*> group_dicts_;
  // Every rank's optimizer has one param group for all its params (a
  // trainer that did not use Megatron's grouping rule): its key, else none.
  std::optional<GroupKey> single_group_;
  std::string grad_dtype_;
  pickle::Arena arena_;  // DropEmptyGroups' lists
};

reshape::SourceTensor Planner::Tensor(
    const std::shared_ptr<const TorchFile>& file, const TensorInfo& t,
    const std::string& what) {
  return sources_.Tensor(file, t, what);
}

universal::AtomPlan& Planner::Atom(const ParamState& ps,
                                   const std::string& kind, DType dtype,
                                   bool scalar) {
  auto key = std::make_pair(ps.name, kind);
  auto it = atoms_.find(key);
  if (it != atoms_.end()) {
    universal::AtomPlan& a = plan_.atoms[it->second];
    const Shape& shape = scalar ? Shape{} : ps.full_shape;
    if (a.dtype != dtype) {
      throw FormatError("'", kind, "' is ", DTypeName(dtype), " here but ",
                        DTypeName(a.dtype), " in another rank file");
    }
    if (a.shape != shape) {
      throw FormatError("'", kind, "' has full shape ", ShapeString(shape),
                        " here but ", ShapeString(a.shape),
                        " in another rank file");
    }
    return a;
  }
  universal::AtomPlan a;
  a.param = ps.name;
  a.state_kind = kind;
  a.dtype = dtype;
  if (!scalar) {
    a.shape = ps.full_shape;
    if (ps.pad_rows > 0) {
      a.pad_shape = ps.full_shape;
      a.pad_shape[static_cast<size_t>(ps.rule->tp.dim)] = ps.pad_rows;
    }
  }
  atoms_.emplace(key, plan_.atoms.size());
  plan_.atoms.push_back(std::move(a));
  return plan_.atoms.back();
}

void Planner::AddFragments(universal::AtomPlan& atom,
                           const reshape::SourceTensor& src,
                           const layouts::LocalShard& shard,
                           const std::string& where) {
  for (const layouts::Piece& piece : shard.pieces) {
    universal::Fragment f;
    f.src = src;
    f.src_box = piece.local;
    f.atom_box = piece.global;
    f.pad = piece.region == layouts::Region::kPad;
    f.where = where;
    atom.fragments.push_back(std::move(f));
  }
}

layouts::LocalShard Planner::ShardOf(const ParamState& ps, const Rule& rule,
                                     int64_t tp_rank) const {
  return layouts::ShardFor(rule, ps.full_shape, L_.topology().tp, tp_rank,
                           ps.padded_rows, ps.pad_rows);
}

// Canonical order, full shapes, dtypes, entries; checks every rank's chunk
// against TP rank 0's and every entry's home.
void Planner::CollectParams() {
  const Layout& layout = *L_.layout;
  const int64_t tp = L_.topology().tp;
  std::set<std::string> seen;
  // Match rules (with context), check homes and key lists.
  for (SourceRank& sr : L_.ranks) {
    for (size_t v = 0; v < sr.chunks.size(); ++v) {
      RankChunk& ch = sr.chunks[v];
      for (size_t i = 0; i < ch.leaves.size(); ++i) {
        const std::string& name = ch.canonical[i];
        try {
          const Rule& rule = layout.Match(name, L_.vars);
          const layouts::Home home =
              layouts::HomeOf(layout, rule, name, *L_.placement);
          if (home.pp_rank != sr.pp_rank ||
              home.vp_chunk != static_cast<int64_t>(v)) {
            throw FormatError("found on pipeline rank ", sr.pp_rank, " chunk ",
                              v, " but ", rule.Describe(),
                              " places it on pipeline rank ", home.pp_rank,
                              " chunk ", home.vp_chunk);
          }
          if (rule.entry != EntryKind::kOpaque &&
              ch.leaves[i].tensor == nullptr)
            throw FormatError("is not a tensor (",
                              pickle::Repr(ch.leaves[i].value, 60), ")");
          ch.rules.push_back(&rule);
        } catch (Error& e) {
          e.AddContext(sr.Where(), " > ", ch.key, " > param ", name);
          throw;
        }
      }
      // Every TP rank of a (pp, ep) holds the same names; every EP rank
      // the same names but for its experts.
      const SourceRank& ref_rank = sr.tp_rank > 0
                                       ? L_.Rank(sr.pp_rank, 0, sr.ep_rank)
                                       : L_.Rank(sr.pp_rank, 0, 0);
      if (&ref_rank == &sr) continue;
      const RankChunk& ref = ref_rank.chunks[v];
      auto names = [&](const RankChunk& c) {
        if (sr.tp_rank > 0) return c.canonical;
        std::vector<std::string> out;
        for (size_t i = 0; i < c.canonical.size(); ++i)
          if (!c.rules[i]->expert) out.push_back(c.canonical[i]);
        return out;
      };
      const std::vector<std::string> mine = names(ch);
      const std::vector<std::string> theirs = names(ref);
      if (mine != theirs) {
        size_t k = 0;
        while (k < theirs.size() && k < mine.size() && theirs[k] == mine[k])
          ++k;
        throw FormatError(sr.Where(), " > ", ch.key, ": entries differ from ",
                          sr.tp_rank > 0 ? "TP rank 0 (" : "EP rank 0 (",
                          ref_rank.path.string(), ") at position ", k, ": ",
                          k < mine.size() ? mine[k] : "<end>", " vs ",
                          k < theirs.size() ? theirs[k] : "<end>");
      }
    }
  }
  if (L_.experts) CheckExpertsCovered();

  // The vocabulary from the padded rows when nothing else says it.
  if (!L_.vocab_known) {
    for (SourceRank& sr : L_.ranks) {
      for (RankChunk& ch : sr.chunks) {
        for (size_t i = 0; i < ch.leaves.size() && !L_.vocab_known; ++i) {
          const Rule& r = *ch.rules[i];
          if (r.tp.split && r.tp.vocab && ch.leaves[i].tensor != nullptr &&
              static_cast<size_t>(r.tp.dim) <
                  ch.leaves[i].tensor->shape.size()) {
            L_.vars.Set(
                "vocab_size",
                ch.leaves[i].tensor->shape[static_cast<size_t>(r.tp.dim)] * tp);
            L_.vocab_known = true;
            L_.vocab_source = "the rank files' rows (true size unknown)";
          }
        }
      }
    }
  }

  // Canonical sequence from TP rank 0 of every chunk in global order (the
  // experts of every EP rank in place of EP rank 0's).
  int64_t order = 0;
  ForChunksInOrder(L_, [&](int64_t p, int64_t v) {
    for (const auto& [sp, i] : MergedEntries(p, v)) {
      SourceRank& sr = *sp;
      RankChunk& ch = sr.chunks[static_cast<size_t>(v)];
      const Rule& rule = *ch.rules[i];
      const std::string& name = ch.canonical[i];
      if (rule.tied_to) continue;
      if (!seen.insert(name).second) {
        throw FormatError(sr.Where(), " > ", ch.key, " > param ", name,
                          ": appears in two model chunks");
      }
      if (rule.entry == EntryKind::kOpaque) {
        entries_.emplace_back(name, "opaque");
        continue;
      }
      entries_.emplace_back(
          name, rule.entry == EntryKind::kBuffer ? "buffer" : "param");
      const TensorInfo& t = *ch.leaves[i].tensor;
      ParamState ps;
      ps.name = name;
      ps.rule = &rule;
      ps.dtype = t.dtype;
      ps.order = order++;
      ps.buffer = rule.entry == EntryKind::kBuffer;
      try {
        ps.full_shape = layouts::FullShapeFromLocal(rule, t.shape, tp, L_.vars);
        if (rule.tp.split && rule.tp.vocab) {
          ps.padded_rows = t.shape[static_cast<size_t>(rule.tp.dim)] * tp;
          ps.pad_rows =
              ps.padded_rows - ps.full_shape[static_cast<size_t>(rule.tp.dim)];
          if (ps.pad_rows < 0) {
            throw FormatError("the ranks hold ", ps.padded_rows,
                              " vocabulary rows, fewer than the vocabulary "
                              "size ",
                              ps.full_shape[static_cast<size_t>(rule.tp.dim)]);
          }
        }
      } catch (Error& e) {
        e.AddContext(sr.Where(), " > ", ch.key, " > param ", name);
        throw;
      }
      param_order_.push_back(name);
      params_.emplace(name, std::move(ps));
    }
  });

  // Tied copies name existing originals with the same shape.
  for (SourceRank& sr : L_.ranks) {
    for (RankChunk& ch : sr.chunks) {
      for (size_t i = 0; i < ch.leaves.size(); ++i) {
        const Rule& rule = *ch.rules[i];
        if (!rule.tied_to) continue;
        auto it = params_.find(*rule.tied_to);
        if (it == params_.end()) {
          throw FormatError(sr.Where(), " > ", ch.key, " > param ",
                            ch.canonical[i], ": tied copy of ", *rule.tied_to,
                            ", which no rank file holds");
        }
        std::vector<std::string>& copies = it->second.tied_copies;
        if (std::find(copies.begin(), copies.end(), ch.canonical[i]) ==
            copies.end())
          copies.push_back(ch.canonical[i]);
      }
    }
  }
}

std::vector<std::pair<SourceRank*, size_t>> Planner::MergedEntries(int64_t p,
                                                                   int64_t v) {
  const Layout& layout = *L_.layout;
  const int64_t ep = L_.topology().ep;
  // Per EP rank (TP rank 0): each leaf's expert layer (-1: not an expert
  // entry) and layer -> its expert leaves in order.
  std::vector<std::vector<int64_t>> layer_of(static_cast<size_t>(ep));
  std::vector<std::map<int64_t, std::vector<size_t>>> layers(
      static_cast<size_t>(ep));
  for (int64_t e = 0; e < ep; ++e) {
    const RankChunk& ch = L_.Rank(p, 0, e).chunks[static_cast<size_t>(v)];
    std::vector<int64_t>& of = layer_of[static_cast<size_t>(e)];
    of.assign(ch.leaves.size(), -1);
    for (size_t i = 0; i < ch.leaves.size(); ++i) {
      if (!ch.rules[i]->expert) continue;
      const auto x = layout.SplitExpert(ch.canonical[i]);
      if (!x) continue;
      of[i] = x->layer;
      layers[static_cast<size_t>(e)][x->layer].push_back(i);
    }
  }
  std::vector<std::pair<SourceRank*, size_t>> out;
  std::set<int64_t> done;  // layers whose experts are out
  SourceRank& r0 = L_.Rank(p, 0, 0);
  for (size_t i = 0; i < layer_of[0].size(); ++i) {
    const int64_t layer = layer_of[0][i];
    if (layer < 0) {
      out.emplace_back(&r0, i);
      continue;
    }
    if (!done.insert(layer).second) continue;
    for (int64_t e = 0; e < ep; ++e) {
      auto it = layers[static_cast<size_t>(e)].find(layer);
      if (it == layers[static_cast<size_t>(e)].end()) continue;
      for (size_t j : it->second) out.emplace_back(&L_.Rank(p, 0, e), j);
    }
  }
  return out;
}

void Planner::CheckExpertsCovered() const {
  const Layout& layout = *L_.layout;
  const int64_t num = L_.experts->num_experts();
  // (canonical name, tp rank) -> the rank files holding it.
  std::map<std::pair<std::string, int64_t>, std::vector<const SourceRank*>>
      held;
  std::map<std::string, std::string> templates;  // suffix -> a name
  for (const SourceRank& sr : L_.ranks) {
    for (const RankChunk& ch : sr.chunks) {
      for (size_t i = 0; i < ch.canonical.size(); ++i) {
        if (!ch.rules[i]->expert) continue;
        const auto x = layout.SplitExpert(ch.canonical[i]);
        if (!x) continue;
        if (!layout.IsMoeLayer(x->layer, L_.vars)) {
          throw FormatError(sr.Where(), " > ", ch.key, " > ", ch.leaves[i].name,
                            ": layer ", x->layer,
                            " holds routed experts, but the model's MoE "
                            "layers (moe_layer_freq) make it dense");
        }
        templates.emplace(x->suffix, ch.canonical[i]);
        held[{ch.canonical[i], sr.tp_rank}].push_back(&sr);
      }
    }
  }
  auto list = [](const std::vector<int64_t>& v) {
    std::string out;
    for (int64_t e : v) out += StrCat(out.empty() ? "" : ", ", e);
    return out;
  };
  std::vector<std::string> problems;
  const int64_t tp = L_.topology().tp;
  for (int64_t l = 0; l < L_.placement->num_layers(); ++l) {
    if (!layout.IsMoeLayer(l, L_.vars)) continue;
    for (const auto& [suffix, name] : templates) {
      for (int64_t r = 0; r < tp; ++r) {
        std::vector<int64_t> missing, twice;
        std::string where;
        for (int64_t e = 0; e < num; ++e) {
          const std::string n = layout.WithExpert(layout.WithLayer(name, l), e);
          const auto it = held.find({n, r});
          const size_t count = it == held.end() ? 0 : it->second.size();
          if (count == 0) missing.push_back(e);
          if (count > 1) {
            twice.push_back(e);
            if (where.empty()) {
              where =
                  StrCat(" (expert ", e, " in ", it->second[0]->path.string(),
                         " and ", it->second[1]->path.string(), ")");
            }
          }
        }
        if (missing.empty() && twice.empty()) continue;
        problems.push_back(
            StrCat("layer ", l, " ", layout.experts()->infix, "*", suffix,
                   tp > 1 ? StrCat(" (tp rank ", r, ")") : "", ": ",
                   missing.empty()
                       ? ""
                       : StrCat("global experts ", list(missing), " missing"),
                   !missing.empty() && !twice.empty() ? ", " : "",
                   twice.empty() ? ""
                                 : StrCat("global experts ", list(twice),
                                          " stored more than once", where)));
      }
    }
  }
  if (!problems.empty()) {
    throw FormatError(
        c_.iter_dir.string(), ": ", problems.front(), " (of ", num,
        " experts over ", L_.topology().ep,
        " EP ranks; every expert of every MoE layer must be stored exactly "
        "once across the rank files)",
        problems.size() > 1
            ? StrCat(" (and ", problems.size() - 1, " more problems)")
            : "");
  }
}

// Model tensors: `param` (training dtype) or `fp32` fragments; shape and
// dtype checks per rank.
void Planner::PlanModel() {
  for (SourceRank& sr : L_.ranks) {
    for (RankChunk& ch : sr.chunks) {
      for (size_t i = 0; i < ch.leaves.size(); ++i) {
        const Rule& rule = *ch.rules[i];
        if (rule.entry == EntryKind::kOpaque) continue;
        const std::string& name = ch.canonical[i];
        const std::string where =
            StrCat(sr.Where(), " > ", ch.key, " > ", ch.leaves[i].name);
        try {
          ParamState& ps = params_.at(rule.tied_to ? *rule.tied_to : name);
          const TensorInfo& t = *ch.leaves[i].tensor;
          if (t.dtype != ps.dtype) {
            throw FormatError("dtype ", DTypeName(t.dtype), ", but ",
                              DTypeName(ps.dtype),
                              " on TP rank 0 of the "
                              "first stage holding it");
          }
          layouts::LocalShard shard = ShardOf(ps, rule, sr.tp_rank);
          if (shard.local_shape != t.shape) {
            throw FormatError(
                "local shape ", ShapeString(t.shape), ", expected ",
                ShapeString(shard.local_shape), " for tp rank ", sr.tp_rank,
                " of ", L_.topology().tp, " (full shape ",
                ShapeString(ps.full_shape), ", ", rule.Describe(), ")");
          }
          const bool low_precision = ps.dtype != DType::kFloat32;
          const std::string kind =
              low_precision && has_optimizer_ && !ps.buffer ? "param" : "fp32";
          universal::AtomPlan& atom =
              ps.buffer
                  ? Atom(ps, "param", ps.dtype, false)
                  : Atom(ps, kind, kind == "param" ? ps.dtype : DType::kFloat32,
                         false);
          AddFragments(atom, Tensor(sr.file, t, where), shard, where);
        } catch (Error& e) {
          e.AddContext(sr.Where(), " > ", ch.key, " > param ", name);
          throw;
        }
      }
    }
  }
}

// The param_groups list of a rank's 'optimizer' entry (the inner
// optimizer's for mixed precision and the distributed optimizer), nullptr if
// there is none.
const Value* StoredGroups(const Value* opt) {
  if (opt == nullptr || !opt->IsDictLike()) return nullptr;
  const Value* inner = opt->Get("optimizer");
  if (inner != nullptr && inner->IsDictLike())
    return inner->Get("param_groups");
  return opt->Get("param_groups");
}

// Megatron's grouping of a rank's params in the order the stored groups
// follow: first appearance (v0.6+), or the fixed order of Megatron-core <=
// v0.5 / Megatron-LM 23.x or v0.16's sorted order when the stored keys say
// so (NoteGroups reports a
// mismatch against the first-appearance rule).
Grouping MatchGrouping(const Value* groups, std::span<const GroupKey> keys) {
  Grouping first = GroupParams(keys);
  if (groups == nullptr || groups->kind != Kind::kList ||
      groups->items.size() != first.keys.size())
    return first;
  std::vector<GroupKey> stored;
  for (const Value* d : groups->items) {
    if (d == nullptr || !d->IsDictLike()) return first;
    stored.push_back(StoredGroupKey(d));
  }
  if (stored == first.keys) return first;
  Grouping legacy = GroupParams(keys, GroupOrder::kLegacyFixed);
  if (stored == legacy.keys) return legacy;
  Grouping sorted = GroupParams(keys, GroupOrder::kOverridesSorted);
  return stored == sorted.keys ? sorted : first;
}

void Planner::NoteGroups(const Value* groups, const Grouping& g,
                         const std::string& where) {
  if (groups == nullptr || groups->kind != Kind::kList) {
    throw FormatError(where, ": 'param_groups' is not a list");
  }
  if (groups->items.size() != g.keys.size()) {
    std::string keys;
    for (const GroupKey& k : g.keys) {
      keys += ' ';
      keys += k.ToString();
    }
    throw FormatError(where, ": ", groups->items.size(),
                      " optimizer param groups, but Megatron's grouping of "
                      "this rank's params gives ",
                      g.keys.size(), ":", keys);
  }
  for (size_t gi = 0; gi < g.keys.size(); ++gi) {
    const Value* d = groups->items[gi];
    const GroupKey stored = StoredGroupKey(d);
    if (!(stored == g.keys[gi])) {
      throw FormatError(where, ": param group ", gi, " has key ",
                        stored.ToString(), ", Megatron's rule gives ",
                        g.keys[gi].ToString());
    }
    size_t ci = 0;
    while (ci < group_keys_.size() && !(group_keys_[ci] == stored)) ++ci;
    if (ci == group_keys_.size()) {
      throw FormatError(where, ": param group ", gi, " ", stored.ToString(),
                        " matches no canonical group");
    }
    const Value*& chosen = group_dicts_[ci];
    if (chosen == nullptr) {
      chosen = d;
      continue;
    }
    // Same hyper-parameters on every rank (`step` only where both have it:
    // a distributed optimizer's group that never stepped on DP rank 0 has
    // none); prefer a dict carrying `step`.
    auto compare = [&](const Value* a, const Value* b) {
      for (const auto& [k, v] : a->entries) {
        if (k == nullptr || k->kind != Kind::kStr || k->s == "params") continue;
        const Value* other = b->Get(k->s);
        if (other == nullptr) {
          if (k->s == "step") continue;
          throw FormatError(where, ": param group ", gi, " ",
                            a == d ? "has" : "lacks", " '", k->s,
                            "', unlike the same group of another rank");
        }
        if (!pickle::DeepEqual(v, other)) {
          throw FormatError(where, ": param group ", gi, " '", k->s,
                            "' = ", pickle::Repr(d->Get(k->s), 40),
                            ", another rank has ",
                            pickle::Repr(chosen->Get(k->s), 40));
        }
      }
    };
    compare(d, chosen);
    compare(chosen, d);
    if (chosen->Get("step") == nullptr && d->Get("step") != nullptr) chosen = d;
  }
}

const Value* Planner::DropEmptyGroups(const Value* groups,
                                      std::span<const GroupKey> keys,
                                      const Value** fp32_groups) {
  if (groups == nullptr || groups->kind != Kind::kList) return groups;
  std::vector<Value*> kept, kept_fp32;
  const Value* fp32 = *fp32_groups;
  const bool fp32_ok = fp32 != nullptr && fp32->kind == Kind::kList &&
                       fp32->items.size() == groups->items.size();
  for (size_t i = 0; i < groups->items.size(); ++i) {
    const Value* d = groups->items[i];
    bool drop = false;
    if (d != nullptr && d->IsDictLike()) {
      const GroupKey k = StoredGroupKey(d);
      const Value* ids = d->Get("params");
      drop =
          std::find(keys.begin(), keys.end(), k) == keys.end() &&
          (ids == nullptr || (ids->kind == Kind::kList && ids->items.empty()));
    }
    if (drop) continue;
    kept.push_back(const_cast<Value*>(d));
    if (fp32_ok) kept_fp32.push_back(const_cast<Value*>(fp32->items[i]));
  }
  if (kept.size() == groups->items.size()) return groups;
  if (fp32_ok) *fp32_groups = arena_.List(std::move(kept_fp32));
  return arena_.List(std::move(kept));
}

// Whether the rank files hold optimizer state: all of them or none.
void Planner::FindOptimizer() {
  const Value* opt0 = pickle::DictGet(L_.ranks.front().root, "optimizer");
  has_optimizer_ = opt0 != nullptr && opt0->kind != Kind::kNone;
  for (SourceRank& sr : L_.ranks) {
    const Value* o = pickle::DictGet(sr.root, "optimizer");
    if ((o != nullptr && o->kind != Kind::kNone) != has_optimizer_) {
      throw FormatError(sr.Where(), ": has ", has_optimizer_ ? "no " : "",
                        "'optimizer' entry, unlike rank (0, 0)");
    }
  }
}

void Planner::PlanOptimizer() {
  if (!has_optimizer_) return;
  // Canonical groups over the canonical params (experts: their own,
  // is_expert_parallel groups).
  std::vector<GroupKey> keys;
  std::vector<std::string> names;
  for (const std::string& n : param_order_) {
    const ParamState& ps = params_.at(n);
    if (ps.buffer) continue;
    keys.push_back(DefaultGroupKey(n, ps.full_shape.size()));
    keys.back().is_expert_parallel = ps.rule->expert && L_.Chained();
    names.push_back(n);
  }
  std::vector<const Value*> stored;
  for (const SourceRank& sr : L_.ranks)
    stored.push_back(StoredGroups(pickle::DictGet(sr.root, "optimizer")));
  if (auto one = L_.Chained() ? std::nullopt
                              : SingleStoredGroup(
                                    stored, GroupParams(keys).keys.size())) {
    single_group_ = one;
    std::fill(keys.begin(), keys.end(), *one);
  }
  Grouping g = GroupParams(keys);
  group_keys_ = g.keys;
  group_dicts_.assign(g.keys.size(), nullptr);
  for (size_t i = 0; i < names.size(); ++i)
    params_.at(names[i]).group = static_cast<int64_t>(g.group_of[i]);
  for (SourceRank& sr : L_.ranks) PlanRankOptimizer(sr);
  for (size_t i = 0; i < group_dicts_.size(); ++i) {
    if (group_dicts_[i] == nullptr) {
      throw FormatError("no rank file holds optimizer group ",
                        group_keys_[i].ToString());
    }
  }
}

void Planner::PlanRankOptimizer(SourceRank& sr) {
  // The distributed optimizer's tensors live in distrib_optim.pt, whose
  // errors name that file; everything else names the model file.
  std::vector<std::optional<std::vector<RankParam>>> distributed;
  try {
    const Value* opt = pickle::DictGet(sr.root, "optimizer");
    if (opt->kind == Kind::kList) {
      // A ChainedOptimizer: a mixture-of-experts model's dense and expert
      // halves.
      if (!L_.Chained() || opt->items.size() != 2) {
        throw FormatError(
            "'optimizer' is a list of ", opt->items.size(),
            " (a ChainedOptimizer): only a mixture-of-experts model's two "
            "halves (dense, experts) are supported");
      }
      for (int half = 0; half < 2; ++half) {
        try {
          distributed.push_back(
              PlanRankModelFileOptimizer(sr, opt->items[half], half));
        } catch (Error& e) {
          e.AddContext("optimizer[", half, "] (the ",
                       half == 0 ? "dense" : "expert", " half)");
          throw;
        }
      }
    } else {
      if (L_.Chained()) {
        throw FormatError(
            "'optimizer' is not a list: with expert parallelism (EP ",
            L_.topology().ep,
            ") the optimizer is a ChainedOptimizer of a dense and an expert "
            "half");
      }
      distributed.push_back(PlanRankModelFileOptimizer(sr, opt, -1));
    }
  } catch (Error& e) {
    e.AddContext(sr.Where());
    throw;
  }
  if (distributed.front()) PlanDistributed(sr, distributed);
}

std::optional<std::vector<RankParam>> Planner::PlanRankModelFileOptimizer(
    SourceRank& sr, const Value* opt, int half) {
  if (opt == nullptr || !opt->IsDictLike())
    throw FormatError("'optimizer' is not a dict");
  std::vector<GroupKey> keys;
  std::vector<RankParam> params = RankParams(sr, keys, half);
  RankOptimizer o = ClassifyOptimizer(opt);
  const Value* groups =
      DropEmptyGroups(o.inner->Get("param_groups"), keys, &o.fp32_groups);
  const Grouping g = MatchGrouping(groups, keys);
  NoteGroups(groups, g, "optimizer param_groups");
  if (o.format == OptimizerFormat::kDistributed) return params;
  if (o.format == OptimizerFormat::kFloat16 &&
      !(o.fp32_groups->kind == Kind::kList &&
        o.fp32_groups->items.size() == g.keys.size())) {
    throw FormatError(
        "'fp32_from_fp16_params' does not hold one list per "
        "param group");
  }
  // State ids -> per-param state dicts.
  const Value* state = o.inner->Get("state");
  if (state == nullptr || !state->IsDictLike())
    throw FormatError("optimizer 'state' is not a dict");
  for (size_t gi = 0; gi < g.keys.size(); ++gi) {
    const std::vector<size_t>& members = g.members[gi];
    const Value* ids = groups->items[gi]->Get("params");
    if (ids == nullptr || ids->kind != Kind::kList ||
        ids->items.size() != members.size()) {
      throw FormatError("param group ", gi, " lists ",
                        ids && ids->kind == Kind::kList ? ids->items.size() : 0,
                        " params, Megatron's grouping gives ", members.size());
    }
    const Value* fp32_list =
        o.fp32_groups != nullptr ? o.fp32_groups->items[gi] : nullptr;
    if (fp32_list != nullptr && (fp32_list->kind != Kind::kList ||
                                 fp32_list->items.size() != members.size())) {
      throw FormatError("fp32_from_fp16_params[", gi, "] does not hold ",
                        members.size(), " tensors");
    }
    for (size_t j = 0; j < members.size(); ++j) {
      PlanParamState(sr, params[members[j]], gi, j, ids->items[j], fp32_list,
                     state);
    }
  }
  return std::nullopt;
}

std::vector<RankParam> Planner::RankParams(SourceRank& sr,
                                           std::vector<GroupKey>& keys,
                                           int half) {
  std::vector<RankParam> params;
  for (size_t v = 0; v < sr.chunks.size(); ++v) {
    RankChunk& ch = sr.chunks[v];
    for (size_t i = 0; i < ch.leaves.size(); ++i) {
      const Rule& rule = *ch.rules[i];
      if (rule.entry != EntryKind::kParam) continue;
      if (half >= 0 && rule.expert != (half == 1)) continue;
      RankParam rp;
      rp.chunk = v;
      rp.leaf = i;
      rp.tied_copy = rule.tied_to.has_value();
      rp.state = &params_.at(rp.tied_copy ? *rule.tied_to : ch.canonical[i]);
      params.push_back(rp);
      keys.push_back(single_group_
                         ? *single_group_
                         : DefaultGroupKey(ch.leaves[i].name,
                                           ch.leaves[i].tensor->shape.size()));
      if (!single_group_)
        keys.back().is_expert_parallel = rule.expert && L_.Chained();
    }
  }
  return params;
}

Planner::RankOptimizer Planner::ClassifyOptimizer(const Value* opt) {
  RankOptimizer o;
  o.inner = opt->Get("optimizer");
  const bool distributed = o.inner != nullptr && o.inner->IsDictLike() &&
                           o.inner->Get("state") == nullptr &&
                           o.inner->Get("param_groups") != nullptr;
  if (distributed) {
    o.format = OptimizerFormat::kDistributed;
  } else if (o.inner != nullptr && o.inner->IsDictLike()) {
    o.format = OptimizerFormat::kFloat16;
    o.fp32_groups = opt->Get("fp32_from_fp16_params");
    if (o.fp32_groups == nullptr) o.fp32_groups = opt->Get("fp32_from_fp16");
    if (o.fp32_groups == nullptr) {
      throw FormatError("optimizer has no 'fp32_from_fp16_params'");
    }
  } else if (opt->Get("state") != nullptr &&
             opt->Get("param_groups") != nullptr) {
    o.format = OptimizerFormat::kFp32;
    o.inner = opt;
  } else {
    throw FormatError("unrecognised 'optimizer' entry (", pickle::Repr(opt, 80),
                      ")");
  }
  if (distributed != L_.run.distributed_optimizer) {
    throw FormatError("the optimizer entry is ", distributed ? "" : "not ",
                      "a distributed optimizer's, but args say "
                      "use_distributed_optimizer=",
                      L_.run.distributed_optimizer ? "True" : "False");
  }
  if (optimizer_format_ == OptimizerFormat::kNone) {
    optimizer_format_ = o.format;
  } else if (optimizer_format_ != o.format) {
    throw FormatError("optimizer format ", OptimizerFormatName(o.format),
                      ", rank (0, 0) has ",
                      OptimizerFormatName(optimizer_format_));
  }
  return o;
}

void Planner::PlanParamState(SourceRank& sr, const RankParam& rp, size_t gi,
                             size_t j, const Value* id, const Value* fp32_list,
                             const Value* state) {
  RankChunk& ch = sr.chunks[rp.chunk];
  const ChunkLeaf& leaf = ch.leaves[rp.leaf];
  const ParamState& ps = *rp.state;
  try {
    const layouts::LocalShard shard =
        ShardOf(ps, *ch.rules[rp.leaf], sr.tp_rank);
    if (fp32_list != nullptr) {
      const TensorInfo* t = sr.file->FindTensor(fp32_list->items[j]);
      const std::string where = StrCat(sr.Where(),
                                       " > optimizer > fp32_from_fp16_"
                                       "params[",
                                       gi, "][", j, "]");
      if (t == nullptr || t->shape != leaf.tensor->shape) {
        throw FormatError(
            "fp32_from_fp16_params[", gi, "][", j, "] ",
            t ? "has shape " + ShapeString(t->shape) : "is not a tensor",
            ", the param's shape is ", ShapeString(leaf.tensor->shape));
      }
      AddFragments(Atom(ps, "fp32", DType::kFloat32, false),
                   Tensor(sr.file, *t, where), shard, where);
    }
    if (id == nullptr || id->kind != Kind::kInt)
      throw FormatError("param group ", gi, " id ", pickle::Repr(id, 20));
    const Value* st = GetInt(state, id->i);
    if (st == nullptr) return;  // never stepped: no state
    if (!st->IsDictLike())
      throw FormatError("optimizer state ", id->i, " is not a dict");
    std::vector<std::string> kinds =
        PlanStateEntries(sr, ps, leaf, shard, st, id->i);
    if (state_keys_.empty()) state_keys_ = std::move(kinds);
  } catch (Error& e) {
    e.AddContext("param ", ch.canonical[rp.leaf]);
    throw;
  }
}

std::vector<std::string> Planner::PlanStateEntries(
    SourceRank& sr, const ParamState& ps, const ChunkLeaf& leaf,
    const layouts::LocalShard& shard, const Value* st, int64_t id) {
  std::vector<std::string> kinds;
  for (const auto& [k, val] : st->entries) {
    if (k == nullptr || k->kind != Kind::kStr) continue;
    const TensorInfo* t = sr.file->FindTensor(val);
    if (t == nullptr) continue;  // python scalars stay out
    kinds.push_back(k->s);
    const std::string where =
        StrCat(sr.Where(), " > optimizer > state[", id, "][", k->s, "]");
    if (t->shape == leaf.tensor->shape) {
      AddFragments(Atom(ps, k->s, t->dtype, false), Tensor(sr.file, *t, where),
                   shard, where);
    } else if (t->numel == 1) {
      const reshape::SourceTensor src =
          reshape::FlatView(Tensor(sr.file, *t, where), 0, {}, where);
      universal::AtomPlan& a = Atom(ps, k->s, t->dtype, true);
      universal::Fragment f;
      f.src = src;
      f.src_box = Box::Whole(src.shape);
      f.atom_box = Box::Whole(src.shape);
      f.where = where;
      a.fragments.push_back(std::move(f));
    } else {
      throw FormatError("optimizer state '", k->s, "' has shape ",
                        ShapeString(t->shape), ", the param ",
                        ShapeString(leaf.tensor->shape));
    }
  }
  return kinds;
}

// The buffer layout of `bparams` whose unpadded size is `stored` (buffer
// `v`'s): Megatron-core v0.13's rules, else v0.8-v0.12's or v0.7's.
// Throws FormatError if none fits, or if the fitting one is a v0.8-v0.12
// layout where a shared-embedding param straddles its bucket (that save
// lost data).
BufferLayout MatchBufferLayout(const std::vector<BufferParam>& bparams,
                               const BufferOptions& bo, int64_t stored,
                               size_t v) {
  BufferLayout layout = ComputeBufferLayout(bparams, bo);
  if (layout.numel_unpadded() == stored) return layout;
  for (LayoutRules rules : {LayoutRules::kCore08, LayoutRules::kCore07}) {
    BufferOptions o2 = bo;
    o2.rules = rules;
    BufferLayout l2 = ComputeBufferLayout(bparams, o2);
    if (l2.numel_unpadded() != stored) continue;
    if (auto s = l2.FirstStraddling()) {
      throw FormatError(
          "buffer ", v, ": numel_unpadded ", stored, " fits the ",
          LayoutRulesName(rules),
          " buffer layout, where the shared-embedding param ", bparams[*s].name,
          " starts before its bucket: Megatron-core v0.8-v0.12 lost "
          "its first elements when saving distrib_optim.pt, so the "
          "file cannot be converted (re-save it with Megatron-core "
          ">= v0.13, or without the distributed optimizer)");
    }
    return l2;
  }
  throw FormatError("buffer ", v, ": numel_unpadded ", stored,
                    " in the file, but the buffer layout of this "
                    "rank's params (Megatron-core v0.13 rules, dp ",
                    bo.dp, ") gives ", layout.numel_unpadded());
}

void Planner::PlanDistributed(
    SourceRank& sr,
    const std::vector<std::optional<std::vector<RankParam>>>& halves) {
  const std::string dwhere = StrCat("rank file ", sr.distrib_path.string());
  const Value* root = sr.distrib->root();
  if (halves.size() == 1) {
    PlanDistributedHalf(sr, *halves.front(), root, L_.topology().dp, dwhere);
    return;
  }
  // [dense state or None, expert state or None]: the dense half's DP rank 0
  // is in EP rank 0's folder, every folder holds its experts' state.
  if (root == nullptr || root->kind != Kind::kList ||
      root->items.size() != halves.size()) {
    throw FormatError(dwhere, ": does not hold a list of ", halves.size(),
                      " (a mixture-of-experts model's ChainedOptimizer: dense "
                      "and expert states)");
  }
  for (size_t h = 0; h < halves.size(); ++h) {
    const Value* item = root->items[h];
    const bool expected = h == 1 || sr.ep_rank == 0;
    const bool none = item == nullptr || item->kind == Kind::kNone;
    if (none && !expected) continue;
    if (none || !expected) {
      throw FormatError(
          dwhere, ": entry ", h, " (the ", h == 0 ? "dense" : "expert",
          " half's state) is ", none ? "None" : "present",
          ", but the ranks of this folder are ", expected ? "" : "not ",
          "DP rank 0 of that half's group");
    }
    PlanDistributedHalf(sr, *halves[h], item,
                        h == 0 ? L_.topology().dp : L_.topology().ExpertDp(),
                        StrCat(dwhere, " > [", h, "]"));
  }
}

void Planner::PlanDistributedHalf(SourceRank& sr,
                                  const std::vector<RankParam>& params,
                                  const Value* root, int64_t dp,
                                  const std::string& dwhere) {
  try {
    if (root == nullptr || !root->IsDictLike())
      throw FormatError("does not hold a dict");
    const Value* coalesced = root->Get("buckets_coalesced");
    if (coalesced == nullptr || coalesced->kind != Kind::kBool ||
        !coalesced->b) {
      throw FormatError(
          "no 'buckets_coalesced': True (a distributed-optimizer format of "
          "Megatron-core before v0.7, not supported)");
    }
    // One buffer per model chunk: Megatron makes one per (chunk, param
    // dtype, grad dtype), numbered over the chunks.
    size_t buffers = 0;
    for (const auto& [k, val] : root->entries)
      if (k != nullptr && k->kind == Kind::kInt) ++buffers;
    if (buffers != (params.empty() ? 0 : sr.chunks.size())) {
      throw FormatError("holds ", buffers, " gradient buffers for ",
                        sr.chunks.size(),
                        " model chunks (params of several dtypes in one "
                        "chunk, e.g. fp8 or fp32 params in a bf16 model, are "
                        "not supported)");
    }
    int64_t local_params = 0;
    for (const RankParam& rp : params)
      local_params += sr.chunks[rp.chunk].leaves[rp.leaf].tensor->numel;
    for (size_t v = 0; v < sr.chunks.size() && !params.empty(); ++v)
      PlanDistributedBuffer(sr, params, root, v, local_params, dp, dwhere);
  } catch (Error& e) {
    e.AddContext(dwhere);
    throw;
  }
}

void Planner::PlanDistributedBuffer(SourceRank& sr,
                                    const std::vector<RankParam>& params,
                                    const Value* root, size_t v,
                                    int64_t local_params, int64_t dp,
                                    const std::string& dwhere) {
  const RunConfig& run = L_.run;
  RankChunk& ch = sr.chunks[v];
  std::vector<BufferParam> bparams;
  std::vector<const RankParam*> members;
  for (const RankParam& rp : params) {
    if (rp.chunk != v) continue;
    const ChunkLeaf& leaf = ch.leaves[rp.leaf];
    BufferParam bp;
    bp.name = leaf.name;
    bp.numel = leaf.tensor->numel;
    // shared_embedding: a tied copy, or an original whose copy exists.
    bp.shared_embedding = rp.tied_copy || !rp.state->tied_copies.empty();
    bparams.push_back(bp);
    members.push_back(&rp);
  }
  const BufferOptions bo = run.DistributedBufferOptions(
      dp, sr.pp_rank, static_cast<int64_t>(v), local_params);
  const Value* gbuf = GetInt(root, static_cast<int64_t>(v));
  if (gbuf == nullptr || !gbuf->IsDictLike() || gbuf->entries.size() != 1) {
    throw FormatError("buffer ", v, " (model chunk ", v,
                      ") is missing or holds several dtype buffers");
  }
  const auto& [dtkey, world] = gbuf->entries.front();
  CheckBufferDtypes(ch, members, dtkey, v);
  if (world == nullptr || !world->IsDictLike())
    throw FormatError("buffer ", v, " is not a dict");
  const Value* nu = world->Get("numel_unpadded");
  if (nu == nullptr || nu->kind != Kind::kInt)
    throw FormatError("buffer ", v, " lacks 'numel_unpadded'");
  const int64_t stored = nu->i;
  const BufferLayout layout = MatchBufferLayout(bparams, bo, stored, v);
  PlanWorldTensors(sr, members, layout, world, v,
                   StrCat(dwhere, " > buffer ", v));
}

void Planner::CheckBufferDtypes(const RankChunk& ch,
                                const std::vector<const RankParam*>& members,
                                const Value* dtkey, size_t v) {
  auto torch_dtype = [&](size_t i) -> const Value* {
    if (dtkey == nullptr || dtkey->kind != Kind::kTuple ||
        dtkey->items.size() != 2)
      return nullptr;
    const Value* d = dtkey->items[i];
    return d != nullptr && d->kind == Kind::kGlobal && d->module == "torch"
               ? d
               : nullptr;
  };
  if (torch_dtype(0) == nullptr || torch_dtype(1) == nullptr) {
    throw FormatError("buffer ", v, " key ", pickle::Repr(dtkey, 60),
                      " is not a (param dtype, grad dtype) pair");
  }
  for (const RankParam* rp : members) {
    const ChunkLeaf& leaf = ch.leaves[rp->leaf];
    if (DTypeName(leaf.tensor->dtype) != torch_dtype(0)->name) {
      throw FormatError("buffer ", v, " holds torch.", torch_dtype(0)->name,
                        " params, but ", leaf.name, " of model chunk ", v,
                        " is ", DTypeName(leaf.tensor->dtype),
                        " (params of several dtypes in one chunk are not "
                        "supported)");
    }
  }
  if (grad_dtype_.empty()) grad_dtype_ = torch_dtype(1)->name;
}

void Planner::PlanWorldTensors(SourceRank& sr,
                               const std::vector<const RankParam*>& members,
                               const BufferLayout& layout, const Value* world,
                               size_t v, const std::string& bwhere) {
  const RankChunk& ch = sr.chunks[v];
  const int64_t stored = layout.numel_unpadded();
  for (const auto& [wkey, kind] : kWorldTensors) {
    const TensorInfo* wt = sr.distrib->FindTensor(world->Get(wkey));
    if (wt == nullptr) {
      if (std::string_view(wkey) == "param")
        throw FormatError("buffer ", v, " lacks '", wkey, "'");
      continue;  // e.g. Lion: exp_avg only
    }
    const std::string where = StrCat(bwhere, " > ", wkey);
    const std::string what = StrCat("buffer ", v, " > ", wkey);
    if (wt->dtype != DType::kFloat32 || wt->shape.size() != 1 ||
        wt->shape[0] != stored) {
      throw FormatError(what, ": expected float32 [", stored, "], got ",
                        DTypeName(wt->dtype), " ", ShapeString(wt->shape));
    }
    reshape::SourceTensor whole = Tensor(sr.distrib, *wt, what);
    for (size_t k = 0; k < members.size(); ++k) {
      const RankParam& rp = *members[k];
      const ChunkLeaf& leaf = ch.leaves[rp.leaf];
      const Rule& rule = *ch.rules[rp.leaf];
      const reshape::SourceTensor src = reshape::FlatView(
          whole, layout.WorldOffset(k), leaf.tensor->shape, what);
      try {
        AddFragments(Atom(*rp.state, kind, DType::kFloat32, false), src,
                     ShardOf(*rp.state, rule, sr.tp_rank),
                     StrCat(where, " > ", leaf.name));
      } catch (Error& e) {
        e.AddContext("param ", ch.canonical[rp.leaf]);
        throw;
      }
    }
    if (std::find(state_keys_.begin(), state_keys_.end(), kind) ==
            state_keys_.end() &&
        std::string_view(kind) != "fp32")
      state_keys_.push_back(kind);
  }
}

std::string Planner::Blob(const TorchFile* file, const Value* v) {
  return SaveBlob(file, v);
}

void Planner::PlanOpaque() {
  SourceRank& r0 = L_.ranks.front();
  const TorchFile* f0 = r0.file.get();
  auto add = [&](std::string key, std::string bytes) {
    plan_.opaque.push_back({std::move(key), std::move(bytes)});
  };
  // Model entries kept as objects: TP rank 0's (experts': their EP
  // rank's).
  ForChunksInOrder(L_, [&](int64_t p, int64_t v) {
    for (const auto& [sp, i] : MergedEntries(p, v)) {
      const RankChunk& ch = sp->chunks[static_cast<size_t>(v)];
      if (ch.rules[i]->entry != EntryKind::kOpaque) continue;
      add("extra_state/" + ch.canonical[i],
          Blob(sp->file.get(), ch.leaves[i].value));
    }
  });
  for (const auto& [k, v] : r0.root->entries) {
    if (k == nullptr || k->kind != Kind::kStr) continue;
    const std::string& key = k->s;
    if (key == "args") {
      add("args", Blob(f0, v));
    } else if (key == "optimizer" || key == "rng_state" || IsModelKey(key)) {
      continue;
    } else if (key == "rerun_state_machine") {
      add("rerun_state_machine", Blob(f0, v));
    } else {
      add("top_level/" + key, Blob(f0, v));
    }
  }
  for (SourceRank& sr : L_.ranks) {
    const Value* rng = pickle::DictGet(sr.root, "rng_state");
    if (rng == nullptr) continue;
    add(RngStateKey(sr.tp_rank, sr.pp_rank, sr.ep_rank),
        Blob(sr.file.get(), rng));
  }
  if (has_optimizer_) {
    const Value* opt = pickle::DictGet(r0.root, "optimizer");
    if (const Value* gs = opt->Get("grad_scaler"))
      add("grad_scaler", Blob(f0, gs));
    // The canonical groups without 'params'.
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
    add("optimizer/param_groups", Blob(nullptr, arena.List(std::move(list))));
  }
}

void Planner::PlanRoot() {
  const SourceRank& r0 = L_.ranks.front();
  const RunConfig& run = L_.run;
  const layouts::Topology& t = run.topology;
  universal::Model& model = plan_.model;
  const Value* it = pickle::DictGet(r0.root, "iteration");
  model.iteration =
      it != nullptr && it->kind == Kind::kInt ? it->i : c_.iteration;
  model.consumed_samples = run.consumed_train_samples.value_or(-1);

  // Ranks per node: the smallest common node size that explains every
  // rank's local_rank (torchrun: local_rank = rank % ranks per node).
  int64_t gpus_per_node = 8;
  {
    std::vector<std::pair<int64_t, int64_t>> seen;
    for (const SourceRank& sr : L_.ranks) {
      const ArgsView a(pickle::DictGet(sr.root, "args"), "args");
      auto rank = a.Int("rank");
      auto local = a.Int("local_rank");
      if (rank && local) seen.emplace_back(*rank, *local);
    }
    for (int64_t g : {8, 16, 4, 2, 1, 32, 64}) {
      bool ok = true;
      for (auto [r, l] : seen) ok = ok && r % g == l;
      if (ok) {
        gpus_per_node = g;
        break;
      }
    }
  }
  std::set<std::string> dtypes;
  for (const auto& [n, ps] : params_)
    dtypes.insert(std::string(DTypeName(ps.dtype)));
  const ArgsView args(pickle::DictGet(r0.root, "args"), "args");
  std::string version = "unknown";
  if (pickle::DictGet(r0.root, "rerun_state_machine") != nullptr) {
    version = "core_v0.10+ (likely v0.13)";
  } else if (args.Find("use_legacy_models") != nullptr) {
    version = "core_v0.5-v0.9";
  } else {
    version = "Megatron-LM <= 23.x";
  }

  universal::SourceInfo& src = model.source;
  src.framework = "megatron-lm";
  src.framework_version = version;
  src.format = "legacy";
  src.tp = t.tp;
  src.pp = t.pp;
  src.vpp = t.vpp;
  src.dp = t.dp;
  src.cp = run.cp;
  src.ep = t.ep;
  if (L_.experts) src.other["etp"] = t.ExpertTp();
  src.first_stage_layers = t.first_stage_layers;
  src.last_stage_layers = t.last_stage_layers;
  src.distributed_optimizer = run.distributed_optimizer;
  src.padded_vocab_size = run.padded_vocab_size;
  src.other["vocab_size_from"] = L_.vocab_source;
  src.dtypes = std::vector<std::string>(dtypes.begin(), dtypes.end());
  src.layout = L_.layout->name();
  src.other["iteration_dir"] = c_.iter_dir.filename().string();

  for (const auto& [k, v] : L_.vars.values()) model.variables.Set(k, v);
  model.variables.Set("true_vocab_size", L_.vars.Get("vocab_size"));
  model.layout_yaml = L_.layout->yaml();

  universal::OptimizerInfo& opt = model.optimizer;
  opt.type = run.optimizer;
  opt.groups.emplace();
  for (size_t i = 0; i < group_keys_.size(); ++i) {
    universal::ParamGroup& g = opt.groups->emplace_back();
    g.other["key"] = group_keys_[i].ToJson();
    for (const auto& [k, v] : group_dicts_[i]->entries) {
      if (k == nullptr || k->kind != Kind::kStr || k->s == "params") continue;
      g.Set(k->s, ValueToJson(v));
    }
  }
  opt.state_kinds.emplace();
  if (has_optimizer_) {
    opt.state_kinds->push_back("fp32");
    for (const std::string& k : state_keys_) opt.state_kinds->push_back(k);
  }
  const Value* sched = pickle::DictGet(r0.root, "opt_param_scheduler");
  model.scheduler =
      sched != nullptr ? ValueToJson(sched) : json::Value::Object();
  model.args = ArgsToJson(args);

  MegatronExtras meta;
  meta.top_level_keys.emplace();
  bool model_seen = false;
  for (const auto& [k, v] : r0.root->entries) {
    if (k == nullptr || k->kind != Kind::kStr) continue;
    if (IsModelKey(k->s)) {
      if (!model_seen) meta.top_level_keys->push_back("model");
      model_seen = true;
    } else {
      meta.top_level_keys->push_back(k->s);
    }
  }
  meta.entries = entries_;
  meta.release = c_.release;
  meta.gpus_per_node = gpus_per_node;
  meta.optimizer_format = OptimizerFormatName(optimizer_format_);
  meta.state_keys = state_keys_;
  meta.grad_dtype = grad_dtype_;
  meta.vocab_size_known = L_.true_vocab_known;
  WriteMegatronExtras(meta, model);

  // Framework-neutral run state.
  universal::TrainingInfo& training = universal::NewTraining(
      model, dtypes.size() == 1 ? *dtypes.begin() : std::string("mixed"));
  training.global_samples = model.consumed_samples;
  for (const std::string& n : param_order_) {
    training.param_order->push_back(n);
    for (const std::string& c : params_.at(n).tied_copies)
      (*training.shared)[c] = n;
  }
}

universal::SourcePlan Planner::Run() {
  CollectParams();
  FindOptimizer();
  PlanModel();
  PlanOptimizer();
  for (const std::string& n : param_order_) {
    const ParamState& ps = params_.at(n);
    plan_.params.push_back(formats::ParamRow({.fqn = n,
                                              .shape = ps.full_shape,
                                              .dtype = ps.dtype,
                                              .rule = ps.rule->name,
                                              .buffer = ps.buffer,
                                              .group = ps.group,
                                              .order = ps.order,
                                              .frozen = false,
                                              .tied_copies = ps.tied_copies}));
  }
  PlanOpaque();
  PlanRoot();
  return std::move(plan_);
}

}  // namespace

NameListing ListNames(const Checkpoint& checkpoint,
                      const SourceOptions& options) {
  Loaded L = Load(checkpoint, options);
  NameListing out;
  std::set<std::string> seen;
  ForChunksInOrder(L, [&](int64_t p, int64_t v) {
    for (int64_t e = 0; e < L.topology().ep; ++e) {
      for (int64_t r = 0; r < L.topology().tp; ++r) {
        const RankChunk& ch = L.Rank(p, r, e).chunks[static_cast<size_t>(v)];
        for (const std::string& n : ch.canonical)
          if (seen.insert(n).second) out.names.push_back(n);
      }
    }
  });
  out.variables = L.vars;
  out.layout_name = L.layout->name();
  out.layout_yaml = L.layout->yaml();
  return out;
}

universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const SourceOptions& options) {
  Loaded L = Load(checkpoint, options);
  Planner planner(L, checkpoint);
  return planner.Run();
}

}  // namespace ucp::megatron
