// Planning a DCP checkpoint from universal content (dcp_plain.h): one unit per
// rank file __R_0.distcp, .metadata last.
//
// Items are placed as torch's save path places them: every tensor of one or
// more dims is chunked along dim 0 over the N ranks with torch.chunk's sizes
// (ceil(d0 / N) rows, the last ranks short or empty, an empty chunk at
// offset d0); each rank lists its chunk of every tensor, every 0-d tensor
// (replicated) and, on rank 0, every object, in the state dict's order;
// torch's save-plan dedup (_dedup_save_plans.py) then gives each item listed
// by several ranks to the one with the fewest bytes so far, walking rank 0's
// list, then rank 1's, ...; a file holds its objects first, then its
// tensors, back to back (filesystem.py). At --ep N, torchtitan's stacked
// routed experts (../dcp/experts.h) are placed as its EP x FSDP layout
// places them (ExpertChunk).

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/sinks.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/common/train_state.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/dcp/experts.h"
#include "engine/formats/dcp/items.h"
#include "engine/formats/dcp/keys.h"
#include "engine/formats/dcp_plain/dcp_plain.h"
#include "engine/json/json.h"
#include "engine/pickle/pickle.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/zip.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

// One key of the target's state dict.
struct Key {
  std::string fqn;
  KeyClass cls;
  bool tensor = false;
  DType dtype = DType::kFloat32;
  Shape shape;
  const atoms::DatasetInfo* atom = nullptr;  // tensor from an atom
  // A stacked expert tensor (../dcp/experts.h): expert e's atom, restacked
  // on dim 0 (a 0-d state: `atom`, expert 0's).
  std::vector<const atoms::DatasetInfo*> experts;
  std::vector<std::byte> constant;  // else a known 0-d tensor
  std::string bytes;                // object: torch.save bytes
  std::vector<PathComponent> path;
};

// An item of the target: a chunk of a tensor key, or an object.
struct ItemRef {
  size_t key = 0;
  Chunk chunk;
  uint64_t bytes = 0;  // for the dedup's sizes
};

class DcpPlan : public formats::TargetPlan {
 public:
  DcpPlan(const universal::UniversalInput& input,
          const formats::TargetOptions& options)
      : input_(input),
        world_(std::max<int64_t>(1, options.topology.dp)),
        ep_(std::max<int64_t>(1, options.topology.ep)) {
    BuildKeys(options);
    CheckExpertParallel();
    PlaceItems();
  }
  size_t units() const override { return static_cast<size_t>(world_) + 1; }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t i) const override;
  formats::TargetSummary Summary() const override;
  std::string label() const override { return "writing DCP files"; }

 private:
  void BuildKeys(const formats::TargetOptions& options);
  void KeysFromDcp(const DcpExtras& meta);
  void StackExperts(const DcpKeyRecord& j, Key& k) const;
  // {expert param -> (stacked param, its experts' params)}
  using Stacks =
      std::map<std::string, std::pair<std::string, std::vector<std::string>>>;
  Stacks ExpertStacks() const;
  void KeysFromOtherFormats(const formats::TargetOptions& options);
  void GroupKeysFromOtherFormats(const Stacks& stacks);
  void CheckExpertParallel() const;
  Chunk ExpertChunk(const Shape& shape, int64_t rank) const;
  void PlaceItems();
  std::string OpaqueBytes(const atoms::DatasetInfo& d) const;
  const atoms::DatasetInfo& AtomOf(const std::string& param,
                                   const std::string& kind) const;

  const universal::UniversalInput& input_;
  int64_t world_;
  int64_t ep_;  // --ep: stacked experts Shard(0) over ep, then FSDP's shard
  std::vector<Key> keys_;
  std::optional<ItemFiles> files_;
  mutable std::set<std::string> notes_;
};

const atoms::DatasetInfo& DcpPlan::AtomOf(const std::string& param,
                                          const std::string& kind) const {
  const atoms::DatasetInfo* d = input_.FindAtom(param, kind);
  if (d == nullptr) {
    throw FormatError("universal input ", input_.path().string(), " > param ",
                      param, ": no '", kind, "' atom");
  }
  return *d;
}

std::string DcpPlan::OpaqueBytes(const atoms::DatasetInfo& d) const {
  // The blob is the item's torch.save archive, whole.
  const std::shared_ptr<const torchfile::TorchFile> f = input_.OpenBlob(d);
  const torchfile::ZipReader* z = f->zip();
  if (z == nullptr) {
    throw FormatError("universal input ", input_.path().string(), " > ", d.path,
                      ": not a torch.save archive");
  }
  std::string b(z->archive_size(), '\0');
  z->file()->ReadExact(b.data(), b.size(), z->archive_offset());
  return b;
}

// A stacked expert key of a DCP source: its experts' atoms, each expert
// once, all of one dtype and shape.
void DcpPlan::StackExperts(const DcpKeyRecord& j, Key& k) const {
  const std::optional<StackedName> n = SplitStacked(k.cls.param);
  if (!n || j.experts > (int64_t{1} << 20)) {
    throw FormatError("key ", k.fqn, ": ", j.experts,
                      " experts recorded, but '", k.cls.param,
                      "' names no stacked expert tensor");
  }
  for (int64_t x = 0; x < j.experts; ++x) {
    const std::string param = ExpertParam(*n, x);
    const std::string kind =
        k.cls.kind == KeyClass::kState
            ? k.cls.state
            : (input_.FindAtom(param, "fp32") != nullptr ? "fp32" : "param");
    const atoms::DatasetInfo& a = AtomOf(param, kind);
    if (!k.experts.empty() &&
        (a.dtype != k.experts[0]->dtype || a.shape != k.experts[0]->shape)) {
      throw FormatError("universal input ", input_.path().string(), " > param ",
                        param, " > ", kind, ": ", DTypeName(a.dtype), " ",
                        ShapeString(a.shape), ", but expert 0's is ",
                        DTypeName(k.experts[0]->dtype), " ",
                        ShapeString(k.experts[0]->shape),
                        " (one stacked tensor ", k.fqn, " holds both)");
    }
    k.experts.push_back(&a);
  }
  k.atom = k.experts.front();
  k.dtype = k.atom->dtype;
  k.shape = k.atom->shape;
  if (k.shape.empty()) {  // a step: expert 0's
    k.experts.clear();
  } else {
    k.shape.insert(k.shape.begin(), j.experts);
  }
}

// The source was DCP: its keys in its order, its objects verbatim, its
// planner_data.
void DcpPlan::KeysFromDcp(const DcpExtras& meta) {
  std::map<std::string, std::vector<PathComponent>> paths;
  if (meta.planner_data)
    for (const auto& [fqn, path] : *meta.planner_data) paths[fqn] = path;
  for (const DcpKeyRecord& j : meta.keys) {
    Key k;
    k.fqn = j.key;
    for (KeyClass::Kind kind :
         {KeyClass::kModel, KeyClass::kState, KeyClass::kParamGroup,
          KeyClass::kParamGroups, KeyClass::kTensor, KeyClass::kBytes}) {
      if (KeyClassName(kind) == j.cls) k.cls.kind = kind;
    }
    k.cls.param = j.param;
    k.cls.state = j.state;
    k.tensor = k.cls.kind == KeyClass::kModel ||
               k.cls.kind == KeyClass::kState ||
               k.cls.kind == KeyClass::kTensor;
    auto pit = paths.find(k.fqn);
    k.path = pit != paths.end() ? pit->second : PathOf(k.cls, k.fqn);
    if (k.tensor && j.experts > 0) {
      StackExperts(j, k);
    } else if (k.tensor) {
      const std::string kind =
          k.cls.kind == KeyClass::kState
              ? k.cls.state
              : (input_.FindAtom(k.cls.param, "fp32") != nullptr ? "fp32"
                                                                 : "param");
      k.atom = &AtomOf(k.cls.param, kind);
      k.dtype = k.atom->dtype;
      k.shape = k.atom->shape;
    } else {
      const atoms::DatasetInfo* d = input_.FindOpaque("dcp/bytes/" + k.fqn);
      if (d == nullptr) {
        throw FormatError("universal input ", input_.path().string(),
                          " lacks /opaque/dcp/bytes/", k.fqn);
      }
      k.bytes = OpaqueBytes(*d);
    }
    keys_.push_back(std::move(k));
  }
  // The state dict's order (planner_data keeps it; the metadata lists keys
  // as the save's plans met them), which torch's dedup walks.
  if (meta.planner_data) {
    std::map<std::string, size_t> rank_of;
    for (const auto& [fqn, p] : *meta.planner_data)
      rank_of.emplace(fqn, rank_of.size());
    std::stable_sort(
        keys_.begin(), keys_.end(), [&](const Key& a, const Key& b) {
          auto x = rank_of.find(a.fqn), y = rank_of.find(b.fqn);
          const size_t ra = x == rank_of.end() ? SIZE_MAX : x->second;
          const size_t rb = y == rank_of.end() ? SIZE_MAX : y->second;
          return ra < rb;
        });
  }
}

// Another format's content: get_state_dict's layout.
// Per-expert params named as torchtitan's experts are held
// (<layer>.moe.experts.<e>.<w1|w2|w3>, ../dcp/experts.h) in content that is
// not DCP's: restacked as <layer>.moe.experts.<w1|w2|w3>, experts 0..E-1 each
// once. Returns {expert param -> (stacked param, its experts' params)}.
DcpPlan::Stacks DcpPlan::ExpertStacks() const {
  std::map<std::string, std::map<int64_t, std::string>> by_stack;
  for (const atoms::StoredParam& p : input_.params()) {
    if (p.info.kind == atoms::ParamKind::kBuffer) continue;
    if (const std::optional<ExpertParamName> x = SplitExpertParam(p.info.fqn))
      by_stack[x->prefix + x->stem][x->expert] = p.info.fqn;
  }
  std::map<std::string, std::pair<std::string, std::vector<std::string>>> out;
  for (const auto& [stacked, experts] : by_stack) {
    const int64_t num = experts.rbegin()->first + 1;
    std::vector<int64_t> missing;
    std::vector<std::string> names;
    for (int64_t x = 0; x < num; ++x) {
      const auto it = experts.find(x);
      if (it == experts.end()) {
        missing.push_back(x);
      } else {
        names.push_back(it->second);
      }
    }
    if (!missing.empty()) {
      throw FormatError("universal input ", input_.path().string(), " > ",
                        stacked, ": global experts ", IndexList(missing),
                        " missing (of ", num,
                        "; torchtitan's stacked tensor needs every expert)");
    }
    for (const std::string& n : names) out[n] = {stacked, names};
  }
  return out;
}

void DcpPlan::KeysFromOtherFormats(const formats::TargetOptions& options) {
  const auto stacks = ExpertStacks();
  // A stacked key of the experts' atoms of `kind` (the weights: each one's
  // fp32, else its param atom).
  auto add_stacked = [&](KeyClass cls, const std::string& kind,
                         const std::vector<std::string>& experts) {
    Key k;
    k.cls = std::move(cls);
    k.fqn = k.cls.kind == KeyClass::kModel
                ? StrCat("model.", k.cls.param)
                : StrCat("optimizer.state.", k.cls.param, ".", k.cls.state);
    k.tensor = true;
    for (const std::string& e : experts) {
      const atoms::DatasetInfo* a =
          kind.empty() ? input_.FindAtom(e, "fp32") : input_.FindAtom(e, kind);
      if (a == nullptr && kind.empty()) a = input_.FindAtom(e, "param");
      if (a == nullptr) {
        throw FormatError("universal input ", input_.path().string(),
                          " > param ", e, ": no '",
                          kind.empty() ? "fp32" : kind, "' atom, which ",
                          experts.front(), " has (one stacked tensor ", k.fqn,
                          " holds both)");
      }
      if (!k.experts.empty() && (a->dtype != k.experts[0]->dtype ||
                                 a->shape != k.experts[0]->shape)) {
        throw FormatError("universal input ", input_.path().string(),
                          " > param ", e, ": ", DTypeName(a->dtype), " ",
                          ShapeString(a->shape), ", but ", experts.front(),
                          "'s is ", DTypeName(k.experts[0]->dtype), " ",
                          ShapeString(k.experts[0]->shape),
                          " (one stacked tensor ", k.fqn, " holds both)");
      }
      k.experts.push_back(a);
    }
    k.atom = k.experts.front();
    k.dtype = k.atom->dtype;
    k.shape = k.atom->shape;
    if (k.shape.empty()) {
      k.experts.clear();
    } else {
      k.shape.insert(k.shape.begin(), static_cast<int64_t>(experts.size()));
    }
    k.path = PathOf(k.cls, k.fqn);
    keys_.push_back(std::move(k));
  };
  auto add_tensor = [&](KeyClass cls, const atoms::DatasetInfo& atom) {
    Key k;
    k.cls = std::move(cls);
    k.fqn = k.cls.kind == KeyClass::kModel
                ? StrCat("model.", k.cls.param)
                : StrCat("optimizer.state.", k.cls.param, ".", k.cls.state);
    k.tensor = true;
    k.atom = &atom;
    k.dtype = atom.dtype;
    k.shape = atom.shape;
    k.path = PathOf(k.cls, k.fqn);
    keys_.push_back(std::move(k));
  };
  for (const atoms::StoredParam& p : input_.params()) {
    const atoms::DatasetInfo* w = input_.FindAtom(p.info.fqn, "fp32");
    if (w == nullptr) w = input_.FindAtom(p.info.fqn, "param");
    if (w == nullptr) {
      throw FormatError("universal input ", input_.path().string(), " > param ",
                        p.info.fqn, ": neither a 'fp32' nor a 'param' atom");
    }
    KeyClass c;
    c.kind = KeyClass::kModel;
    c.param = p.info.fqn;
    if (const auto st = stacks.find(p.info.fqn); st != stacks.end()) {
      if (st->second.second.front() != p.info.fqn) continue;  // stacked
      c.param = st->second.first;
      add_stacked(std::move(c), "", st->second.second);
      continue;
    }
    add_tensor(std::move(c), *w);
  }
  if (options.no_optimizer) return;
  // State kinds: step, then Adam's moments, then any other, as torch's Adam
  // keeps them.
  std::set<std::string> other;
  bool any_state = false, step_atoms = false;
  for (const atoms::DatasetInfo& d : input_.datasets()) {
    if (d.kind != atoms::DatasetKind::kAtom || d.state_kind == "fp32" ||
        d.state_kind == "param")
      continue;
    any_state = any_state || d.state_kind != "step";
    step_atoms = step_atoms || d.state_kind == "step";
    if (d.state_kind != "step" && d.state_kind != "exp_avg" &&
        d.state_kind != "exp_avg_sq")
      other.insert(d.state_kind);
  }
  if (!any_state) return;
  std::vector<std::string> kinds = {"exp_avg", "exp_avg_sq"};
  kinds.insert(kinds.end(), other.begin(), other.end());
  const int64_t optimizer_step = formats::OptimizerStep(input_.model());
  const auto step = static_cast<double>(optimizer_step);
  if (!step_atoms) {
    notes_.insert(
        StrCat("the source kept no per-param optimizer step: wrote step ",
               optimizer_step, " (its optimizer's step) for every param"));
  }
  for (const atoms::StoredParam& p : input_.params()) {
    if (p.info.kind == atoms::ParamKind::kBuffer || p.info.frozen) continue;
    if (input_.FindAtom(p.info.fqn, "exp_avg") == nullptr &&
        input_.FindAtom(p.info.fqn, "exp_avg_sq") == nullptr &&
        std::none_of(other.begin(), other.end(), [&](const std::string& k) {
          return input_.FindAtom(p.info.fqn, k) != nullptr;
        }))
      continue;
    KeyClass c;
    c.kind = KeyClass::kState;
    c.param = p.info.fqn;
    c.state = "step";
    const auto st = stacks.find(p.info.fqn);
    if (st != stacks.end()) {
      if (st->second.second.front() != p.info.fqn) continue;  // stacked
      c.param = st->second.first;
    }
    if (const atoms::DatasetInfo* s = input_.FindAtom(p.info.fqn, "step")) {
      if (st != stacks.end()) {
        add_stacked(c, "step", st->second.second);
      } else {
        add_tensor(c, *s);
      }
    } else {
      Key k;
      k.cls = c;
      k.fqn = StrCat("optimizer.state.", c.param, ".step");
      k.tensor = true;
      k.dtype = DType::kFloat32;
      const float v = static_cast<float>(step);
      k.constant.resize(4);
      std::memcpy(k.constant.data(), &v, 4);
      k.path = PathOf(k.cls, k.fqn);
      keys_.push_back(std::move(k));
    }
    for (const std::string& kind : kinds) {
      if (const atoms::DatasetInfo* a = input_.FindAtom(p.info.fqn, kind)) {
        c.state = kind;
        if (st != stacks.end()) {
          add_stacked(c, kind, st->second.second);
        } else {
          add_tensor(c, *a);
        }
      }
    }
  }
  GroupKeysFromOtherFormats(stacks);
}

// Param groups: the source's hyper-parameters, then the params by name (a
// stacked expert tensor once, under its key's name).
void DcpPlan::GroupKeysFromOtherFormats(const Stacks& stacks) {
  std::vector<std::vector<std::string>> members;
  for (const atoms::StoredParam& p : input_.params()) {
    if (p.info.kind == atoms::ParamKind::kBuffer || p.info.frozen) continue;
    const size_t g = static_cast<size_t>(std::max<int64_t>(0, p.info.group));
    if (members.size() <= g) members.resize(g + 1);
    if (const auto st = stacks.find(p.info.fqn); st != stacks.end()) {
      if (st->second.second.front() == p.info.fqn)
        members[g].push_back(st->second.first);
      continue;
    }
    members[g].push_back(p.info.fqn);
  }
  std::shared_ptr<const torchfile::TorchFile> templates;
  if (const atoms::DatasetInfo* d = input_.FindOpaque("optimizer/param_groups"))
    templates = input_.OpenBlob(*d);
  const Value* list = templates != nullptr ? templates->root() : nullptr;
  // Without the source's pickled groups (MindSpore, Megatron-FSDP): the
  // hyper-parameters its optimizer attribute keeps.
  pickle::Arena json_groups;
  if (list == nullptr || list->kind != Kind::kList) {
    templates = nullptr;
    std::vector<Value*> made;
    // (torch.optim.Adam's load needs lr, betas, eps and weight_decay.)
    for (const universal::ParamGroup& g :
         formats::AdamGroups(input_.model(), notes_))
      made.push_back(formats::GroupHyperparamsDict(g, json_groups));
    const bool any = std::any_of(made.begin(), made.end(),
                                 [](const Value* v) { return v != nullptr; });
    list = any ? json_groups.List(std::move(made)) : nullptr;
    notes_.insert(
        any ? "no pickled optimizer param groups in the universal content: "
              "wrote its groups' hyper-parameters (numbers as floats)"
            : "no optimizer param groups in the universal content: wrote "
              "groups of params without hyper-parameters");
  }
  for (size_t g = 0; g < members.size(); ++g) {
    auto add_bytes = [&](const std::string& name, std::string bytes) {
      Key k;
      k.cls.kind = KeyClass::kParamGroup;
      k.cls.group = static_cast<int64_t>(g);
      k.cls.group_key = name;
      k.fqn = StrCat("optimizer.param_groups.", g, ".", name);
      k.bytes = std::move(bytes);
      k.path = PathOf(k.cls, k.fqn);
      keys_.push_back(std::move(k));
    };
    const Value* d =
        list != nullptr && g < list->items.size() ? list->items[g] : nullptr;
    if (d != nullptr && d->IsDictLike()) {
      for (const auto& [k, v] : d->entries) {
        if (k == nullptr || k->kind != Kind::kStr || k->s == "params") continue;
        add_bytes(k->s, formats::SaveBlob(templates.get(), v));
      }
    }
    pickle::Arena a;
    std::vector<Value*> names;
    for (const std::string& n : members[g]) names.push_back(a.Str(n));
    add_bytes("params", formats::SaveBlob(nullptr, a.List(std::move(names))));
  }
}

void DcpPlan::BuildKeys(const formats::TargetOptions& options) {
  if (const std::optional<DcpExtras> meta =
          ReadDcpExtras(input_.model(), input_.path())) {
    try {
      KeysFromDcp(*meta);
    } catch (Error& e) {
      e.AddContext("universal input ", input_.path().string(), " > attribute ",
                   kMetaAttr);
      throw;
    }
    if (options.no_optimizer) {
      std::erase_if(keys_, [](const Key& k) {
        return k.cls.kind == KeyClass::kState ||
               k.cls.kind == KeyClass::kParamGroup ||
               k.cls.kind == KeyClass::kParamGroups;
      });
    }
    return;
  }
  KeysFromOtherFormats(options);
}

// --ep N: the target has stacked experts, each tensor's E a multiple of N
// (the CLI checked that N divides --dp).
void DcpPlan::CheckExpertParallel() const {
  if (ep_ == 1) return;
  bool any = false;
  for (const Key& k : keys_) {
    if (k.experts.empty()) continue;
    any = true;
    if (k.shape[0] % ep_ != 0) {
      throw UsageError("--ep ", ep_, " does not divide the ", k.shape[0],
                       " experts of ", k.fqn);
    }
  }
  if (!any) {
    throw UsageError("--ep ", ep_,
                     ": the model has no stacked routed experts (torchtitan's "
                     "moe.experts.w1, ...); give no --ep");
  }
}

// Rank `rank`'s chunk of a stacked expert tensor at --ep: torchtitan's mesh
// (dp_shard_mod_ep, ep), ep the inner dim; the experts Shard(0) over ep
// (E / ep each), then FSDP over the dp / ep ranks of the outer dim: Shard(0)
// of the local experts, or Shard(1) when they are fewer than those ranks
// (torchtitan's shard_placement_fn); torch.chunk sizes, the last short or
// empty.
Chunk DcpPlan::ExpertChunk(const Shape& shape, int64_t rank) const {
  const int64_t fsdp = world_ / ep_;
  const int64_t local = shape[0] / ep_;
  const int64_t e = rank % ep_, f = rank / ep_;
  Chunk c;
  c.offsets.assign(shape.size(), 0);
  c.sizes = shape;
  c.offsets[0] = e * local;
  c.sizes[0] = local;
  const size_t dim = local >= fsdp ? 0 : 1;
  const int64_t n = dim == 0 ? local : shape[1];
  const int64_t cs = (n + fsdp - 1) / fsdp;
  const int64_t begin = std::min(f * cs, n);
  c.offsets[dim] += begin;
  c.sizes[dim] = std::max<int64_t>(0, std::min((f + 1) * cs, n) - begin);
  return c;
}

void DcpPlan::PlaceItems() {
  // Every rank's list in the state dict's order.
  std::vector<std::vector<ItemRef>> lists(static_cast<size_t>(world_));
  for (size_t i = 0; i < keys_.size(); ++i) {
    const Key& k = keys_[i];
    if (!k.tensor) {  // every rank plans the objects; one writes each
      for (auto& l : lists) l.push_back({i, {}, 1});
      continue;
    }
    const uint64_t es = ElementSize(k.dtype);
    if (k.shape.empty()) {
      for (auto& l : lists) l.push_back({i, {}, es});
      continue;
    }
    if (!k.experts.empty() && ep_ > 1) {
      // Empty chunks are not listed (one could share its offsets with
      // another rank's chunk).
      for (int64_t r = 0; r < world_; ++r) {
        Chunk c = ExpertChunk(k.shape, r);
        const int64_t n = NumElements(c.sizes);
        if (n == 0) continue;
        lists[static_cast<size_t>(r)].push_back(
            {i, std::move(c), static_cast<uint64_t>(n) * es});
      }
      continue;
    }
    const int64_t d0 = k.shape[0];
    const int64_t cs = (d0 + world_ - 1) / world_;
    int64_t rest = 1;
    for (size_t d = 1; d < k.shape.size(); ++d) rest *= k.shape[d];
    for (int64_t r = 0; r < world_; ++r) {
      const int64_t begin = std::min(r * cs, d0);
      const int64_t size =
          std::max<int64_t>(0, std::min((r + 1) * cs, d0) - begin);
      Chunk c;
      c.offsets.assign(k.shape.size(), 0);
      c.offsets[0] = begin;
      c.sizes = k.shape;
      c.sizes[0] = size;
      lists[static_cast<size_t>(r)].push_back(
          {i, std::move(c), static_cast<uint64_t>(size * rest) * es});
    }
  }
  // torch's dedup: each item once, on the rank of its list with the fewest
  // bytes so far, walking the lists in rank order.
  using Index = std::pair<size_t, Shape>;  // key, chunk offsets
  std::map<Index, std::vector<int64_t>> holders;
  std::vector<Index> order;
  for (int64_t r = 0; r < world_; ++r) {
    for (const ItemRef& it : lists[static_cast<size_t>(r)]) {
      Index idx{it.key, it.chunk.offsets};
      auto [pos, fresh] = holders.try_emplace(idx);
      if (fresh) order.push_back(idx);
      pos->second.push_back(r);
    }
  }
  std::vector<uint64_t> size(static_cast<size_t>(world_), 0);
  std::map<Index, int64_t> owner;
  for (const Index& idx : order) {
    const std::vector<int64_t>& h = holders[idx];
    int64_t best = h.front();
    for (int64_t r : h)
      if (size[static_cast<size_t>(r)] < size[static_cast<size_t>(best)])
        best = r;
    owner[idx] = best;
    const auto& l = lists[static_cast<size_t>(best)];
    const auto it = std::find_if(l.begin(), l.end(), [&](const ItemRef& x) {
      return x.key == idx.first && x.chunk.offsets == idx.second;
    });
    size[static_cast<size_t>(best)] += std::max<uint64_t>(it->bytes, 1);
  }
  // The metadata lists the keys as torch's global plan meets them: rank by
  // rank, in each rank's plan.
  std::vector<size_t> entry_order;
  std::vector<bool> listed(keys_.size(), false);
  for (int64_t r = 0; r < world_; ++r) {
    for (const ItemRef& it : lists[static_cast<size_t>(r)]) {
      if (owner[{it.key, it.chunk.offsets}] != r || listed[it.key]) continue;
      listed[it.key] = true;
      entry_order.push_back(it.key);
    }
  }
  // Each file: its objects, then its tensors, in its list's order.
  std::vector<std::vector<ItemRef>> items(static_cast<size_t>(world_));
  for (int64_t r = 0; r < world_; ++r) {
    std::vector<ItemRef> objects, tensors;
    for (ItemRef& it : lists[static_cast<size_t>(r)]) {
      if (owner[{it.key, it.chunk.offsets}] != r) continue;
      (keys_[it.key].tensor ? tensors : objects).push_back(std::move(it));
    }
    auto& out = items[static_cast<size_t>(r)];
    out = std::move(objects);
    out.insert(out.end(), std::make_move_iterator(tensors.begin()),
               std::make_move_iterator(tensors.end()));
  }
  std::vector<PlannedKey> keys;
  for (const Key& k : keys_) {
    keys.push_back({.fqn = k.fqn,
                    .tensor = k.tensor,
                    .dtype = k.dtype,
                    .shape = k.shape,
                    .bytes = k.bytes,
                    .path = k.path});
  }
  std::vector<std::vector<PlannedItem>> planned(items.size());
  for (size_t r = 0; r < items.size(); ++r) {
    for (ItemRef& it : items[r]) {
      const Key& k = keys_[it.key];
      PlannedItem p;
      p.key = it.key;
      p.chunk = std::move(it.chunk);
      if (!k.constant.empty()) {
        p.constant = k.constant;
      } else if (!k.experts.empty() && NumElements(p.chunk.sizes) > 0) {
        // Each expert's rows of the chunk from its own atom.
        const Shape off(p.chunk.offsets.begin() + 1, p.chunk.offsets.end());
        const Shape sub(p.chunk.sizes.begin() + 1, p.chunk.sizes.end());
        for (int64_t i = 0; i < p.chunk.sizes[0]; ++i) {
          reshape::CopyOp op;
          op.src = input_.Tensor(
              *k.experts[static_cast<size_t>(p.chunk.offsets[0] + i)]);
          op.src_box = Box{off, sub};
          op.dst_box = Box::Whole(sub);
          op.dst_offset = i * NumElements(sub);
          op.dst_shape = sub;
          p.ops.push_back(std::move(op));
        }
      } else if (k.tensor &&
                 (NumElements(p.chunk.sizes) > 0 || p.chunk.sizes.empty())) {
        reshape::CopyOp op;
        op.src = input_.Tensor(*k.atom);
        op.src_box = Box{p.chunk.offsets, p.chunk.sizes};
        op.dst_box = Box::Whole(p.chunk.sizes);
        p.ops.push_back(std::move(op));
      }
      planned[r].push_back(std::move(p));
    }
  }
  files_.emplace(std::move(keys), std::move(planned), std::move(entry_order));
}

std::vector<std::unique_ptr<formats::PlannedFile>> DcpPlan::Plan(
    size_t u) const {
  std::vector<std::unique_ptr<formats::PlannedFile>> out;
  if (u < static_cast<size_t>(world_)) {
    out.push_back(files_->RankFile(static_cast<int64_t>(u)));
    return out;
  }
  // .metadata, last, with the attributes the source kept beside its
  // metadata (Megatron's mcore_data).
  std::vector<std::pair<std::string, std::string>> extra;
  if (const atoms::DatasetInfo* d = input_.FindOpaque("dcp/metadata_extra")) {
    std::shared_ptr<const torchfile::TorchFile> f = input_.OpenBlob(*d);
    if (f->root() != nullptr && f->root()->IsDictLike()) {
      for (const auto& [name, v] : f->root()->entries) {
        if (name != nullptr && name->kind == Kind::kStr)
          extra.emplace_back(name->s, v != nullptr ? pickle::Pickle(v) : "");
      }
    }
  }
  out.push_back(files_->MetadataFile(std::move(extra)));
  return out;
}

formats::TargetSummary DcpPlan::Summary() const {
  formats::TargetSummary s;
  s.notes.assign(notes_.begin(), notes_.end());
  s.resume_hint = StrCat(
      "PyTorch: dcp.load(state_dict, checkpoint_id=\"<output>\") at any "
      "world size (written for ",
      world_, " ranks)");
  s.details["world_size"] = world_;
  if (ep_ > 1) s.details["ep"] = ep_;
  return s;
}

}  // namespace

std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options) {
  return std::make_unique<DcpPlan>(input, options);
}

}  // namespace ucp::dcp
