#pragma once
// Writes a universal file from a SourcePlan (to-universal).

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/error.h"
#include "engine/json/json.h"
#include "engine/reshape/executor.h"
#include "engine/torchfile/zip.h"
#include "engine/universal/source_plan.h"

namespace ucp::universal {

struct WriteSummary {
  int64_t params = 0;
  int64_t atoms = 0;
  uint64_t atom_bytes = 0;
  uint64_t bytes_read = 0;
  int64_t replicas_verified = 0;
  double seconds = 0;
  /// Bytes this process wrote (of a job: its datasets; else atom_bytes and
  /// the opaque blobs).
  uint64_t bytes_written = 0;
  /// Of a job: the datasets this process wrote.
  int64_t datasets_written = 0;
};

/// The processes of a job writing one universal file between them
/// (cli/dist.cc implements it on engine/dist's coordinator): every process
/// plans the same file; rank 0 allocates it, each process writes and
/// hashes the datasets assigned to it, rank 0 commits.
class UniversalJob {
 public:
  struct Dataset {
    std::string path;  // HDF5 path
    uint64_t bytes = 0;
    bool assigned = false;  // false: rank 0's (opaque blobs, empty ones)
  };
  virtual ~UniversalJob() = default;
  virtual int rank() const = 0;
  virtual int world() const = 0;
  /// The process writing each dataset: the assigned ones balanced by bytes,
  /// largest first, the others rank 0's; the same in every process. Throws
  /// UsageError if this process planned another file than rank 0.
  virtual std::vector<int> Assign(const std::vector<Dataset>& datasets) = 0;
  /// Rank 0 publishes `value` (a handful of bytes) and returns it; the
  /// others wait for rank 0's and return it.
  virtual std::string Share(std::string_view name, std::string_view value) = 0;
  /// Sends `report` (an object) to rank 0, which returns every process's in
  /// rank order once all arrived; the others return an empty list.
  virtual std::vector<json::Value> Gather(json::Value report) = 0;
  /// Rank 0, the file committed: tells the others; they wait for it.
  virtual void Committed() = 0;
  /// Rank 0: a file of its staging (the temporary file, the part files),
  /// to remove should this process be ended abruptly by another process's
  /// failure while it writes. Default: nothing.
  virtual void Staging(const std::filesystem::path& /*file*/) {}
  /// This process failed with `error` (called before its staging is
  /// removed, so that the others learn this error first). Default: nothing.
  virtual void Failed(const Error& /*error*/) {}
  /// The progress of the whole job (rank 0) from this process's: called
  /// with the bytes this process has written so far, returns the job's
  /// (absent: the job's are not known yet). Default: this process's.
  virtual uint64_t JobDone(uint64_t own) { return own; }
};

/// Creates `path` (atomically: nothing appears under that name on failure).
/// Throws FormatError if the fragments of an atom do not cover it exactly
/// (naming the atom and the elements missing), overlap partially, or if
/// replicas differ (naming both rank files); IoError on write failures.
///
/// With `job`, the processes write the one file between them: rank 0
/// creates and allocates the temporary file beside `path` and writes its
/// datasets' offsets into a hidden part file beside it
/// (`<temp>.offsets`, its name and xxh3 through the job); each process
/// writes, hashes and fsyncs its datasets (reading only the source bytes
/// they need) and checks its share of the replicas, then writes its hashes
/// into a hidden part file (`<temp>.xxh3-<rank>`) and reports; rank 0
/// checks that every dataset with bytes was hashed exactly once, commits
/// and removes the part files. The file is byte-identical to the one
/// written without a job. Throws also what `job` throws (another process's
/// error, a lost process).
WriteSummary WriteUniversal(const SourcePlan& plan,
                            const std::filesystem::path& path,
                            const reshape::ExecutorOptions& options,
                            UniversalJob* job = nullptr);

/// The check of a checkpoint's files against their own checksums that
/// VerifySource runs (formats::IntegrityPassFor makes it).
struct IntegrityPass {
  /// Whether `run` reads every zip record whole (it checks a
  /// ucp.manifest.json): the replicated regions lying in zip records are
  /// then hashed from its reads instead of being read beforehand.
  bool whole_records = false;
  /// Called with the CRC-32 of every zip-record range read so far (a
  /// partial pass need not read them again) and, when whole_records is set,
  /// the observers of the records to show every chunk it reads.
  std::function<void(const torchfile::RecordCrcs& known,
                     const torchfile::RecordObservers& observers)>
      run;
};

/// Checks a source without writing anything: every atom covered exactly by
/// its fragments and every replica bit-identical to its primary, reading
/// only the replicated regions, once.
///
/// `integrity` (optional) runs after those regions were read and before the
/// replicas are compared (damage a record's CRC-32 pins down is reported as
/// such first). With `whole_records` it reads them itself: replicas in zip
/// records are then compared by the XXH3-64 of their raw bytes taken from its
/// reads (a replica whose dtype differs from its primary's, or lying outside
/// a zip record, is still read beforehand and compared after conversion).
/// Throws like WriteUniversal; what `integrity` throws passes through.
struct VerifySummary {
  int64_t atoms = 0;
  uint64_t atom_bytes = 0;
  int64_t replicas_verified = 0;
};
VerifySummary VerifySource(const SourcePlan& plan,
                           const reshape::ExecutorOptions& options,
                           const IntegrityPass& integrity = {});

/// A ByteSink into one dataset of a store being written.
class StoreSink : public reshape::ByteSink {
 public:
  StoreSink(atoms::AtomStoreWriter& writer, atoms::DatasetId id)
      : writer_(writer), id_(id) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    writer_.Write(id_, offset, data);
  }

 private:
  atoms::AtomStoreWriter& writer_;
  atoms::DatasetId id_;
};

}  // namespace ucp::universal
