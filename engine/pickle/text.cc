#include "engine/pickle/text.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <iterator>
#include <system_error>
#include <vector>

namespace ucp::pickle::internal {
namespace {

struct Range {
  int32_t first;
  int32_t last;
};

constexpr Range kNonPrintable[] = {
#include "engine/pickle/unicode_nonprintable.inc"
};

bool IsPrintable(int32_t cp) {
  auto it =
      std::upper_bound(std::begin(kNonPrintable), std::end(kNonPrintable), cp,
                       [](int32_t c, const Range& r) { return c < r.first; });
  if (it == std::begin(kNonPrintable)) return true;
  --it;
  return cp > it->last;
}

constexpr char kHex[] = "0123456789abcdef";

void AppendHex(std::string& out, uint32_t v, int digits) {
  for (int k = digits - 1; k >= 0; --k) out += kHex[(v >> (4 * k)) & 0xf];
}

// Removes redundant sign-extension bytes (keeps at least one byte).
void TrimTwosComplement(std::string& bytes) {
  while (bytes.size() > 1) {
    const auto top = static_cast<unsigned char>(bytes.back());
    const auto next = static_cast<unsigned char>(bytes[bytes.size() - 2]);
    if ((top == 0x00 && (next & 0x80) == 0) ||
        (top == 0xff && (next & 0x80) != 0)) {
      bytes.pop_back();
    } else {
      break;
    }
  }
}

void NegateTwosComplement(std::string& bytes) {
  unsigned carry = 1;
  for (char& c : bytes) {
    unsigned v = (~static_cast<unsigned char>(c) & 0xffu) + carry;
    c = static_cast<char>(v & 0xff);
    carry = v >> 8;
  }
}

}  // namespace

int32_t NextCodePoint(std::string_view text, size_t& pos) noexcept {
  const size_t n = text.size();
  if (pos >= n) return -1;
  const auto b0 = static_cast<unsigned char>(text[pos]);
  if (b0 < 0x80) {
    ++pos;
    return b0;
  }
  int len;
  int32_t cp;
  unsigned char lo = 0x80;
  unsigned char hi = 0xbf;
  if (b0 >= 0xc2 && b0 <= 0xdf) {
    len = 2;
    cp = b0 & 0x1f;
  } else if (b0 >= 0xe0 && b0 <= 0xef) {
    len = 3;
    cp = b0 & 0x0f;
    if (b0 == 0xe0) lo = 0xa0;
  } else if (b0 >= 0xf0 && b0 <= 0xf4) {
    len = 4;
    cp = b0 & 0x07;
    if (b0 == 0xf0) lo = 0x90;
    if (b0 == 0xf4) hi = 0x8f;
  } else {
    return -1;
  }
  if (n - pos < static_cast<size_t>(len)) return -1;
  for (int k = 1; k < len; ++k) {
    const auto b = static_cast<unsigned char>(text[pos + k]);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xbf)) return -1;
    cp = (cp << 6) | (b & 0x3f);
  }
  pos += len;
  return cp;
}

bool IsValidUtf8(std::string_view text) noexcept {
  size_t pos = 0;
  while (pos < text.size()) {
    // Fast path for ASCII runs.
    if (static_cast<unsigned char>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    if (NextCodePoint(text, pos) < 0) return false;
  }
  return true;
}

void AppendUtf8(int32_t cp, std::string& out) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xc0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xe0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  } else {
    out += static_cast<char>(0xf0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
    out += static_cast<char>(0x80 | (cp & 0x3f));
  }
}

std::string Latin1ToUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() + bytes.size() / 4);
  for (char c : bytes) AppendUtf8(static_cast<unsigned char>(c), out);
  return out;
}

std::optional<std::string> Utf8ToLatin1(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  size_t pos = 0;
  while (pos < text.size()) {
    const int32_t cp = NextCodePoint(text, pos);
    if (cp < 0 || cp > 0xff) return std::nullopt;
    out += static_cast<char>(cp);
  }
  return out;
}

std::string BigIntToDecimal(std::string_view le_bytes) {
  if (le_bytes.empty()) return "0";
  std::string mag(le_bytes);
  const bool negative = (static_cast<unsigned char>(mag.back()) & 0x80) != 0;
  if (negative) NegateTwosComplement(mag);
  // Little-endian base-2^32 limbs of the magnitude.
  std::vector<uint32_t> limbs((mag.size() + 3) / 4, 0);
  for (size_t k = 0; k < mag.size(); ++k) {
    limbs[k / 4] |= uint32_t{static_cast<unsigned char>(mag[k])}
                    << (8 * (k % 4));
  }
  while (!limbs.empty() && limbs.back() == 0) limbs.pop_back();
  std::vector<uint32_t> chunks;  // base 10^9, least significant first
  while (!limbs.empty()) {
    uint64_t rem = 0;
    for (size_t k = limbs.size(); k-- > 0;) {
      const uint64_t cur = (rem << 32) | limbs[k];
      limbs[k] = static_cast<uint32_t>(cur / 1000000000u);
      rem = cur % 1000000000u;
    }
    chunks.push_back(static_cast<uint32_t>(rem));
    while (!limbs.empty() && limbs.back() == 0) limbs.pop_back();
  }
  std::string out = negative ? "-" : "";
  if (chunks.empty()) return "0";
  out += std::to_string(chunks.back());
  for (size_t k = chunks.size() - 1; k-- > 0;) {
    std::string part = std::to_string(chunks[k]);
    out.append(9 - part.size(), '0');
    out += part;
  }
  return out;
}

std::optional<std::string> DecimalToBigInt(std::string_view text) {
  bool negative = false;
  if (!text.empty() && (text[0] == '-' || text[0] == '+')) {
    negative = text[0] == '-';
    text.remove_prefix(1);
  }
  if (text.empty()) return std::nullopt;
  for (char c : text) {
    if (c < '0' || c > '9') return std::nullopt;
  }
  std::vector<uint32_t> limbs;  // magnitude, base 2^32, least significant first
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t take = std::min<size_t>(9, text.size() - pos);
    uint32_t chunk = 0;
    uint32_t scale = 1;
    for (size_t k = 0; k < take; ++k) {
      chunk = chunk * 10 + static_cast<uint32_t>(text[pos + k] - '0');
      scale *= 10;
    }
    pos += take;
    uint64_t carry = chunk;
    for (uint32_t& limb : limbs) {
      const uint64_t cur = uint64_t{limb} * scale + carry;
      limb = static_cast<uint32_t>(cur);
      carry = cur >> 32;
    }
    if (carry != 0) limbs.push_back(static_cast<uint32_t>(carry));
  }
  std::string bytes;
  bytes.reserve(limbs.size() * 4 + 1);
  for (uint32_t limb : limbs) {
    for (int k = 0; k < 4; ++k) bytes += static_cast<char>(limb >> (8 * k));
  }
  bytes += '\0';  // room for the sign bit
  if (negative) NegateTwosComplement(bytes);
  TrimTwosComplement(bytes);
  if (bytes.size() == 1 && bytes[0] == 0) bytes.clear();
  return bytes;
}

std::string EncodeLong(int64_t v) {
  if (v == 0) return "";
  std::string bytes(8, '\0');
  const auto u = static_cast<uint64_t>(v);
  for (int k = 0; k < 8; ++k) bytes[k] = static_cast<char>(u >> (8 * k));
  TrimTwosComplement(bytes);
  return bytes;
}

std::string FloatRepr(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f < 0 ? "-inf" : "inf";
  char buf[64];
  auto res =
      std::to_chars(buf, buf + sizeof buf, f, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<size_t>(res.ptr - buf));
  std::string out;
  if (!sci.empty() && sci[0] == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const size_t e = sci.find('e');
  std::string digits;
  for (char c : sci.substr(0, e)) {
    if (c != '.') digits += c;
  }
  int exponent = 0;
  std::from_chars(sci.data() + e + 1 + (sci[e + 1] == '+' ? 1 : 0),
                  sci.data() + sci.size(), exponent);
  // Python: value = 0.DIGITS * 10**decpt; exponent form when decpt is
  // outside (-4, 16].
  const int decpt = exponent + 1;
  const int nd = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (nd > 1) {
      out += '.';
      out.append(digits, 1);
    }
    out += 'e';
    out += exponent < 0 ? '-' : '+';
    std::string ex = std::to_string(exponent < 0 ? -exponent : exponent);
    if (ex.size() < 2) out += '0';
    out += ex;
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= nd) {
    out += digits;
    out.append(static_cast<size_t>(decpt - nd), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<size_t>(decpt));
    out += '.';
    out.append(digits, static_cast<size_t>(decpt));
  }
  return out;
}

std::string StrRepr(std::string_view utf8) {
  const bool has_single = utf8.find('\'') != std::string_view::npos;
  const bool has_double = utf8.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out;
  out.reserve(utf8.size() + 2);
  out += quote;
  size_t pos = 0;
  while (pos < utf8.size()) {
    const size_t start = pos;
    int32_t cp = NextCodePoint(utf8, pos);
    if (cp < 0) {  // not valid UTF-8: show the byte as Python would a
      cp = static_cast<unsigned char>(utf8[start]);  // surrogateescape
      pos = start + 1;
      out += "\\udc";
      AppendHex(out, static_cast<uint32_t>(cp), 2);
      continue;
    }
    if (cp == quote || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (cp < 0x20 || cp == 0x7f) {
      out += "\\x";
      AppendHex(out, static_cast<uint32_t>(cp), 2);
    } else if (cp < 0x7f) {
      out += static_cast<char>(cp);
    } else if (IsPrintable(cp)) {
      out.append(utf8.substr(start, pos - start));
    } else if (cp <= 0xff) {
      out += "\\x";
      AppendHex(out, static_cast<uint32_t>(cp), 2);
    } else if (cp <= 0xffff) {
      out += "\\u";
      AppendHex(out, static_cast<uint32_t>(cp), 4);
    } else {
      out += "\\U";
      AppendHex(out, static_cast<uint32_t>(cp), 8);
    }
  }
  out += quote;
  return out;
}

std::string BytesRepr(std::string_view bytes) {
  const bool has_single = bytes.find('\'') != std::string_view::npos;
  const bool has_double = bytes.find('"') != std::string_view::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::string out = "b";
  out.reserve(bytes.size() + 3);
  out += quote;
  for (char ch : bytes) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == static_cast<unsigned char>(quote) || c == '\\') {
      out += '\\';
      out += ch;
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c >= 0x7f) {
      out += "\\x";
      AppendHex(out, c, 2);
    } else {
      out += ch;
    }
  }
  out += quote;
  return out;
}

}  // namespace ucp::pickle::internal
