#include "engine/diff/compare.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>

#include "engine/core/convert.h"
#include "engine/core/error.h"

namespace ucp::diff {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool IsComplex(DType d) {
  return d == DType::kComplex64 || d == DType::kComplex128;
}

template <typename T>
T Load(const std::byte* data, int64_t i) {
  T v;
  std::memcpy(&v, data + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

// A float8 value from its fields: `ebits` exponent bits with `bias`,
// `mbits` mantissa bits; subnormals at exponent 0.
double Float8Value(uint8_t bits, int ebits, int mbits, int bias) {
  const int m = bits & ((1 << mbits) - 1);
  const int e = (bits >> mbits) & ((1 << ebits) - 1);
  const double sign = (bits & 0x80) != 0 ? -1.0 : 1.0;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - mbits);
  return sign * std::ldexp((1 << mbits) + m, e - bias - mbits);
}

// |x - y| and over |y|, by the rules of compare.h.
void Delta(double x, double y, double& abs_diff, double& rel_diff) {
  if (x == y || (std::isnan(x) && std::isnan(y))) {
    abs_diff = 0;
  } else if (std::isnan(x) || std::isnan(y) || std::isinf(x) || std::isinf(y)) {
    abs_diff = kInf;
  } else {
    abs_diff = std::fabs(x - y);
  }
  if (abs_diff == 0) {
    rel_diff = 0;
  } else {
    const double ay = std::fabs(y);
    rel_diff = ay == 0 || std::isnan(ay) ? kInf : abs_diff / ay;
  }
}

bool Close(double x, double y, const Tolerance& t) {
  if (x == y) return true;
  if (std::isnan(x) || std::isnan(y)) return std::isnan(x) && std::isnan(y);
  if (std::isinf(x) || std::isinf(y)) return false;
  return std::fabs(x - y) <= t.atol + t.rtol * std::fabs(y);
}

void Differs(int64_t index, double x, double y, ElementStats& s) {
  double abs_diff = 0, rel_diff = 0;
  Delta(x, y, abs_diff, rel_diff);
  ++s.differing;
  if (s.first < 0 || index < s.first) s.first = index;
  s.max_abs = std::max(s.max_abs, abs_diff);
  s.max_rel = std::max(s.max_rel, rel_diff);
}

// Elements per block: the unit of the byte fast path and of conversions.
constexpr int64_t kBlock = 4096;

// Elements of one block as doubles.
void ToDoubles(DType dtype, const std::byte* data, int64_t n, double* out) {
  switch (dtype) {
    case DType::kFloat64:
      std::memcpy(out, data, static_cast<size_t>(n) * sizeof(double));
      return;
    case DType::kFloat32:
    case DType::kBFloat16:
    case DType::kFloat16:
      ConvertElements(dtype, data, DType::kFloat64, out,
                      static_cast<size_t>(n));
      return;
    default:
      for (int64_t i = 0; i < n; ++i) out[i] = ElementToDouble(dtype, data, i);
  }
}

}  // namespace

void ElementStats::Merge(const ElementStats& o) noexcept {
  compared += o.compared;
  differing += o.differing;
  if (o.first >= 0 && (first < 0 || o.first < first)) first = o.first;
  max_abs = std::max(max_abs, o.max_abs);
  max_rel = std::max(max_rel, o.max_rel);
}

bool ValuesComparable(DType a, DType b) noexcept {
  return a == b || (!IsComplex(a) && !IsComplex(b));
}

double Float8ToDouble(DType dtype, uint8_t bits) noexcept {
  switch (dtype) {
    case DType::kFloat8E4M3Fn:  // no infinities; NaN: S.1111.111
      if ((bits & 0x7f) == 0x7f) return kNaN;
      return Float8Value(bits, 4, 3, 7);
    case DType::kFloat8E5M2:  // IEEE-like: the top byte of a float16
      if ((bits & 0x7c) == 0x7c) {
        if ((bits & 0x03) != 0) return kNaN;
        return (bits & 0x80) != 0 ? -kInf : kInf;
      }
      return Float8Value(bits, 5, 2, 15);
    case DType::kFloat8E4M3Fnuz:  // no infinities, no -0: NaN is 0x80
      if (bits == 0x80) return kNaN;
      return Float8Value(bits, 4, 3, 8);
    case DType::kFloat8E5M2Fnuz:
      if (bits == 0x80) return kNaN;
      return Float8Value(bits, 5, 2, 16);
    default:
      return kNaN;
  }
}

double ElementToDouble(DType dtype, const std::byte* data, int64_t i) noexcept {
  switch (dtype) {
    case DType::kFloat64:
      return Load<double>(data, i);
    case DType::kFloat32:
      return Load<float>(data, i);
    case DType::kFloat16:
      return Float16ToFloat32(Load<uint16_t>(data, i));
    case DType::kBFloat16:
      return BFloat16ToFloat32(Load<uint16_t>(data, i));
    case DType::kInt64:
      return static_cast<double>(Load<int64_t>(data, i));
    case DType::kInt32:
      return Load<int32_t>(data, i);
    case DType::kInt16:
      return Load<int16_t>(data, i);
    case DType::kInt8:
      return Load<int8_t>(data, i);
    case DType::kUInt8:
      return Load<uint8_t>(data, i);
    case DType::kBool:
      return Load<uint8_t>(data, i) != 0 ? 1.0 : 0.0;
    case DType::kUInt16:
      return Load<uint16_t>(data, i);
    case DType::kUInt32:
      return Load<uint32_t>(data, i);
    case DType::kUInt64:
      return static_cast<double>(Load<uint64_t>(data, i));
    case DType::kFloat8E4M3Fn:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3Fnuz:
    case DType::kFloat8E5M2Fnuz:
      return Float8ToDouble(dtype, Load<uint8_t>(data, i));
    case DType::kComplex64:
    case DType::kComplex128:
      return kNaN;
  }
  return kNaN;
}

void CompareElements(DType a_dtype, const std::byte* a, DType b_dtype,
                     const std::byte* b, int64_t count, int64_t first_index,
                     const Tolerance& tolerance, ElementStats& stats) {
  UCP_CHECK(ValuesComparable(a_dtype, b_dtype), "diff: ", DTypeName(a_dtype),
            " and ", DTypeName(b_dtype), " values do not compare");
  stats.compared += count;
  const bool same = a_dtype == b_dtype;
  const bool exact = same && (tolerance.exact() || IsComplex(a_dtype));
  const auto ea = static_cast<int64_t>(ElementSize(a_dtype));
  const auto eb = static_cast<int64_t>(ElementSize(b_dtype));
  std::array<double, kBlock> x, y;
  for (int64_t at = 0; at < count; at += kBlock) {
    const int64_t n = std::min(kBlock, count - at);
    const std::byte* pa = a + at * ea;
    const std::byte* pb = b + at * eb;
    if (same && std::memcmp(pa, pb, static_cast<size_t>(n * ea)) == 0) {
      continue;  // equal bytes: equal in either mode
    }
    if (exact) {
      for (int64_t i = 0; i < n; ++i) {
        if (std::memcmp(pa + i * ea, pb + i * eb, static_cast<size_t>(ea)) ==
            0) {
          continue;
        }
        Differs(first_index + at + i, ElementToDouble(a_dtype, pa, i),
                ElementToDouble(b_dtype, pb, i), stats);
      }
      continue;
    }
    ToDoubles(a_dtype, pa, n, x.data());
    ToDoubles(b_dtype, pb, n, y.data());
    for (int64_t i = 0; i < n; ++i) {
      if (!Close(x[i], y[i], tolerance)) {
        Differs(first_index + at + i, x[i], y[i], stats);
      }
    }
  }
}

}  // namespace ucp::diff
