// transformers 5's fused experts (hf.h, FusedExpertParts): the per-expert
// tensors of a MoE layer saved as two stacked tensors, each a run of rows of
// one of them.

#include "engine/core/error.h"
#include "engine/core/strided.h"
#include "engine/formats/hf/hf.h"

namespace ucp::hf {

std::map<std::string, StoredPart> FusedExpertParts(
    const ModelConfig& c,
    const std::function<const Shape*(const std::string&)>& shape_of,
    const std::function<std::string(const std::string&)>& where) {
  std::map<std::string, StoredPart> parts;
  if (c.experts == 0) return parts;
  const int64_t e = c.experts, h = c.hidden, f = c.moe_ffn;
  const bool mixtral = c.model_type == "mixtral";
  for (int64_t i = 0; i < c.layers; ++i) {
    if (!c.moe_layer[static_cast<size_t>(i)]) continue;
    const std::string l = StrCat("model.layers.", i, ".");
    const std::string gate_up = l + "mlp.experts.gate_up_proj";
    const std::string down = l + "mlp.experts.down_proj";
    const Shape* gu = shape_of(gate_up);
    const Shape* dn = shape_of(down);
    if (gu == nullptr && dn == nullptr) continue;  // per-expert names
    const auto check = [&](const std::string& name, const Shape* s,
                           const Shape& want) {
      if (s == nullptr) {
        throw FormatError(where(gate_up == name ? down : gate_up), ": no ",
                          name,
                          " beside it (transformers' fused "
                          "experts are gate_up_proj [E, 2I, H] and "
                          "down_proj [E, H, I])");
      }
      if (*s != want) {
        throw FormatError(where(name), ": shape ", ShapeString(*s),
                          ", but config.json's ", e, " experts, hidden_size ",
                          h, " and an expert's intermediate size ", f,
                          " make the fused form ", ShapeString(want));
      }
    };
    check(gate_up, gu, {e, 2 * f, h});
    check(down, dn, {e, h, f});
    const std::string m = mixtral ? l + "block_sparse_moe." : l + "mlp.";
    // Mixtral's router moves with its experts (MixtralSparseMoeBlock under
    // `mlp`); Qwen's keeps its name.
    if (mixtral) parts[m + "gate.weight"] = {l + "mlp.gate.weight", 0};
    for (int64_t j = 0; j < e; ++j) {
      const std::string x = StrCat(m, "experts.", j, ".");
      // gate_up_proj[j]: the expert's gate rows, then its up rows.
      parts[x + (mixtral ? "w1.weight" : "gate_proj.weight")] = {gate_up,
                                                                 j * 2 * f * h};
      parts[x + (mixtral ? "w3.weight" : "up_proj.weight")] = {
          gate_up, j * 2 * f * h + f * h};
      parts[x + (mixtral ? "w2.weight" : "down_proj.weight")] = {down,
                                                                 j * h * f};
    }
  }
  return parts;
}

}  // namespace ucp::hf
