#pragma once
// Overflow-safe range checks for sizes and offsets read from untrusted files.

#include <cstdint>

namespace ucp {

/// a + b <= limit, without overflow.
constexpr bool FitsWithin(uint64_t a, uint64_t b, uint64_t limit) noexcept {
  return a <= limit && b <= limit - a;
}

}  // namespace ucp
