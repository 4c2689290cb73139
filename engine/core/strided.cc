#include "engine/core/strided.h"

#include <cstring>

#include "engine/core/error.h"

namespace ucp {

std::optional<int64_t> CheckedNumElements(
    std::span<const int64_t> shape) noexcept {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

int64_t NumElements(std::span<const int64_t> shape) {
  std::optional<int64_t> n = CheckedNumElements(shape);
  UCP_CHECK(n.has_value(), "invalid shape");
  return *n;
}

std::string ShapeString(std::span<const int64_t> shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(shape[i]);
  }
  return out + "]";
}

std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape) {
  std::vector<int64_t> stride(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    stride[i] = s;
    s *= shape[i] > 0 ? shape[i] : 1;
  }
  return stride;
}

bool IsContiguous(std::span<const int64_t> shape,
                  std::span<const int64_t> stride) noexcept {
  if (shape.size() != stride.size()) return false;
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 0) return true;
    if (shape[i] != 1 && stride[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::optional<ElementRange> ViewExtent(std::span<const int64_t> shape,
                                       std::span<const int64_t> stride,
                                       int64_t offset) {
  if (shape.size() != stride.size()) {
    throw FormatError("tensor has ", shape.size(), " sizes but ", stride.size(),
                      " strides");
  }
  if (offset < 0) throw FormatError("negative storage offset ", offset);
  int64_t last = offset;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) throw FormatError("negative size ", shape[i]);
    if (stride[i] < 0) throw FormatError("negative stride ", stride[i]);
    if (shape[i] == 0) return std::nullopt;
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t span = 0;
    if (__builtin_mul_overflow(shape[i] - 1, stride[i], &span) ||
        __builtin_add_overflow(last, span, &last)) {
      throw FormatError("tensor view arithmetic overflows");
    }
  }
  int64_t end = 0;
  if (__builtin_add_overflow(last, int64_t{1}, &end)) {
    throw FormatError("tensor view arithmetic overflows");
  }
  return ElementRange{offset, end};
}

namespace {

void GatherDim(const std::byte* base, size_t element_size,
               std::span<const int64_t> shape, std::span<const int64_t> stride,
               size_t dim, std::byte*& dst) {
  const int64_t n = shape[dim];
  const size_t step = static_cast<size_t>(stride[dim]) * element_size;
  if (dim + 1 == shape.size()) {
    if (stride[dim] == 1) {
      const size_t bytes = static_cast<size_t>(n) * element_size;
      std::memcpy(dst, base, bytes);
      dst += bytes;
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      std::memcpy(dst, base + i * step, element_size);
      dst += element_size;
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    GatherDim(base + i * step, element_size, shape, stride, dim + 1, dst);
  }
}

}  // namespace

void GatherStrided(const std::byte* base, size_t element_size,
                   std::span<const int64_t> shape,
                   std::span<const int64_t> stride, std::byte* dst) {
  UCP_CHECK(shape.size() == stride.size());
  if (shape.empty()) {
    std::memcpy(dst, base, element_size);
    return;
  }
  for (int64_t d : shape) {
    if (d == 0) return;
  }
  GatherDim(base, element_size, shape, stride, 0, dst);
}

}  // namespace ucp
