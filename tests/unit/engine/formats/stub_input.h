#pragma once
// Universal content for unit tests of the write stage: a model and params,
// no datasets (every Find* is absent, blobs empty); Run does nothing unless
// a test overrides it.

#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/universal/input.h"
#include "engine/universal/model.h"

namespace ucp::testutil {

class StubInput : public universal::UniversalInput {
 public:
  explicit StubInput(universal::Model model = {},
                     std::vector<atoms::StoredParam> params = {},
                     std::filesystem::path path = "content.ucp.h5")
      : path_(std::move(path)),
        model_(std::move(model)),
        params_(std::move(params)) {}
  const std::filesystem::path& path() const noexcept override { return path_; }
  const universal::Model& model() const noexcept override { return model_; }
  std::span<const atoms::StoredParam> params() const noexcept override {
    return params_;
  }
  std::span<const atoms::DatasetInfo> datasets() const noexcept override {
    return {};
  }
  const atoms::StoredParam* FindParam(std::string_view) const override {
    return nullptr;
  }
  const atoms::DatasetInfo* FindAtom(std::string_view,
                                     std::string_view) const override {
    return nullptr;
  }
  const atoms::DatasetInfo* FindPadAtom(std::string_view,
                                        std::string_view) const override {
    return nullptr;
  }
  const atoms::DatasetInfo* FindOpaque(std::string_view) const override {
    return nullptr;
  }
  std::shared_ptr<const torchfile::TorchFile> OpenBlob(
      const atoms::DatasetInfo&) const override {
    return nullptr;
  }
  std::string ReadBlob(const atoms::DatasetInfo&) const override { return {}; }
  reshape::SourceTensor Tensor(const atoms::DatasetInfo&) const override {
    return {};
  }
  reshape::ExecutorStats Run(std::span<reshape::Job>,
                             const reshape::ExecutorOptions&) const override {
    return {};
  }

 private:
  std::filesystem::path path_;
  universal::Model model_;
  std::vector<atoms::StoredParam> params_;
};

}  // namespace ucp::testutil
