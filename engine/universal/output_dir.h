#pragma once
// An output folder written under a temporary name next to its final name and
// renamed into place only by Commit(), so a failed run leaves nothing under
// the output name and never touches an existing folder. Staging of the same
// name left by runs that no longer exist is removed first (core/staging.h).

#include <cstdint>
#include <filesystem>

namespace ucp::universal {

class StagedDirectory {
 public:
  /// Throws UsageError if `final_dir` exists and is not an empty folder;
  /// IoError if the staging folder cannot be created.
  explicit StagedDirectory(std::filesystem::path final_dir);
  StagedDirectory(const StagedDirectory&) = delete;
  StagedDirectory& operator=(const StagedDirectory&) = delete;
  /// Removes the staging folder unless committed.
  ~StagedDirectory();

  /// Where to write (the staging folder).
  const std::filesystem::path& path() const noexcept { return staging_; }
  const std::filesystem::path& final_path() const noexcept { return final_; }
  /// Renames the staging folder onto the final name. Throws IoError.
  void Commit();

 private:
  std::filesystem::path final_;
  std::filesystem::path staging_;
  bool committed_ = false;
};

/// Fails early, naming both numbers, when the filesystem that will hold
/// `output` has less free space than `needed` (core/staging.h
/// RequireFreeSpace: IoError); nothing to check when the folder that would
/// hold it does not exist (its writer reports that).
void CheckFreeSpace(const std::filesystem::path& output, uint64_t needed);

}  // namespace ucp::universal
