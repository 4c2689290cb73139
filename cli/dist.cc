#include "cli/dist.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/core/staging.h"

namespace ucp::cli {

namespace {

std::unique_ptr<DistJob> g_job;
bool g_jobs_enabled = true;

// --progress of a job on rank 0: the job's sums, drawn from the heartbeat
// thread (Coordinator::SetProgressSink), in Progress's shape with the
// processes counted.
struct JobProgressLine {
  std::mutex mu;
  bool drawn = false, finished = false;
  std::string label;
  uint64_t total = 0;
  int world = 1;
  std::chrono::steady_clock::time_point start =
      std::chrono::steady_clock::now();

  void Draw(const std::string& l, uint64_t done, uint64_t t, int reporting) {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return;
    drawn = true;
    label = l;
    total = t;
    const double frac =
        t > 0
            ? std::min(1.0, static_cast<double>(done) / static_cast<double>(t))
            : 0.0;
    constexpr int kWidth = 30;
    std::string bar(kWidth, '.');
    for (int i = 0; i < static_cast<int>(frac * kWidth); ++i)
      bar[static_cast<size_t>(i)] = '#';
    std::fprintf(stderr,
                 "\r\033[K%s [%s] %3.0f%% %s / %s (%d of %d processes "
                 "reporting)",
                 label.c_str(), bar.c_str(), frac * 100,
                 HumanBytes(static_cast<double>(done)).c_str(),
                 HumanBytes(static_cast<double>(t)).c_str(), reporting, world);
    std::fflush(stderr);
  }
  // The final line (success) or the line erased (failure).
  void End(bool ok) {
    std::lock_guard<std::mutex> lock(mu);
    if (finished) return;
    finished = true;
    if (!drawn) return;
    if (!ok) {
      std::fprintf(stderr, "\r\033[K");
    } else {
      const double secs = std::chrono::duration<double>(
                              std::chrono::steady_clock::now() - start)
                              .count();
      std::fprintf(stderr, "\r\033[K%s: %s in %.1f s by %d processes\n",
                   label.c_str(),
                   HumanBytes(static_cast<double>(total)).c_str(), secs, world);
    }
    std::fflush(stderr);
  }
};
JobProgressLine* g_progress_line = nullptr;  // leaked: the heartbeat's

// Rank 0's staging files and folders that an abort (below) removes: the
// heartbeat ends the process with _exit, which runs no destructor.
std::mutex g_staging_mu;
std::vector<std::filesystem::path> g_staging;

}  // namespace

namespace {

// The coordinator's options: its abort (another process failed while this
// one was busy) erases a progress line before the error line.
dist::CoordinatorOptions JobOptions() {
  dist::CoordinatorOptions o = dist::CoordinatorOptions::FromEnvironment();
  o.abort = [](const Error& e) {
    if (g_progress_line) g_progress_line->End(false);
    {
      std::lock_guard<std::mutex> lock(g_staging_mu);
      std::error_code ignored;
      for (const std::filesystem::path& f : g_staging)
        std::filesystem::remove_all(f, ignored);
    }
    std::string line = e.what();
    std::replace(line.begin(), line.end(), '\n', ' ');
    std::replace(line.begin(), line.end(), '\r', ' ');
    std::fprintf(stderr, "ucp: %s: %s\n", e.kind(), line.c_str());
    std::fflush(stderr);
    ::_exit(e.ExitCode());
  };
  return o;
}

}  // namespace

DistJob::DistJob(dist::Job job, std::string_view scope)
    : coordinator_(std::move(job), scope, JobOptions()),
      split_(coordinator_),
      scoped_(&split_) {}

void SetJobsEnabled(bool enabled) noexcept { g_jobs_enabled = enabled; }

void RemoveOnAbort(const std::filesystem::path& path) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  g_staging.push_back(path);
}

void KeepOnAbort(const std::filesystem::path& path) {
  std::lock_guard<std::mutex> lock(g_staging_mu);
  std::erase(g_staging, path);
}

DistJob* StartJob(std::string_view command, const std::string& output) {
  UCP_CHECK(!g_job, "a job started twice");
  if (!g_jobs_enabled) return nullptr;
  std::optional<dist::Job> job = dist::JobFromEnvironment();
  if (!job) return nullptr;
  const std::string scope = StrCat(command, " ", OutputName(output).string());
  // Whether this process would draw progress (before the observer below).
  const bool draws = Progress::DefaultDraws();
  g_job = std::make_unique<DistJob>(std::move(*job), scope);
  if (!g_job->leader()) Progress::SetDefaultMode(Progress::Mode::kNever);
  // Each process's stages go to the coordinator, which publishes them with
  // its heartbeat; rank 0 draws the job's sums.
  dist::Coordinator* c = &g_job->coordinator();
  Progress::SetObserver(
      [c](const std::string& label, uint64_t done, uint64_t total) {
        c->SetProgress(label, done, total);
      });
  if (g_job->leader() && draws) {
    g_progress_line = new JobProgressLine();
    g_progress_line->world = c->world();
    c->SetProgressSink([line = g_progress_line](const std::string& label,
                                                uint64_t done, uint64_t total,
                                                int reporting) {
      line->Draw(label, done, total, reporting);
    });
  }
  return g_job.get();
}

DistJob* CurrentJob() { return g_job.get(); }

bool PrintsResult() { return !g_job || g_job->leader(); }

void ReportJobFailure(const Error& error) {
  if (g_progress_line) g_progress_line->End(false);
  if (g_job) g_job->coordinator().ReportError(error);
}

void EndJob() {
  // Rank 0's coordinator reads the others' last progress as they leave:
  // the final line after it.
  if (g_job) Progress::SetObserver({});
  g_job.reset();
  if (g_progress_line) g_progress_line->End(true);
}

JobOutput::JobOutput(const std::filesystem::path& output) {
  DistJob* job = CurrentJob();
  if (job == nullptr || job->leader()) {
    staged_.emplace(output);
    path_ = staged_->path();
    if (job) {
      RemoveOnAbort(std::filesystem::absolute(path_));
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
    if (job) {
      KeepOnAbort(std::filesystem::absolute(path_));
      job->coordinator().Publish("committed", "1");
    }
  } else if (job) {
    job->coordinator().Fetch("committed");
  }
}

namespace {

class CoordinatedUniversal : public universal::UniversalJob {
 public:
  explicit CoordinatedUniversal(DistJob& job) : job_(job) {}
  int rank() const override { return job_.coordinator().rank(); }
  int world() const override { return job_.coordinator().world(); }
  std::vector<int> Assign(const std::vector<Dataset>& datasets) override {
    std::vector<formats::EmitSplit::File> files;
    files.reserve(datasets.size());
    for (const Dataset& d : datasets)
      files.push_back({d.path, d.bytes, d.assigned});
    return job_.split().Assign(files);
  }
  std::string Share(std::string_view name, std::string_view value) override {
    if (!job_.leader()) return job_.coordinator().Fetch(name);
    job_.coordinator().Publish(name, value);
    return std::string(value);
  }
  std::vector<json::Value> Gather(json::Value report) override {
    std::optional<std::vector<json::Value>> all =
        job_.split().Finished(std::move(report));
    return all ? *std::move(all) : std::vector<json::Value>();
  }
  void Staging(const std::filesystem::path& file) override {
    RemoveOnAbort(file);
  }
  void Failed(const Error& error) override { ReportJobFailure(error); }
  void Committed() override {
    if (job_.leader()) {
      job_.coordinator().Publish("committed", "1");
    } else {
      job_.coordinator().Fetch("committed");
    }
  }

 private:
  DistJob& job_;
};

}  // namespace

std::unique_ptr<universal::UniversalJob> UniversalJobOf(DistJob& job) {
  return std::make_unique<CoordinatedUniversal>(job);
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
