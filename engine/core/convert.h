#pragma once
// Element-wise dtype conversion with PyTorch's exact rounding:
// float32 -> bfloat16 and float32 -> float16 round to nearest even (NaN stays
// NaN), widening conversions are exact. Used when a target rank file stores a
// parameter in its training dtype and the universal file holds float32.

#include <cstddef>

#include "engine/core/dtype.h"

namespace ucp {

/// True if ConvertElements supports from -> to.
bool CanConvert(DType from, DType to) noexcept;

/// Converts `count` elements. Same dtype is a plain copy; supported pairs:
/// float32 <-> bfloat16, float32 <-> float16, float32 <-> float64,
/// bfloat16/float16 -> float64. Throws InternalError for other pairs.
void ConvertElements(DType from, const void* src, DType to, void* dst,
                     size_t count);

/// Scalar helpers (bit patterns of 16-bit floats).
uint16_t Float32ToBFloat16(float value) noexcept;
float BFloat16ToFloat32(uint16_t bits) noexcept;
uint16_t Float32ToFloat16(float value) noexcept;
float Float16ToFloat32(uint16_t bits) noexcept;

}  // namespace ucp
