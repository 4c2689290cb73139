#pragma once
// The processes of one job, coordinated through LibTorch's c10d TCPStore
// (hosted by rank 0 at Job::store_host:store_port; the other processes are
// its clients). Small messages only, a fixed handful per process: a barrier,
// a published string, a report gathered to rank 0, the first error.
//
// Every wait polls the store with a bounded timeout and checks, each time,
// the job's error key (set once, by the first process that fails: the
// others stop with that error) and the store itself (gone: rank 0 died).
// Each process also beats a heartbeat from a thread of its own; a process
// whose heartbeat stalls (killed) makes the waiting ones fail naming it, and
// a process busy writing learns of another's failure from its heartbeat
// thread, which ends it (the staging folder stays behind, for the next run to
// reclaim). Keys are prefixed per job (run id and scope: the command and its
// output).
//
// Environment (seconds): UCP_DIST_TIMEOUT (longest wait, 86400),
// UCP_DIST_CONNECT_TIMEOUT (reaching rank 0's store, 300), UCP_DIST_DEAD_AFTER
// (a silent heartbeat, 60).

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/error.h"
#include "engine/dist/launcher.h"

namespace ucp::dist {

/// Another process's failure, as it reported it (its kind and exit code).
class RemoteError : public Error {
 public:
  RemoteError(std::string kind, int code, std::string message);
  const char* kind() const noexcept override { return kind_.c_str(); }
  int ExitCode() const noexcept override { return code_; }

 private:
  std::string kind_;
  int code_;
};

struct CoordinatorOptions {
  std::chrono::milliseconds timeout{std::chrono::hours(24)};
  std::chrono::milliseconds connect_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds dead_after{std::chrono::seconds(60)};
  std::chrono::milliseconds heartbeat{std::chrono::milliseconds(500)};
  /// Called (from the heartbeat thread) when another process failed or the
  /// store was lost while this one was not waiting: prints `error` and ends
  /// the process with its exit code. Default: "ucp: <kind>: <message>" on
  /// stderr, then _exit.
  std::function<void(const Error& error)> abort;
  /// The options above from the UCP_DIST_* environment variables. Throws
  /// UsageError for a value that is not a positive number.
  static CoordinatorOptions FromEnvironment();
};

/// Messages and bytes sent to the store by this process.
struct StoreStats {
  int64_t messages = 0;  // set, get, add, compare-set (not polls, heartbeats)
  uint64_t bytes = 0;    // keys and values of those
  int64_t polls = 0;     // checks while waiting, heartbeats
};

class Coordinator {
 public:
  /// Rank 0 hosts the store, the others connect to it (retrying until
  /// connect_timeout). `scope` names what the job does (the command and its
  /// output): the keys' prefix. Throws IoError naming host and port when the
  /// store cannot be hosted (port taken) or reached.
  Coordinator(
      Job job, std::string_view scope,
      CoordinatorOptions options = CoordinatorOptions::FromEnvironment());
  /// Leaves the job; rank 0 first waits (a few seconds at most) for every
  /// other process to leave, so that they read the store's last word.
  ~Coordinator();
  Coordinator(const Coordinator&) = delete;
  Coordinator& operator=(const Coordinator&) = delete;

  const Job& job() const noexcept;
  int rank() const noexcept { return job().rank; }
  int world() const noexcept { return job().world; }
  bool leader() const noexcept { return job().rank == 0; }

  /// Returns once every process reached barrier `name`. Throws RemoteError
  /// (another process failed), IoError (store lost, a process stopped, or
  /// the timeout).
  void Barrier(std::string_view name);
  /// Sets `name` to `value` for every process (any process may publish).
  void Publish(std::string_view name, std::string_view value);
  /// Waits for `name` to be published and returns it. Throws like Barrier.
  std::string Fetch(std::string_view name);
  /// Sends `payload` to rank 0; rank 0 returns every process's, in rank
  /// order, once all were sent; the others return an empty list at once.
  /// Throws like Barrier.
  std::vector<std::string> Gather(std::string_view name,
                                  std::string_view payload);
  /// Records `error` as the job's failure unless another process's came
  /// first (then nothing changes). Never throws (a lost store is ignored).
  void ReportError(const Error& error) noexcept;
  /// The same for a failure that is not a ucp::Error (its CLI kind and exit
  /// code).
  void ReportError(std::string_view kind, int code,
                   std::string_view message) noexcept;

  StoreStats stats() const;

  /// This process's progress (its current stage: `label`, `done` of `total`
  /// units). The heartbeat thread publishes it with its beat when it
  /// changed (one set per beat, 500 ms); rank 0's reads the others' once a
  /// second and passes the job's sums (rank 0's label) to the sink. These
  /// are polls, not messages (stats()). Thread-safe.
  void SetProgress(std::string_view label, uint64_t done, uint64_t total);
  /// Rank 0: receives the job's progress from the heartbeat thread, and the
  /// number of processes that reported one. Set it before the work starts.
  using ProgressSink = std::function<void(
      const std::string& label, uint64_t done, uint64_t total, int reporting)>;
  void SetProgressSink(ProgressSink sink);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::dist
