#pragma once
// The element comparison of `ucp diff` (diff.h), on buffers of elements:
//
//   exact (Tolerance{} and equal dtypes): element i of a and b are equal when
//     their bytes are; so a NaN equals a NaN of the same bits only, and -0.0
//     differs from 0.0.
//   numeric (atol or rtol > 0, or the two dtypes differ): both elements as
//     doubles x, y (bool 0/1, integers, every float type including float8);
//     equal when numpy.isclose(x, y, rtol, atol, equal_nan=True) is:
//     |x - y| <= atol + rtol * |y| for finite x, y; x == y when either is
//     infinite; any NaN equals any NaN. Elements of equal bytes and dtype are
//     equal without conversion (int64 values beyond 2^53 whose bytes differ
//     compare as their nearest doubles). Complex values are compared by their
//     bytes only (same dtype) or not at all (ValuesComparable).
//
// A differing element's absolute difference is |x - y| (infinite when one is
// NaN and the other not, or for infinities that differ; 0 for -0.0 vs 0.0 or
// two NaNs of other bits), its relative difference that over |y| (b is the
// reference, as numpy's isclose takes it; infinite when y is 0 and the
// absolute difference is not).

#include <cstddef>
#include <cstdint>

#include "engine/core/dtype.h"

namespace ucp::diff {

struct Tolerance {
  double atol = 0;
  double rtol = 0;
  /// Bitwise comparison (for equal dtypes).
  bool exact() const noexcept { return atol == 0 && rtol == 0; }
};

/// What a comparison of elements found; chunks' stats merge.
struct ElementStats {
  int64_t compared = 0;   // elements compared
  int64_t differing = 0;  // elements found different
  int64_t first = -1;     // flat index of the first differing one; -1: none
  double max_abs = 0;     // largest absolute difference of a differing one
  double max_rel = 0;     // largest relative difference of a differing one
  void Merge(const ElementStats& other) noexcept;
};

/// Whether values of these dtypes compare at all (false when one is complex
/// and the dtypes differ).
bool ValuesComparable(DType a, DType b) noexcept;

/// Element `i` of `data` (little-endian elements of `dtype`) as a double;
/// NaN for complex dtypes.
double ElementToDouble(DType dtype, const std::byte* data, int64_t i) noexcept;

/// A float8 byte's value (dtype kFloat8E4M3Fn, kFloat8E5M2, kFloat8E4M3Fnuz
/// or kFloat8E5M2Fnuz), as ml_dtypes / torch decode it.
double Float8ToDouble(DType dtype, uint8_t bits) noexcept;

/// Compares elements [0, count) of `a` and `b` (elements `first_index` +
/// [0, count) of their tensors) by the rules above and adds what it finds to
/// `stats`. Throws InternalError unless ValuesComparable(a_dtype, b_dtype).
void CompareElements(DType a_dtype, const std::byte* a, DType b_dtype,
                     const std::byte* b, int64_t count, int64_t first_index,
                     const Tolerance& tolerance, ElementStats& stats);

}  // namespace ucp::diff
