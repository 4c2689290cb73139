// The "megatron" root attribute (megatron_format.h): its one serializer.

#include "engine/universal/extras.h"

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/universal/model.h"

namespace ucp::megatron {

namespace {

json::Value ExtrasStringList(const std::vector<std::string>& v) {
  json::Value a = json::Value::Array();
  for (const std::string& s : v) a.Append(s);
  return a;
}

}  // namespace

std::optional<MegatronExtras> ReadMegatronExtras(
    const universal::Model& model, const std::filesystem::path& file) {
  std::optional<universal::RecordReader> r =
      universal::RecordReader::ForExtras(model, kMetaAttr, file);
  if (!r) return std::nullopt;
  MegatronExtras x;
  r->Get("top_level_keys", x.top_level_keys);
  r->Member("entries", false, [&](const json::Value& v) {
    x.entries.emplace();
    for (const json::Value& e : v.items()) {
      if (!e.is_array() || e.size() != 2 || !e.items()[0].is_string() ||
          !e.items()[1].is_string()) {
        throw FormatError("entry ", e.Dump(),
                          " is not [name, \"param\"|\"buffer\"|"
                          "\"opaque\"]");
      }
      x.entries->emplace_back(e.items()[0].AsString(), e.items()[1].AsString());
    }
  });
  r->Get("release", x.release);
  r->Get("gpus_per_node", x.gpus_per_node);
  r->Get("optimizer_format", x.optimizer_format);
  r->Get("state_keys", x.state_keys);
  r->Get("grad_dtype", x.grad_dtype);
  r->Get("vocab_size_known", x.vocab_size_known);
  x.other = r->Rest();
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
  universal::PutOpaque(o, x.other);
  model.extras[std::string(kMetaAttr)] = std::move(o);
}

}  // namespace ucp::megatron
