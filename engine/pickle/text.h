#pragma once
// Text and number helpers shared by the pickle VM, the pickler and Repr.
// Internal to ucp::pickle.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace ucp::pickle::internal {

/// Decodes one code point of UTF-8 at `pos` (advancing it). Accepts encoded
/// surrogates (U+D800..U+DFFF), as Python's 'surrogatepass' does; rejects
/// overlong forms and values above U+10FFFF. Returns -1 on invalid input.
int32_t NextCodePoint(std::string_view text, size_t& pos) noexcept;

/// True if `text` decodes completely with NextCodePoint.
bool IsValidUtf8(std::string_view text) noexcept;

/// Appends the UTF-8 encoding of `cp` (surrogates included).
void AppendUtf8(int32_t cp, std::string& out);

/// Each byte is one code point U+0000..U+00FF.
std::string Latin1ToUtf8(std::string_view bytes);

/// Inverse of Latin1ToUtf8; nullopt if `text` is not valid UTF-8 or holds a
/// code point above U+00FF.
std::optional<std::string> Utf8ToLatin1(std::string_view text);

/// Decimal text of a two's-complement little-endian integer of any length.
std::string BigIntToDecimal(std::string_view le_bytes);

/// Two's-complement little-endian bytes (minimal) of decimal text with an
/// optional sign; nullopt if `text` is not such a number.
std::optional<std::string> DecimalToBigInt(std::string_view text);

/// Minimal two's-complement little-endian bytes of `v` (empty for 0), as
/// CPython's encode_long writes them.
std::string EncodeLong(int64_t v);

/// Python's repr() of a float ('1.0', '1e-05', 'inf', 'nan', ...).
std::string FloatRepr(double f);

/// Python's repr() of a str given as UTF-8.
std::string StrRepr(std::string_view utf8);

/// Python's repr() of bytes (b'...').
std::string BytesRepr(std::string_view bytes);

}  // namespace ucp::pickle::internal
