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
  if (t.tp < 1 || t.pp < 1 || t.vpp < 1 || t.dp < 1 || t.ep < 1 ||
      t.ExpertTp() < 1) {
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

// What Megatron refuses of the expert sizes, as one usage line naming the
// numbers: expert parallelism of a model without routed experts (Megatron-LM
// arguments: "num_experts must be non None to use expert model
// parallelism"), an expert count EP does not divide (MoELayer: num_moe_experts
// % ep_size == 0), expert biases with ETP > 1 (TransformerConfig: "Bias in
// Moe is only supported when ETP==1").
void CheckExpertSizes(const layouts::Layout& layout,
                      const layouts::Variables& vars,
                      std::span<const layouts::ParamShape> shapes,
                      const layouts::Topology& t) {
  if (t.ep < 1 || t.ExpertTp() < 1) {
    throw UsageError("--ep ", t.ep, ", --etp ", t.ExpertTp(),
                     ": sizes must be >= 1");
  }
  if (!layout.experts()) {
    if (t.ep > 1) {
      throw UsageError("--ep ", t.ep, ": the model (layout ", layout.name(),
                       ") has no routed experts; expert parallelism needs a "
                       "mixture-of-experts model");
    }
    return;
  }
  const int64_t experts = layout.NumExperts(vars);
  if (experts % t.ep != 0) {
    throw UsageError("--ep ", t.ep, " does not divide the ", experts,
                     " experts of each MoE layer (layout ", layout.name(),
                     "; Megatron needs num_experts % ep == 0)");
  }
  if (t.ExpertTp() > 1) {
    for (const layouts::ParamShape& p : shapes) {
      if (layout.SplitExpert(p.name) && p.name.ends_with(".bias")) {
        throw UsageError("--etp ", t.ExpertTp(), ": the experts have biases (",
                         p.name,
                         "); Megatron-core supports biases in MoE experts only "
                         "with ETP 1");
      }
    }
  }
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
  CheckExpertSizes(layout, vars, shapes, request.topology);
  // Routed experts are read (and exported), not yet placed into rank files
  // by EP / ETP: refused rather than written as if they were dense.
  if (layout.experts() && !request.experts) {
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
