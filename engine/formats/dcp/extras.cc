// The "dcp" root attribute (dcp.h): its one serializer.

#include "engine/universal/extras.h"

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/universal/model.h"

namespace ucp::dcp {

std::optional<DcpExtras> ReadDcpExtras(const universal::Model& model,
                                       const std::filesystem::path& file) {
  std::optional<universal::RecordReader> r =
      universal::RecordReader::ForExtras(model, kMetaAttr, file);
  if (!r) return std::nullopt;
  DcpExtras x;
  r->Member("keys", true, [&](const json::Value& v) {
    for (const json::Value& j : v.items()) {
      universal::RecordReader item(j);
      DcpKeyRecord& k = x.keys.emplace_back();
      item.Get("key", k.key);
      item.Get("class", k.cls);
      item.Get("param", k.param, /*required=*/false);
      item.Get("state", k.state, /*required=*/false);
      item.Get("experts", k.experts, /*required=*/false);
      item.Get("order", k.order, /*required=*/false);
    }
  });
  r->Member("planner_data", false, [&](const json::Value& v) {
    x.planner_data.emplace();
    for (const auto& [fqn, p] : v.members()) {
      std::vector<PathComponent> path;
      for (const json::Value& c : p.items()) {
        if (c.is_string()) {
          path.emplace_back(c.AsString());
        } else {
          path.emplace_back(c.AsInt());
        }
      }
      x.planner_data->emplace_back(fqn, std::move(path));
    }
  });
  r->Get("version", x.version);
  r->Get("world", x.world);
  x.other = r->Rest();
  return x;
}

void WriteDcpExtras(const DcpExtras& x, universal::Model& model) {
  json::Value o = json::Value::Object();
  json::Value keys = json::Value::Array();
  for (const DcpKeyRecord& r : x.keys) {
    json::Value j = json::Value::Object();
    j["key"] = r.key;
    j["class"] = r.cls;
    if (!r.param.empty()) j["param"] = r.param;
    if (!r.state.empty()) j["state"] = r.state;
    if (r.experts > 0) {
      j["experts"] = r.experts;
      j["order"] = r.order;
    }
    keys.Append(std::move(j));
  }
  o["keys"] = std::move(keys);
  if (x.planner_data) {
    std::vector<std::pair<std::string, json::Value>> pd;
    for (const auto& [fqn, path] : *x.planner_data) {
      json::Value a = json::Value::Array();
      for (const PathComponent& c : path) {
        if (std::holds_alternative<std::string>(c)) {
          a.Append(std::get<std::string>(c));
        } else {
          a.Append(std::get<int64_t>(c));
        }
      }
      pd.emplace_back(fqn, std::move(a));
    }
    o["planner_data"] = json::Value::FromMembers(std::move(pd));
  }
  if (x.version) o["version"] = *x.version;
  if (x.world) o["world"] = *x.world;
  universal::PutOpaque(o, x.other);
  model.extras[kMetaAttr] = std::move(o);
}

}  // namespace ucp::dcp
