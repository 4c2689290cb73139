#include "cli/dist.h"

#include <utility>

#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/core/staging.h"

namespace ucp::cli {

namespace {

std::unique_ptr<DistJob> g_job;
bool g_jobs_enabled = true;

}  // namespace

DistJob::DistJob(dist::Job job, std::string_view scope)
    : coordinator_(std::move(job), scope),
      split_(coordinator_),
      scoped_(&split_) {}

void SetJobsEnabled(bool enabled) noexcept { g_jobs_enabled = enabled; }

DistJob* StartJob(std::string_view command, const std::string& output) {
  UCP_CHECK(!g_job, "a job started twice");
  if (!g_jobs_enabled) return nullptr;
  std::optional<dist::Job> job = dist::JobFromEnvironment();
  if (!job) return nullptr;
  const std::string scope = StrCat(command, " ", OutputName(output).string());
  g_job = std::make_unique<DistJob>(std::move(*job), scope);
  if (!g_job->leader()) Progress::SetDefaultMode(Progress::Mode::kNever);
  return g_job.get();
}

DistJob* CurrentJob() { return g_job.get(); }

bool PrintsResult() { return !g_job || g_job->leader(); }

void ReportJobFailure(const Error& error) {
  if (g_job) g_job->coordinator().ReportError(error);
}

void EndJob() { g_job.reset(); }

JobOutput::JobOutput(const std::filesystem::path& output) {
  DistJob* job = CurrentJob();
  if (job == nullptr || job->leader()) {
    staged_.emplace(output);
    path_ = staged_->path();
    if (job) {
      job->coordinator().Publish("staging",
                                 std::filesystem::absolute(path_).string());
    }
  } else {
    path_ = job->coordinator().Fetch("staging");
  }
}

void JobOutput::Commit() {
  DistJob* job = CurrentJob();
  if (staged_) {
    staged_->Commit();
    if (job) job->coordinator().Publish("committed", "1");
  } else if (job) {
    job->coordinator().Fetch("committed");
  }
}

universal::ReplicaShare JobReplicaShare() {
  DistJob* job = CurrentJob();
  if (job == nullptr) return {};
  return {job->coordinator().rank(), job->coordinator().world()};
}

json::Value JobProcesses() {
  DistJob* job = CurrentJob();
  if (job == nullptr || !job->leader()) return json::Value();
  return job->split().Processes();
}

}  // namespace ucp::cli
