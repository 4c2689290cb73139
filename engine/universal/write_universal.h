#pragma once
// Writes a universal file from a SourcePlan (to-universal).

#include <cstdint>
#include <filesystem>
#include <functional>

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
};

/// Creates `path` (atomically: nothing appears under that name on failure).
/// Throws FormatError if the fragments of an atom do not cover it exactly
/// (naming the atom and the elements missing), overlap partially, or if
/// replicas differ (naming both rank files); IoError on write failures.
WriteSummary WriteUniversal(const SourcePlan& plan,
                            const std::filesystem::path& path,
                            const reshape::ExecutorOptions& options);

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
