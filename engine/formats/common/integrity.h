#pragma once
// Integrity of a saved checkpoint's files, beyond "it parses":
//
// * the CRC-32 torch.save keeps for every zip record, recomputed (a byte
//   flipped inside a tensor after the file was written is caught without any
//   manifest);
// * when the checkpoint folder holds `ucp.manifest.json`, each file's size
//   and each record's XXH3-64 against it.
//
// ucp.manifest.json (written by `ucp manifest CKPT`, and by ucp itself beside
// the load folders `ucp resume` makes):
//
//   {
//     "format": "ucp.manifest", "version": 1, "hash": "xxh3-64",
//     "files": {
//       "<path relative to the manifest's folder>": {
//         "size": <bytes>,
//         "records": {"<zip record name>": "<16 hex digits>", ...}
//       },
//       "<a file that is not a zip (legacy torch.save, marker)>": {
//         "size": <bytes>, "xxh3": "<16 hex digits of the whole file>"
//       }
//       "<a file holding several torch.save archives (a DCP .distcp)>": {
//         "size": <bytes>,
//         "records": {"<record of the archive at 0>": "...",
//                     "@<offset>/<record of the archive at offset>": "..."}
//       }
//     }
//   }
//
// Every file the checkpoint needs must be listed with the same size and
// hashes; files the manifest lists must exist.

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "engine/formats/target_plan.h"
#include "engine/torchfile/zip.h"
#include "engine/universal/write_universal.h"

namespace ucp::formats {

inline constexpr const char* kManifestName = "ucp.manifest.json";

/// The torch.save archives a file holds (Source::Archives); empty: the file
/// is one archive if it is a zip. Records of an archive at offset k > 0 are
/// named "@k/<record>" in manifests, observers and `known` CRCs.
using ArchivesOf =
    std::function<std::vector<ArchiveSpan>(const std::filesystem::path&)>;

struct IntegrityReport {
  int64_t files = 0;
  int64_t zips = 0;
  int64_t records = 0;
  bool manifest = false;  // checked against (or written to) ucp.manifest.json
  /// "12 records of 4 torch.save files match their CRC-32 and
  /// ucp.manifest.json".
  std::string Summary() const;
};

/// Reads each of `files` once and checks it as described above. `dir` is the
/// checkpoint folder that may hold ucp.manifest.json (the files' paths are
/// taken relative to it). Without a manifest, the ranges of records `known`
/// gives the CRC-32 of (read by universal::VerifySource) are not read again,
/// and files that are not zip archives are not read at all (they carry no
/// checksum). With a manifest, or with `observers`, every zip record is read
/// whole, and each chunk read is shown to the record's observer. Progress is
/// reported on stderr.
/// Throws FormatError naming the file and record on a CRC or manifest
/// mismatch, a malformed manifest, or a listed file that is missing; IoError
/// if a file cannot be read; what an observer throws passes through.
IntegrityReport CheckIntegrity(const std::filesystem::path& dir,
                               const std::vector<std::filesystem::path>& files,
                               const torchfile::RecordCrcs* known = nullptr,
                               const torchfile::RecordObservers& observers = {},
                               const ArchivesOf& archives = {});

/// The integrity pass universal::VerifySource runs on a checkpoint:
/// CheckIntegrity(dir, files), its report stored in `*report` (when given),
/// reading every record whole if `dir` holds ucp.manifest.json (the
/// replicated regions are then hashed from those reads, so that each byte is
/// read once) and otherwise only what the replica check did not read.
universal::IntegrityPass IntegrityPassFor(
    const std::filesystem::path& dir,
    const std::vector<std::filesystem::path>& files,
    IntegrityReport* report = nullptr, ArchivesOf archives = {});

/// Writes `dir/ucp.manifest.json` (atomically) for `files`, all of which lie
/// under `dir`, after checking their CRC-32s (a manifest of damaged files
/// would bless them). Throws like CheckIntegrity (a manifest already there is
/// not consulted), UsageError if a file lies outside `dir`.
IntegrityReport WriteManifest(const std::filesystem::path& dir,
                              const std::vector<std::filesystem::path>& files,
                              const ArchivesOf& archives = {});

/// The entries WriteManifest writes for `files` (an object of their paths
/// relative to `dir`, in order; each file read once, its CRC-32s checked), so
/// that processes of a job (engine/dist) each describe their own files and
/// one writes the manifest. Adds the counts to `*report` when given. Throws
/// like WriteManifest.
json::Value ManifestEntries(const std::filesystem::path& dir,
                            const std::vector<std::filesystem::path>& files,
                            const ArchivesOf& archives = {},
                            IntegrityReport* report = nullptr);
/// Writes `dir/ucp.manifest.json` (atomically) listing `entries` (an object
/// ManifestEntries made, or several of them joined). Throws IoError.
void WriteManifestEntries(const std::filesystem::path& dir,
                          json::Value entries);

}  // namespace ucp::formats
