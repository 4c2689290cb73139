#include "engine/universal/extras.h"

#include <algorithm>

namespace ucp::universal {

RecordReader::RecordReader(const json::Value& object, std::string context)
    : object_(&object), context_(std::move(context)) {
  if (!object.is_object()) {
    FormatError e("not a JSON object");
    if (!context_.empty()) e.AddContext(context_);
    throw e;
  }
}

std::optional<RecordReader> RecordReader::ForExtras(
    const Model& model, std::string_view name,
    const std::filesystem::path& file) {
  const json::Value* doc = model.FindExtra(name);
  if (doc == nullptr) return std::nullopt;
  return RecordReader(
      *doc, StrCat("universal file ", file.string(), " > attribute ", name));
}

const json::Value* RecordReader::Take(std::string_view key, bool required) {
  taken_.emplace_back(key);
  const json::Value* v = object_->Find(key);
  if (v == nullptr && required) {
    FormatError e("missing key \"", key, "\"");
    if (!context_.empty()) e.AddContext(context_);
    throw e;
  }
  return v;
}

void RecordReader::AddContext(Error& e, std::string_view key) const {
  e.AddContext("member ", key);
  if (!context_.empty()) e.AddContext(context_);
}

bool RecordReader::Get(std::string_view key, std::string& out, bool required) {
  return Member(key, required,
                [&](const json::Value& v) { out = v.AsString(); });
}

bool RecordReader::Get(std::string_view key, int64_t& out, bool required) {
  return Member(key, required, [&](const json::Value& v) { out = v.AsInt(); });
}

bool RecordReader::Get(std::string_view key, double& out, bool required) {
  return Member(key, required,
                [&](const json::Value& v) { out = v.AsDouble(); });
}

bool RecordReader::Get(std::string_view key, bool& out, bool required) {
  return Member(key, required, [&](const json::Value& v) { out = v.AsBool(); });
}

bool RecordReader::Get(std::string_view key, std::vector<std::string>& out,
                       bool required) {
  return Member(key, required, [&](const json::Value& v) {
    std::vector<std::string> list;
    for (const json::Value& x : v.items()) list.push_back(x.AsString());
    out = std::move(list);
  });
}

OpaqueMembers RecordReader::Rest() const {
  std::vector<std::pair<std::string, json::Value>> rest;
  for (const auto& [k, v] : object_->members())
    if (std::find(taken_.begin(), taken_.end(), k) == taken_.end())
      rest.emplace_back(k, v);
  return json::Value::FromMembers(std::move(rest));
}

void PutOpaque(json::Value& out, const OpaqueMembers& other) {
  if (!other.is_object()) return;
  for (const auto& [k, v] : other.members()) {
    UCP_CHECK(out.Find(k) == nullptr, "member ", k,
              " both typed and kept opaque");
    out[k] = v;
  }
}

}  // namespace ucp::universal
