#pragma once
// Staging names, leftovers of crashed runs, and free space.
//
// ucp writes every output under a hidden name beside its final name and
// renames it at the end: a folder `.<name>.ucp-partial-<pid>-<start>-XXXXXX`
// (universal::StagedDirectory) or a file `.<name>.ucp-tmp-<pid>-<start>-<n>`
// (OutputFile), where <pid> and <start> (the process's start time in clock
// ticks since boot, /proc/<pid>/stat field 22) name the writing process. A
// run killed with SIGKILL leaves its staging behind; the next run writing the
// same name removes every staging of that name whose process no longer exists
// (no process <pid>, or one started at another time: the pid was reused),
// never one that is still running. `ucp verify` / `ucp inspect` report
// leftovers in and beside a folder.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace ucp {

/// An output path as a name: "out/" (and "out//") -> "out"; the root and
/// "" unchanged.
std::filesystem::path OutputName(std::filesystem::path path);

/// "<pid>-<start>" of this process (computed once).
const std::string& StagingToken();

struct Leftover {
  std::filesystem::path path;  // the staging folder or file
  int64_t pid = 0;
  bool running = false;  // its process still exists
  uint64_t bytes = 0;    // on disk (files' sizes, recursively)
};

/// Staging entries for `final_path` (siblings named after it).
std::vector<Leftover> FindLeftovers(const std::filesystem::path& final_path);
/// Every staging entry directly inside `dir` (any name).
std::vector<Leftover> FindLeftoversIn(const std::filesystem::path& dir);
/// Removes the staging entries of `final_path` whose process is gone;
/// returns what was removed. Errors while removing are ignored (the entry
/// stays, as before).
std::vector<Leftover> ReclaimLeftovers(const std::filesystem::path& final_path);

/// Free bytes for unprivileged writers on the filesystem holding `dir`
/// (statvfs). The environment variable UCP_TESTING_FREE_BYTES, if set,
/// replaces the reading (tests). Throws IoError if `dir` cannot be queried.
uint64_t FreeBytes(const std::filesystem::path& dir);
/// Throws IoError "not enough free space for <what>: needs at least <needed>
/// bytes, <free> free on the filesystem of <dir>" before anything is written.
void RequireFreeSpace(const std::filesystem::path& dir, uint64_t needed,
                      std::string_view what);

}  // namespace ucp
