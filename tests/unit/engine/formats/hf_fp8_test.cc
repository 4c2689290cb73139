// FP8 block-scaled weights dequantized while read (engine/formats/hf/hf.h,
// Fp8Dequantized): float8_e4m3fn values as the OCP FP8 spec gives them (bias
// 7, subnormals, the largest 448, NaN), each times its block's scale (edge
// blocks partial, the scales in another file), rounded to bf16 / float32; a
// read of any byte range (odd offsets, across weights) equals the same bytes
// of the whole read.

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "engine/formats/hf/hf.h"
#include "tests/testutil/testutil.h"

namespace ucp::hf {
namespace {

// float32 values as safetensors stores them (little-endian, as the host).
std::string Floats(const std::vector<float>& v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.data(), s.size());
  return s;
}

TEST(HfFp8Test, SpecValuesTimesTheirBlockScale) {
  testutil::TempDir dir;
  // [3, 5] in blocks of 2 x 2: scales [2, 3], the last row and column of
  // blocks partial.
  const std::vector<uint8_t> fp8 = {
      0x38, 0x7E, 0x01, 0xB8, 0x00,   // 1.0, 448, 2^-9, -1.0, 0
      0x08, 0x40, 0x3C, 0x80, 0x7F,   // 2^-6, 2.0, 1.5, -0, NaN
      0x30, 0x31, 0x07, 0x57, 0xFE};  // 0.5, 0.5625, 7 * 2^-9, 15, -448
  const std::vector<float> scale = {0.5f, 2.0f, 1.0f, 4.0f, 0.25f, 3.0f};
  std::string w(5, 'x');
  w.append(fp8.begin(), fp8.end());
  testutil::WriteFile(dir / "a.safetensors", w);
  testutil::WriteFile(dir / "b.safetensors", "yyy" + Floats(scale));
  // by hand from the spec: value x scale[row / 2][col / 2]
  const std::vector<float> want = {0.5f,
                                   224.0f,
                                   std::ldexp(1.0f, -9) * 2.0f,
                                   -2.0f,
                                   0.0f,
                                   std::ldexp(1.0f, -7),
                                   1.0f,
                                   3.0f,
                                   -0.0f,
                                   NAN,
                                   2.0f,
                                   0.5625f * 4.0f,
                                   7 * std::ldexp(1.0f, -11),
                                   3.75f,
                                   -448.0f * 3.0f};
  for (DType out : {DType::kFloat32, DType::kBFloat16}) {
    Fp8Dequantized d(out, 2, 2);
    EXPECT_EQ(d.Add(dir / "a.safetensors", 5, 3, 5, dir / "b.safetensors", 3),
              0u);
    const uint64_t es = ElementSize(out);
    // A second weight after it (the same bytes, scales all 1 but one).
    testutil::WriteFile(dir / "c.safetensors",
                        Floats({1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 8.0f}));
    EXPECT_EQ(d.Add(dir / "a.safetensors", 5, 3, 5, dir / "c.safetensors", 0),
              15 * es);
    std::vector<std::byte> all(30 * es);
    d.Read(0, all);
    int checked = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      float got = 0;
      if (out == DType::kFloat32) {
        std::memcpy(&got, all.data() + i * 4, 4);
      } else {
        uint16_t b = 0;
        std::memcpy(&b, all.data() + i * 2, 2);
        const uint32_t bits = uint32_t{b} << 16;
        std::memcpy(&got, &bits, 4);
      }
      if (std::isnan(want[i])) {
        EXPECT_TRUE(std::isnan(got)) << i;
      } else {
        // every expected value is exact in bf16 too
        EXPECT_EQ(got, want[i]) << i << " " << DTypeName(out);
        EXPECT_EQ(std::signbit(got), std::signbit(want[i])) << i;
      }
      ++checked;
    }
    EXPECT_EQ(checked, 15);
    // the second weight: 448 x 1, and -448 x 8 in the corner block
    float v = 0;
    if (out == DType::kFloat32) {
      std::memcpy(&v, all.data() + 16 * 4, 4);
      EXPECT_EQ(v, 448.0f);
      std::memcpy(&v, all.data() + 29 * 4, 4);
      EXPECT_EQ(v, -3584.0f);
    }
    // any range: the same bytes as the whole read
    for (uint64_t at = 0; at < all.size(); at += 3) {
      for (uint64_t n : {1u, 2u, 5u, 17u, 40u}) {
        if (at + n > all.size()) continue;
        std::vector<std::byte> part(n);
        d.Read(at, part);
        EXPECT_EQ(std::memcmp(part.data(), all.data() + at, n), 0)
            << at << " +" << n;
      }
    }
    std::vector<std::byte> past(2);
    EXPECT_THROW(d.Read(all.size() - 1, past), Error);
  }
}

TEST(HfFp8Test, Bf16RoundsHalfwayToEven) {
  testutil::TempDir dir;
  // 1.0 x (1 + 2^-8) and 1.0 x (1 + 3 * 2^-8): float32 products halfway
  // between two bf16 values (whose step is 2^-7 here): to the even one,
  // 1.0 (0x3F80) and 1 + 2^-6 (0x3F82); 1.0 x (1 + 2^-7 + 2^-9) (below
  // half) stays 0x3F81. Blocks of 1 x 1.
  testutil::WriteFile(dir / "w", std::string(3, static_cast<char>(0x38)));
  testutil::WriteFile(
      dir / "s",
      Floats({1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8),
              1.0f + std::ldexp(1.0f, -7) + std::ldexp(1.0f, -9)}));
  Fp8Dequantized d(DType::kBFloat16, 1, 1);
  d.Add(dir / "w", 0, 1, 3, dir / "s", 0);
  std::vector<std::byte> got(6);
  d.Read(0, got);
  uint16_t b[3] = {};
  std::memcpy(b, got.data(), 6);
  EXPECT_EQ(b[0], 0x3F80);
  EXPECT_EQ(b[1], 0x3F82);
  EXPECT_EQ(b[2], 0x3F81);
}

}  // namespace
}  // namespace ucp::hf
