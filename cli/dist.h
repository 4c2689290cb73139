#pragma once
// A command run as one job of several processes when a launcher's
// environment says so (engine/dist): the job this process is part of, the
// output folder staged by rank 0 for all of them.

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "engine/dist/coordinator.h"
#include "engine/dist/split.h"
#include "engine/formats/emit.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"

namespace ucp::cli {

class DistJob {
 public:
  DistJob(dist::Job job, std::string_view scope);
  dist::Coordinator& coordinator() noexcept { return coordinator_; }
  dist::JobSplit& split() noexcept { return split_; }
  bool leader() const noexcept { return coordinator_.leader(); }

 private:
  dist::Coordinator coordinator_;
  dist::JobSplit split_;
  formats::ScopedEmitSplit scoped_;
};

/// Whether StartJob may join a launcher's job (default true). The Python
/// module turns it off: a training script's ranks calling ucp.convert each
/// convert alone, in their own process (a job is `torchrun ... ucp`).
void SetJobsEnabled(bool enabled) noexcept;

/// Joins the job the launcher's environment describes (nullptr: none, the
/// command runs alone), for `command` writing `output`; the processes other
/// than rank 0 show no progress. Once per run. Throws UsageError for an
/// inconsistent environment, IoError when the store is unreachable.
DistJob* StartJob(std::string_view command, const std::string& output);
/// The job StartJob joined, or nullptr.
DistJob* CurrentJob();
/// True unless this process is a job's rank other than 0 (which prints
/// nothing on success).
bool PrintsResult();
/// main(): tells the job's other processes of this one's failure.
void ReportJobFailure(const Error& error);
/// Runs `body`, a command's writing into a JobOutput, reporting an Error it
/// throws to the job before unwinding on: rank 0's JobOutput removes the
/// staging folder the others write into, and they must learn the first error
/// before they fail on the missing folder.
template <class F>
void ReportingFailures(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    ReportJobFailure(e);
    throw;
  }
}
/// main(): leaves the job (before exiting).
void EndJob();
/// A staging file or folder of this process that goes if another process's
/// failure ends this one (the heartbeat's _exit runs no destructor; without
/// a job nothing is recorded). KeepOnAbort once it is committed or removed.
void RemoveOnAbort(const std::filesystem::path& path);
void KeepOnAbort(const std::filesystem::path& path);

/// The output folder of a command: staged by rank 0 (or the one process),
/// whose staging path the others fetch.
class JobOutput {
 public:
  /// Throws what StagedDirectory throws (rank 0), or the job's first error.
  explicit JobOutput(const std::filesystem::path& output);
  /// Where to write.
  const std::filesystem::path& path() const noexcept { return path_; }
  /// Whether this process commits (and checks free space, prints).
  bool owner() const noexcept { return staged_.has_value(); }
  /// Rank 0: renames the folder into place, then lets the others finish;
  /// others: wait for that. Throws IoError, the job's first error.
  void Commit();

 private:
  std::optional<universal::StagedDirectory> staged_;
  std::filesystem::path path_;
};

/// The job's side of writing one universal file (to-universal as a job):
/// the datasets assigned by the job's split (the plan digest checked, as
/// convert's files), the allocated file shared, the reports gathered, the
/// commit awaited.
std::unique_ptr<universal::UniversalJob> UniversalJobOf(DistJob& job);

/// This process's share of the source's replica checks (all of them
/// without a job).
universal::ReplicaShare JobReplicaShare();

/// The "processes" member of --json (rank 0 of a job), else null.
json::Value JobProcesses();

}  // namespace ucp::cli
