#include "engine/torchfile/crc32_fast.h"

#include <immintrin.h>

namespace ucp::torchfile::internal {

bool HaveFastCrc32() noexcept {
  static const bool have =
      __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
  return have;
}

bool HaveWideCrc32() noexcept {
  static const bool have = HaveFastCrc32() &&
                           __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("vpclmulqdq");
  return have;
}

namespace {

// Folding constants for the reflected polynomial 0xEDB88320 (x^n mod P,
// bit-reflected and shifted as the folding scheme needs them).
constexpr long long kR1 = 0x154442bd4LL;    // 4x128+32 bits
constexpr long long kR2 = 0x1c6e41596LL;    // 4x128-32
constexpr long long kR3 = 0x1751997d0LL;    // 128+32
constexpr long long kR4 = 0x0ccaa009eLL;    // 128-32
constexpr long long kR5 = 0x163cd6124LL;    // 64
constexpr long long kPoly = 0x1db710641LL;  // P'
constexpr long long kMu = 0x1f7011641LL;    // Barrett constant
// Folding four 512-bit registers by 2048 bits (the wide path).
constexpr long long kW1 = 0x11542778aLL;  // 2048+32
constexpr long long kW2 = 0x1322d1430LL;  // 2048-32

__attribute__((target("pclmul,sse4.1"))) inline __m128i Fold(__m128i x,
                                                             __m128i k) {
  // x.lo * k.lo xor x.hi * k.hi
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00),
                       _mm_clmulepi64_si128(x, k, 0x11));
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i Load(
    const unsigned char* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// The 16-byte folds of what is left, then 128 -> 32 bits (Barrett).
__attribute__((target("pclmul,sse4.1"))) uint32_t Finish(__m128i x1,
                                                         const unsigned char* p,
                                                         size_t len) noexcept {
  const __m128i k34 = _mm_set_epi64x(kR4, kR3);
  while (len >= 16) {
    x1 = _mm_xor_si128(Fold(x1, k34), Load(p));
    p += 16;
    len -= 16;
  }
  // 128 -> 64 bits: x1.hi xor x1.lo * R4.
  x1 =
      _mm_xor_si128(_mm_srli_si128(x1, 8), _mm_clmulepi64_si128(x1, k34, 0x10));
  // 64 -> 32 bits.
  const __m128i mask32 = _mm_set_epi32(0, 0, 0, -1);
  __m128i x2b = _mm_srli_si128(x1, 4);
  x1 = _mm_and_si128(x1, mask32);
  x1 = _mm_clmulepi64_si128(x1, _mm_set_epi64x(0, kR5), 0x00);
  x1 = _mm_xor_si128(x1, x2b);
  // Barrett reduction to 32 bits.
  const __m128i pu = _mm_set_epi64x(kMu, kPoly);
  __m128i t = _mm_and_si128(x1, mask32);
  t = _mm_clmulepi64_si128(t, pu, 0x10);
  t = _mm_and_si128(t, mask32);
  t = _mm_clmulepi64_si128(t, pu, 0x00);
  x1 = _mm_xor_si128(x1, t);
  return ~static_cast<uint32_t>(_mm_extract_epi32(x1, 1));
}

__attribute__((target("avx512f,vpclmulqdq"))) inline __m512i Fold512(
    __m512i x, __m512i k) {
  return _mm512_xor_si512(_mm512_clmulepi64_epi128(x, k, 0x00),
                          _mm512_clmulepi64_epi128(x, k, 0x11));
}

__attribute__((target("avx512f"))) inline __m512i Load512(
    const unsigned char* p) {
  return _mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

}  // namespace

__attribute__((target("pclmul,sse4.1"))) uint32_t Crc32Folded(
    uint32_t crc, const unsigned char* p, size_t len) noexcept {
  const __m128i k12 = _mm_set_epi64x(kR2, kR1);
  const __m128i k34 = _mm_set_epi64x(kR4, kR3);
  __m128i x1 = Load(p), x2 = Load(p + 16), x3 = Load(p + 32), x4 = Load(p + 48);
  // zlib convention: the register starts as ~crc.
  x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128(static_cast<int>(~crc)));
  p += 64;
  len -= 64;
  while (len >= 64) {
    x1 = _mm_xor_si128(Fold(x1, k12), Load(p));
    x2 = _mm_xor_si128(Fold(x2, k12), Load(p + 16));
    x3 = _mm_xor_si128(Fold(x3, k12), Load(p + 32));
    x4 = _mm_xor_si128(Fold(x4, k12), Load(p + 48));
    p += 64;
    len -= 64;
  }
  x1 = _mm_xor_si128(Fold(x1, k34), x2);
  x1 = _mm_xor_si128(Fold(x1, k34), x3);
  x1 = _mm_xor_si128(Fold(x1, k34), x4);
  return Finish(x1, p, len);
}

__attribute__((target("avx512f,vpclmulqdq,pclmul,sse4.1"))) uint32_t Crc32Wide(
    uint32_t crc, const unsigned char* p, size_t len) noexcept {
  // (set, not broadcast: GCC 12 warns inside the broadcast intrinsics.)
  const __m512i k2048 =
      _mm512_set_epi64(kW2, kW1, kW2, kW1, kW2, kW1, kW2, kW1);
  const __m512i k512 = _mm512_set_epi64(kR2, kR1, kR2, kR1, kR2, kR1, kR2, kR1);
  __m512i x0 = Load512(p), x1 = Load512(p + 64), x2 = Load512(p + 128),
          x3 = Load512(p + 192);
  // zlib convention: the register starts as ~crc.
  x0 = _mm512_xor_si512(
      x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(~crc))));
  p += 256;
  len -= 256;
  while (len >= 256) {
    x0 = _mm512_xor_si512(Fold512(x0, k2048), Load512(p));
    x1 = _mm512_xor_si512(Fold512(x1, k2048), Load512(p + 64));
    x2 = _mm512_xor_si512(Fold512(x2, k2048), Load512(p + 128));
    x3 = _mm512_xor_si512(Fold512(x3, k2048), Load512(p + 192));
    p += 256;
    len -= 256;
  }
  x0 = _mm512_xor_si512(Fold512(x0, k512), x1);
  x0 = _mm512_xor_si512(Fold512(x0, k512), x2);
  x0 = _mm512_xor_si512(Fold512(x0, k512), x3);
  while (len >= 64) {
    x0 = _mm512_xor_si512(Fold512(x0, k512), Load512(p));
    p += 64;
    len -= 64;
  }
  // Four 128-bit lanes (lowest address first) into one.
  const __m128i k34 = _mm_set_epi64x(kR4, kR3);
  alignas(64) __m128i lane[4];
  _mm512_store_si512(reinterpret_cast<void*>(lane), x0);
  __m128i x = lane[0];
  x = _mm_xor_si128(Fold(x, k34), lane[1]);
  x = _mm_xor_si128(Fold(x, k34), lane[2]);
  x = _mm_xor_si128(Fold(x, k34), lane[3]);
  return Finish(x, p, len);
}

}  // namespace ucp::torchfile::internal
