#pragma once
// Element types of tensors as PyTorch names them. Storage is always
// little-endian; 16-bit floats keep their exact bits.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ucp {

enum class DType : uint8_t {
  kFloat64,
  kFloat32,
  kFloat16,
  kBFloat16,
  kInt64,
  kInt32,
  kInt16,
  kInt8,
  kUInt8,
  kBool,
  kComplex64,
  kComplex128,
  kUInt16,
  kUInt32,
  kUInt64,
  kFloat8E4M3Fn,
  kFloat8E5M2,
  kFloat8E4M3Fnuz,
  kFloat8E5M2Fnuz,
};

inline constexpr int kNumDTypes = 19;

/// Bytes per element.
size_t ElementSize(DType dtype) noexcept;

/// PyTorch's primary name without the "torch." prefix: "float32", "bfloat16".
std::string_view DTypeName(DType dtype) noexcept;

/// Inverse of DTypeName; also accepts "torch.float32" and the aliases
/// half/float/double/long/int/short. Absent for unknown names.
std::optional<DType> DTypeFromName(std::string_view name) noexcept;

/// True for float64/32/16, bfloat16 and the float8 types.
bool IsFloatingPoint(DType dtype) noexcept;

}  // namespace ucp
