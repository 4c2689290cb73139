#pragma once
// MindSpore `.ckpt` files (mindspore.save_checkpoint), read as an index of
// records whose tensor bytes stay in the file.
//
// A file is Checkpoint protobuf messages back to back (proto2,
// mindspore/ccsrc/utils/checkpoint.proto), one per parameter slice:
//   message Checkpoint { message Value { required string tag = 1;
//                          oneof value { TensorProto tensor = 2;
//                                        MapTensorProto maptensor = 3; } }
//                        repeated Value value = 1; }
//   message TensorProto { repeated int64 dims = 1;
//                         required string tensor_type = 2;
//                         required bytes tensor_content = 3; }
// Wire form of one record: 0x0A <varint len> Value; in a Value 0x0A tag,
// 0x12 TensorProto (0x1A MapTensorProto); in a TensorProto dims as 0x08
// <varint> each (or packed, 0x0A), 0x12 type string, 0x1A content.
// `tensor_type` is str(mstype): Float32, Float16, BFloat16, Float64, Int8 ..
// UInt64, Bool ("str" values and "Int4" are not tensors ucp reads). dims
// [0] is a scalar. Every slice repeats the full dims; the slices of one
// parameter are consecutive records with the same tag, split along dim 0
// (np.array_split) and concatenated on load. save_checkpoint(crc_check=True)
// appends "crc_num" and the CRC-32 of every byte before it as a 10-digit
// big-endian number; encrypted files (enc_key) are AES/SM4 streams.

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/core/dtype.h"

namespace ucp::mindspore {

/// One piece of a parameter's bytes in the file.
struct CkptSlice {
  uint64_t offset = 0;  // of tensor_content in the file
  uint64_t length = 0;
};

/// A parameter (the records of one tag, in file order).
struct CkptEntry {
  std::string tag;
  std::string tensor_type;  // as stored
  std::vector<int64_t> dims;
  /// MapTensorProto (a MapParameter, streamed in several Values): kept out
  /// of tensors; its slices are the raw records, 0x0A byte included.
  bool map_tensor = false;
  std::vector<CkptSlice> slices;
  uint64_t nbytes = 0;  // sum of the slices
};

struct CkptIndex {
  std::filesystem::path path;
  std::vector<CkptEntry> entries;  // in file order
  bool crc = false;                // a CRC trailer was checked
};

/// The dtype a tensor_type names; nullopt for types ucp does not read.
std::optional<DType> DTypeOfTensorType(const std::string& tensor_type);
/// The tensor_type MindSpore writes for `dtype` ("Float32", ...).
std::string TensorTypeOf(DType dtype);

/// Reads the record structure of `path` (tensor contents are not read; the
/// CRC trailer, when present, is checked over the whole file). Throws
/// FormatError naming the file and the byte offset for anything that is
/// not a Checkpoint stream (encrypted files included), IoError if unreadable.
CkptIndex ReadCkptIndex(const std::filesystem::path& path);

/// Whether the file starts like a Checkpoint stream (a Value with a tag).
/// Never throws.
bool LooksLikeCkpt(const std::filesystem::path& path) noexcept;

}  // namespace ucp::mindspore
