// Layouts for layout-placed targets (target_layout.h).

#include "engine/formats/target_layout.h"

#include <algorithm>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/common/attrs.h"
#include "engine/universal/mapped_input.h"
#include "layouts/layout.h"

namespace ucp::formats {

std::unique_ptr<universal::UniversalInput> WithTargetLayout(
    const universal::UniversalInput& input, std::string_view spec,
    const layouts::Variables& given) {
  const universal::Model& model = input.model();
  if (!model.layout_yaml.empty()) return nullptr;
  std::vector<std::string> names;
  for (const atoms::StoredParam& p : input.params())
    names.push_back(p.info.fqn);
  if (spec.empty() && layouts::Layout::DetectBuiltins(names).empty()) {
    throw LayoutError(
        input.path().string(),
        " holds no layout descriptor and its param names (first: ",
        names.empty() ? std::string("none") : names[0],
        ") match no built-in layout: a Megatron target needs one (give "
        "--layout NAME|FILE; ucp layout list)");
  }
  const layouts::Layout layout = layouts::Layout::FromSpec(spec, names);
  // The model variables: the content's, what the names tell, then --model.
  layouts::Variables vars = ModelVariables(model.variables);
  int64_t layers = 0;
  for (const std::string& n : names)
    if (auto l = layout.SplitLayer(n)) layers = std::max(layers, l->index + 1);
  if (!vars.Has("num_layers")) vars.Set("num_layers", layers);
  if (!vars.Has("make_vocab_size_divisible_by"))
    vars.Set("make_vocab_size_divisible_by", 128);
  vars = vars.Merged(given);
  if (layout.experts() && !vars.Has("num_moe_experts")) {
    // The routed experts the names hold (a source that does not record
    // them: DCP, whose reader checks every layer holds all its router's).
    int64_t experts = 0;
    for (const std::string& n : names)
      if (auto e = layout.SplitExpert(n))
        experts = std::max(experts, e->index + 1);
    if (experts > 0) vars.Set("num_moe_experts", experts);
  }
  if (!vars.Has("vocab_size")) {  // the rows of the vocabulary's param
    const layouts::Variables resolved = layout.Resolve(vars);
    for (const atoms::StoredParam& p : input.params()) {
      const layouts::Rule* r = layout.Find(p.info.fqn, resolved);
      if (r != nullptr && r->tp.vocab && !p.info.shape.empty()) {
        vars.Set("vocab_size", p.info.shape[0]);
        break;
      }
    }
  }
  universal::Model out = model;
  out.layout_yaml = layout.yaml();
  for (const auto& [k, v] : vars.values()) out.variables.Set(k, v);
  out.source.layout = layout.name();
  std::vector<universal::MappedParam> params;
  for (const atoms::StoredParam& p : input.params())
    params.push_back(universal::WholeParam(p, p.info.fqn));
  return universal::MappedInput(input, std::move(params), std::move(out));
}

}  // namespace ucp::formats
