#pragma once
// Helpers for the torchfile tests: the Python oracles, the container walk of
// notes/HELPERS.md and comparison with description JSON files.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::torchfile::test {

/// The bytes of `s`.
inline std::span<const std::byte> Bytes(std::string_view s) {
  return std::as_bytes(std::span<const char>(s.data(), s.size()));
}

/// Runs Debian's python3 on `script` (the program text) with `args` appended
/// to the command line; returns the exit status, stdout+stderr in `*output`.
int RunPythonScript(std::string_view script, const std::string& args,
                    std::string* output);

/// Runs tests/tools/check_torch_files.py with `args`.
int CheckTorchFiles(const std::string& args, std::string* output);

/// True if tests/tools/<name> exists (the Python tools are written by others).
bool HaveTool(std::string_view name);

/// One (path, node) per path at which a non-container node is reachable
/// (dict / OrderedDict / list / tuple descended, shared containers once per
/// path), depth-first pre-order: the walk of torchdesc.py.
struct Reached {
  TensorPath path;
  const pickle::Value* node = nullptr;
};
std::vector<Reached> WalkContainers(const pickle::Value* root);

/// The tensor's contiguous bytes, read with ReadTensor.
std::string TensorBytes(const TorchFile& file, const TensorInfo& tensor);

/// Python's type(obj).__module__ + "." + __qualname__ for a non-container
/// leaf node as torchdesc.py reports it ("torch.bfloat16" for dtypes).
std::string PyClassName(const TorchFile& file, const pickle::Value* v);

/// Compares `file` with a description JSON (notes/HELPERS.md). Returns "" if
/// everything agrees, else the first difference.
std::string CompareWithDescription(const TorchFile& file,
                                   const std::filesystem::path& json_path);

/// Every *.pt file under `dir`, recursively, sorted.
std::vector<std::filesystem::path> FindPtFiles(
    const std::filesystem::path& dir);

/// JSON rendering of a path (for messages).
std::string PathJson(const TensorPath& path);

}  // namespace ucp::torchfile::test
