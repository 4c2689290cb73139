#pragma once
// The universal atom store: one HDF5 file holding every full (unsharded)
// tensor of a checkpoint, written and read with pwrite/pread at dataset
// offsets.
//
// Universal file, HDF5, format version 2 (version 1 files still read: they
// lack the `frozen` param attribute and the `training` root attribute):
//
// /                 attrs: ucp_format = "universal" (str),
//                          ucp_version = 2 (int64), iteration (int64),
//                          consumed_samples (int64, -1 if unknown),
//                          source, model, layout, optimizer, scheduler, args,
//                          training (str: JSON / YAML text from the caller,
//                          opaque here; `training` is the framework-neutral
//                          run state, RootInfo::training), any extra scalar
//                          str / int64 attrs (a framework's own metadata,
//                          e.g. "megatron", "deepspeed")
// /params/<fqn>     group; attrs: shape (int64[rank], a 0-element array for
//                          a 0-d param), dtype (str, training dtype),
//                          rule (str), kind ("param" | "buffer"),
//                          group (int64, optimizer group, -1 none),
//                          order (int64, canonical position),
//                          tied_copies (str, JSON list of names;
//                          ParamInfo keeps the names),
//                          frozen (int64 0/1: no optimizer state; v2)
// /params/<fqn>/<state kind>      dataset: the full logical tensor, of the
//                          group's shape (or 0-d for per-param scalars
//                          such as Adam's step)
// /params/<fqn>/pad/<state kind>  optional dataset: the source's padding
//                          rows verbatim (same rank as the param)
// /buffers/<fqn>    dataset: non-parameter state in its own dtype
// /opaque/<key>     1-D uint8 dataset: bytes kept verbatim; each "/" in the
//                          key makes a subgroup ("rng_state/tp00_pp000");
//                          at most 32 levels
//
// Every dataset has the attrs dtype (str, torch dtype name as DTypeName
// gives it) and xxh3 (uint64: XXH3-64, seed 0, of its raw little-endian
// bytes; 0 until the writer commits). Stored HDF5 type by dtype:
//   float64, float32 -> H5T_IEEE_F64LE, H5T_IEEE_F32LE
//   int8..int64 -> H5T_STD_I8LE..I64LE; uint8..uint64 -> H5T_STD_U8LE..U64LE
//   bool -> H5T_STD_U8LE; float8 variants -> H5T_STD_U8LE
//   float16, bfloat16 -> H5T_STD_U16LE (exact bits; h5py sees uint16)
//   complex64, complex128 -> compound {r, i} of F32LE / F64LE, the layout
//     h5py reads as numpy complex64 / complex128
// A 0-d tensor has a scalar dataspace; a tensor with a zero dim has that
// zero dim and no storage (offset 0, nbytes 0).
//
// Names: each fqn, state kind and "/"-separated opaque key part is one link
// name, escaped by EscapeLinkName (names.h): '%' -> %25, '/' -> %2F, a name
// "." or ".." -> %2E / %2E., a state kind "pad" -> %70ad. The reader accepts
// only this canonical escaping, and only hard links. Link names are UTF-8.
//
// Storage: every dataset is contiguous, H5D_ALLOC_TIME_EARLY,
// H5D_FILL_TIME_NEVER, without modification times (the file's bytes depend
// only on its contents). H5Pset_alignment(4096, 4096): a dataset of 4096
// bytes or more starts at a multiple of 4096; smaller ones are packed. File
// format bounds libver v18..v18 (HDF5 >= 1.8, h5py). Bulk bytes move with
// pread / pwrite at the offsets H5Dget_offset reports while HDF5 has the file
// closed. HDF5 file locking is on with ignore_when_disabled (filesystems
// without flock work); $HDF5_USE_FILE_LOCKING=FALSE turns it off.
//
// Threads: all HDF5 calls happen in Allocate / Commit on the calling thread,
// and for Open in a child process forked from it (libhdf5 1.10 can crash on
// damaged metadata; the child's death becomes a FormatError). No other
// thread may be inside HDF5 during Open. Write / SetHash / HashWritten /
// Read / ComputeHash are safe to call from many threads at once. Cost:
// Allocate or Open of a store with 20 000 datasets takes about half a second
// to a second.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/strided.h"

namespace ucp::atoms {

inline constexpr std::string_view kFormatName = "universal";
inline constexpr int64_t kFormatVersion = 2;
/// The oldest version Open still reads (version 1: no `frozen` param
/// attribute, no `training` root attribute).
inline constexpr int64_t kMinFormatVersion = 1;
/// Datasets of at least kAlignmentThreshold bytes start at a multiple of
/// kAlignment.
inline constexpr uint64_t kAlignment = 4096;
inline constexpr uint64_t kAlignmentThreshold = 4096;

/// Root attributes.
struct RootInfo {
  /// ucp_version as read (writers always write kFormatVersion).
  int64_t version = 2;
  int64_t iteration = 0;
  int64_t consumed_samples = -1;
  std::string source;     // JSON
  std::string model;      // JSON
  std::string layout;     // YAML text of the descriptor
  std::string optimizer;  // JSON
  std::string scheduler;  // JSON
  std::string args;       // JSON
  /// JSON, framework-neutral (version 2): {"dtype": training dtype,
  /// "step": optimizer step, "iteration", "global_samples", "frozen":
  /// [fqn...], "shared": {alias: fqn}, "param_order": [fqn...]}; "" in v1.
  std::string training;
  /// Further scalar attributes. Names must differ from the fixed ones above.
  std::map<std::string, std::string> extra_strings;
  std::map<std::string, int64_t> extra_ints;
};

enum class ParamKind : uint8_t { kParam, kBuffer };
/// "param" / "buffer".
std::string_view ParamKindName(ParamKind kind) noexcept;

/// Attributes of a /params/<fqn> group.
struct ParamInfo {
  std::string fqn;
  Shape shape;
  DType dtype = DType::kFloat32;  // training dtype
  std::string rule;
  ParamKind kind = ParamKind::kParam;
  int64_t group = -1;
  int64_t order = 0;
  /// Names of this param's tied / shared copies (stored as a JSON list).
  std::vector<std::string> tied_copies;
  /// A param without optimizer state (requires_grad False); version 2.
  bool frozen = false;
};

enum class DatasetKind : uint8_t { kAtom, kPad, kBuffer, kOpaque };

/// Index into AtomStoreWriter / AtomStoreReader datasets.
using DatasetId = uint32_t;

struct DatasetInfo {
  DatasetId id = 0;
  DatasetKind kind = DatasetKind::kAtom;
  /// Param or buffer fqn; the opaque key for kOpaque.
  std::string fqn;
  /// State kind of kAtom / kPad; empty otherwise.
  std::string state_kind;
  /// HDF5 path (escaped names), for messages and h5py.
  std::string path;
  DType dtype = DType::kUInt8;
  Shape shape;
  uint64_t offset = 0;  // file offset of the first byte (0 if nbytes == 0)
  uint64_t nbytes = 0;
  uint64_t xxh3 = 0;
};

/// Writes a universal file, plan-then-write:
///   auto w = AtomStoreWriter::Create(path);
///   w.SetRoot(...); w.AddParam(...); id = w.AddAtom(...); ...
///   w.Allocate();                       // all HDF5 metadata; HDF5 closed
///   w.Write(id, off, bytes) ...         // from any thread
///   w.SetHash(id, xxh3) ...             // one per dataset with bytes
///   w.Commit();                         // xxh3 attrs, fsync, rename
/// The file lives under a temporary name in the destination folder until
/// Commit; a writer destroyed without Commit removes it.
///
/// Declaration calls (SetRoot, Add*) are allowed only before Allocate; Write
/// and SetHash only between Allocate and Commit. Misuse (wrong phase,
/// duplicate or conflicting names, unknown param, out-of-bounds write, an
/// atom shape that differs from its param's) throws InternalError.
class AtomStoreWriter {
 public:
  /// Starts a store that Commit publishes as `final_path`. Throws IoError if
  /// the temporary file cannot be created.
  static AtomStoreWriter Create(const std::filesystem::path& final_path);
  /// One of several processes writing one store (a job): declares like
  /// Create's writer, creates no file; Attach replaces Allocate, and Commit
  /// is the allocating process's. Throws IoError.
  static AtomStoreWriter CreateShared(const std::filesystem::path& final_path);

  AtomStoreWriter(AtomStoreWriter&&) noexcept;
  AtomStoreWriter& operator=(AtomStoreWriter&&) noexcept;
  ~AtomStoreWriter();

  const std::filesystem::path& final_path() const noexcept;
  /// The file written until Commit (after Attach: the attached file).
  const std::filesystem::path& temp_path() const noexcept;

  /// Throws InternalError if an extra attribute reuses a fixed name.
  void SetRoot(RootInfo root);
  /// Declares /params/<fqn>. Throws InternalError on a duplicate fqn.
  void AddParam(ParamInfo param);
  /// Declares /params/<fqn>/<state_kind>. `shape` must equal the param's
  /// shape or be 0-d.
  DatasetId AddAtom(std::string_view fqn, std::string_view state_kind,
                    DType dtype, Shape shape);
  /// Declares /params/<fqn>/pad/<state_kind> (rank of the param).
  DatasetId AddPadAtom(std::string_view fqn, std::string_view state_kind,
                       DType dtype, Shape shape);
  /// Declares /buffers/<fqn>.
  DatasetId AddBuffer(std::string_view fqn, DType dtype, Shape shape);
  /// Declares /opaque/<key> as `size_bytes` uint8s. Throws InternalError if
  /// the key has an empty part or collides with another key's groups.
  DatasetId AddOpaque(std::string_view key, uint64_t size_bytes);

  /// Creates every group, dataset and attribute, records dataset offsets,
  /// closes HDF5 and reserves the file's blocks. Throws IoError.
  void Allocate();

  /// A CreateShared writer's Allocate: writes into `temp_path`, the file
  /// another process's writer with the same declarations allocated, at
  /// `offsets` (its dataset(id).offset, one per dataset). The file is not
  /// removed when this writer goes. Throws IoError if the file cannot be
  /// opened or a dataset would end beyond it, InternalError on misuse.
  void Attach(const std::filesystem::path& temp_path,
              std::span<const uint64_t> offsets);
  /// fsyncs the bytes this writer wrote (nothing with durable writes off,
  /// core/file.h). Throws IoError.
  void SyncWrites();

  size_t num_datasets() const noexcept;
  /// The declared dataset; offset is valid after Allocate.
  const DatasetInfo& dataset(DatasetId id) const;

  /// Writes `data` at byte `byte_offset` of the dataset (pwrite).
  /// Thread-safe. Throws InternalError if the range leaves the dataset,
  /// IoError if the write fails.
  void Write(DatasetId id, uint64_t byte_offset,
             std::span<const std::byte> data);
  /// Records the XXH3-64 of the dataset's complete bytes. Thread-safe.
  void SetHash(DatasetId id, uint64_t xxh3);
  /// Reads the written bytes back, hashes them, records and returns the hash.
  /// Thread-safe. Throws IoError.
  uint64_t HashWritten(DatasetId id);

  /// Writes the xxh3 attributes, fsyncs and renames onto final_path(). Call
  /// it once every Write has returned.
  /// Throws InternalError if a dataset with bytes has no hash, IoError on
  /// failure (the temporary file is then removed with the writer).
  void Commit();

 private:
  struct Impl;
  explicit AtomStoreWriter(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

/// A param group as read back, with the ids of its datasets (in file order).
struct StoredParam {
  ParamInfo info;
  std::vector<DatasetId> atoms;
  std::vector<DatasetId> pads;
};

/// A dataset whose bytes no longer hash to its xxh3 attribute.
struct HashMismatch {
  DatasetId id = 0;
  std::string path;
  uint64_t stored = 0;
  uint64_t actual = 0;
};

/// Reads a universal file: Open reads all metadata with HDF5 and closes it;
/// Read then preads bytes from any thread.
class AtomStoreReader {
 public:
  /// Throws IoError if the file cannot be opened, FormatError naming the
  /// file (and dataset) if it is not HDF5, lacks ucp_format="universal", has
  /// an unsupported ucp_version, or a dataset is not contiguous, has no or
  /// an unknown dtype attribute, a stored type that does not match it, an
  /// extent that differs from its param's shape attribute (for a pad
  /// dataset: its rank, which must be at least 1), or bytes beyond the end
  /// of the file; also for a missing schema attribute, a name that is not
  /// canonically escaped, a soft / external link, opaque groups nested
  /// deeper than 32 levels, an opaque group reached through two links, or
  /// metadata so damaged that HDF5 itself crashes reading it.
  static AtomStoreReader Open(const std::filesystem::path& path);

  AtomStoreReader(AtomStoreReader&&) noexcept;
  AtomStoreReader& operator=(AtomStoreReader&&) noexcept;
  ~AtomStoreReader();

  const std::filesystem::path& path() const noexcept;
  const RootInfo& root() const noexcept;
  uint64_t file_size() const noexcept;

  /// Params sorted by their order attribute (then fqn).
  std::span<const StoredParam> params() const noexcept;
  /// Every dataset, sorted by file offset; DatasetInfo::id is the index.
  std::span<const DatasetInfo> datasets() const noexcept;
  /// Throws InternalError if `id` is out of range.
  const DatasetInfo& dataset(DatasetId id) const;

  /// nullptr if absent.
  const StoredParam* FindParam(std::string_view fqn) const;
  const DatasetInfo* FindAtom(std::string_view fqn,
                              std::string_view state_kind) const;
  const DatasetInfo* FindPadAtom(std::string_view fqn,
                                 std::string_view state_kind) const;
  const DatasetInfo* FindBuffer(std::string_view fqn) const;
  const DatasetInfo* FindOpaque(std::string_view key) const;

  /// Reads `out.size()` bytes from byte `byte_offset` of the dataset (pread).
  /// Thread-safe. Throws InternalError if the range leaves the dataset,
  /// IoError / FormatError if the read fails or the file is short.
  void Read(DatasetId id, uint64_t byte_offset, std::span<std::byte> out) const;
  /// XXH3-64 of the dataset's bytes as they are in the file. Thread-safe.
  uint64_t ComputeHash(DatasetId id) const;

  /// Rehashes every dataset; returns those whose xxh3 attribute differs.
  /// `progress` (optional) gets the number of bytes hashed since its last
  /// call. Throws IoError / FormatError only if reading fails.
  std::vector<HashMismatch> Verify(
      const std::function<void(uint64_t)>& progress = {}) const;

 private:
  struct Impl;
  explicit AtomStoreReader(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::atoms
