// The "mindspore" root attribute (mindspore_extras.h): its one serializer.

#include "engine/formats/names/mindspore_extras.h"

#include <utility>

#include "engine/core/error.h"
#include "engine/universal/extras.h"
#include "engine/universal/model.h"

namespace ucp::mindspore {

namespace {

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
  std::optional<universal::RecordReader> r =
      universal::RecordReader::ForExtras(model, kMetaAttr, file);
  if (!r) return std::nullopt;
  MindSporeExtras x;
  r->Member("records", /*required=*/false, [&](const json::Value& v) {
    x.records.emplace();
    for (const json::Value& rec : v.items())
      x.records->push_back(ReadRecord(rec));
  });
  r->Get("order", x.order);
  r->Get("exp_avg_prefix", x.exp_avg_prefix);
  r->Get("exp_avg_sq_prefix", x.exp_avg_sq_prefix);
  r->Get("file", x.file);
  r->Get("rank_folder", x.rank_folder);
  r->Get("crc", x.crc);
  r->Get("files", x.files);
  x.other = r->Rest();
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
  universal::PutOpaque(o, x.other);
  model.extras[kMetaAttr] = std::move(o);
}

}  // namespace ucp::mindspore
