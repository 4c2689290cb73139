#pragma once
// The one stage that writes every target checkpoint: executes a TargetPlan
// (target_plan.h) into an output folder.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <vector>

#include "engine/formats/target_plan.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"

namespace ucp::formats {

/// Emit spread over the processes of a job (engine/dist implements it): each
/// process plans the whole target (pass 1: every file's tensor bytes), writes
/// the files with tensor slots assigned to it (pass 2; the executor then
/// reads only the source bytes they need), and reports them; the process of
/// rank 0 then writes the files without slots (trackers, metadata, indexes,
/// which plans list last) and ucp.manifest.json from every process's entries.
class EmitSplit {
 public:
  struct File {
    std::filesystem::path path;  // relative to the output folder
    uint64_t bytes = 0;          // the slots' tensor bytes
    bool slots = false;
  };
  virtual ~EmitSplit() = default;
  /// This process's rank; rank 0 writes the files without slots.
  virtual int rank() const = 0;
  /// The process that writes each of `files` (every file of the plan, in
  /// plan order), the same on every process.
  virtual std::vector<int> Assign(const std::vector<File>& files) = 0;
  /// After this process wrote and synced its files: sends `report` (JSON:
  /// "files", "bytes", "bytes_read", "seconds", "manifest": a count; the
  /// entries are in part files, emit.cc) to rank 0. On rank 0, returns every
  /// process's report (rank order) once all were sent; elsewhere, absent at
  /// once. Throws the first error of any process, IoError if one stopped.
  virtual std::optional<std::vector<json::Value>> Finished(
      json::Value report) = 0;
};

/// Makes `split` the one Emit uses when EmitOptions::split is null (for the
/// Emit calls inside drivers and the export), until destroyed.
class ScopedEmitSplit {
 public:
  explicit ScopedEmitSplit(EmitSplit* split) noexcept;
  ~ScopedEmitSplit();
  ScopedEmitSplit(const ScopedEmitSplit&) = delete;
  ScopedEmitSplit& operator=(const ScopedEmitSplit&) = delete;

 private:
  EmitSplit* previous_;
};

struct EmitOptions {
  reshape::ExecutorOptions executor;
  /// Also write ucp.manifest.json (formats/common/integrity.h) into the
  /// plan's checkpoint folder, describing the files written there.
  bool manifest = false;
  /// Files open at once (their graphs and slots in memory).
  size_t batch_files = 32;
  /// This process's share of a job (null: the ScopedEmitSplit's, if any;
  /// else the process writes everything).
  EmitSplit* split = nullptr;
};

/// Plans the plan's units in order and writes their files into `out_dir` (an
/// existing folder; wrap it in a universal::StagedDirectory so that a
/// failure leaves nothing under the final name): in batches of at most
/// `batch_files` files, each batch opened (known bytes written), its slots
/// filled by the executor within the memory budget, then its files committed
/// in plan order (fsynced unless --no-sync). Returns the plan's summary with
/// the files and bytes written. Under an EmitSplit, see there: the summary
/// of rank 0 counts every process's files, the others' their own. Throws what
/// planning, the executor and the containers throw, with the file as context.
TargetSummary Emit(const TargetPlan& plan,
                   const universal::UniversalInput& input,
                   const std::filesystem::path& out_dir,
                   const EmitOptions& options);

}  // namespace ucp::formats
