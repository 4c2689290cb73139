#include "layouts/placement.h"

#include <algorithm>
#include <cstdint>
#include <map>

#include "engine/core/error.h"

namespace ucp::layouts {

int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by, int64_t tp) {
  if (vocab_size < 0) throw LayoutError("negative vocab size ", vocab_size);
  if (divisible_by < 1) {
    throw LayoutError("make_vocab_size_divisible_by must be >= 1, not ",
                      divisible_by);
  }
  if (tp < 1) throw LayoutError("tp must be >= 1, not ", tp);
  int64_t multiple = 0;
  int64_t padded = 0;
  if (__builtin_mul_overflow(divisible_by, tp, &multiple) ||
      vocab_size > INT64_MAX - multiple ||
      __builtin_mul_overflow((vocab_size + multiple - 1) / multiple, multiple,
                             &padded)) {
    throw LayoutError("padded vocab size of ", vocab_size, " (divisible by ",
                      divisible_by, " x tp ", tp, ") overflows");
  }
  return padded;
}

// ---------------------------------------------------------------- ranks

void ValidateParallelSizes(const Topology& t) {
  if (t.tp < 1 || t.pp < 1 || t.vpp < 1 || t.dp < 1 || t.ep < 1 ||
      t.ExpertTp() < 1) {
    throw LayoutError("topology ", t.ToString(), ": sizes must be >= 1");
  }
  int64_t world = 0;
  int64_t grid = 0;
  if (__builtin_mul_overflow(t.tp, t.dp, &world) ||
      __builtin_mul_overflow(world, t.pp, &world) ||
      __builtin_mul_overflow(t.ExpertTp(), t.ep, &grid) ||
      __builtin_mul_overflow(grid, t.pp, &grid)) {
    throw LayoutError("topology ", t.ToString(), ": sizes overflow");
  }
  if (world % grid != 0) {
    throw LayoutError("topology ", t.ToString(), ": etp ", t.ExpertTp(),
                      " x ep ", t.ep, " x pp ", t.pp, " = ", grid,
                      " does not divide the world of tp ", t.tp, " x pp ", t.pp,
                      " x dp ", t.dp, " = ", world,
                      " ranks (the expert data-parallel size would not be "
                      "whole)");
  }
}

int64_t WorldSize(const Topology& t) {
  ValidateParallelSizes(t);
  return t.tp * t.pp * t.dp;
}

RankCoordinates CoordinatesOf(const Topology& t, int64_t rank) {
  const int64_t world = WorldSize(t);
  if (rank < 0 || rank >= world) {
    throw LayoutError("rank ", rank, " out of range (topology ", t.ToString(),
                      ": ", world, " ranks)");
  }
  RankCoordinates c;
  c.tp = rank % t.tp;
  c.dp = rank / t.tp % t.dp;
  c.pp = rank / (t.tp * t.dp);
  const int64_t etp = t.ExpertTp();
  c.etp = rank % etp;
  c.ep = rank / etp % t.ep;
  c.edp = rank / (etp * t.ep) % t.ExpertDp();
  UCP_CHECK(rank / (etp * t.ep * t.ExpertDp()) == c.pp, "rank ", rank);
  return c;
}

namespace {

void CheckCoordinate(const char* what, int64_t value, int64_t size,
                     const Topology& t) {
  if (value < 0 || value >= size) {
    throw LayoutError(what, " rank ", value, " out of range (", what, " size ",
                      size, ", topology ", t.ToString(), ")");
  }
}

}  // namespace

int64_t DenseRank(const Topology& t, int64_t tp_rank, int64_t dp_rank,
                  int64_t pp_rank) {
  ValidateParallelSizes(t);
  CheckCoordinate("tp", tp_rank, t.tp, t);
  CheckCoordinate("dp", dp_rank, t.dp, t);
  CheckCoordinate("pp", pp_rank, t.pp, t);
  return tp_rank + t.tp * (dp_rank + t.dp * pp_rank);
}

int64_t ExpertRank(const Topology& t, int64_t etp_rank, int64_t ep_rank,
                   int64_t edp_rank, int64_t pp_rank) {
  ValidateParallelSizes(t);
  const int64_t etp = t.ExpertTp();
  const int64_t edp = t.ExpertDp();
  CheckCoordinate("etp", etp_rank, etp, t);
  CheckCoordinate("ep", ep_rank, t.ep, t);
  CheckCoordinate("edp", edp_rank, edp, t);
  CheckCoordinate("pp", pp_rank, t.pp, t);
  return etp_rank + etp * (ep_rank + t.ep * (edp_rank + edp * pp_rank));
}

int64_t TpSizeFor(const Rule& rule, const Topology& topology) {
  return rule.expert ? topology.ExpertTp() : topology.tp;
}

int64_t DpSizeFor(const Rule& rule, const Topology& topology) {
  return rule.expert ? topology.ExpertDp() : topology.dp;
}

// ---------------------------------------------------------------- experts

ExpertPlacement::ExpertPlacement(int64_t num_experts, int64_t ep)
    : num_experts_(num_experts), ep_(ep) {
  if (num_experts < 1)
    throw LayoutError("the number of experts must be >= 1, not ", num_experts);
  if (ep < 1) throw LayoutError("ep must be >= 1, not ", ep);
  if (num_experts % ep != 0) {
    throw LayoutError("ep ", ep, " does not divide the ", num_experts,
                      " experts");
  }
}

ExpertLocation ExpertPlacement::Locate(int64_t global_expert) const {
  if (global_expert < 0 || global_expert >= num_experts_) {
    throw LayoutError("expert ", global_expert, " out of range (the model has ",
                      num_experts_, " experts)");
  }
  return {global_expert / local_experts(), global_expert % local_experts()};
}

int64_t ExpertPlacement::Global(int64_t ep_rank, int64_t local_index) const {
  const LayerRange range = ExpertsOf(ep_rank);
  if (local_index < 0 || local_index >= range.size()) {
    throw LayoutError("local expert ", local_index, " out of range: ep rank ",
                      ep_rank, " holds ", range.size(), " experts (",
                      num_experts_, " experts, ep ", ep_, ")");
  }
  return range.begin + local_index;
}

LayerRange ExpertPlacement::ExpertsOf(int64_t ep_rank) const {
  if (ep_rank < 0 || ep_rank >= ep_) {
    throw LayoutError("ep rank ", ep_rank, " out of range (ep ", ep_, ")");
  }
  return {ep_rank * local_experts(), (ep_rank + 1) * local_experts()};
}

// ---------------------------------------------------------------- layers

LayerPlacement::LayerPlacement(int64_t num_layers, const Topology& topology)
    : num_layers_(num_layers), topology_(topology) {
  const Topology& t = topology;
  if (num_layers < 0)
    throw LayoutError("negative number of layers ", num_layers);
  ValidateParallelSizes(t);
  const bool uneven = t.first_stage_layers || t.last_stage_layers;
  if (uneven && t.pp == 1) {
    throw LayoutError("topology ", t.ToString(),
                      ": first_stage_layers/last_stage_layers need pp > 1");
  }
  if ((t.first_stage_layers && *t.first_stage_layers < 0) ||
      (t.last_stage_layers && *t.last_stage_layers < 0)) {
    throw LayoutError("topology ", t.ToString(),
                      ": negative stage layer count");
  }
  std::vector<int64_t> stage(static_cast<size_t>(t.pp), 0);
  if (!uneven) {
    if (num_layers % t.pp != 0) {
      throw LayoutError("topology ", t.ToString(), ": pp ", t.pp,
                        " does not divide the ", num_layers, " layers");
    }
    std::fill(stage.begin(), stage.end(), num_layers / t.pp);
  } else {
    const int64_t first = t.first_stage_layers.value_or(0);
    const int64_t last = t.last_stage_layers.value_or(0);
    const int64_t middle_stages =
        t.pp - (t.first_stage_layers ? 1 : 0) - (t.last_stage_layers ? 1 : 0);
    const int64_t middle = num_layers - first - last;
    if (middle < 0) {
      throw LayoutError("topology ", t.ToString(),
                        ": the first and last stages hold ", first + last,
                        " layers but the model has ", num_layers);
    }
    if (middle_stages == 0 && middle != 0) {
      throw LayoutError("topology ", t.ToString(),
                        ": first_stage_layers + last_stage_layers = ",
                        first + last, " but the model has ", num_layers,
                        " layers and there are no middle stages");
    }
    if (middle_stages > 0 && middle % middle_stages != 0) {
      throw LayoutError("topology ", t.ToString(), ": the ", middle,
                        " layers left for the ", middle_stages,
                        " middle stages do not divide evenly");
    }
    const int64_t per_middle = middle_stages > 0 ? middle / middle_stages : 0;
    std::fill(stage.begin(), stage.end(), per_middle);
    if (t.first_stage_layers) stage.front() = first;
    if (t.last_stage_layers) stage.back() = last;
  }
  chunk_layers_.resize(stage.size());
  chunk_start_.resize(stage.size());
  int64_t start = 0;
  for (size_t p = 0; p < stage.size(); ++p) {
    if (stage[p] % t.vpp != 0) {
      throw LayoutError("topology ", t.ToString(), ": pipeline stage ", p,
                        " holds ", stage[p], " layers, not divisible by vpp ",
                        t.vpp);
    }
    chunk_layers_[p] = stage[p] / t.vpp;
    chunk_start_[p] = start;
    start += chunk_layers_[p];
  }
  layers_per_chunk_row_ = start;
  UCP_CHECK(layers_per_chunk_row_ * t.vpp == num_layers);
}

int64_t LayerPlacement::StageLayers(int64_t pp_rank) const {
  CheckStage(pp_rank, 0);
  return chunk_layers_[static_cast<size_t>(pp_rank)] * topology_.vpp;
}

void LayerPlacement::CheckStage(int64_t pp_rank, int64_t vp_chunk) const {
  if (pp_rank < 0 || pp_rank >= topology_.pp) {
    throw LayoutError("pipeline rank ", pp_rank, " out of range (pp ",
                      topology_.pp, ")");
  }
  if (vp_chunk < 0 || vp_chunk >= topology_.vpp) {
    throw LayoutError("model chunk ", vp_chunk, " out of range (vpp ",
                      topology_.vpp, ")");
  }
}

LayerRange LayerPlacement::LayersOf(int64_t pp_rank, int64_t vp_chunk) const {
  CheckStage(pp_rank, vp_chunk);
  const size_t p = static_cast<size_t>(pp_rank);
  const int64_t begin = vp_chunk * layers_per_chunk_row_ + chunk_start_[p];
  return {begin, begin + chunk_layers_[p]};
}

LayerLocation LayerPlacement::Locate(int64_t global_layer) const {
  if (global_layer < 0 || global_layer >= num_layers_) {
    throw LayoutError("layer ", global_layer, " out of range (the model has ",
                      num_layers_, " layers)");
  }
  const int64_t v = global_layer / layers_per_chunk_row_;
  const int64_t in_row = global_layer % layers_per_chunk_row_;
  // The stage whose chunk covers in_row: the last with start <= in_row
  // (stages without layers share their start with the next stage).
  size_t p = static_cast<size_t>(
      std::upper_bound(chunk_start_.begin(), chunk_start_.end(), in_row) -
      chunk_start_.begin() - 1);
  UCP_CHECK(chunk_layers_[p] > 0, "layer ", global_layer);
  return {static_cast<int64_t>(p), v, in_row - chunk_start_[p]};
}

int64_t LayerPlacement::Global(int64_t pp_rank, int64_t vp_chunk,
                               int64_t local_index) const {
  const LayerRange range = LayersOf(pp_rank, vp_chunk);
  if (local_index < 0 || local_index >= range.size()) {
    throw LayoutError("local layer ", local_index, " out of range: chunk ",
                      vp_chunk, " of pipeline stage ", pp_rank, " holds ",
                      range.size(), " layers (", topology_.ToString(), ", ",
                      num_layers_, " layers)");
  }
  return range.begin + local_index;
}

// ---------------------------------------------------------------- homes

Home HomeOf(const Layout& layout, const Rule& rule, std::string_view name,
            const LayerPlacement& placement) {
  const Topology& t = placement.topology();
  switch (rule.stage) {
    case Stage::kFirst:
      return {0, 0, std::nullopt};
    case Stage::kLast:
      return {t.pp - 1, t.vpp - 1, std::nullopt};
    case Stage::kLayer:
      break;
  }
  const std::optional<LayerName> split = layout.SplitLayer(name);
  if (!split) {
    throw LayoutError(rule.Describe(), " is for layer params but '", name,
                      "' has no layer index");
  }
  const LayerLocation loc = placement.Locate(split->index);
  return {loc.pp_rank, loc.vp_chunk, loc.local_index};
}

std::string LocalName(const Layout& layout, std::string_view canonical,
                      const LayerPlacement& placement) {
  const std::optional<LayerName> split = layout.SplitLayer(canonical);
  if (!split) return std::string(canonical);
  return layout.WithLayer(canonical,
                          placement.Locate(split->index).local_index);
}

std::string CanonicalName(const Layout& layout, std::string_view local_name,
                          const LayerPlacement& placement, int64_t pp_rank,
                          int64_t vp_chunk) {
  const std::optional<LayerName> split = layout.SplitLayer(local_name);
  if (!split) return std::string(local_name);
  return layout.WithLayer(local_name,
                          placement.Global(pp_rank, vp_chunk, split->index));
}

// ---------------------------------------------------------------- shards

namespace {

// A box covering all of `shape` except [offset, offset+size) along `dim`.
Box Slab(std::span<const int64_t> shape, size_t dim, int64_t offset,
         int64_t size) {
  Box box = Box::Whole(shape);
  box.offset[dim] = offset;
  box.size[dim] = size;
  return box;
}

}  // namespace

LocalShard ShardFor(const Rule& rule, std::span<const int64_t> full_shape,
                    int64_t tp, int64_t tp_rank, int64_t padded_dim_size,
                    int64_t pad_rows_available) {
  auto fail = [&](auto&&... args) {
    throw LayoutError(rule.Describe(), ", shape ", ShapeString(full_shape),
                      ", tp ", tp, ": ", args...);
  };
  if (rule.entry == EntryKind::kOpaque)
    fail("opaque entries have no tensor placement");
  if (tp < 1) fail("tp must be >= 1");
  if (tp_rank < 0 || tp_rank >= tp) fail("tp rank ", tp_rank, " out of range");
  for (int64_t s : full_shape) {
    if (s < 0) fail("negative size");
  }
  LocalShard shard;
  shard.local_shape.assign(full_shape.begin(), full_shape.end());
  auto add = [&](Box local, Box global, Region region) {
    if (!local.empty())
      shard.pieces.push_back({std::move(local), std::move(global), region});
  };
  const TpPlacement& p = rule.tp;
  if (!p.split) {
    add(Box::Whole(full_shape), Box::Whole(full_shape), Region::kMain);
    return shard;
  }
  const size_t dim = static_cast<size_t>(p.dim);
  if (dim >= full_shape.size()) {
    fail("split dim ", p.dim, " is not a dim of a rank-", full_shape.size(),
         " tensor");
  }
  const int64_t size = full_shape[dim];
  if (p.vocab) {
    if (padded_dim_size < size) {
      fail("padded size ", padded_dim_size, " of dim ", dim,
           " is below the true size ", size);
    }
    if (padded_dim_size % tp != 0) {
      fail("padded size ", padded_dim_size, " of dim ", dim,
           " is not divisible by tp");
    }
    if (pad_rows_available < 0) fail("negative number of padding rows");
    const int64_t per = padded_dim_size / tp;
    const int64_t begin = tp_rank * per;
    const int64_t end = begin + per;
    shard.local_shape[dim] = per;
    if (begin < size) {
      const int64_t n = std::min(end, size) - begin;
      add(Slab(shard.local_shape, dim, 0, n), Slab(full_shape, dim, begin, n),
          Region::kMain);
    }
    // Padding rows [size, padded) are numbered from 0 in the pad region.
    const int64_t pad_begin = std::max(begin, size) - size;
    const int64_t pad_end = std::min(end - size, pad_rows_available);
    if (pad_end > pad_begin) {
      Shape pad_shape(full_shape.begin(), full_shape.end());
      pad_shape[dim] = pad_rows_available;
      add(Slab(shard.local_shape, dim, pad_begin + size - begin,
               pad_end - pad_begin),
          Slab(pad_shape, dim, pad_begin, pad_end - pad_begin), Region::kPad);
    }
    return shard;
  }
  const int64_t k = p.segments;
  if (size % (tp * k) != 0) {
    fail("dim ", dim, " of size ", size,
         " is not divisible by tp x segments = ", tp * k);
  }
  const int64_t segment = size / k;
  const int64_t per = segment / tp;
  shard.local_shape[dim] = k * per;
  for (int64_t s = 0; s < k; ++s) {
    add(Slab(shard.local_shape, dim, s * per, per),
        Slab(full_shape, dim, s * segment + tp_rank * per, per), Region::kMain);
  }
  return shard;
}

std::optional<int64_t> PaddedDimSize(const Rule& rule, const Variables& vars,
                                     int64_t tp) {
  if (!rule.tp.split || !rule.tp.vocab) return std::nullopt;
  try {
    return PaddedVocabSize(rule.tp.vocab->true_size.Evaluate(vars),
                           rule.tp.vocab->divisible_by.Evaluate(vars), tp);
  } catch (Error& e) {
    e.AddContext(rule.Describe(), " vocab padding");
    throw;
  }
}

Shape FullShapeFromLocal(const Rule& rule, std::span<const int64_t> local_shape,
                         int64_t tp, const Variables& vars) {
  Shape full(local_shape.begin(), local_shape.end());
  const TpPlacement& p = rule.tp;
  if (!p.split) return full;
  auto fail = [&](auto&&... args) {
    throw LayoutError(rule.Describe(), ", local shape ",
                      ShapeString(local_shape), ", tp ", tp, ": ", args...);
  };
  if (tp < 1) fail("tp must be >= 1");
  const size_t dim = static_cast<size_t>(p.dim);
  if (dim >= local_shape.size()) {
    fail("split dim ", p.dim, " is not a dim of a rank-", local_shape.size(),
         " tensor");
  }
  if (local_shape[dim] % p.segments != 0) {
    fail("dim ", dim, " is not divisible by the ", p.segments, " segments");
  }
  int64_t padded = 0;
  if (__builtin_mul_overflow(local_shape[dim], tp, &padded))
    fail("size overflows");
  if (p.vocab) {
    int64_t true_size = 0;
    try {
      true_size = p.vocab->true_size.Evaluate(vars);
    } catch (Error& e) {
      e.AddContext(rule.Describe(), " vocab true_size");
      throw;
    }
    if (true_size > padded || true_size < 0) {
      fail("the ", tp, " ranks hold ", padded, " rows along dim ", dim,
           ", fewer than the true vocab size ", true_size);
    }
    full[dim] = true_size;
  } else {
    full[dim] = padded;
  }
  return full;
}

// ---------------------------------------------------------------- validation

void ValidateTopology(const Layout& layout, std::span<const ParamShape> params,
                      const Variables& vars, const Topology& topology) {
  const std::string header =
      StrCat("target topology ", topology.ToString(), " does not fit layout '",
             layout.name(), "': ");
  const Variables resolved = layout.Resolve(vars);
  std::optional<LayerPlacement> placement;
  try {
    placement.emplace(layout.NumLayers(resolved), topology);
  } catch (const LayoutError& e) {
    throw LayoutError(header, e.what());
  }
  // The expert count and its placement over ep, when some param is an
  // expert's (a dense model need not set the count).
  std::optional<int64_t> num_experts;
  for (const ParamShape& param : params) {
    const Rule* rule = nullptr;
    try {
      rule = layout.Find(param.name, resolved);
    } catch (const LayoutError&) {
      continue;  // reported below
    }
    if (rule == nullptr || !rule->expert) continue;
    try {
      num_experts = layout.NumExperts(resolved);
      ExpertPlacement(*num_experts, topology.ep);
    } catch (const LayoutError& e) {
      throw LayoutError(header, "param '", param.name, "' (", rule->Describe(),
                        "): ", e.what());
    }
    break;
  }
  std::map<std::string_view, const ParamShape*> by_name;
  for (const ParamShape& p : params) by_name.emplace(p.name, &p);

  std::vector<std::string> problems;
  std::vector<std::string> model_problems;  // heads / query groups
  for (const ParamShape& param : params) {
    const Rule* rule = nullptr;
    try {
      rule = &layout.Match(param.name, resolved);
    } catch (const LayoutError& e) {
      problems.push_back(StrCat("param '", param.name, "': ", e.what()));
      continue;
    }
    auto problem = [&](auto&&... args) {
      problems.push_back(StrCat("param '", param.name, "' (", rule->Describe(),
                                "): ", args...));
    };
    auto model_problem = [&](auto&&... args) {
      model_problems.push_back(StrCat("param '", param.name, "' (",
                                      rule->Describe(), "): ", args...));
    };
    auto eval = [&](const Expression& e) -> std::optional<int64_t> {
      try {
        return e.Evaluate(resolved);
      } catch (const LayoutError& err) {
        problem(err.what());
        return std::nullopt;
      }
    };
    const std::optional<LayerName> layer = layout.SplitLayer(param.name);
    if (rule->stage == Stage::kLayer) {
      if (!layer) {
        problem("a layer rule, but the name has no layer index");
        continue;
      }
      if (layer->index >= placement->num_layers()) {
        problem("layer ", layer->index, " but the model has ",
                placement->num_layers(), " layers");
        continue;
      }
    } else if (layer) {
      problem("the ", StageName(rule->stage),
              " stage's rule, but the name has a layer index");
      continue;
    }
    const std::optional<ExpertName> expert = layout.SplitExpert(param.name);
    if (rule->expert && !expert) {
      problem("an expert rule, but the name has no expert index");
      continue;
    }
    if (!rule->expert && expert) {
      problem("not an expert rule, but the name has expert index ",
              expert->index);
      continue;
    }
    if (expert && num_experts && expert->index >= *num_experts) {
      problem("expert ", expert->index, " but the model has ", *num_experts,
              " experts (", layout.experts()->count.text(), ")");
      continue;
    }
    if (expert) {
      bool moe = false;
      try {
        moe = layout.IsMoeLayer(expert->layer, resolved);
      } catch (const LayoutError& e) {
        problem(e.what());
        continue;
      }
      if (!moe) {
        problem("an expert of layer ", expert->layer,
                ", which experts.moe_layers (",
                layout.experts()->moe_layers->text(), ") makes a dense layer");
        continue;
      }
    }
    if (rule->entry == EntryKind::kOpaque) continue;
    const int64_t tp = TpSizeFor(*rule, topology);
    const std::string_view tp_name = rule->expert ? "etp " : "tp ";
    const TpPlacement& p = rule->tp;
    if (p.split) {
      const size_t dim = static_cast<size_t>(p.dim);
      if (dim >= param.shape.size()) {
        problem("split dim ", p.dim, " but the shape ",
                ShapeString(param.shape), " has ", param.shape.size(), " dims");
        continue;
      }
      if (p.groups) {
        // Heads and query groups first: they are the cause users act on.
        const std::optional<int64_t> groups = eval(*p.groups);
        const std::optional<int64_t> heads = eval(*p.heads);
        if (!groups || !heads) continue;
        if (*groups < 1 || *groups % tp != 0) {
          model_problem(tp_name, tp, " does not divide the query groups (",
                        p.groups->text(), " = ", *groups, ")");
          continue;
        }
        if (*heads < 1 || *heads % tp != 0) {
          model_problem(tp_name, tp, " does not divide the attention heads (",
                        p.heads->text(), " = ", *heads, ")");
          continue;
        }
      }
      const int64_t size = param.shape[dim];
      if (p.vocab) {
        const std::optional<int64_t> true_size = eval(p.vocab->true_size);
        const std::optional<int64_t> div = eval(p.vocab->divisible_by);
        if (!true_size || !div) continue;
        if (size != *true_size) {
          problem("dim ", dim, " holds ", size, " but the true vocab size (",
                  p.vocab->true_size.text(), ") is ", *true_size);
          continue;
        }
        if (*div < 1) {
          problem(p.vocab->divisible_by.text(), " = ", *div, " must be >= 1");
          continue;
        }
      } else if (size % (tp * p.segments) != 0) {
        if (p.segments == 1) {
          problem(tp_name, tp, " does not divide dim ", dim, " of size ", size);
        } else {
          problem(tp_name, tp, " x ", p.segments,
                  " segments does not divide dim ", dim, " of size ", size);
        }
        continue;
      }
    }
    if (rule->tied_to) {
      auto it = by_name.find(*rule->tied_to);
      if (it == by_name.end()) {
        problem("a tied copy of '", *rule->tied_to,
                "', which is not among the params");
      } else if (it->second->shape != param.shape) {
        problem("shape ", ShapeString(param.shape),
                " differs from its original '", *rule->tied_to, "' ",
                ShapeString(it->second->shape));
      }
    }
  }
  if (problems.empty() && model_problems.empty()) return;
  const size_t total = problems.size() + model_problems.size();
  std::string msg =
      header + (model_problems.empty() ? problems : model_problems).front();
  if (total > 1) {
    msg +=
        StrCat(" (and ", total - 1, " more problem", total > 2 ? "s" : "", ")");
  }
  throw LayoutError(msg);
}

}  // namespace ucp::layouts
