#include "engine/core/dtype.h"

#include <array>

namespace ucp {
namespace {

struct DTypeInfo {
  DType dtype;
  std::string_view name;
  size_t size;
  bool floating;
};

constexpr std::array<DTypeInfo, kNumDTypes> kInfo = {{
    {DType::kFloat64, "float64", 8, true},
    {DType::kFloat32, "float32", 4, true},
    {DType::kFloat16, "float16", 2, true},
    {DType::kBFloat16, "bfloat16", 2, true},
    {DType::kInt64, "int64", 8, false},
    {DType::kInt32, "int32", 4, false},
    {DType::kInt16, "int16", 2, false},
    {DType::kInt8, "int8", 1, false},
    {DType::kUInt8, "uint8", 1, false},
    {DType::kBool, "bool", 1, false},
    {DType::kComplex64, "complex64", 8, false},
    {DType::kComplex128, "complex128", 16, false},
    {DType::kUInt16, "uint16", 2, false},
    {DType::kUInt32, "uint32", 4, false},
    {DType::kUInt64, "uint64", 8, false},
    {DType::kFloat8E4M3Fn, "float8_e4m3fn", 1, true},
    {DType::kFloat8E5M2, "float8_e5m2", 1, true},
    {DType::kFloat8E4M3Fnuz, "float8_e4m3fnuz", 1, true},
    {DType::kFloat8E5M2Fnuz, "float8_e5m2fnuz", 1, true},
}};

const DTypeInfo& Info(DType dtype) noexcept {
  return kInfo[static_cast<size_t>(dtype)];
}

}  // namespace

size_t ElementSize(DType dtype) noexcept { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) noexcept { return Info(dtype).name; }
bool IsFloatingPoint(DType dtype) noexcept { return Info(dtype).floating; }

std::optional<DType> DTypeFromName(std::string_view name) noexcept {
  if (name.starts_with("torch.")) name.remove_prefix(6);
  for (const DTypeInfo& info : kInfo) {
    if (info.name == name) return info.dtype;
  }
  if (name == "half") return DType::kFloat16;
  if (name == "float") return DType::kFloat32;
  if (name == "double") return DType::kFloat64;
  if (name == "long") return DType::kInt64;
  if (name == "int") return DType::kInt32;
  if (name == "short") return DType::kInt16;
  if (name == "cfloat") return DType::kComplex64;
  if (name == "cdouble") return DType::kComplex128;
  return std::nullopt;
}

}  // namespace ucp
