#pragma once
// Model state dicts of rank files: flattening nested dicts into dotted names
// (reading) and rebuilding them (writing).
//
// A chunk (`model` / `model{i}`) is a dict whose values are leaves or nested
// dicts (legacy models: model['language_model']['encoder']['layers.0.x']).
// Flattening walks dicts and OrderedDicts depth-first in insertion order; a
// leaf's name is its key path joined with "." (the layout's FromKeyPath
// checks the nesting). Rebuilding nests by the layout's KeyPath; a dict that
// directly holds leaves is written as collections.OrderedDict (what
// module.state_dict() returns), one that holds only dicts as a plain dict
// (state_dict_for_save_checkpoint of legacy models), the same classes
// Megatron's files carry. The `_metadata` attribute of state dicts (module
// versions) is not written.

#include <string>
#include <utility>
#include <vector>

#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::formats {

struct ChunkLeaf {
  std::vector<std::string> key_path;
  std::string name;  // key path joined with "."
  const pickle::Value* value = nullptr;
  const torchfile::TensorInfo* tensor = nullptr;  // null for non-tensors
};

/// The leaves of a chunk in state-dict order. Throws FormatError if `chunk`
/// is not a dict or a key is not a str.
std::vector<ChunkLeaf> FlattenChunk(const torchfile::TorchFile& file,
                                    const pickle::Value* chunk);

/// Builds a nested chunk in `arena` from (key path, value) leaves in order.
/// Throws InternalError if a key path is empty or a leaf's path collides with
/// a nested level.
pickle::Value* BuildChunk(
    pickle::Arena& arena,
    const std::vector<std::pair<std::vector<std::string>, pickle::Value*>>&
        leaves);

/// A new empty collections.OrderedDict node.
pickle::Value* NewOrderedDict(pickle::Arena& arena);

/// Appends a str-keyed entry to a dict or OrderedDict node.
void AppendEntry(pickle::Arena& arena, pickle::Value* dict,
                 std::string_view key, pickle::Value* value);

}  // namespace ucp::formats
