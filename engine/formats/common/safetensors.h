#pragma once
// safetensors (huggingface/safetensors @24b0b28, safetensors/src/tensor.rs):
//   u64 LE N | N bytes of UTF-8 JSON
//     {"<name>": {"dtype": "F32" | "BF16" | ..., "shape": [...],
//                 "data_offsets": [begin, end]}, ...,
//      "__metadata__": {str: str}}
//   | the data; offsets relative to byte 8 + N, tensors in C order; writers
//   pad the JSON with spaces to a multiple of 8 bytes.
// Shared by the writers of safetensors files (ucp export, MindFormers'
// Checkpoint 2.0) and its reader.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/strided.h"
#include "engine/json/json.h"

namespace ucp::formats {

/// "F32", "BF16", "F8_E4M3", ...; absent for a dtype safetensors has no
/// name for.
std::optional<std::string_view> SafetensorsDTypeName(DType dtype);
/// The dtype of a safetensors dtype name; absent for one ucp does not read.
std::optional<DType> DTypeOfSafetensorsName(std::string_view name);

struct SafetensorsTensor {
  std::string name;
  DType dtype = DType::kFloat32;
  Shape shape;
  uint64_t offset = 0;  // of its data in the file (ReadSafetensorsHeader)
  uint64_t bytes = 0;
};

/// The header of `tensors` laid out back to back in their order (their
/// `offset`s are not used), `metadata` as "__metadata__". Throws UsageError
/// for a dtype safetensors has no name for.
std::string SafetensorsHeader(std::span<const SafetensorsTensor> tensors,
                              const json::Value& metadata);

/// A safetensors file's tensors, in header order, with absolute offsets.
/// Throws IoError; FormatError naming the file (and tensor) for a header
/// that is no safetensors header, a dtype ucp does not read, data outside
/// the file, sizes that do not match, overlapping data.
std::vector<SafetensorsTensor> ReadSafetensorsHeader(
    const std::filesystem::path& path);

/// A safetensors file's "__metadata__" (null if absent), the tensors not
/// checked (a file cut short still shows whose it is). Throws IoError;
/// FormatError naming the file for a header that is no safetensors header.
json::Value SafetensorsMetadata(const std::filesystem::path& path);

}  // namespace ucp::formats
