#include "engine/formats/common/safetensors.h"

#include <algorithm>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"

namespace ucp::formats {
namespace {

constexpr uint64_t kMaxHeader = 100'000'000;  // safetensors' MAX_HEADER_SIZE

constexpr std::pair<const char*, DType> kDTypes[] = {
    {"F64", DType::kFloat64},       {"F32", DType::kFloat32},
    {"F16", DType::kFloat16},       {"BF16", DType::kBFloat16},
    {"I64", DType::kInt64},         {"I32", DType::kInt32},
    {"I16", DType::kInt16},         {"I8", DType::kInt8},
    {"U8", DType::kUInt8},          {"U16", DType::kUInt16},
    {"U32", DType::kUInt32},        {"U64", DType::kUInt64},
    {"BOOL", DType::kBool},         {"F8_E4M3", DType::kFloat8E4M3Fn},
    {"F8_E5M2", DType::kFloat8E5M2}};

std::vector<int64_t> IntList(const json::Value* v, const std::string& where) {
  if (v == nullptr || !v->is_array())
    throw FormatError(where, ": not a list of integers");
  std::vector<int64_t> out;
  for (const json::Value& x : v->items()) {
    if (!x.is_int() || x.AsInt() < 0)
      throw FormatError(where, ": not a list of integers >= 0");
    out.push_back(x.AsInt());
  }
  return out;
}

}  // namespace

std::optional<std::string_view> SafetensorsDTypeName(DType dtype) {
  for (const auto& [name, d] : kDTypes)
    if (d == dtype) return name;
  return std::nullopt;
}

std::optional<DType> DTypeOfSafetensorsName(std::string_view name) {
  for (const auto& [n, d] : kDTypes)
    if (name == n) return d;
  return std::nullopt;
}

std::string SafetensorsHeader(std::span<const SafetensorsTensor> tensors,
                              const json::Value& metadata) {
  std::vector<std::pair<std::string, json::Value>> members;
  members.emplace_back("__metadata__", metadata);
  uint64_t offset = 0;
  for (const SafetensorsTensor& t : tensors) {
    const std::optional<std::string_view> dtype = SafetensorsDTypeName(t.dtype);
    if (!dtype) {
      throw UsageError(t.name, ": safetensors has no dtype for ",
                       DTypeName(t.dtype));
    }
    json::Value e = json::Value::Object();
    e["dtype"] = std::string(*dtype);
    json::Value shape = json::Value::Array();
    for (int64_t d : t.shape) shape.Append(d);
    e["shape"] = std::move(shape);
    json::Value offs = json::Value::Array();
    offs.Append(offset);
    offs.Append(offset + t.bytes);
    e["data_offsets"] = std::move(offs);
    members.emplace_back(t.name, std::move(e));
    offset += t.bytes;
  }
  std::string text = json::Value::FromMembers(std::move(members)).Dump();
  while (text.size() % 8 != 0) text += ' ';
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<size_t>(i)] =
        static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text;
}

namespace {

// A safetensors file's header, parsed; `n` its length. Throws FormatError
// naming the file for a length or text that is no safetensors header.
json::Value HeaderJson(const File& f, const std::string& where, uint64_t& n) {
  const uint64_t size = f.Size();
  if (size < 8) throw FormatError(where, ": shorter than its 8-byte header");
  unsigned char n8[8];
  f.ReadExact(n8, 8, 0);
  n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | n8[i];
  if (n > kMaxHeader || n > size - 8) {
    throw FormatError(where, ": a header of ", n, " bytes in a file of ", size,
                      " (not a safetensors file, or cut)");
  }
  std::string text(n, '\0');
  f.ReadExact(text.data(), n, 8);
  json::Value header;
  try {
    header = json::Value::Parse(text);
  } catch (Error& e) {
    e.AddContext(where, " > header");
    throw;
  }
  if (!header.is_object())
    throw FormatError(where, ": the header is not a JSON object");
  return header;
}

}  // namespace

json::Value SafetensorsMetadata(const std::filesystem::path& path) {
  uint64_t n = 0;
  const json::Value header = HeaderJson(
      File::OpenRead(path), StrCat("safetensors file ", path.string()), n);
  const json::Value* meta = header.Find("__metadata__");
  return meta != nullptr ? *meta : json::Value();
}

std::vector<SafetensorsTensor> ReadSafetensorsHeader(
    const std::filesystem::path& path) {
  const File f = File::OpenRead(path);
  const uint64_t size = f.Size();
  const std::string where = StrCat("safetensors file ", path.string());
  uint64_t n = 0;
  const json::Value header = HeaderJson(f, where, n);
  const uint64_t data = 8 + n, data_size = size - data;
  std::vector<SafetensorsTensor> out;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const auto& [name, t] : header.members()) {
    if (name == "__metadata__") continue;
    const std::string tw = StrCat(where, " > ", name);
    const json::Value* dt = t.Find("dtype");
    if (dt == nullptr || !dt->is_string()) throw FormatError(tw, ": no dtype");
    SafetensorsTensor s;
    s.name = name;
    const std::optional<DType> d = DTypeOfSafetensorsName(dt->AsString());
    if (!d) throw FormatError(tw, ": dtype ", dt->AsString(), " not read");
    s.dtype = *d;
    s.shape = IntList(t.Find("shape"), tw + " > shape");
    const std::vector<int64_t> be =
        IntList(t.Find("data_offsets"), tw + " > data_offsets");
    if (be.size() != 2 || be[0] > be[1] ||
        static_cast<uint64_t>(be[1]) > data_size) {
      throw FormatError(tw, ": data_offsets outside the ", data_size,
                        " bytes of data");
    }
    uint64_t want = ElementSize(*d);
    for (int64_t x : s.shape) {
      if (x != 0 && want > (uint64_t{1} << 62) / static_cast<uint64_t>(x))
        throw FormatError(tw, ": shape too large");
      want *= static_cast<uint64_t>(x);
    }
    s.bytes = static_cast<uint64_t>(be[1] - be[0]);
    if (s.bytes != want) {
      throw FormatError(tw, ": ", s.bytes, " bytes of data, ",
                        ShapeString(s.shape), " ", dt->AsString(), " needs ",
                        want);
    }
    s.offset = data + static_cast<uint64_t>(be[0]);
    ranges.emplace_back(be[0], be[1]);
    out.push_back(std::move(s));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second)
      throw FormatError(where, ": two tensors' data overlap");
  }
  return out;
}

}  // namespace ucp::formats
