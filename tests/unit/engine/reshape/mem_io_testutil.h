#pragma once
// In-memory byte source and sink for the executor's tests: the source counts
// its reads and bytes read, the sink records where each write landed.

#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/reshape/executor.h"

namespace ucp::testutil {

class MemSource : public reshape::ByteSource {
 public:
  explicit MemSource(std::string bytes) : bytes_(std::move(bytes)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    if (offset + dst.size() > bytes_.size()) throw FormatError("read past end");
    std::memcpy(dst.data(), bytes_.data() + offset, dst.size());
    reads_ += 1;
    bytes_read_ += dst.size();
  }
  std::string Describe() const override { return "memory"; }
  const std::string& bytes() const { return bytes_; }
  mutable std::atomic<int> reads_{0};
  mutable std::atomic<uint64_t> bytes_read_{0};

 private:
  std::string bytes_;
};

class MemSink : public reshape::ByteSink {
 public:
  explicit MemSink(size_t size) : bytes_(size, '\xAB') {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    std::lock_guard<std::mutex> lock(mu_);
    ASSERT_LE(offset + data.size(), bytes_.size());
    std::memcpy(bytes_.data() + offset, data.data(), data.size());
    offsets_.push_back(offset);
  }
  std::string bytes_;
  std::vector<uint64_t> offsets_;
  std::mutex mu_;
};

}  // namespace ucp::testutil
