#pragma once
// The ZIP container of torch.save files: a lazy reader and a planned,
// parallel writer.
//
// What ZipWriter writes (all integers little-endian; offsets count from the
// first byte of the archive):
//
//   for each record, in the order given:
//     local header (30 bytes)
//       u32 0x04034b50 | u16 version needed (20, 45 with zip64)
//       u16 flags 0x0800 (UTF-8 names) | u16 method 0 (stored)
//       u16 time 0 | u16 date 0 | u32 crc32 | u32 compressed size
//       u32 uncompressed size (both 0xFFFFFFFF with zip64) | u16 name length
//       u16 extra length
//     name (the archive prefix included: "<prefix>/data/0")
//     [zip64 extra: u16 0x0001, u16 16, u64 uncompressed, u64 compressed]
//         when the size is >= 0xFFFFFFFF (or ZipLayoutOptions::force_zip64)
//     padding extra: u16 0x4246 ("FB"), u16 n, n bytes 'Z', with n chosen so
//         the data starts at a multiple of the alignment (64, as torch);
//         always present, n may be 0
//     data (stored; no data descriptor)
//   central directory, one entry per record in the same order
//       u32 0x02014b50 | u16 made by 45 | u16 needed | u16 flags 0x0800
//       u16 method 0 | u16 time 0 | u16 date 0 | u32 crc32
//       u32 compressed | u32 uncompressed | u16 name length | u16 extra length
//       u16 comment length 0 | u16 disk 0 | u16 internal attrs 0
//       u32 external attrs 0 | u32 local header offset | name
//       [zip64 extra 0x0001: u64 uncompressed, u64 compressed (if the size is
//        >= 0xFFFFFFFF), u64 local header offset (if >= 0xFFFFFFFF); the
//        32-bit fields then hold 0xFFFFFFFF]
//   zip64 end of central directory (always, like torch's miniz writer)
//       u32 0x06064b50 | u64 44 | u16 made by 45 | u16 needed 45 | u32 0 | u32
//       0 u64 entries | u64 entries | u64 directory size | u64 directory offset
//   zip64 locator: u32 0x07064b50 | u32 0 | u64 zip64 EOCD offset | u32 1
//   end of central directory
//       u32 0x06054b50 | u16 0 | u16 0 | u16 entries | u16 entries
//       u32 directory size | u32 directory offset (0xFFFF / 0xFFFFFFFF when
//       they do not fit) | u16 comment length 0
//
// ZipReader accepts any conforming archive with stored (0) or deflated (8)
// records: torch's own (flags 0x0808, data descriptors, zero CRC/sizes in the
// local headers), Python zipfile's, zip64 sizes/offsets, an archive embedded
// in a larger file. Open() reads only the end records and the central
// directory (the last 4 KiB of the archive, or up to 64 KiB for a long
// comment, or the whole archive up to 64 KiB, in one pread); a local header
// is read the first time its data is located (with the 4 KiB around it, until
// ReleaseCache, so that the headers and small records at the start of a
// torch.save archive cost one pread).
//
// ZipWriter writes each record's data as it comes, except records of up to
// 4 KiB written whole in one Write: those are kept and written by Commit with
// the local headers next to them, one pwrite per contiguous run of headers,
// small records and directory.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ucp {
class File;
class OutputFile;
}  // namespace ucp

namespace ucp::torchfile {

/// zlib CRC-32 of `data`, continuing a running `crc` (0 to start).
uint32_t Crc32(std::span<const std::byte> data, uint32_t crc = 0) noexcept;
/// CRC-32 of A followed by B, from crc(A), crc(B) and the length of B.
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) noexcept;

/// The CRC-32 of bytes [offset, offset + size) of a record's uncompressed
/// content, computed by whoever read them (see ZipReader::CheckCrc).
struct CrcPiece {
  uint64_t offset = 0;
  uint64_t size = 0;
  uint32_t crc = 0;
};
/// CrcPieces by file path (lexically normal, archive at offset 0) and record
/// name.
using RecordCrcs =
    std::map<std::string, std::map<std::string, std::vector<CrcPiece>>>;

/// Sees a record's uncompressed bytes as a pass over it reads them: `bytes`
/// start at byte `offset` of the record; the chunks of one record arrive in
/// increasing order, cover it whole, and are only valid during the call.
using RecordChunkObserver =
    std::function<void(uint64_t offset, std::span<const std::byte> bytes)>;
/// The observer of record `record` of file `file` (lexically normal, as in
/// RecordCrcs), or an empty one for a record nobody watches.
using RecordObservers = std::function<RecordChunkObserver(
    const std::string& file, const std::string& record)>;

inline constexpr uint16_t kZipStored = 0;
inline constexpr uint16_t kZipDeflated = 8;

/// One central-directory entry.
struct ZipEntry {
  std::string name;  // as stored, including the archive prefix
  uint16_t method = kZipStored;
  uint16_t flags = 0;
  uint32_t crc32 = 0;
  uint64_t compressed_size = 0;
  uint64_t uncompressed_size = 0;
  uint64_t local_header_offset = 0;  // from the start of the archive
};

class ZipReader {
 public:
  /// Opens the archive occupying bytes [offset, offset + length) of `path`
  /// (to the end of the file if `length` is absent). Reads only the end
  /// records and the central directory.
  /// Throws IoError if the file cannot be opened or read; FormatError naming
  /// the file if it is not a zip archive or its directory is corrupt
  /// (entries outside the archive, overlapping, absurd sizes, duplicates,
  /// encrypted or multi-disk archives).
  static ZipReader Open(const std::filesystem::path& path, uint64_t offset = 0,
                        std::optional<uint64_t> length = std::nullopt);
  /// The same on an already opened file (shared with the caller). `head`:
  /// the archive's first bytes if the caller read them (up to 64 KiB), kept
  /// to serve the local headers and small records they hold (ReleaseCache).
  static ZipReader Open(std::shared_ptr<const File> file, uint64_t offset,
                        uint64_t length, std::span<const std::byte> head = {});

  ZipReader(ZipReader&&) noexcept;
  ZipReader& operator=(ZipReader&&) noexcept;
  ~ZipReader();

  const std::filesystem::path& path() const noexcept;
  const std::shared_ptr<const File>& file() const noexcept;
  /// Where the archive starts in the file, and its length.
  uint64_t archive_offset() const noexcept;
  uint64_t archive_size() const noexcept;

  /// All entries in central-directory order.
  const std::vector<ZipEntry>& entries() const noexcept;
  /// The entry with exactly this name, nullptr if absent.
  const ZipEntry* Find(std::string_view name) const noexcept;

  /// Absolute file offset of the entry's (possibly compressed) data. Reads
  /// and checks its local header on first use; thread-safe. `entry` must
  /// come from entries(). Throws FormatError if the local header is corrupt
  /// or the data runs into the next entry.
  uint64_t DataOffset(const ZipEntry& entry) const;

  /// The whole uncompressed content. Throws FormatError if it is larger than
  /// `max_bytes`, uses another method than stored/deflated, or does not
  /// inflate to its declared size; IoError on read failure.
  std::string ReadRecord(const ZipEntry& entry,
                         uint64_t max_bytes = uint64_t{1} << 32) const;

  /// Until this is called, the bytes read with the end records and with the
  /// local headers (a few KiB) are kept to serve the small reads that follow
  /// (directory, other local headers, pickles) without another pread; this
  /// resolves the data offsets of the entries whose local headers they hold
  /// and frees them. Call it once the archive's small records are read.
  /// Thread-safe.
  void ReleaseCache() const noexcept;

  /// Reads dst.size() bytes starting at byte `offset` of the uncompressed
  /// content: one pread for stored entries (no copy), the whole record is
  /// inflated for deflated ones. Thread-safe. Throws UsageError if the range
  /// lies outside the record, FormatError / IoError as ReadRecord.
  void ReadRange(const ZipEntry& entry, uint64_t offset,
                 std::span<std::byte> dst) const;

  /// Recomputes the CRC-32 of the uncompressed content and compares it with
  /// the directory's. Throws like ReadRange.
  bool CheckCrc(const ZipEntry& entry) const;
  /// The same, reading only the bytes `known` does not cover: the CRC-32 of
  /// each piece (any order; one overlapping an earlier piece, or leaving
  /// the record, is not used) is combined with those of the bytes between
  /// them. Deflated entries are read whole. Throws like ReadRange.
  bool CheckCrc(const ZipEntry& entry, std::span<const CrcPiece> known) const;

  /// One pass over the uncompressed content: whether its CRC-32 matches the
  /// directory's, and (with `xxh3`) its XXH3-64 (ucp.manifest.json); every
  /// chunk read is shown to `observe` when given. Throws like ReadRange, and
  /// what `observe` throws.
  struct RecordDigest {
    bool crc_ok = false;
    uint64_t xxh3 = 0;
  };
  RecordDigest Digest(const ZipEntry& entry, bool xxh3 = true,
                      const RecordChunkObserver& observe = {}) const;

 private:
  struct Impl;
  explicit ZipReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// --- Writing ---------------------------------------------------------------

struct ZipLayoutOptions {
  /// Data of every record starts at a multiple of this (a power of two, at
  /// most 32768). torch uses 64.
  uint32_t alignment = 64;
  /// Write zip64 extras for every record and offset, even small ones (tests).
  bool force_zip64 = false;
};

struct ZipRecordSpec {
  std::string name;  // full name, prefix included
  uint64_t size = 0;
};

/// Where one record lands.
struct ZipPlannedRecord {
  std::string name;
  uint64_t size = 0;
  uint64_t header_offset = 0;  // local header
  uint64_t data_offset = 0;    // first data byte (a multiple of alignment)
  bool zip64_size = false;     // local + central zip64 sizes
  bool zip64_offset = false;   // central zip64 local-header offset
};

struct ZipLayout {
  std::vector<ZipPlannedRecord> records;
  uint64_t central_directory_offset = 0;
  uint64_t central_directory_size = 0;
  uint64_t zip64_eocd_offset = 0;
  uint64_t total_size = 0;  // of the whole archive
};

/// Pure layout computation (no I/O), exposed for tests of >4 GiB layouts.
/// Throws UsageError for an empty or over-long (> 65535 bytes) name, a
/// duplicate name, a bad alignment, or sizes whose sum overflows.
ZipLayout PlanZipLayout(std::span<const ZipRecordSpec> records,
                        const ZipLayoutOptions& options = {});

/// Writes a planned archive: the layout is fixed up front, the file is
/// created under a temporary name and its full size reserved; record bytes
/// are then written in any order from any thread; Commit() writes the
/// headers (with CRCs combined from the chunks) and renames the file to its
/// final name. Destroyed without a successful Commit(), the temporary file is
/// removed, so no partial file ever appears under the final name.
class ZipWriter {
 public:
  /// Throws UsageError as PlanZipLayout, IoError if the file cannot be
  /// created or its space reserved. `in_memory`: the archive is built in an
  /// anonymous memory file (Contents()) and nothing is written to `path`,
  /// which only names it.
  ZipWriter(const std::filesystem::path& path,
            std::span<const ZipRecordSpec> records,
            const ZipLayoutOptions& options = {}, bool in_memory = false);
  /// An archive embedded in a file that holds several (a run of torch.save
  /// archives, as PyTorch DCP writes): bytes [base, base + layout size) of
  /// `file`, whose owner reserved them and commits the file after every
  /// archive in it is committed. `name` names the archive in messages.
  /// Commit() writes the headers there and neither syncs nor renames.
  /// Throws UsageError as PlanZipLayout.
  ZipWriter(std::shared_ptr<OutputFile> file, uint64_t base,
            const std::filesystem::path& name,
            std::span<const ZipRecordSpec> records,
            const ZipLayoutOptions& options = {});
  ZipWriter(ZipWriter&&) noexcept;
  ZipWriter& operator=(ZipWriter&&) noexcept;
  ~ZipWriter();

  const ZipLayout& layout() const noexcept;
  const std::filesystem::path& path() const noexcept;  // the final name

  /// Writes `data` as bytes [offset, offset + data.size()) of record `index`
  /// (pwrite at the planned position + CRC of the chunk). Thread-safe.
  /// Throws UsageError if the range lies outside the record or overlaps
  /// bytes already written, or after Commit; IoError on write failure.
  /// After any exception the writer is failed and Commit() will throw.
  void Write(size_t index, uint64_t offset, std::span<const std::byte> data);

  /// Checks that every byte of every record was written exactly once, writes
  /// local headers, central directory and end records, fsyncs and renames.
  /// Throws UsageError naming the first incomplete record (the temporary file
  /// is removed), IoError on write/rename failure.
  void Commit();

  /// Bytes due at an offset of a shared file, not written yet.
  struct PendingRun {
    uint64_t at = 0;
    std::string bytes;
  };
  /// Commit of an embedded archive among archives laid back to back: its
  /// first run of headers is written together with `carry` when it starts
  /// where `carry` ends (else `carry` is written first), and its last run
  /// (the directory and end records, which end where the next archive starts)
  /// is left in `carry` for the next archive's Commit or for the caller to
  /// write: one pwrite fewer per archive. Throws as Commit().
  void Commit(PendingRun& carry);

  /// The committed archive's bytes, for an in-memory writer. Throws
  /// UsageError for another writer or before Commit(), IoError.
  std::string Contents() const;

 private:
  void CommitRuns(PendingRun* carry);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::torchfile
