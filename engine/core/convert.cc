#include "engine/core/convert.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "engine/core/error.h"

namespace ucp {
namespace {

uint32_t Bits(float f) noexcept {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float FromBits(uint32_t u) noexcept {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename From, typename To, typename Fn>
void Loop(const void* src, void* dst, size_t n, Fn fn) {
  const auto* s = static_cast<const unsigned char*>(src);
  auto* d = static_cast<unsigned char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    From in;
    std::memcpy(&in, s + i * sizeof(From), sizeof(From));
    To out = fn(in);
    std::memcpy(d + i * sizeof(To), &out, sizeof(To));
  }
}

}  // namespace

uint16_t Float32ToBFloat16(float value) noexcept {
  // Round to nearest even, as c10::BFloat16's round_to_nearest_even.
  if (std::isnan(value)) return 0x7FC0;
  uint32_t u = Bits(value);
  uint32_t rounding_bias = ((u >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>((u + rounding_bias) >> 16);
}

float BFloat16ToFloat32(uint16_t bits) noexcept {
  return FromBits(static_cast<uint32_t>(bits) << 16);
}

uint16_t Float32ToFloat16(float value) noexcept {
  // IEEE 754 binary16, round to nearest even (as c10::Half).
  uint32_t f = Bits(value);
  uint32_t sign = (f >> 16) & 0x8000u;
  uint32_t abs = f & 0x7FFFFFFFu;
  if (abs > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (abs >= 0x47800000u)
    return static_cast<uint16_t>(sign | 0x7C00u);  // overflow/inf
  if (abs < 0x38800000u) {
    // Subnormal half (or zero): value * 2^24, rounded to nearest even.
    float scaled = FromBits(abs) * 16777216.0f;  // exact for these magnitudes
    float r = std::nearbyint(scaled);            // default mode: ties to even
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(r));
  }
  uint32_t mant_odd = (abs >> 13) & 1u;
  abs += 0xC8000FFFu + mant_odd;  // rebias exponent (-112 << 23) and round
  return static_cast<uint16_t>(sign | (abs >> 13));
}

float Float16ToFloat32(uint16_t h) noexcept {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  if (exp == 0) {
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);
    return sign ? -v : v;
  }
  if (exp == 0x1F) return FromBits(sign | 0x7F800000u | (mant << 13));
  return FromBits(sign | ((exp + 112) << 23) | (mant << 13));
}

bool CanConvert(DType from, DType to) noexcept {
  if (from == to) return true;
  auto is = [&](DType a, DType b) { return from == a && to == b; };
  return is(DType::kFloat32, DType::kBFloat16) ||
         is(DType::kBFloat16, DType::kFloat32) ||
         is(DType::kFloat32, DType::kFloat16) ||
         is(DType::kFloat16, DType::kFloat32) ||
         is(DType::kFloat32, DType::kFloat64) ||
         is(DType::kFloat64, DType::kFloat32) ||
         is(DType::kBFloat16, DType::kFloat64) ||
         is(DType::kFloat16, DType::kFloat64);
}

void ConvertElements(DType from, const void* src, DType to, void* dst,
                     size_t count) {
  if (from == to) {
    std::memcpy(dst, src, count * ElementSize(from));
    return;
  }
  auto is = [&](DType a, DType b) { return from == a && to == b; };
  if (is(DType::kFloat32, DType::kBFloat16)) {
    Loop<float, uint16_t>(src, dst, count, Float32ToBFloat16);
  } else if (is(DType::kBFloat16, DType::kFloat32)) {
    Loop<uint16_t, float>(src, dst, count, BFloat16ToFloat32);
  } else if (is(DType::kFloat32, DType::kFloat16)) {
    Loop<float, uint16_t>(src, dst, count, Float32ToFloat16);
  } else if (is(DType::kFloat16, DType::kFloat32)) {
    Loop<uint16_t, float>(src, dst, count, Float16ToFloat32);
  } else if (is(DType::kFloat32, DType::kFloat64)) {
    Loop<float, double>(src, dst, count,
                        [](float f) { return static_cast<double>(f); });
  } else if (is(DType::kFloat64, DType::kFloat32)) {
    Loop<double, float>(src, dst, count,
                        [](double d) { return static_cast<float>(d); });
  } else if (is(DType::kBFloat16, DType::kFloat64)) {
    Loop<uint16_t, double>(src, dst, count, [](uint16_t b) {
      return static_cast<double>(BFloat16ToFloat32(b));
    });
  } else if (is(DType::kFloat16, DType::kFloat64)) {
    Loop<uint16_t, double>(src, dst, count, [](uint16_t b) {
      return static_cast<double>(Float16ToFloat32(b));
    });
  } else {
    throw InternalError("unsupported dtype conversion ", DTypeName(from),
                        " -> ", DTypeName(to));
  }
}

}  // namespace ucp
