// The layout-placed target (placed_target.h).

#include "engine/formats/placed_target.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"

namespace ucp::formats {

namespace {

layouts::Topology CheckedTopology(const layouts::Topology& t) {
  if (t.tp < 1 || t.pp < 1 || t.vpp < 1 || t.dp < 1) {
    throw LayoutError("target topology ", t.ToString(), ": sizes must be >= 1");
  }
  if (t.vpp > 1 && t.pp == 1) {
    throw LayoutError("target topology ", t.ToString(),
                      ": a virtual pipeline (vpp ", t.vpp,
                      ") needs pp > 1 (Megatron builds model chunks only "
                      "with pipeline parallelism)");
  }
  return t;
}

}  // namespace

int64_t PlacedTarget::PaddedVocabSize() const {
  for (const layouts::Rule& r : layout.rules())
    if (auto pd = layouts::PaddedDimSize(r, vars, topology.tp)) return *pd;
  return vars.Find("vocab_size").value_or(0);
}

PlacedTarget PlaceParams(layouts::Layout layout, layouts::Variables given,
                         std::span<const layouts::ParamShape> shapes,
                         const PlaceRequest& request) {
  if (request.true_vocab_size)
    given.Set("vocab_size", *request.true_vocab_size);
  if (request.count_layers && !given.Has("num_layers")) {
    int64_t layers = 0;
    for (const layouts::ParamShape& p : shapes)
      if (auto l = layout.SplitLayer(p.name))
        layers = std::max(layers, l->index + 1);
    given.Set("num_layers", layers);
  }
  layouts::Variables vars = layout.Resolve(given);
  // Routed experts are read (and exported), not yet placed into rank files
  // by EP / ETP: refused rather than written as if they were dense.
  if (layout.experts()) {
    throw UsageError(
        "a mixture-of-experts model (layout ", layout.name(),
        "): writing its rank files for an EP / ETP layout is not supported "
        "yet; convert it to dcp or export it (ucp export --hf)");
  }
  const layouts::Topology topology = CheckedTopology(request.topology);
  // A universal file that did not know the true vocabulary size holds the
  // source's padded rows as real rows; a given size below them marks the
  // rest as padding again.
  std::optional<int64_t> vocab_rows;
  if (request.true_vocab_size && !request.vocab_size_known)
    vocab_rows = *request.true_vocab_size;
  std::vector<layouts::ParamShape> trimmed;
  for (const layouts::ParamShape& p : shapes) {
    Shape shape = p.shape;
    const layouts::Rule* r = layout.Find(p.name, vars);
    const size_t dim = r != nullptr ? static_cast<size_t>(r->tp.dim) : 0;
    if (vocab_rows && r != nullptr && r->tp.split && r->tp.vocab &&
        dim < shape.size())
      shape[dim] = std::min(shape[dim], *vocab_rows);
    trimmed.push_back({p.name, std::move(shape)});
  }
  layouts::ValidateTopology(layout, trimmed, vars, topology);
  layouts::LayerPlacement placement(layout.NumLayers(vars), topology);
  return PlacedTarget{std::move(layout), std::move(vars), vocab_rows, topology,
                      std::move(placement)};
}

PlacedTarget PlaceTarget(const universal::UniversalInput& input,
                         const PlaceRequest& request) {
  const universal::Model& model = input.model();
  if (model.layout_yaml.empty() && !request.layout) {
    throw FormatError("universal input ", input.path().string(),
                      " has no layout descriptor: cannot place params (a "
                      "Megatron target needs one: convert from a Megatron "
                      "checkpoint or give --layout when reading the source)");
  }
  layouts::Layout layout =
      model.layout_yaml.empty()
          ? *request.layout
          : layouts::Layout::ParseStored(model.layout_yaml, input.path());
  std::vector<layouts::ParamShape> shapes;
  for (const atoms::StoredParam& p : input.params())
    shapes.push_back({p.info.fqn, p.info.shape});
  return PlaceParams(std::move(layout), ModelVariables(model.variables), shapes,
                     request);
}

}  // namespace ucp::formats
