// The "deepspeed" root attribute (deepspeed_format.h): its one serializer.

#include "engine/universal/extras.h"

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed_format.h"
#include "engine/universal/model.h"

namespace ucp::deepspeed {

namespace {

// {name: int} in the record's order (duplicates: the last one).
std::map<std::string, int64_t> ExtrasIntMap(const json::Value& v) {
  std::map<std::string, int64_t> out;
  for (const auto& [k, x] : v.members()) {
    try {
      out[k] = x.AsInt();
    } catch (Error& e) {
      e.AddContext("member ", k);
      throw;
    }
  }
  return out;
}

json::Value ExtrasIntObject(const std::map<std::string, int64_t>& m) {
  std::vector<std::pair<std::string, json::Value>> members;
  for (const auto& [k, v] : m) members.emplace_back(k, v);
  return json::Value::FromMembers(std::move(members));
}

json::Value ExtrasNames(const std::vector<std::string>& names) {
  json::Value a = json::Value::Array();
  for (const std::string& n : names) a.Append(n);
  return a;
}

DeepSpeedModelParallel ReadModelParallel(universal::RecordReader& r) {
  DeepSpeedModelParallel mp;
  r.Get("tp", mp.tp);
  r.Get("pp", mp.pp);
  r.Get("pipeline", mp.pipeline);
  r.Get("layout", mp.layout);
  r.Get("layout_yaml", mp.layout_yaml);
  r.Member("tied_layers", false,
           [&](const json::Value& v) { mp.tied_layers = ExtrasIntMap(v); });
  r.Member("variables", false,
           [&](const json::Value& v) { mp.variables = ExtrasIntMap(v); });
  r.Get("vocab_size", mp.vocab_size);
  r.Get("vocab_size_from", mp.vocab_size_from);
  mp.other = r.Rest();
  return mp;
}

json::Value ModelParallelJson(const DeepSpeedModelParallel& mp) {
  json::Value o = json::Value::Object();
  o["tp"] = mp.tp;
  o["pp"] = mp.pp;
  o["pipeline"] = mp.pipeline;
  if (mp.layout) o["layout"] = *mp.layout;
  if (mp.layout_yaml) o["layout_yaml"] = *mp.layout_yaml;
  if (mp.tied_layers) o["tied_layers"] = ExtrasIntObject(*mp.tied_layers);
  if (mp.variables) o["variables"] = ExtrasIntObject(*mp.variables);
  if (mp.vocab_size) o["vocab_size"] = *mp.vocab_size;
  if (mp.vocab_size_from) o["vocab_size_from"] = *mp.vocab_size_from;
  universal::PutOpaque(o, mp.other);
  return o;
}

DeepSpeedMoe ReadMoe(universal::RecordReader& r) {
  DeepSpeedMoe m;
  r.Member("num_experts", true, [&](const json::Value& v) {
    for (const json::Value& n : v.items()) m.num_experts.push_back(n.AsInt());
  });
  r.Get("layers", m.layers);
  r.Get("ep", m.ep);
  r.Member("expert_groups", true, [&](const json::Value& v) {
    for (const json::Value& n : v.items()) m.expert_groups.push_back(n.AsInt());
  });
  r.Get("legacy_names", m.legacy_names, /*required=*/false);
  if (m.layers.size() != m.num_experts.size()) {
    throw FormatError("moe: ", m.layers.size(), " layers but ",
                      m.num_experts.size(), " num_experts");
  }
  m.other = r.Rest();
  return m;
}

json::Value MoeJson(const DeepSpeedMoe& m) {
  json::Value o = json::Value::Object();
  json::Value counts = json::Value::Array();
  for (int64_t n : m.num_experts) counts.Append(n);
  o["num_experts"] = std::move(counts);
  o["layers"] = ExtrasNames(m.layers);
  o["ep"] = m.ep;
  json::Value groups = json::Value::Array();
  for (int64_t g : m.expert_groups) groups.Append(g);
  o["expert_groups"] = std::move(groups);
  if (m.legacy_names) o["legacy_names"] = true;
  universal::PutOpaque(o, m.other);
  return o;
}

}  // namespace

std::optional<DeepSpeedExtras> ReadDeepSpeedExtras(
    const universal::Model& model, const std::filesystem::path& file) {
  std::optional<universal::RecordReader> r =
      universal::RecordReader::ForExtras(model, kMetaAttr, file);
  if (!r) return std::nullopt;
  DeepSpeedExtras x;
  r->Get("tag", x.tag);
  r->Get("stage", x.stage);
  r->Get("wrapper", x.wrapper);
  r->Get("bf16_prefix", x.bf16_prefix);
  r->Member("groups", false, [&](const json::Value& v) {
    x.groups.emplace();
    for (const json::Value& g : v.items()) {
      std::vector<std::string>& names = x.groups->emplace_back();
      for (const json::Value& n : g.items()) names.push_back(n.AsString());
    }
  });
  r->Get("module_keys", x.module_keys);
  r->Get("model_keys", x.model_keys);
  r->Get("step_kind", x.step_kind);
  r->Get("step_value", x.step_value);
  r->Get("zero3_sub_groups", x.zero3_sub_groups);
  r->Get("lp_dtype", x.lp_dtype);
  r->Object("model_parallel", false, [&](universal::RecordReader& mp) {
    x.model_parallel = ReadModelParallel(mp);
  });
  r->Object("moe", false,
            [&](universal::RecordReader& m) { x.moe = ReadMoe(m); });
  x.other = r->Rest();
  return x;
}

void WriteDeepSpeedExtras(const DeepSpeedExtras& x, universal::Model& model) {
  json::Value o = json::Value::Object();
  o["tag"] = x.tag;
  o["stage"] = x.stage;
  o["wrapper"] = x.wrapper;
  if (x.bf16_prefix) o["bf16_prefix"] = *x.bf16_prefix;
  if (x.groups) {
    json::Value groups = json::Value::Array();
    for (const std::vector<std::string>& g : *x.groups)
      groups.Append(ExtrasNames(g));
    o["groups"] = std::move(groups);
  }
  if (x.module_keys) o["module_keys"] = ExtrasNames(*x.module_keys);
  if (x.model_keys) o["model_keys"] = ExtrasNames(*x.model_keys);
  if (x.step_kind) o["step_kind"] = *x.step_kind;
  if (x.step_value) o["step_value"] = *x.step_value;
  if (x.zero3_sub_groups) o["zero3_sub_groups"] = *x.zero3_sub_groups;
  o["lp_dtype"] = x.lp_dtype;
  if (x.model_parallel)
    o["model_parallel"] = ModelParallelJson(*x.model_parallel);
  if (x.moe) o["moe"] = MoeJson(*x.moe);
  universal::PutOpaque(o, x.other);
  model.extras[std::string(kMetaAttr)] = std::move(o);
}

}  // namespace ucp::deepspeed
