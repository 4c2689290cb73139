#pragma once
// Shapes, strides and strided copies of raw tensor bytes (row-major, element
// units, as PyTorch counts them).

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace ucp {

using Shape = std::vector<int64_t>;

/// Product of the dims; absent if a dim is negative or the product overflows.
std::optional<int64_t> CheckedNumElements(
    std::span<const int64_t> shape) noexcept;

/// Product of the dims. Throws InternalError if negative or overflowing.
int64_t NumElements(std::span<const int64_t> shape);

/// "[4, 6]" for messages.
std::string ShapeString(std::span<const int64_t> shape);

/// Row-major strides of a contiguous tensor of this shape.
std::vector<int64_t> ContiguousStrides(std::span<const int64_t> shape);

/// True if (shape, stride) describes a row-major contiguous tensor (dims of
/// size 1 may carry any stride, as in PyTorch).
bool IsContiguous(std::span<const int64_t> shape,
                  std::span<const int64_t> stride) noexcept;

/// The element range [begin, end) of a storage that a view touches. Absent
/// for a view with zero elements. Throws FormatError if ranks differ, a size
/// or stride or the offset is negative, or the arithmetic overflows.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
};
std::optional<ElementRange> ViewExtent(std::span<const int64_t> shape,
                                       std::span<const int64_t> stride,
                                       int64_t offset);

/// Copies the elements of the strided view (shape, stride) whose first element
/// is at `base` into `dst`, contiguous and row-major. `base` must cover the
/// whole view (see ViewExtent).
void GatherStrided(const std::byte* base, size_t element_size,
                   std::span<const int64_t> shape,
                   std::span<const int64_t> stride, std::byte* dst);

}  // namespace ucp
