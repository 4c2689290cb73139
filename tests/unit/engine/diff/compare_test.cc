// The element rules of `ucp diff` (engine/diff/compare.h) against values
// worked out by hand: bitwise equality, NaN and -0.0, numpy.isclose's
// asymmetric test, infinities, differing dtypes and float8 decoding.

#include "engine/diff/compare.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "engine/core/error.h"

namespace ucp::diff {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

template <typename T>
const std::byte* Bytes(const std::vector<T>& v) {
  return reinterpret_cast<const std::byte*>(v.data());
}

template <typename A, typename B>
ElementStats Compared(DType da, const std::vector<A>& a, DType db,
                      const std::vector<B>& b, Tolerance t = {},
                      int64_t first = 0) {
  EXPECT_EQ(a.size(), b.size());
  ElementStats s;
  CompareElements(da, Bytes(a), db, Bytes(b), static_cast<int64_t>(a.size()),
                  first, t, s);
  return s;
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

TEST(DiffCompareTest, EqualBytesAreEqual) {
  const std::vector<float> a = {1.5f, -2.0f, 0.0f, 3.25f};
  const ElementStats s = Compared(DType::kFloat32, a, DType::kFloat32, a);
  EXPECT_EQ(s.compared, 4);
  EXPECT_EQ(s.differing, 0);
  EXPECT_EQ(s.first, -1);
  EXPECT_EQ(s.max_abs, 0);
}

TEST(DiffCompareTest, OneChangedElementGivesItsIndexAndDifferences) {
  const std::vector<float> a = {1.0f, 2.0f, 4.0f, 8.0f};
  std::vector<float> b = a;
  b[2] = 3.0f;  // |4 - 3| = 1, over |3|
  const ElementStats s =
      Compared(DType::kFloat32, a, DType::kFloat32, b, {}, /*first=*/100);
  EXPECT_EQ(s.differing, 1);
  EXPECT_EQ(s.first, 102);
  EXPECT_EQ(s.max_abs, 1.0);
  EXPECT_DOUBLE_EQ(s.max_rel, 1.0 / 3.0);
}

TEST(DiffCompareTest, NaNEqualsOnlyTheSameBitsWhenExact) {
  const float qnan = FromBits(0x7fc00000u), other = FromBits(0x7fc00001u);
  const std::vector<float> a = {qnan, qnan};
  const std::vector<float> b = {qnan, other};
  const ElementStats s = Compared(DType::kFloat32, a, DType::kFloat32, b);
  EXPECT_EQ(s.differing, 1);
  EXPECT_EQ(s.first, 1);
  EXPECT_EQ(s.max_abs, 0);  // two NaNs: no distance
  // With a tolerance, any NaN equals any NaN (equal_nan=True).
  EXPECT_EQ(
      Compared(DType::kFloat32, a, DType::kFloat32, b, {1e-9, 0}).differing, 0);
}

TEST(DiffCompareTest, NegativeZeroDiffersOnlyWhenExact) {
  const std::vector<float> a = {-0.0f}, b = {0.0f};
  const ElementStats s = Compared(DType::kFloat32, a, DType::kFloat32, b);
  EXPECT_EQ(s.differing, 1);
  EXPECT_EQ(s.max_abs, 0);
  EXPECT_EQ(s.max_rel, 0);
  EXPECT_EQ(
      Compared(DType::kFloat32, a, DType::kFloat32, b, {0, 1e-6}).differing, 0);
}

TEST(DiffCompareTest, IsCloseIsRelativeToB) {
  // |1 - 1.1| = 0.1 <= 0.05 + 0.05 * 1.1 = 0.105: close.
  // |1 - 1.2| = 0.2 >  0.05 + 0.05 * 1.2 = 0.11: not.
  const std::vector<double> a = {1.0, 1.0}, b = {1.1, 1.2};
  ElementStats s =
      Compared(DType::kFloat64, a, DType::kFloat64, b, {0.05, 0.05});
  EXPECT_EQ(s.differing, 1);
  EXPECT_EQ(s.first, 1);
  EXPECT_DOUBLE_EQ(s.max_abs, 0.2);
  EXPECT_DOUBLE_EQ(s.max_rel, 0.2 / 1.2);
  // rtol 0.6: |2 - 1| = 1 > 0.6 * |1|, but |1 - 2| = 1 <= 0.6 * |2|.
  s = Compared(DType::kFloat64, std::vector<double>{2.0}, DType::kFloat64,
               std::vector<double>{1.0}, {0, 0.6});
  EXPECT_EQ(s.differing, 1);
  s = Compared(DType::kFloat64, std::vector<double>{1.0}, DType::kFloat64,
               std::vector<double>{2.0}, {0, 0.6});
  EXPECT_EQ(s.differing, 0);
  // A zero reference: the relative difference is infinite.
  s = Compared(DType::kFloat64, std::vector<double>{0.5}, DType::kFloat64,
               std::vector<double>{0.0});
  EXPECT_EQ(s.max_abs, 0.5);
  EXPECT_EQ(s.max_rel, kInf);
}

TEST(DiffCompareTest, InfinitiesEqualOnlyThemselves) {
  const std::vector<double> a = {kInf, kInf, kInf, std::nan("")};
  const std::vector<double> b = {kInf, -kInf, 1e300, 1.0};
  const ElementStats s =
      Compared(DType::kFloat64, a, DType::kFloat64, b, {1e308, 1});
  EXPECT_EQ(s.differing, 3);
  EXPECT_EQ(s.first, 1);
  EXPECT_EQ(s.max_abs, kInf);
}

TEST(DiffCompareTest, DifferingDtypesCompareValues) {
  // bfloat16 0x3f80 is 1.0; 0x3f81 is 1 + 2^-7.
  const std::vector<uint16_t> a = {0x3f80, 0x3f81, 0xc000};
  const std::vector<float> b = {1.0f, 1.0f, -2.0f};
  const ElementStats s = Compared(DType::kBFloat16, a, DType::kFloat32, b);
  EXPECT_EQ(s.differing, 1);
  EXPECT_EQ(s.first, 1);
  EXPECT_EQ(s.max_abs, 0.0078125);
  // Integers of other widths, and bool against uint8.
  EXPECT_EQ(Compared(DType::kInt64, std::vector<int64_t>{-3, 7}, DType::kInt32,
                     std::vector<int32_t>{-3, 7})
                .differing,
            0);
  EXPECT_EQ(Compared(DType::kBool, std::vector<uint8_t>{1, 0}, DType::kFloat32,
                     std::vector<float>{1.0f, 0.5f})
                .differing,
            1);
}

TEST(DiffCompareTest, DifferencesAcrossBlocksMerge) {
  std::vector<float> a(10000, 1.0f);
  std::vector<float> b = a;
  b[9999] = 2.0f;
  b[5000] = 0.75f;
  ElementStats s = Compared(DType::kFloat32, a, DType::kFloat32, b);
  EXPECT_EQ(s.differing, 2);
  EXPECT_EQ(s.first, 5000);
  EXPECT_EQ(s.max_abs, 1.0);
  ElementStats later;
  later.compared = 1;
  later.differing = 1;
  later.first = 20000;
  later.max_rel = 9;
  s.Merge(later);
  EXPECT_EQ(s.differing, 3);
  EXPECT_EQ(s.first, 5000);
  EXPECT_EQ(s.max_rel, 9);
  EXPECT_EQ(s.compared, 10001);
}

TEST(DiffCompareTest, Float8Decoding) {
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E4M3Fn, 0x7e), 448.0);
  EXPECT_TRUE(std::isnan(Float8ToDouble(DType::kFloat8E4M3Fn, 0x7f)));
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E4M3Fn, 0x01), std::ldexp(1.0, -9));
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E4M3Fn, 0xc0), -2.0);
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E5M2, 0x7c), kInf);
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E5M2, 0x7b), 57344.0);
  EXPECT_TRUE(std::isnan(Float8ToDouble(DType::kFloat8E5M2, 0x7d)));
  EXPECT_TRUE(std::isnan(Float8ToDouble(DType::kFloat8E4M3Fnuz, 0x80)));
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E4M3Fnuz, 0x7f), 240.0);
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E4M3Fnuz, 0x08), std::ldexp(1.0, -7));
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E5M2Fnuz, 0x7f), 57344.0);
  EXPECT_EQ(Float8ToDouble(DType::kFloat8E5M2Fnuz, 0x04), std::ldexp(1.0, -15));
}

TEST(DiffCompareTest, ComplexComparesOnlyWithItsOwnDtype) {
  EXPECT_TRUE(ValuesComparable(DType::kComplex64, DType::kComplex64));
  EXPECT_FALSE(ValuesComparable(DType::kComplex64, DType::kFloat32));
  const std::vector<float> a = {1, 2}, b = {1, 2};
  ElementStats s;
  EXPECT_THROW(CompareElements(DType::kComplex64, Bytes(a), DType::kFloat32,
                               Bytes(b), 1, 0, {}, s),
               InternalError);
}

}  // namespace
}  // namespace ucp::diff
