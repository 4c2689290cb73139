#pragma once
// What a format driver's writer reads: the universal content, either from a
// universal file (StoreInput) or straight from a source checkpoint's plan
// (PlanInput, for `ucp convert`: nothing is materialised; every target tensor
// is composed from boxes of the source rank files).

#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "engine/atoms/atom_store.h"
#include "engine/reshape/executor.h"
#include "engine/reshape/plan.h"
#include "engine/universal/model.h"
#include "engine/universal/source_plan.h"

namespace ucp::torchfile {
class TorchFile;
}

namespace ucp::universal {

class UniversalInput {
 public:
  virtual ~UniversalInput() = default;

  /// For messages: the universal file, or the source checkpoint.
  virtual const std::filesystem::path& path() const noexcept = 0;
  /// The universal content's typed model (what the root attributes hold).
  virtual const Model& model() const noexcept = 0;
  /// Params sorted by their order attribute (then name).
  virtual std::span<const atoms::StoredParam> params() const noexcept = 0;
  virtual std::span<const atoms::DatasetInfo> datasets() const noexcept = 0;
  /// nullptr if absent.
  virtual const atoms::StoredParam* FindParam(std::string_view fqn) const = 0;
  virtual const atoms::DatasetInfo* FindAtom(std::string_view fqn,
                                             std::string_view kind) const = 0;
  virtual const atoms::DatasetInfo* FindPadAtom(
      std::string_view fqn, std::string_view kind) const = 0;
  virtual const atoms::DatasetInfo* FindOpaque(std::string_view key) const = 0;

  /// An opaque blob (torch.save bytes) opened as a torch file. Throws
  /// FormatError naming the key if it is not a torch.save archive.
  virtual std::shared_ptr<const torchfile::TorchFile> OpenBlob(
      const atoms::DatasetInfo& blob) const = 0;

  /// An opaque blob's bytes, whatever they hold (small blobs: they are
  /// read whole). Throws IoError naming the file if unreadable, FormatError
  /// if a stored blob's bytes do not match its xxh3.
  virtual std::string ReadBlob(const atoms::DatasetInfo& blob) const = 0;

  /// The dataset as a source tensor for CopyOps of jobs given to Run().
  virtual reshape::SourceTensor Tensor(const atoms::DatasetInfo& d) const = 0;
  /// Runs jobs whose ops read Tensor()s. Throws what reshape::Execute throws.
  virtual reshape::ExecutorStats Run(
      std::span<reshape::Job> jobs,
      const reshape::ExecutorOptions& options) const = 0;
};

/// A universal file. `store` must outlive the input.
std::unique_ptr<UniversalInput> StoreInput(const atoms::AtomStoreReader& store);

/// Which replicated regions a process verifies: the k-th replica of the
/// plan (atoms in order) when k % count == index. A job's processes
/// (engine/dist) each take their share; one process takes all.
struct ReplicaShare {
  int index = 0;
  int count = 1;
};

/// A source plan used directly. Verifies coverage and replicas first (like
/// WriteUniversal; throws FormatError on failure), the replicas of `share`.
/// `plan` must outlive the input; `path` names the source in messages.
std::unique_ptr<UniversalInput> PlanInput(
    const SourcePlan& plan, const std::filesystem::path& path,
    const reshape::ExecutorOptions& options, ReplicaShare share = {});

/// A lower bound of the bytes a checkpoint written from `input` takes: every
/// master weight and optimizer state (atoms other than training-dtype
/// copies and steps) once; with `weights_only`, the weights at their
/// smallest stored size.
uint64_t MinimumTargetBytes(const UniversalInput& input, bool weights_only);

}  // namespace ucp::universal
