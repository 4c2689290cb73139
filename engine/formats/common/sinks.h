#pragma once
// Byte sinks every torch-based driver uses: into a tensor of a torch.save
// file being written, and into memory (small tensors read back).

#include <algorithm>
#include <cstddef>
#include <span>
#include <vector>

#include "engine/core/error.h"
#include "engine/reshape/executor.h"
#include "engine/torchfile/torch_writer.h"

namespace ucp::formats {

/// Writes a job's bytes into one tensor node of a TorchWriter (after Begin).
class WriterSink : public reshape::ByteSink {
 public:
  WriterSink(torchfile::TorchWriter& writer, const pickle::Value* node)
      : writer_(writer), node_(node) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    writer_.WriteTensorData(node_, offset, data);
  }

 private:
  torchfile::TorchWriter& writer_;
  const pickle::Value* node_;
};

/// Collects a small tensor's bytes.
class MemorySink : public reshape::ByteSink {
 public:
  explicit MemorySink(size_t n) : bytes_(n) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    UCP_CHECK(offset + data.size() <= bytes_.size(), "write past the end");
    std::copy(data.begin(), data.end(),
              bytes_.begin() + static_cast<std::ptrdiff_t>(offset));
  }
  const std::vector<std::byte>& bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

}  // namespace ucp::formats
