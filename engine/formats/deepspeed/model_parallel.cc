// Merging per-mp-rank plans into whole tensors (model_parallel.h).

#include "engine/formats/deepspeed/model_parallel.h"

#include <algorithm>
#include <map>
#include <set>

#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed_format.h"
#include "layouts/placement.h"

namespace ucp::deepspeed::internal {
namespace {

struct Global {
  atoms::ParamInfo info;  // shape: full
  int64_t stage = 0;
  const layouts::Rule* rule = nullptr;  // tp > 1
  Shape local;
  int64_t padded_rows = 0;  // vocab-padded split dim: local rows x tp
  int64_t pad_rows = 0;     // of which beyond the true size
};

std::string Mp(int64_t mp) { return StrCat(mp < 10 ? "0" : "", mp); }

// Appends the names of `from` missing in `into`.
void AppendMissing(std::vector<std::string>& into,
                   const std::vector<std::string>& from) {
  std::set<std::string> have(into.begin(), into.end());
  for (const std::string& n : from)
    if (have.insert(n).second) into.push_back(n);
}

void UnionNames(std::optional<std::vector<std::string>>& into,
                const std::optional<std::vector<std::string>>& from) {
  if (!from) return;
  if (!into) into.emplace();
  AppendMissing(*into, *from);
}

// Per-group name lists: group g of `from` joins group g of `into`.
void UnionGroups(
    std::optional<std::vector<std::vector<std::string>>>& into,
    const std::optional<std::vector<std::vector<std::string>>>& from) {
  if (!from) return;
  if (!into) into.emplace();
  for (size_t g = 0; g < from->size(); ++g) {
    if (g >= into->size()) into->emplace_back();
    AppendMissing((*into)[g], (*from)[g]);
  }
}

// The "deepspeed" record of the plan of mp rank `mp` (every rank's planner
// writes one).
DeepSpeedExtras RankExtras(const universal::SourcePlan& plan,
                           const ModelParallel& m, size_t mp) {
  std::optional<DeepSpeedExtras> x = ReadDeepSpeedExtras(
      plan.model,
      mp < m.model_files.size() ? m.model_files[mp] : std::filesystem::path());
  UCP_CHECK(x.has_value(), "mp rank ", mp, " planned without its record");
  return std::move(*x);
}

// The rank file of mp rank `mp`, for messages.
std::string RankFile(const ModelParallel& m, size_t mp) {
  return StrCat("rank file ", mp < m.model_files.size()
                                  ? m.model_files[mp].string()
                                  : StrCat("of mp rank ", Mp(mp)));
}

using ParamIndex = std::map<std::string, size_t>;
using AtomIndex = std::map<std::pair<std::string, std::string>, size_t>;

// Adds the params of stage p that no earlier stage holds, in the stage's
// own order, with their full shapes (the layout's TP placement).
void AddStageParams(const std::vector<universal::SourcePlan>& ranks,
                    const ModelParallel& m, int64_t p,
                    std::vector<Global>& params, ParamIndex& index) {
  const int64_t tp = m.tp;
  auto where = [&](size_t mp) { return RankFile(m, mp); };
  const size_t mp0 = static_cast<size_t>(p * tp);
  std::vector<const atoms::ParamInfo*> local;
  for (const atoms::ParamInfo& i : ranks[mp0].params) local.push_back(&i);
  std::stable_sort(local.begin(), local.end(),
                   [](auto* a, auto* b) { return a->order < b->order; });
  for (const atoms::ParamInfo* i : local) {
    if (index.count(i->fqn)) continue;  // pipeline-replicated (tied)
    Global g;
    g.info = *i;
    g.info.order = static_cast<int64_t>(params.size());
    g.stage = p;
    g.local = i->shape;
    try {
      if (m.layout != nullptr) {
        g.rule = &m.layout->Match(i->fqn, m.vars);
        if (g.rule->entry == layouts::EntryKind::kOpaque)
          throw FormatError("is a tensor but ", g.rule->Describe(),
                            " says it is opaque");
        g.info.shape =
            layouts::FullShapeFromLocal(*g.rule, i->shape, tp, m.vars);
        if (g.rule->tp.split && g.rule->tp.vocab) {
          const size_t d = static_cast<size_t>(g.rule->tp.dim);
          g.padded_rows = i->shape[d] * tp;
          g.pad_rows = g.padded_rows - g.info.shape[d];
        }
        g.info.rule = g.rule->name;
      }
    } catch (Error& e) {
      e.AddContext(where(mp0), " > param ", i->fqn);
      throw;
    }
    index.emplace(i->fqn, params.size());
    params.push_back(std::move(g));
  }
}

// Every tp rank of stage p: the names, local shapes and dtypes of tp rank 0.
void CheckTpRanks(const std::vector<universal::SourcePlan>& ranks,
                  const ModelParallel& m, int64_t p) {
  const int64_t tp = m.tp;
  auto where = [&](size_t mp) { return RankFile(m, mp); };
  const size_t mp0 = static_cast<size_t>(p * tp);
  std::map<std::string, const atoms::ParamInfo*> ref;
  for (const atoms::ParamInfo& i : ranks[mp0].params) ref[i.fqn] = &i;
  for (int64_t t = 1; t < tp; ++t) {
    const size_t mp = static_cast<size_t>(p * tp + t);
    if (ranks[mp].params.size() != ref.size()) {
      throw FormatError(where(mp), ": ", ranks[mp].params.size(),
                        " params but tp rank 0 (", where(mp0), ") has ",
                        ref.size());
    }
    for (const atoms::ParamInfo& i : ranks[mp].params) {
      auto it = ref.find(i.fqn);
      if (it == ref.end()) {
        throw FormatError(where(mp), " > param ", i.fqn,
                          ": not a param of tp rank 0 (", where(mp0), ")");
      }
      if (it->second->shape != i.shape || it->second->dtype != i.dtype) {
        throw FormatError(where(mp), " > param ", i.fqn, ": local shape ",
                          ShapeString(i.shape), " ", DTypeName(i.dtype),
                          " but tp rank 0 has ", ShapeString(it->second->shape),
                          " ", DTypeName(it->second->dtype));
      }
    }
  }
}

// The fragments of atom `a` of mp rank `mp` (tp rank t) mapped through the
// layout's shard pieces onto the full atom `dst`.
void PlaceFragments(const universal::AtomPlan& a, const Global& g,
                    const ModelParallel& m, size_t mp, int64_t t,
                    universal::AtomPlan& dst) {
  layouts::LocalShard shard;
  try {
    shard = layouts::ShardFor(*g.rule, g.info.shape, m.tp, t, g.padded_rows,
                              g.pad_rows);
  } catch (Error& e) {
    e.AddContext(RankFile(m, mp), " > param ", a.param);
    throw;
  }
  for (const universal::Fragment& f : a.fragments) {
    for (const layouts::Piece& piece : shard.pieces) {
      const std::optional<Box> hit = Intersect(f.atom_box, piece.local);
      if (!hit) continue;
      universal::Fragment nf = f;
      nf.src_box = f.src_box;
      nf.atom_box = piece.global;
      for (size_t d = 0; d < hit->offset.size(); ++d) {
        nf.src_box.offset[d] += hit->offset[d] - f.atom_box.offset[d];
        nf.atom_box.offset[d] += hit->offset[d] - piece.local.offset[d];
      }
      nf.src_box.size = hit->size;
      nf.atom_box.size = hit->size;
      nf.pad = piece.region == layouts::Region::kPad;
      dst.fragments.push_back(std::move(nf));
    }
  }
}

// The atoms of mp rank `mp` (its sources from `offset` on in `out`) merged
// into out.atoms: every local fragment mapped onto the full tensor.
void MergeRankAtoms(universal::SourcePlan& rank, size_t mp, uint32_t offset,
                    const ModelParallel& m, const std::vector<Global>& params,
                    const ParamIndex& index, AtomIndex& atom_index,
                    universal::SourcePlan& out) {
  const int64_t tp = m.tp;
  const int64_t p = static_cast<int64_t>(mp) / tp;
  const int64_t t = static_cast<int64_t>(mp) % tp;
  for (universal::AtomPlan& a : rank.atoms) {
    auto pit = index.find(a.param);
    if (pit == index.end()) {
      throw InternalError("atom of unknown param ", a.param);
    }
    const Global& g = params[pit->second];
    if (g.stage != p) continue;             // the first stage's copy is kept
    const bool whole = a.shape != g.local;  // scalars (step)
    if (whole && t > 0) continue;
    for (universal::Fragment& f : a.fragments) f.src.source += offset;
    auto key = std::make_pair(a.param, a.state_kind);
    auto it = atom_index.find(key);
    if (it == atom_index.end()) {
      universal::AtomPlan merged;
      merged.param = a.param;
      merged.state_kind = a.state_kind;
      merged.dtype = a.dtype;
      merged.shape = whole ? a.shape : g.info.shape;
      if (!whole && g.pad_rows > 0) {
        merged.pad_shape = g.info.shape;
        merged.pad_shape[static_cast<size_t>(g.rule->tp.dim)] = g.pad_rows;
      }
      it = atom_index.emplace(key, out.atoms.size()).first;
      out.atoms.push_back(std::move(merged));
    }
    universal::AtomPlan& dst = out.atoms[it->second];
    if (dst.dtype != a.dtype) {
      throw FormatError(RankFile(m, mp), " > param ", a.param, " > ",
                        a.state_kind, ": ", DTypeName(a.dtype), " but ",
                        DTypeName(dst.dtype), " on tp rank 0");
    }
    if (whole || g.rule == nullptr) {
      for (universal::Fragment& f : a.fragments)
        dst.fragments.push_back(std::move(f));
      continue;
    }
    PlaceFragments(a, g, m, mp, t, dst);
  }
}

// Root metadata: the stages' name lists joined; the topology.
void MergeRoot(const std::vector<universal::SourcePlan>& ranks,
               const ModelParallel& m, universal::Model& model) {
  const int64_t tp = m.tp;
  model.source.tp = tp;
  model.source.pp = m.pp;
  universal::TrainingInfo& training =
      model.training ? *model.training : model.training.emplace();
  DeepSpeedExtras meta = RankExtras(ranks[0], m, 0);
  for (int64_t p = 1; p < m.pp; ++p) {
    const size_t mp0 = static_cast<size_t>(p * tp);
    const universal::Model& r = ranks[mp0].model;
    if (r.training) {
      UnionNames(training.param_order, r.training->param_order);
      UnionNames(training.frozen, r.training->frozen);
    }
    if (r.optimizer.groups) {
      std::optional<std::vector<universal::ParamGroup>>& into =
          model.optimizer.groups;
      if (!into) into.emplace();
      for (size_t g = 0; g < r.optimizer.groups->size(); ++g) {
        const universal::ParamGroup& src = (*r.optimizer.groups)[g];
        if (g >= into->size()) into->push_back(src);
        UnionNames((*into)[g].params, src.params);
      }
    }
    const DeepSpeedExtras stage = RankExtras(ranks[mp0], m, mp0);
    UnionGroups(meta.groups, stage.groups);
    UnionNames(meta.module_keys, stage.module_keys);
  }
  DeepSpeedModelParallel& mpx = meta.model_parallel.emplace();
  mpx.tp = tp;
  mpx.pp = m.pp;
  mpx.pipeline = m.pipeline;
  if (m.layout != nullptr) {
    mpx.layout = m.layout->name();
    // What a writer needs to place the params on another TP size.
    mpx.layout_yaml = m.layout->yaml();
  }
  if (!m.tied_layers.empty()) mpx.tied_layers = m.tied_layers;
  mpx.variables.emplace(m.vars.values().begin(), m.vars.values().end());
  if (auto v = m.vars.Find("vocab_size")) {
    mpx.vocab_size = *v;
    mpx.vocab_size_from = m.vocab_source;
  }
  WriteDeepSpeedExtras(meta, model);
}

}  // namespace

universal::SourcePlan MergeModelParallel(
    std::vector<universal::SourcePlan> ranks, const ModelParallel& m) {
  const int64_t tp = m.tp;
  if (static_cast<int64_t>(ranks.size()) != tp * m.pp || ranks.empty())
    throw InternalError("MergeModelParallel: ", ranks.size(), " plans for tp ",
                        tp, " x pp ", m.pp);
  if (tp > 1 && m.layout == nullptr)
    throw InternalError("MergeModelParallel: tp > 1 without a layout");

  universal::SourcePlan out;
  out.model = ranks[0].model;
  std::vector<uint32_t> offset(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    offset[i] = static_cast<uint32_t>(out.sources.size());
    for (auto& s : ranks[i].sources) out.sources.push_back(std::move(s));
  }

  // Params: the first stage holding a name owns it; order by stage, then
  // the stage's own order.
  std::vector<Global> params;
  ParamIndex index;
  for (int64_t p = 0; p < m.pp; ++p) {
    AddStageParams(ranks, m, p, params, index);
    CheckTpRanks(ranks, m, p);
  }
  AtomIndex atom_index;
  for (size_t mp = 0; mp < ranks.size(); ++mp)
    MergeRankAtoms(ranks[mp], mp, offset[mp], m, params, index, atom_index,
                   out);
  for (Global& g : params) out.params.push_back(std::move(g.info));

  // Opaque entries: mp rank 0's as they are, the others under mp_rank_XX/.
  for (size_t mp = 0; mp < ranks.size(); ++mp) {
    for (universal::OpaqueBlob& b : ranks[mp].opaque) {
      if (mp > 0)
        b.key = StrCat("mp_rank_", Mp(static_cast<int64_t>(mp)), "/", b.key);
      out.opaque.push_back(std::move(b));
    }
  }
  MergeRoot(ranks, m, out.model);
  return out;
}

}  // namespace ucp::deepspeed::internal
