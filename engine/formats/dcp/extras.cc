// The "dcp" root attribute (dcp.h): its one serializer.

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/universal/model.h"

namespace ucp::dcp {

std::optional<DcpExtras> ReadDcpExtras(const universal::Model& model,
                                       const std::filesystem::path& file) {
  const json::Value* doc = model.FindExtra(kMetaAttr);
  if (doc == nullptr) return std::nullopt;
  DcpExtras x;
  std::string member;
  try {
    if (!doc->is_object()) throw FormatError("not a JSON object");
    std::vector<std::pair<std::string, json::Value>> other;
    if (doc->Find("keys") == nullptr) throw FormatError("missing key \"keys\"");
    for (const auto& [k, v] : doc->members()) {
      member = k;
      if (k == "keys") {
        for (const json::Value& j : v.items()) {
          DcpKeyRecord r;
          r.key = j.At("key").AsString();
          r.cls = j.At("class").AsString();
          if (const json::Value* p = j.Find("param")) r.param = p->AsString();
          if (const json::Value* s = j.Find("state")) r.state = s->AsString();
          x.keys.push_back(std::move(r));
        }
      } else if (k == "planner_data") {
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
      } else if (k == "version") {
        x.version = v.AsString();
      } else if (k == "world") {
        x.world = v.AsInt();
      } else {
        other.emplace_back(k, v);
      }
    }
    x.other = json::Value::FromMembers(std::move(other));
  } catch (Error& e) {
    if (!member.empty()) e.AddContext("member ", member);
    e.AddContext("universal file ", file.string(), " > attribute ", kMetaAttr);
    throw;
  }
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
  if (x.other.is_object())
    for (const auto& [k, v] : x.other.members()) o[k] = v;
  model.extras[kMetaAttr] = std::move(o);
}

}  // namespace ucp::dcp
