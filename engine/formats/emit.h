#pragma once
// The one stage that writes every target checkpoint: executes a TargetPlan
// (target_plan.h) into an output folder.

#include <cstddef>
#include <filesystem>

#include "engine/formats/target_plan.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"

namespace ucp::formats {

struct EmitOptions {
  reshape::ExecutorOptions executor;
  /// Also write ucp.manifest.json (formats/common/integrity.h) into the
  /// plan's checkpoint folder, describing the files written there.
  bool manifest = false;
  /// Files open at once (their graphs and slots in memory).
  size_t batch_files = 32;
};

/// Plans the plan's units in order and writes their files into `out_dir` (an
/// existing folder; wrap it in a universal::StagedDirectory so that a
/// failure leaves nothing under the final name): in batches of at most
/// `batch_files` files, each batch opened (known bytes written), its slots
/// filled by the executor within the memory budget, then its files committed
/// in plan order (fsynced unless --no-sync). Returns the plan's summary with
/// the files and bytes written. Throws what planning, the executor and the
/// containers throw, with the file as context.
TargetSummary Emit(const TargetPlan& plan,
                   const universal::UniversalInput& input,
                   const std::filesystem::path& out_dir,
                   const EmitOptions& options);

}  // namespace ucp::formats
