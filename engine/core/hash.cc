#include "engine/core/hash.h"

#include <xxhash.h>

#include <cstdio>
#include <new>

namespace ucp {

uint64_t Xxh3(const void* data, size_t size) noexcept {
  return XXH3_64bits(data, size);
}

uint64_t Xxh3(std::span<const std::byte> data) noexcept {
  return XXH3_64bits(data.data(), data.size());
}

std::string HashHex(uint64_t hash) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx",
                static_cast<unsigned long long>(hash));
  return buf;
}

struct Xxh3Hasher::State {
  XXH3_state_t* s = nullptr;
  State() : s(XXH3_createState()) {
    if (s == nullptr) throw std::bad_alloc();
    XXH3_64bits_reset(s);
  }
  ~State() { XXH3_freeState(s); }
};

Xxh3Hasher::Xxh3Hasher() : state_(std::make_unique<State>()) {}
Xxh3Hasher::Xxh3Hasher(Xxh3Hasher&&) noexcept = default;
Xxh3Hasher& Xxh3Hasher::operator=(Xxh3Hasher&&) noexcept = default;
Xxh3Hasher::~Xxh3Hasher() = default;

void Xxh3Hasher::Update(const void* data, size_t size) noexcept {
  XXH3_64bits_update(state_->s, data, size);
}

uint64_t Xxh3Hasher::Digest() const noexcept {
  return XXH3_64bits_digest(state_->s);
}

}  // namespace ucp
