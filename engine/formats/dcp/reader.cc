// Reading a DCP checkpoint into a universal SourcePlan (dcp.h).

#include <algorithm>
#include <map>
#include <set>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/formats/common/source_table.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/dcp/experts.h"
#include "engine/formats/dcp/keys.h"
#include "engine/json/json.h"
#include "engine/pickle/pickle.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

class Reader {
 public:
  Reader(const Checkpoint& c, const ParamNamer& namer) : c_(c), namer_(namer) {}
  universal::SourcePlan Run();

 private:
  struct Param {
    std::string name;
    Shape shape;
    DType dtype = DType::kFloat32;
    bool buffer = false;
    bool frozen = false;
    int64_t group = 0;
  };
  // torchtitan's stacked routed experts (experts.h): each key of one split
  // into one param per global expert.
  struct Stacked {
    StackedName name;
    int64_t experts = 0;
    std::string order;  // the dims after E, as the suffix spells them
    Shape per;          // one expert's slice
  };
  void Classify();
  void DetectExperts();
  void PlanStacked(const Entry& e, const KeyClass& k, const Stacked& s);
  // Opens `item` (the chunk of `e` at `key`) and checks that it holds a
  // tensor of the chunk's dtype and shape: its source tensor. Throws
  // FormatError otherwise.
  reshape::SourceTensor OpenChunk(const Item& item, const ItemKey& key,
                                  const Entry& e, const Chunk& chunk,
                                  const std::string& where);
  void CheckExpertStates() const;
  void ReadParamGroups();
  Param& ParamOf(const std::string& name, const Shape& shape, const Entry& e);
  void PlanTensor(const Entry& e, const KeyClass& k);
  const Value* ItemValue(const ItemKey& key, const std::string& where);

  const Checkpoint& c_;
  const ParamNamer& namer_;
  universal::SourcePlan plan_;
  std::map<std::pair<std::string, std::string>, size_t> atom_of_;
  formats::SourceTable sources_{plan_};
  FileCache files_;
  std::vector<std::shared_ptr<const torchfile::TorchFile>> open_;
  std::vector<KeyClass> classes_;           // per entry
  std::map<std::string, Stacked> stacked_;  // by the stacked param's name
  std::vector<Param> params_;
  std::map<std::string, size_t> index_;
  // Param groups: the dict entries (key, value) of each, and their params.
  std::vector<std::vector<std::pair<std::string, const Value*>>> groups_;
  std::vector<std::vector<std::string>> group_params_;
  std::set<std::string> state_kinds_;
  bool has_optimizer_ = false;
  DType model_dtype_ = DType::kFloat32;
  bool model_dtype_known_ = false;
};

void Reader::Classify() {
  const KeyNames names = KeyNames::From(c_.metadata);
  for (const Entry& e : c_.metadata.entries)
    classes_.push_back(names.Classify(e.fqn, e.tensor));
}

// Stacked expert tensors: 3-D model tensors named <prefix>moe.experts.<w1|
// w2|w3>[_XYZ] (experts.h). Every one of a layer holds the same E experts,
// the layer's router (<prefix>moe.router.gate.weight [E, D]) as many: a save
// that lost experts (each rank's local experts under the global name) or
// names more is refused naming the layer and the global experts.
void Reader::DetectExperts() {
  std::map<std::string, const Entry*> model;
  for (size_t i = 0; i < c_.metadata.entries.size(); ++i) {
    const Entry& e = c_.metadata.entries[i];
    const KeyClass& k = classes_[i];
    if (e.tensor && (k.kind == KeyClass::kModel || k.kind == KeyClass::kTensor))
      model.emplace(k.param, &e);
  }
  std::map<std::string, std::vector<std::pair<std::string, const Entry*>>>
      layers;
  for (const auto& [param, e] : model) {
    if (e->size.size() != 3) continue;
    if (const std::optional<StackedName> n = SplitStacked(param))
      layers[n->prefix].emplace_back(param, e);
  }
  for (const auto& [prefix, members] : layers) {
    const auto& [first, fe] = members.front();
    const int64_t num = fe->size[0];
    for (const auto& [param, e] : members) {
      if (e->size[0] != num) {
        throw FormatError(c_.path.string(), " > ", e->fqn, ": holds ",
                          e->size[0], " experts, but ", first, " holds ", num,
                          " (the stacked experts of one MoE layer disagree)");
      }
    }
    const std::string base =
        prefix.substr(0, prefix.size() - std::string_view("experts.").size());
    const auto router = model.find(base + "router.gate.weight");
    int64_t dim = -1;
    if (router != model.end() && router->second->size.size() == 2) {
      const int64_t want = router->second->size[0];
      dim = router->second->size[1];
      if (want != num) {
        std::vector<int64_t> v;
        for (int64_t x = std::min(num, want); x < std::max(num, want); ++x)
          v.push_back(x);
        throw FormatError(
            c_.path.string(), " > ", fe->fqn, ": layer ", base,
            "*: global experts ", IndexList(v),
            want > num ? " missing" : " beyond the router's",
            " (the stacked experts hold ", num, ", the router ",
            router->second->fqn, " ", want,
            "; every expert of every MoE layer must be stored exactly once)");
      }
    }
    for (const auto& [param, e] : members) {
      Stacked st;
      st.name = *SplitStacked(param);
      st.experts = num;
      st.per = Shape(e->size.begin() + 1, e->size.end());
      // The suffix tells the order; else the router's D (w1 / w3 [F, D] in
      // torchtitan's order, [D, F] in older saves).
      const bool w2 = st.name.stem == "w2";
      const bool d_last = st.per[1] == dim && st.per[0] != dim;
      const bool d_first = st.per[0] == dim && st.per[1] != dim;
      if (!st.name.suffix.empty()) {
        st.order = st.name.suffix.substr(1);
      } else if (w2) {
        st.order = d_last ? "EFD" : "EDF";
      } else {
        st.order = d_first ? "EDF" : "EFD";
      }
      stacked_.emplace(param, std::move(st));
    }
  }
}

// A stacked expert key (its model tensor or an optimizer state of it): one
// atom per global expert, each chunk's rows the experts' fragments; a 0-d
// state (the step) given to every expert.
reshape::SourceTensor Reader::OpenChunk(const Item& item, const ItemKey& key,
                                        const Entry& e, const Chunk& chunk,
                                        const std::string& where) {
  open_.push_back(OpenItem(item, key, files_));
  const torchfile::TorchFile& f = *open_.back();
  const torchfile::TensorInfo* t = f.FindTensor(f.root());
  if (t == nullptr) throw FormatError("the item is not a tensor");
  if (t->dtype != e.dtype || t->shape != chunk.sizes) {
    throw FormatError("the item holds a ", DTypeName(t->dtype), " ",
                      ShapeString(t->shape), " tensor, the metadata says ",
                      DTypeName(e.dtype), " ", ShapeString(chunk.sizes));
  }
  return sources_.Tensor(open_.back(), *t, where);
}

void Reader::PlanStacked(const Entry& e, const KeyClass& k, const Stacked& s) {
  const std::string where = StrCat(c_.path.string(), " > ", e.fqn);
  const bool state = k.kind == KeyClass::kState;
  const std::string kind =
      state ? k.state : (e.dtype == DType::kFloat32 ? "fp32" : "param");
  if (state && (kind == "fp32" || kind == "param")) {
    throw FormatError(where, ": optimizer state named '", kind,
                      "' (reserved by the universal file)");
  }
  Shape stacked = s.per;
  stacked.insert(stacked.begin(), s.experts);
  if (!e.size.empty() && e.size != stacked) {
    throw FormatError(where, ": shape ", ShapeString(e.size), " but the ",
                      "stacked experts' is ", ShapeString(stacked));
  }
  std::vector<size_t> atoms;
  for (int64_t x = 0; x < s.experts; ++x) {
    Param& p = ParamOf(ExpertParam(s.name, x), s.per, e);
    if (state) {
      state_kinds_.insert(kind);
      has_optimizer_ = true;
    } else {
      p.dtype = e.dtype;
      p.buffer = !IsFloatingPoint(e.dtype);
      if (!p.buffer && !model_dtype_known_) {
        model_dtype_ = e.dtype;
        model_dtype_known_ = true;
      }
    }
    const auto [slot, fresh] =
        atom_of_.try_emplace({p.name, kind}, plan_.atoms.size());
    if (fresh) {
      universal::AtomPlan a;
      a.param = p.name;
      a.state_kind = kind;
      a.dtype = e.dtype;
      a.shape = e.size.empty() ? e.size : s.per;
      plan_.atoms.push_back(std::move(a));
    }
    const universal::AtomPlan& atom = plan_.atoms[slot->second];
    if (atom.dtype != e.dtype || (e.size.empty() != atom.shape.empty())) {
      throw FormatError(where, ": a ", DTypeName(e.dtype), " ",
                        ShapeString(e.size), " part of ", p.name, "'s ", kind,
                        ", which is ", DTypeName(atom.dtype), " ",
                        ShapeString(atom.shape));
    }
    atoms.push_back(slot->second);
  }
  for (const Chunk& chunk : e.chunks) {
    if (!e.size.empty() && NumElements(chunk.sizes) == 0) continue;
    const ItemKey key{e.fqn, chunk.offsets};
    for (const Item& item : c_.items.at(key)) {
      const std::string iw = StrCat("rank file ", item.file.string(), " > ",
                                    e.fqn, " > chunk ", BoxString(chunk));
      try {
        const reshape::SourceTensor whole = OpenChunk(item, key, e, chunk, iw);
        if (e.size.empty()) {  // the step: every expert's
          for (size_t a : atoms) {
            universal::Fragment fr;
            fr.src = whole;
            fr.where = iw;
            plan_.atoms[a].fragments.push_back(std::move(fr));
          }
          continue;
        }
        const Shape sub(chunk.sizes.begin() + 1, chunk.sizes.end());
        const Shape off(chunk.offsets.begin() + 1, chunk.offsets.end());
        const int64_t row =
            whole.stride.empty() ? NumElements(sub) : whole.stride[0];
        for (int64_t i = 0; i < chunk.sizes[0]; ++i) {
          const int64_t x = chunk.offsets[0] + i;
          UCP_CHECK(x >= 0 && x < s.experts, where, ": chunk ",
                    BoxString(chunk), " past the experts (tiling checked)");
          universal::Fragment fr;
          fr.src = whole;
          fr.src.byte_offset +=
              static_cast<uint64_t>(i * row) * ElementSize(e.dtype);
          if (!fr.src.stride.empty())
            fr.src.stride.erase(fr.src.stride.begin());
          fr.src.shape = sub;
          fr.src_box = Box::Whole(sub);
          fr.atom_box = Box{off, sub};
          fr.where = StrCat(iw, " (global expert ", x, ")");
          plan_.atoms[atoms[static_cast<size_t>(x)]].fragments.push_back(
              std::move(fr));
        }
      } catch (Error& err) {
        if (std::string_view(err.what()).find(item.file.string()) ==
            std::string_view::npos)
          err.AddContext(iw);
        throw;
      }
    }
  }
}

// Every stacked expert tensor an optimizer updates has each optimizer state
// the others have: a save whose experts lost their moments (stale Adam state
// after a conversion) is refused naming the key.
void Reader::CheckExpertStates() const {
  std::set<std::string> kinds;
  for (const auto& [param, s] : stacked_)
    for (const std::string& kind : state_kinds_)
      if (atom_of_.count({ExpertParam(s.name, 0), kind})) kinds.insert(kind);
  std::set<std::string> optimized;
  for (const std::vector<std::string>& g : group_params_)
    optimized.insert(g.begin(), g.end());
  for (const auto& [param, s] : stacked_) {
    const std::string first = ExpertParam(s.name, 0);
    if (s.experts == 0 || (!optimized.empty() && !optimized.count(first)))
      continue;
    for (const std::string& kind : kinds) {
      if (atom_of_.count({first, kind})) continue;
      throw FormatError(c_.path.string(), " > optimizer.state.", param, ".",
                        kind, ": missing (global experts 0-", s.experts - 1,
                        " of ", param, " without their ", kind,
                        ", which the other stacked experts have)");
    }
  }
}

const Value* Reader::ItemValue(const ItemKey& key, const std::string& where) {
  const auto it = c_.items.find(key);
  UCP_CHECK(it != c_.items.end() && !it->second.empty(), where, ": no item");
  open_.push_back(OpenItem(it->second.front(), key, files_));
  const Value* v = open_.back()->root();
  if (v == nullptr) throw FormatError(where, ": an empty item");
  return v;
}

void Reader::ReadParamGroups() {
  for (size_t i = 0; i < c_.metadata.entries.size(); ++i) {
    const Entry& e = c_.metadata.entries[i];
    const KeyClass& k = classes_[i];
    if (e.tensor) continue;
    const std::string where = StrCat(c_.path.string(), " > ", e.fqn);
    if (k.kind == KeyClass::kParamGroup) {
      if (k.group < 0 || k.group > 100000)
        throw FormatError(where, ": param group index ", k.group);
      if (groups_.size() <= static_cast<size_t>(k.group)) {
        groups_.resize(static_cast<size_t>(k.group) + 1);
        group_params_.resize(groups_.size());
      }
      const Value* v = ItemValue({e.fqn, std::nullopt}, where);
      if (k.group_key == "params") {
        if (v->kind != Kind::kList && v->kind != Kind::kTuple)
          throw FormatError(where, ": 'params' is not a list");
        for (const Value* p : v->items) {
          if (p->kind == Kind::kStr)
            group_params_[static_cast<size_t>(k.group)].push_back(p->s);
        }
      } else {
        groups_[static_cast<size_t>(k.group)].emplace_back(k.group_key, v);
      }
      has_optimizer_ = true;
    } else if (k.kind == KeyClass::kParamGroups) {
      // Older traversals: the whole list as one item.
      const Value* v = ItemValue({e.fqn, std::nullopt}, where);
      if (v->kind != Kind::kList) continue;
      for (const Value* g : v->items) {
        if (g == nullptr || !g->IsDictLike()) continue;
        groups_.emplace_back();
        group_params_.emplace_back();
        for (const auto& [gk, gv] : g->entries) {
          if (gk == nullptr || gk->kind != Kind::kStr) continue;
          if (gk->s == "params") {
            if (gv != nullptr && gv->kind == Kind::kList)
              for (const Value* p : gv->items)
                if (p->kind == Kind::kStr) group_params_.back().push_back(p->s);
          } else {
            groups_.back().emplace_back(gk->s, gv);
          }
        }
      }
      has_optimizer_ = true;
    }
  }
}

Reader::Param& Reader::ParamOf(const std::string& name, const Shape& shape,
                               const Entry& e) {
  auto it = index_.find(name);
  if (it != index_.end()) return params_[it->second];
  Param p;
  p.name = name;
  p.shape = shape;
  p.dtype = e.dtype;
  p.buffer = !IsFloatingPoint(e.dtype);
  index_.emplace(name, params_.size());
  params_.push_back(std::move(p));
  return params_.back();
}

void Reader::PlanTensor(const Entry& e, const KeyClass& k) {
  const std::string where = StrCat(c_.path.string(), " > ", e.fqn);
  ParamPlace place{k.param, e.size, {}};
  if (namer_) place = namer_(e.fqn, k.param, e.size);
  if (const auto s = stacked_.find(place.param); s != stacked_.end()) {
    PlanStacked(e, k, s->second);
    return;
  }
  if (place.param.empty()) {  // an object in a tensor
    if (e.chunks.size() != 1) {
      throw FormatError(where, ": ", e.chunks.size(), " chunks of a tensor ",
                        "that is no param's (one expected)");
    }
    const ItemKey key{e.fqn, e.chunks[0].offsets};
    plan_.opaque.push_back({StrCat("dcp/bytes/", e.fqn),
                            ItemBytes(c_.items.at(key).front(), key, files_)});
    return;
  }
  if (!place.offset.empty() && place.offset.size() != e.size.size())
    place.offset.clear();
  std::string kind;
  Param* p;
  if (k.kind == KeyClass::kState) {
    p = &ParamOf(place.param, place.shape, e);
    kind = k.state;
    if (kind == "fp32" || kind == "param") {
      throw FormatError(where, ": optimizer state named '", kind,
                        "' (reserved by the universal file)");
    }
    state_kinds_.insert(kind);
    has_optimizer_ = true;
    if (kind != "step" && place.shape != p->shape) {
      throw FormatError(where, ": shape ", ShapeString(place.shape),
                        " but the ", "param's is ", ShapeString(p->shape));
    }
  } else {
    p = &ParamOf(place.param, place.shape, e);
    if (place.shape != p->shape) {
      throw FormatError(where, ": shape ", ShapeString(place.shape),
                        " but its optimizer state's is ",
                        ShapeString(p->shape));
    }
    p->dtype = e.dtype;
    p->buffer = !IsFloatingPoint(e.dtype);
    kind = e.dtype == DType::kFloat32 ? "fp32" : "param";
    if (k.kind == KeyClass::kModel && !p->buffer && !model_dtype_known_) {
      model_dtype_ = e.dtype;
      model_dtype_known_ = true;
    }
  }
  // Several keys of one param (namer_): one atom, their fragments merged.
  const auto [slot, fresh] =
      atom_of_.try_emplace({p->name, kind}, plan_.atoms.size());
  if (fresh) {
    universal::AtomPlan a;
    a.param = p->name;
    a.state_kind = kind;
    a.dtype = e.dtype;
    a.shape = kind == "step" ? e.size : place.shape;
    plan_.atoms.push_back(std::move(a));
  }
  universal::AtomPlan& atom = plan_.atoms[slot->second];
  if (atom.dtype != e.dtype || (kind == "step" && atom.shape != e.size)) {
    throw FormatError(where, ": a ", DTypeName(e.dtype), " ",
                      ShapeString(e.size), " part of ", p->name, "'s ", kind,
                      ", which is ", DTypeName(atom.dtype), " ",
                      ShapeString(atom.shape));
  }
  const bool shifted = !place.offset.empty() && kind != "step";
  for (const Chunk& chunk : e.chunks) {
    int64_t volume = 1;
    for (int64_t d : chunk.sizes) volume *= d;
    if (volume == 0 && !e.size.empty()) continue;
    const ItemKey key{e.fqn, chunk.offsets};
    for (const Item& item : c_.items.at(key)) {
      const std::string iw = StrCat("rank file ", item.file.string(), " > ",
                                    e.fqn, " > chunk ", BoxString(chunk));
      try {
        universal::Fragment fr;
        fr.src = OpenChunk(item, key, e, chunk, iw);
        fr.src_box = Box::Whole(chunk.sizes);
        fr.atom_box = Box{chunk.offsets, chunk.sizes};
        if (shifted)
          for (size_t d = 0; d < place.offset.size(); ++d)
            fr.atom_box.offset[d] += place.offset[d];
        fr.where = iw;
        atom.fragments.push_back(std::move(fr));
      } catch (Error& err) {
        if (std::string_view(err.what()).find(item.file.string()) ==
            std::string_view::npos)
          err.AddContext(iw);
        throw;
      }
    }
  }
}

universal::SourcePlan Reader::Run() {
  Classify();
  if (!namer_) DetectExperts();
  ReadParamGroups();
  // A group lists a stacked expert tensor: its experts' params.
  for (std::vector<std::string>& names : group_params_) {
    std::vector<std::string> out;
    for (std::string& n : names) {
      const auto s = stacked_.find(n);
      if (s == stacked_.end()) {
        out.push_back(std::move(n));
        continue;
      }
      for (int64_t x = 0; x < s->second.experts; ++x)
        out.push_back(ExpertParam(s->second.name, x));
    }
    names = std::move(out);
  }
  // Model weights first (their shapes are the params'), then the rest.
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < c_.metadata.entries.size(); ++i) {
      const Entry& e = c_.metadata.entries[i];
      const KeyClass& k = classes_[i];
      if (!e.tensor) continue;
      const bool weights =
          k.kind == KeyClass::kModel || k.kind == KeyClass::kTensor;
      if (weights != (pass == 0)) continue;
      PlanTensor(e, k);
    }
  }
  CheckExpertStates();
  // Groups and frozen params (listed in no group of an optimizer).
  std::map<std::string, int64_t> group_of;
  for (size_t g = 0; g < group_params_.size(); ++g)
    for (const std::string& n : group_params_[g])
      group_of.emplace(n, static_cast<int64_t>(g));
  int64_t order = 0;
  std::vector<std::string> frozen;
  std::vector<std::string> param_order;
  for (Param& p : params_) {
    if (auto it = group_of.find(p.name); it != group_of.end()) {
      p.group = it->second;
    } else if (!group_of.empty() && !p.buffer) {
      p.frozen = true;
      frozen.push_back(p.name);
    }
    param_order.push_back(p.name);
    plan_.params.push_back(formats::ParamRow({.fqn = p.name,
                                              .shape = p.shape,
                                              .dtype = p.dtype,
                                              .rule = "dcp",
                                              .buffer = p.buffer,
                                              .group = p.buffer ? -1 : p.group,
                                              .order = order++,
                                              .frozen = p.frozen,
                                              .tied_copies = {}}));
  }
  // BYTE_IO items verbatim; the param groups for other formats.
  DcpExtras meta;
  for (size_t i = 0; i < c_.metadata.entries.size(); ++i) {
    const Entry& e = c_.metadata.entries[i];
    const KeyClass& k = classes_[i];
    meta.keys.push_back(
        {e.fqn, std::string(KeyClassName(k.kind)), k.param, k.state});
    if (const auto s = stacked_.find(k.param);
        e.tensor && s != stacked_.end()) {
      meta.keys.back().experts = s->second.experts;
      meta.keys.back().order = s->second.order;
    }
    if (e.tensor) continue;
    const ItemKey key{e.fqn, std::nullopt};
    plan_.opaque.push_back({StrCat("dcp/bytes/", e.fqn),
                            ItemBytes(c_.items.at(key).front(), key, files_)});
  }
  if (!groups_.empty()) {
    pickle::Arena arena;
    std::vector<Value*> list;
    for (const auto& g : groups_) {
      Value* d = arena.Dict();
      for (const auto& [k, v] : g)
        d->entries.emplace_back(arena.Str(k), arena.Copy(v));
      list.push_back(d);
    }
    plan_.opaque.push_back(
        {"optimizer/param_groups",
         formats::SaveBlob(nullptr, arena.List(std::move(list)))});
  }
  if (!c_.metadata.extra.empty()) {
    pickle::Arena arena;
    Value* d = arena.Dict();
    for (const auto& [name, bytes] : c_.metadata.extra)
      d->entries.emplace_back(
          arena.Str(name),
          bytes.empty() ? arena.None() : pickle::Unpickle(bytes, arena));
    plan_.opaque.push_back(
        {"dcp/metadata_extra", formats::SaveBlob(nullptr, d)});
  }
  // The model.
  universal::Model& model = plan_.model;
  model.iteration = c_.iteration;
  model.consumed_samples = -1;
  universal::SourceInfo& src = model.source;
  src.framework = "pytorch-dcp";
  src.driver = "dcp";
  src.framework_version = c_.metadata.version;
  src.tp = 1;
  src.pp = 1;
  src.vpp = 1;
  src.dp = c_.world;
  src.dtype = std::string(DTypeName(model_dtype_));
  src.other["checkpoint"] = c_.name;
  if (has_optimizer_) {
    universal::OptimizerInfo& opt = model.optimizer;
    opt.type = "torch.optim";
    opt.groups.emplace();
    for (size_t g = 0; g < groups_.size(); ++g) {
      universal::ParamGroup& j = opt.groups->emplace_back();
      j.params = group_params_[g];
      for (const auto& [k, v] : groups_[g])
        formats::AddGroupHyperparam(k, v, j);
    }
    opt.state_kinds =
        std::vector<std::string>(state_kinds_.begin(), state_kinds_.end());
    opt.step = model.iteration;
  }
  universal::TrainingInfo& training =
      universal::NewTraining(model, std::string(DTypeName(model_dtype_)));
  training.frozen = std::move(frozen);
  training.param_order = std::move(param_order);
  meta.planner_data = c_.metadata.planner_data;
  meta.version = c_.metadata.version;
  meta.world = c_.world;
  WriteDcpExtras(meta, model);
  return std::move(plan_);
}

}  // namespace

universal::SourcePlan PlanSource(const Checkpoint& checkpoint,
                                 const ParamNamer& namer) {
  Reader r(checkpoint, namer);
  return r.Run();
}

std::vector<formats::ArchiveSpan> Archives(const Checkpoint& c,
                                           const fs::path& file) {
  std::vector<formats::ArchiveSpan> out;
  const fs::path f = fs::absolute(file).lexically_normal();
  for (const auto& [key, items] : c.items) {
    for (const Item& it : items) {
      // Compressed items are no archives until decompressed.
      if (it.file == f && it.info.transforms.empty())
        out.push_back({it.info.offset, it.info.length});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.offset < b.offset; });
  return out;
}

json::Value Inventory(const Checkpoint& c, std::string_view format,
                      std::string_view title) {
  json::Value j;
  j["format"] = format;
  j["path"] = c.path.string();
  j["version"] = c.metadata.version;
  j["rank_local"] = c.rank_local;
  j["world"] = c.world;
  std::string text =
      StrCat(c.path.string(), "  (", title, ", ", c.metadata.entries.size(),
             " keys, ", c.files.size(), " files",
             c.rank_local ? ", rank-local metadata" : "", ")\n");
  json::Value keys = json::Value::Array();
  for (const Entry& e : c.metadata.entries) {
    json::Value k;
    k["key"] = e.fqn;
    k["tensor"] = e.tensor;
    if (e.tensor) {
      k["dtype"] = std::string(DTypeName(e.dtype));
      json::Value shape = json::Value::Array();
      for (int64_t d : e.size) shape.Append(d);
      k["shape"] = std::move(shape);
      text += StrCat("  ", e.fqn, "  ", DTypeName(e.dtype), " ",
                     ShapeString(e.size), "  ", e.chunks.size(), " chunk",
                     e.chunks.size() == 1 ? "" : "s", "\n");
    } else {
      text += StrCat("  ", e.fqn, "  (bytes)\n");
    }
    json::Value chunks = json::Value::Array();
    auto add = [&](const ItemKey& key, const Chunk* chunk) {
      auto it = c.items.find(key);
      if (it == c.items.end()) return;
      for (const Item& item : it->second) {
        json::Value x;
        if (chunk != nullptr) {
          json::Value o = json::Value::Array(), s = json::Value::Array();
          for (int64_t d : chunk->offsets) o.Append(d);
          for (int64_t d : chunk->sizes) s.Append(d);
          x["offsets"] = std::move(o);
          x["sizes"] = std::move(s);
        }
        x["file"] = item.info.relative_path;
        x["offset"] = item.info.offset;
        x["length"] = item.info.length;
        if (!item.info.transforms.empty())
          x["transforms"] = item.info.transforms.front();
        text +=
            StrCat("      ", chunk != nullptr ? BoxString(*chunk) + "  " : "",
                   item.info.relative_path, " @", item.info.offset, "+",
                   item.info.length, "\n");
        chunks.Append(std::move(x));
      }
    };
    if (e.tensor) {
      for (const Chunk& ch : e.chunks) add({e.fqn, ch.offsets}, &ch);
    } else {
      add({e.fqn, std::nullopt}, nullptr);
    }
    k["chunks"] = std::move(chunks);
    keys.Append(std::move(k));
  }
  j["keys"] = std::move(keys);
  json::Value files = json::Value::Array();
  for (const fs::path& f : c.files) files.Append(f.string());
  j["files"] = std::move(files);
  j["text"] = text;
  return j;
}

}  // namespace ucp::dcp
