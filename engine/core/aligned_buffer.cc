#include "engine/core/aligned_buffer.h"

#include <cstdlib>
#include <new>
#include <utility>

namespace ucp {

AlignedBuffer::AlignedBuffer(size_t size) : size_(size) {
  if (size == 0) return;
  size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  void* p = std::aligned_alloc(kAlignment, rounded);
  if (p == nullptr) throw std::bad_alloc();
  data_ = static_cast<std::byte*>(p);
}

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

void AlignedBuffer::Reserve(size_t size) {
  if (size <= size_) return;
  *this = AlignedBuffer(size);
}

}  // namespace ucp
