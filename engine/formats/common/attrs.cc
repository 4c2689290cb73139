#include "engine/formats/common/attrs.h"

#include <algorithm>

#include "engine/core/error.h"

namespace ucp::formats {

json::Value ParseJsonAttr(const std::string& text, const char* what,
                          const std::filesystem::path& path) {
  if (text.empty()) return json::Value::Object();
  try {
    return json::Value::Parse(text);
  } catch (Error& e) {
    e.AddContext("universal file ", path.string(), " > attribute ", what);
    throw;
  }
}

layouts::Variables ModelVariables(const std::string& text,
                                  const std::filesystem::path& path) {
  const json::Value model = ParseJsonAttr(text, "model", path);
  layouts::Variables vars;
  if (model.is_object()) {
    for (const auto& [k, v] : model.members()) {
      if (v.is_int()) vars.Set(k, v.AsInt());
      if (v.is_bool()) vars.Set(k, v.AsBool() ? 1 : 0);
    }
  }
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
  json::Value tc = json::Value::Array();
  for (const std::string& c : spec.tied_copies) tc.Append(c);
  info.tied_copies = tc.Dump();
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

void GroupHyperparamsJson(const pickle::Value* group, json::Value& out) {
  if (group == nullptr || !group->IsDictLike()) return;
  for (const auto& [k, v] : group->entries)
    if (k != nullptr && k->kind == pickle::Kind::kStr)
      GroupHyperparamJson(k->s, v, out);
}

pickle::Value* GroupHyperparamsDict(const json::Value& group,
                                    pickle::Arena& arena) {
  if (!group.is_object()) return nullptr;
  pickle::Value* d = arena.Dict();
  for (const auto& [k, v] : group.members()) {
    pickle::Value* x = nullptr;
    if (k == "params") continue;
    if (v.is_bool()) {
      x = arena.Bool(v.AsBool());
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
