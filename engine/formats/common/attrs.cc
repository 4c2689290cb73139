#include "engine/formats/common/attrs.h"

#include <algorithm>

#include "engine/core/error.h"

namespace ucp::formats {

layouts::Variables ModelVariables(const universal::ModelInfo& model) {
  layouts::Variables vars;
  for (const universal::ModelVariable& v : model.variables)
    vars.Set(v.name, v.value);
  return vars;
}

atoms::ParamInfo ParamRow(const ParamRowSpec& spec) {
  atoms::ParamInfo info;
  info.fqn = spec.fqn;
  info.shape = spec.shape;
  info.dtype = spec.dtype;
  info.rule = spec.rule;
  info.kind =
      spec.buffer ? atoms::ParamKind::kBuffer : atoms::ParamKind::kParam;
  info.group = spec.group;
  info.order = spec.order;
  info.frozen = spec.frozen;
  info.tied_copies = spec.tied_copies;
  return info;
}

void GroupHyperparamJson(const std::string& key, const pickle::Value* v,
                         json::Value& out) {
  if (key == "params" || v == nullptr) return;
  if (v->kind == pickle::Kind::kBool) {
    out[key] = v->b;
  } else if (std::optional<double> x = v->AsFloat()) {
    out[key] = *x;
  } else if (v->kind == pickle::Kind::kTuple ||
             v->kind == pickle::Kind::kList) {
    json::Value a = json::Value::Array();
    for (const pickle::Value* item : v->items) {
      std::optional<double> y =
          item != nullptr && item->kind != pickle::Kind::kBool ? item->AsFloat()
                                                               : std::nullopt;
      if (!y) return;
      a.Append(*y);
    }
    out[key] = std::move(a);
  }
}

void AddGroupHyperparam(const std::string& key, const pickle::Value* v,
                        universal::ParamGroup& group) {
  json::Value one = json::Value::Object();
  GroupHyperparamJson(key, v, one);
  if (const json::Value* x = one.Find(key)) group.Set(key, *x);
}

void GroupHyperparamsJson(const pickle::Value* group, json::Value& out) {
  if (group == nullptr || !group->IsDictLike()) return;
  for (const auto& [k, v] : group->entries)
    if (k != nullptr && k->kind == pickle::Kind::kStr)
      GroupHyperparamJson(k->s, v, out);
}

pickle::Value* GroupHyperparamsDict(const universal::ParamGroup& group,
                                    pickle::Arena& arena) {
  pickle::Value* d = arena.Dict();
  if (group.lr)
    d->entries.emplace_back(arena.Str("lr"), arena.Float(*group.lr));
  if (group.betas) {
    d->entries.emplace_back(arena.Str("betas"),
                            arena.Tuple({arena.Float((*group.betas)[0]),
                                         arena.Float((*group.betas)[1])}));
  }
  if (group.eps)
    d->entries.emplace_back(arena.Str("eps"), arena.Float(*group.eps));
  if (group.weight_decay) {
    d->entries.emplace_back(arena.Str("weight_decay"),
                            arena.Float(*group.weight_decay));
  }
  if (!group.other.is_object()) return d->entries.empty() ? nullptr : d;
  for (const auto& [k, v] : group.other.members()) {
    pickle::Value* x = nullptr;
    if (k == "params") continue;
    if (v.is_bool()) {
      x = arena.Bool(v.AsBool());
    } else if (v.is_null()) {  // torch.optim.Adam's foreach / fused None
      x = arena.None();
    } else if (v.is_number()) {
      x = arena.Float(v.AsDouble());
    } else if (v.is_array() && !v.items().empty() &&
               std::all_of(
                   v.items().begin(), v.items().end(),
                   [](const json::Value& y) { return y.is_number(); })) {
      std::vector<pickle::Value*> items;
      for (const json::Value& y : v.items())
        items.push_back(arena.Float(y.AsDouble()));
      x = arena.Tuple(std::move(items));
    }
    if (x != nullptr) d->entries.emplace_back(arena.Str(k), x);
  }
  return d->entries.empty() ? nullptr : d;
}

}  // namespace ucp::formats
