#include "engine/atoms/names.h"

#include "engine/core/error.h"

namespace ucp::atoms {
namespace {

constexpr char kHex[] = "0123456789ABCDEF";

void AppendEscaped(std::string& out, unsigned char c) {
  out += '%';
  out += kHex[c >> 4];
  out += kHex[c & 0xf];
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

std::string EscapeLinkName(std::string_view name, std::string_view reserved) {
  UCP_CHECK(!name.empty(), "empty name cannot be stored");
  std::string out;
  out.reserve(name.size() + 2);
  size_t start = 0;
  if (name == "." || name == ".." || (!reserved.empty() && name == reserved)) {
    AppendEscaped(out, static_cast<unsigned char>(name[0]));
    start = 1;
  }
  for (size_t i = start; i < name.size(); ++i) {
    char c = name[i];
    if (c == '%' || c == '/') {
      AppendEscaped(out, static_cast<unsigned char>(c));
    } else {
      out += c;
    }
  }
  return out;
}

std::optional<std::string> UnescapeLinkName(std::string_view link) {
  std::string out;
  out.reserve(link.size());
  for (size_t i = 0; i < link.size(); ++i) {
    if (link[i] != '%') {
      out += link[i];
      continue;
    }
    if (i + 2 >= link.size()) return std::nullopt;
    int hi = HexValue(link[i + 1]);
    int lo = HexValue(link[i + 2]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  if (out.empty()) return std::nullopt;
  return out;
}

}  // namespace ucp::atoms
