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

PlacedTarget PlaceTarget(const universal::UniversalInput& input,
                         const PlaceRequest& request) {
  const universal::Model& model = input.model();
  if (model.layout_yaml.empty()) {
    throw FormatError("universal input ", input.path().string(),
                      " has no layout descriptor: cannot place params (a "
                      "Megatron target needs one: convert from a Megatron "
                      "checkpoint or give --layout when reading the source)");
  }
  layouts::Layout layout =
      layouts::Layout::ParseStored(model.layout_yaml, input.path());
  layouts::Variables given = ModelVariables(model.variables);
  if (request.true_vocab_size)
    given.Set("vocab_size", *request.true_vocab_size);
  layouts::Variables vars = layout.Resolve(given);
  const layouts::Topology topology = CheckedTopology(request.topology);
  // A universal file that did not know the true vocabulary size holds the
  // source's padded rows as real rows; a given size below them marks the
  // rest as padding again.
  std::optional<int64_t> vocab_rows;
  if (request.true_vocab_size && !request.vocab_size_known)
    vocab_rows = *request.true_vocab_size;
  std::vector<layouts::ParamShape> shapes;
  for (const atoms::StoredParam& p : input.params()) {
    Shape shape = p.info.shape;
    const layouts::Rule* r = layout.Find(p.info.fqn, vars);
    const size_t dim = r != nullptr ? static_cast<size_t>(r->tp.dim) : 0;
    if (vocab_rows && r != nullptr && r->tp.split && r->tp.vocab &&
        dim < shape.size())
      shape[dim] = std::min(shape[dim], *vocab_rows);
    shapes.push_back({p.info.fqn, std::move(shape)});
  }
  layouts::ValidateTopology(layout, shapes, vars, topology);
  layouts::LayerPlacement placement(layout.NumLayers(vars), topology);
  return PlacedTarget{std::move(layout), std::move(vars), vocab_rows, topology,
                      std::move(placement)};
}

}  // namespace ucp::formats
