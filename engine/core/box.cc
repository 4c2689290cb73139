#include "engine/core/box.h"

#include <algorithm>

namespace ucp {

Box Box::Whole(std::span<const int64_t> shape) {
  return Box{Shape(shape.size(), 0), Shape(shape.begin(), shape.end())};
}

int64_t Box::NumElements() const noexcept {
  int64_t n = 1;
  for (int64_t d : size) n *= d;
  return n;
}

std::string Box::ToString() const {
  std::string s = "[";
  for (size_t i = 0; i < size.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(offset[i]) + ":" + std::to_string(offset[i] + size[i]);
  }
  return s + "]";
}

bool BoxInside(const Box& box, std::span<const int64_t> shape) noexcept {
  if (box.offset.size() != shape.size() || box.size.size() != shape.size()) {
    return false;
  }
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t end = 0;
    if (box.offset[d] < 0 || box.size[d] < 0 ||
        __builtin_add_overflow(box.offset[d], box.size[d], &end) ||
        end > shape[d]) {
      return false;
    }
  }
  return true;
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  UCP_CHECK(a.rank() == b.rank());
  Box r{Shape(a.rank()), Shape(a.rank())};
  for (size_t d = 0; d < a.rank(); ++d) {
    int64_t lo = std::max(a.offset[d], b.offset[d]);
    int64_t hi = std::min(a.offset[d] + a.size[d], b.offset[d] + b.size[d]);
    if (hi <= lo) return std::nullopt;
    r.offset[d] = lo;
    r.size[d] = hi - lo;
  }
  return r;
}

Box Shifted(const Box& box, std::span<const int64_t> delta) {
  Box r = box;
  for (size_t d = 0; d < r.rank(); ++d) r.offset[d] += delta[d];
  return r;
}

Runs ContiguousRuns(const Box& box, std::span<const int64_t> shape) {
  Runs runs;
  ForEachRunPair(box, shape, box, shape,
                 [&](int64_t start, int64_t, int64_t length) {
                   runs.length = length;
                   runs.starts.push_back(start);
                 });
  return runs;
}

}  // namespace ucp
