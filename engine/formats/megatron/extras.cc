// The "megatron" root attribute (megatron_format.h): its one serializer.

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/universal/model.h"

namespace ucp::megatron {

namespace {

std::vector<std::string> ExtrasStrings(const json::Value& v) {
  std::vector<std::string> out;
  for (const json::Value& x : v.items()) out.push_back(x.AsString());
  return out;
}

json::Value ExtrasStringList(const std::vector<std::string>& v) {
  json::Value a = json::Value::Array();
  for (const std::string& s : v) a.Append(s);
  return a;
}

}  // namespace

std::optional<MegatronExtras> ReadMegatronExtras(
    const universal::Model& model, const std::filesystem::path& file) {
  const json::Value* doc = model.FindExtra(kMetaAttr);
  if (doc == nullptr) return std::nullopt;
  MegatronExtras x;
  std::string member;
  try {
    if (!doc->is_object()) throw FormatError("not a JSON object");
    std::vector<std::pair<std::string, json::Value>> other;
    for (const auto& [k, v] : doc->members()) {
      member = k;
      if (k == "top_level_keys") {
        x.top_level_keys = ExtrasStrings(v);
      } else if (k == "entries") {
        x.entries.emplace();
        for (const json::Value& e : v.items()) {
          if (!e.is_array() || e.size() != 2 || !e.items()[0].is_string() ||
              !e.items()[1].is_string()) {
            throw FormatError("entry ", e.Dump(),
                              " is not [name, \"param\"|\"buffer\"|"
                              "\"opaque\"]");
          }
          x.entries->emplace_back(e.items()[0].AsString(),
                                  e.items()[1].AsString());
        }
      } else if (k == "release") {
        x.release = v.AsBool();
      } else if (k == "gpus_per_node") {
        x.gpus_per_node = v.AsInt();
      } else if (k == "optimizer_format") {
        x.optimizer_format = v.AsString();
      } else if (k == "state_keys") {
        x.state_keys = ExtrasStrings(v);
      } else if (k == "grad_dtype") {
        x.grad_dtype = v.AsString();
      } else if (k == "vocab_size_known") {
        x.vocab_size_known = v.AsBool();
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

void WriteMegatronExtras(const MegatronExtras& x, universal::Model& model) {
  json::Value o = json::Value::Object();
  if (x.top_level_keys)
    o["top_level_keys"] = ExtrasStringList(*x.top_level_keys);
  if (x.entries) {
    json::Value a = json::Value::Array();
    for (const auto& [name, kind] : *x.entries) {
      json::Value e = json::Value::Array();
      e.Append(name);
      e.Append(kind);
      a.Append(std::move(e));
    }
    o["entries"] = std::move(a);
  }
  if (x.release) o["release"] = *x.release;
  if (x.gpus_per_node) o["gpus_per_node"] = *x.gpus_per_node;
  if (x.optimizer_format) o["optimizer_format"] = *x.optimizer_format;
  if (x.state_keys) o["state_keys"] = ExtrasStringList(*x.state_keys);
  if (x.grad_dtype) o["grad_dtype"] = *x.grad_dtype;
  if (x.vocab_size_known) o["vocab_size_known"] = *x.vocab_size_known;
  if (x.other.is_object())
    for (const auto& [k, v] : x.other.members()) o[k] = v;
  model.extras[std::string(kMetaAttr)] = std::move(o);
}

}  // namespace ucp::megatron
