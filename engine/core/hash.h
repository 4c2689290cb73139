#pragma once
// XXH3-64 checksums (stored per dataset in the universal file and used to
// compare tensors cheaply).

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

namespace ucp {

/// One-shot XXH3-64 of `data` (seed 0).
uint64_t Xxh3(std::span<const std::byte> data) noexcept;
uint64_t Xxh3(const void* data, size_t size) noexcept;

/// Lower-case 16-digit hex of a 64-bit hash.
std::string HashHex(uint64_t hash);

/// Streaming XXH3-64: Update() over consecutive pieces gives the same digest
/// as Xxh3() over their concatenation.
class Xxh3Hasher {
 public:
  Xxh3Hasher();
  Xxh3Hasher(Xxh3Hasher&&) noexcept;
  Xxh3Hasher& operator=(Xxh3Hasher&&) noexcept;
  ~Xxh3Hasher();
  void Update(const void* data, size_t size) noexcept;
  uint64_t Digest() const noexcept;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace ucp
