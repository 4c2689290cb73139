// The "mindspore" root attribute (mindspore.h): its one serializer.

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/universal/model.h"

namespace ucp::mindspore {

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

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string FromHex(const std::string& hex) {
  if (hex.size() % 2 != 0) throw FormatError("hex of odd length ", hex.size());
  std::string out;
  out.reserve(hex.size() / 2);
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = HexDigit(hex[i]), lo = HexDigit(hex[i + 1]);
    if (hi < 0 || lo < 0)
      throw FormatError("hex: '", hex[hi < 0 ? i : i + 1],
                        "' is not a hex digit");
    out.push_back(static_cast<char>(hi << 4 | lo));
  }
  return out;
}

std::string ToHex(const std::string& bytes) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string hex;
  hex.reserve(bytes.size() * 2);
  for (unsigned char ch : bytes) {
    hex.push_back(kHex[ch >> 4]);
    hex.push_back(kHex[ch & 15]);
  }
  return hex;
}

OtherRecord ReadRecord(const json::Value& v) {
  if (!v.is_object()) throw FormatError("record ", v.Dump(), " is no object");
  OtherRecord r;
  r.tag = v.At("tag").AsString();
  try {
    r.type = v.At("type").AsString();
    for (const json::Value& d : v.At("dims").items())
      r.dims.push_back(d.AsInt());
    r.bytes = FromHex(v.At("hex").AsString());
  } catch (Error& e) {
    e.AddContext("record ", r.tag);
    throw;
  }
  return r;
}

}  // namespace

std::optional<MindSporeExtras> ReadMindSporeExtras(
    const universal::Model& model, const std::filesystem::path& file) {
  const json::Value* doc = model.FindExtra(kMetaAttr);
  if (doc == nullptr) return std::nullopt;
  MindSporeExtras x;
  std::string member;
  try {
    if (!doc->is_object()) throw FormatError("not a JSON object");
    std::vector<std::pair<std::string, json::Value>> other;
    for (const auto& [k, v] : doc->members()) {
      member = k;
      if (k == "records") {
        x.records.emplace();
        for (const json::Value& r : v.items())
          x.records->push_back(ReadRecord(r));
      } else if (k == "order") {
        x.order = ExtrasStrings(v);
      } else if (k == "exp_avg_prefix") {
        x.exp_avg_prefix = v.AsString();
      } else if (k == "exp_avg_sq_prefix") {
        x.exp_avg_sq_prefix = v.AsString();
      } else if (k == "file") {
        x.file = v.AsString();
      } else if (k == "rank_folder") {
        x.rank_folder = v.AsBool();
      } else if (k == "crc") {
        x.crc = v.AsBool();
      } else if (k == "files") {
        x.files = ExtrasStrings(v);
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

void WriteMindSporeExtras(const MindSporeExtras& x, universal::Model& model) {
  json::Value o = json::Value::Object();
  if (x.records) {
    json::Value a = json::Value::Array();
    for (const OtherRecord& r : *x.records) {
      json::Value j = json::Value::Object();
      j["tag"] = r.tag;
      j["type"] = r.type;
      json::Value dims = json::Value::Array();
      for (int64_t d : r.dims) dims.Append(d);
      j["dims"] = std::move(dims);
      j["hex"] = ToHex(r.bytes);
      a.Append(std::move(j));
    }
    o["records"] = std::move(a);
  }
  if (x.order) o["order"] = ExtrasStringList(*x.order);
  if (x.exp_avg_prefix) o["exp_avg_prefix"] = *x.exp_avg_prefix;
  if (x.exp_avg_sq_prefix) o["exp_avg_sq_prefix"] = *x.exp_avg_sq_prefix;
  if (x.file) o["file"] = *x.file;
  if (x.rank_folder) o["rank_folder"] = *x.rank_folder;
  if (x.crc) o["crc"] = *x.crc;
  if (x.files) o["files"] = ExtrasStringList(*x.files);
  if (x.other.is_object())
    for (const auto& [k, v] : x.other.members()) o[k] = v;
  model.extras[kMetaAttr] = std::move(o);
}

}  // namespace ucp::mindspore
