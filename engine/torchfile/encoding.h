#pragma once
// Internal to engine/torchfile: how torch.save spells tensors and storages in
// the pickle (see torch_file.h for the format), shared by reader and writer.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/strided.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::torchfile::internal {

struct StorageClass {
  DType dtype = DType::kUInt8;
  bool untyped = false;  // numel counts bytes
};

/// The storage class a kGlobal names (torch.FloatStorage, ...,
/// torch.UntypedStorage); absent for any other node.
std::optional<StorageClass> StorageClassOf(const pickle::Value* global);

/// "FloatStorage" ... for dtypes torch 1.13 pickles through a typed storage
/// class; "" for those that need _rebuild_tensor_v3 + UntypedStorage.
std::string_view TypedStorageName(DType dtype);

struct PersistentStorage {
  StorageClass cls;
  std::string key;
  std::string location;
  int64_t numel = 0;
};

/// Parses a kPersId node. Returns absent for ids that are not storages (the
/// legacy format's ('module', ...) ids). Throws FormatError for a storage id
/// of the wrong shape or with an unknown class.
std::optional<PersistentStorage> ParsePersistentId(const pickle::Value* persid,
                                                   bool legacy);

struct ParsedTensor {
  const pickle::Value* node = nullptr;         // outermost
  const pickle::Value* tensor_node = nullptr;  // the rebuild call
  const pickle::Value* persid = nullptr;       // kPersId of the storage
  std::optional<DType> dtype;                  // from _rebuild_tensor_v3
  Shape shape;
  std::vector<int64_t> stride;
  int64_t storage_offset = 0;
  bool requires_grad = false;
  bool is_parameter = false;
  TensorWrapper wrapper = TensorWrapper::kNone;
  /// Nodes the pickler meets after the storage (Parameter state, subclass
  /// type and state), in pickling order.
  std::vector<const pickle::Value*> trailing;
};

/// Recognises the tensor encodings listed in torch_file.h. Absent if `v` is
/// not one; throws FormatError if it is one but its arguments are malformed.
std::optional<ParsedTensor> ParseTensor(const pickle::Value* v);

/// Visits every node reachable from `root` once, in the order CPython's
/// pickler first meets it (depth-first: callable, args, kwargs, items,
/// entries, state; persistent ids' tuples). `visit` returns false to skip a
/// node's children; it may append nodes to `then`, which are visited next
/// (before the node's siblings). Iterative: any depth.
void ForEachInPickleOrder(
    const pickle::Value* root,
    const std::function<bool(const pickle::Value*,
                             std::vector<const pickle::Value*>& then)>& visit);

/// Visits every node reachable from `root` through dict / OrderedDict / list /
/// tuple containers (dict keys must be str or int; other entries are
/// skipped), in depth-first pre-order, each container once; LibTorch's
/// type-tag wrappers (torch.jit._pickle.restore_type_tag(obj, type),
/// build_tensorlist(list), build_genericlist(list)) are seen through. For every
/// non-container node for which `wanted` is true, calls `visit(node, path)`.
/// Iterative: any depth. The paths handed to `visit` may hold at most
/// `max_path_bytes` in all (each component counts its size plus its string's
/// length): a key shared through the memo at every level of a deep chain
/// makes paths much larger than the pickle. Throws FormatError beyond that.
void ForEachContainerLeaf(
    const pickle::Value* root,
    const std::function<bool(const pickle::Value*)>& wanted,
    const std::function<void(const pickle::Value*, const TensorPath&)>& visit,
    uint64_t max_path_bytes);

}  // namespace ucp::torchfile::internal
