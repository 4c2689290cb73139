#include "engine/torchfile/encoding.h"

#include <array>
#include <unordered_set>
#include <utility>

#include "engine/core/error.h"

namespace ucp::torchfile::internal {
namespace {

using pickle::Kind;
using pickle::Value;

struct TypedStorage {
  std::string_view name;
  DType dtype;
};

constexpr std::array<TypedStorage, 12> kTypedStorages = {{
    {"DoubleStorage", DType::kFloat64},
    {"FloatStorage", DType::kFloat32},
    {"HalfStorage", DType::kFloat16},
    {"BFloat16Storage", DType::kBFloat16},
    {"LongStorage", DType::kInt64},
    {"IntStorage", DType::kInt32},
    {"ShortStorage", DType::kInt16},
    {"CharStorage", DType::kInt8},
    {"ByteStorage", DType::kUInt8},
    {"BoolStorage", DType::kBool},
    {"ComplexFloatStorage", DType::kComplex64},
    {"ComplexDoubleStorage", DType::kComplex128},
}};

// Text of a str node, or of a bytes node (Python 2 pickles).
std::optional<std::string_view> Text(const Value* v) {
  if (v == nullptr) return std::nullopt;
  if (v->kind == Kind::kStr || v->kind == Kind::kBytes) {
    return std::string_view(v->s);
  }
  return std::nullopt;
}

std::string Describe(const Value* v) { return pickle::Repr(v, 60); }

int64_t NonNegativeInt(const Value* v, std::string_view what) {
  if (v == nullptr || v->kind != Kind::kInt || !v->big.empty() || v->i < 0) {
    throw FormatError("tensor ", what,
                      " is not a non-negative int: ", Describe(v));
  }
  return v->i;
}

std::vector<int64_t> IntTuple(const Value* v, std::string_view what) {
  if (v == nullptr || (v->kind != Kind::kTuple && v->kind != Kind::kList)) {
    throw FormatError("tensor ", what, " is not a tuple: ", Describe(v));
  }
  std::vector<int64_t> out;
  out.reserve(v->items.size());
  for (const Value* item : v->items) {
    out.push_back(NonNegativeInt(item, what));
  }
  return out;
}

bool BoolArg(const Value* v, std::string_view what) {
  if (v == nullptr || v->kind != Kind::kBool) {
    throw FormatError("tensor ", what, " is not a bool: ", Describe(v));
  }
  return v->b;
}

bool IsTorchUtils(const Value* callable, std::string_view name) {
  return callable != nullptr && callable->IsGlobal("torch._utils", name);
}

enum class Rebuild { kNone, kV1, kV2, kV3 };

Rebuild RebuildKind(const Value* callable) {
  if (IsTorchUtils(callable, "_rebuild_tensor_v2")) return Rebuild::kV2;
  if (IsTorchUtils(callable, "_rebuild_tensor_v3")) return Rebuild::kV3;
  if (IsTorchUtils(callable, "_rebuild_tensor")) return Rebuild::kV1;
  return Rebuild::kNone;
}

// Parses the arguments of a storage-based rebuild function into `t`.
void ParseRebuildArgs(Rebuild kind, const Value* args, ParsedTensor& t) {
  if (args == nullptr || args->kind != Kind::kTuple) {
    throw FormatError("tensor arguments are not a tuple: ", Describe(args));
  }
  const size_t n = args->items.size();
  const bool ok = (kind == Rebuild::kV1 && n == 4) ||
                  (kind == Rebuild::kV2 && (n == 6 || n == 7)) ||
                  (kind == Rebuild::kV3 && (n == 7 || n == 8));
  if (!ok) {
    throw FormatError("tensor rebuild call has ", n, " arguments");
  }
  const Value* storage = args->items[0];
  if (storage == nullptr || storage->kind != Kind::kPersId) {
    throw FormatError("tensor storage is not a persistent id: ",
                      Describe(storage));
  }
  t.persid = storage;
  t.storage_offset = NonNegativeInt(args->items[1], "storage offset");
  t.shape = IntTuple(args->items[2], "size");
  t.stride = IntTuple(args->items[3], "stride");
  if (t.shape.size() != t.stride.size()) {
    throw FormatError("tensor has ", t.shape.size(), " sizes but ",
                      t.stride.size(), " strides");
  }
  if (kind != Rebuild::kV1) {
    t.requires_grad = BoolArg(args->items[4], "requires_grad");
  }
  if (kind == Rebuild::kV3) {
    const Value* d = args->items[6];
    std::optional<DType> dtype;
    if (d != nullptr && d->kind == Kind::kGlobal && d->module == "torch") {
      dtype = DTypeFromName(d->name);
    }
    if (!dtype) throw FormatError("unknown tensor dtype ", Describe(d));
    t.dtype = dtype;
  }
}

}  // namespace

std::optional<StorageClass> StorageClassOf(const Value* g) {
  if (g == nullptr || g->kind != Kind::kGlobal) return std::nullopt;
  if ((g->module == "torch" || g->module == "torch.storage") &&
      (g->name == "UntypedStorage" || g->name == "_UntypedStorage")) {
    return StorageClass{DType::kUInt8, true};
  }
  if (g->module != "torch" && g->module != "torch.cuda") return std::nullopt;
  for (const TypedStorage& s : kTypedStorages) {
    if (s.name == g->name) return StorageClass{s.dtype, false};
  }
  return std::nullopt;
}

std::string_view TypedStorageName(DType dtype) {
  for (const TypedStorage& s : kTypedStorages) {
    if (s.dtype == dtype) return s.name;
  }
  return "";
}

std::optional<PersistentStorage> ParsePersistentId(const Value* persid,
                                                   bool legacy) {
  const Value* pid = persid == nullptr ? nullptr : persid->pid;
  if (pid == nullptr || pid->kind != Kind::kTuple || pid->items.empty()) {
    throw FormatError("persistent id is not a tuple: ", Describe(pid));
  }
  const std::vector<Value*>& f = pid->items;
  std::optional<std::string_view> tag = Text(f[0]);
  if (legacy && tag == "module") return std::nullopt;
  if (tag != "storage") {
    throw FormatError("unsupported persistent id ", Describe(pid));
  }
  const size_t want = legacy ? 6 : 5;
  if (f.size() != want) {
    throw FormatError("storage persistent id has ", f.size(),
                      " fields, expected ", want, ": ", Describe(pid));
  }
  std::optional<StorageClass> cls = StorageClassOf(f[1]);
  if (!cls) {
    throw FormatError("unknown storage class ",
                      f[1] != nullptr && f[1]->kind == Kind::kGlobal
                          ? f[1]->module + "." + f[1]->name
                          : Describe(f[1]));
  }
  std::optional<std::string_view> key = Text(f[2]);
  std::optional<std::string_view> location = Text(f[3]);
  if (!key || !location) {
    throw FormatError("storage key or location is not a string: ",
                      Describe(pid));
  }
  const Value* numel = f[4];
  if (numel == nullptr || numel->kind != Kind::kInt || !numel->big.empty() ||
      numel->i < 0) {
    throw FormatError("storage ", *key, " has invalid numel ", Describe(numel));
  }
  if (legacy && (f[5] == nullptr || f[5]->kind != Kind::kNone)) {
    throw FormatError("storage ", *key,
                      " is a storage view (torch < 0.4), not supported");
  }
  PersistentStorage out;
  out.cls = *cls;
  out.key = std::string(*key);
  out.location = std::string(*location);
  out.numel = numel->i;
  return out;
}

std::optional<ParsedTensor> ParseTensor(const Value* v) {
  if (v == nullptr || v->kind != Kind::kObject || v->callable == nullptr ||
      v->callable->kind != Kind::kGlobal) {
    return std::nullopt;
  }
  const Value* callable = v->callable;
  const Rebuild direct = RebuildKind(callable);
  const bool param = IsTorchUtils(callable, "_rebuild_parameter");
  const bool param_state =
      IsTorchUtils(callable, "_rebuild_parameter_with_state");
  const bool subclass =
      callable->IsGlobal("torch._tensor", "_rebuild_from_type_v2");
  if (direct == Rebuild::kNone && !param && !param_state && !subclass) {
    return std::nullopt;
  }
  const Value* args = v->args;
  if (v->op != pickle::ObjectOp::kReduce || args == nullptr ||
      args->kind != Kind::kTuple) {
    throw FormatError("malformed ", callable->name, " call: ", Describe(v));
  }
  ParsedTensor t;
  t.node = v;
  t.tensor_node = v;
  if (direct != Rebuild::kNone) {
    ParseRebuildArgs(direct, args, t);
    return t;
  }
  if (param || param_state) {
    const size_t want = param ? 3 : 4;
    if (args->items.size() != want) {
      throw FormatError(callable->name, " has ", args->items.size(),
                        " arguments, expected ", want);
    }
    std::optional<ParsedTensor> inner = ParseTensor(args->items[0]);
    if (!inner || inner->wrapper != TensorWrapper::kNone) {
      throw FormatError(callable->name, " of something that is not a tensor: ",
                        Describe(args->items[0]));
    }
    t = std::move(*inner);
    t.node = v;
    t.requires_grad = BoolArg(args->items[1], "requires_grad");
    t.is_parameter = true;
    t.wrapper =
        param ? TensorWrapper::kParameter : TensorWrapper::kParameterWithState;
    if (param_state) t.trailing.push_back(args->items[3]);
    return t;
  }
  // _rebuild_from_type_v2(func, new_type, args, state)
  if (args->items.size() != 4) {
    throw FormatError("_rebuild_from_type_v2 has ", args->items.size(),
                      " arguments, expected 4");
  }
  const Rebuild inner = RebuildKind(args->items[0]);
  if (inner == Rebuild::kNone) return std::nullopt;  // e.g. a wrapper subclass
  ParseRebuildArgs(inner, args->items[2], t);
  t.wrapper = TensorWrapper::kSubclass;
  const Value* new_type = args->items[1];
  t.is_parameter = new_type != nullptr &&
                   new_type->IsGlobal("torch.nn.parameter", "Parameter");
  t.trailing.push_back(new_type);
  t.trailing.push_back(args->items[3]);
  return t;
}

void ForEachInPickleOrder(
    const Value* root,
    const std::function<bool(const Value*, std::vector<const Value*>& then)>&
        visit) {
  std::unordered_set<const Value*> seen;
  std::vector<const Value*> stack;
  std::vector<const Value*> then;
  std::vector<const Value*> children;
  if (root != nullptr) stack.push_back(root);
  while (!stack.empty()) {
    const Value* v = stack.back();
    stack.pop_back();
    if (v == nullptr || !seen.insert(v).second) continue;
    then.clear();
    const bool descend = visit(v, then);
    children.clear();
    if (descend) {
      children.push_back(v->callable);
      children.push_back(v->args);
      children.push_back(v->kwargs);
      for (const Value* item : v->items) children.push_back(item);
      for (const auto& [key, value] : v->entries) {
        children.push_back(key);
        children.push_back(value);
      }
      children.push_back(v->state);
      children.push_back(v->pid);
    }
    for (const Value* t : then) children.push_back(t);
    for (size_t i = children.size(); i-- > 0;) {
      if (children[i] != nullptr) stack.push_back(children[i]);
    }
  }
}

void ForEachContainerLeaf(
    const Value* root, const std::function<bool(const Value*)>& wanted,
    const std::function<void(const Value*, const TensorPath&)>& visit,
    uint64_t max_path_bytes) {
  // Paths are kept as a tree of (parent, component) to stay linear in size;
  // a str key is referenced, not copied (one key object may be shared by
  // every level of a nesting).
  struct Step {
    size_t parent;
    const Value* key;  // a kStr dict key, or nullptr: `index` is the component
    int64_t index;     // list/tuple index or int dict key
  };
  constexpr size_t kNoParent = static_cast<size_t>(-1);
  std::vector<Step> steps;
  std::vector<std::pair<const Value*, size_t>> stack;  // node, step index
  std::unordered_set<const Value*> seen_containers;
  uint64_t budget = max_path_bytes;
  auto materialize = [&](size_t step) {
    // Sized first: nothing is copied beyond the budget.
    size_t depth = 0;
    for (size_t s = step; s != kNoParent; s = steps[s].parent, ++depth) {
      const uint64_t bytes =
          sizeof(PathComponent) +
          (steps[s].key != nullptr ? steps[s].key->s.size() : 0);
      if (bytes > budget) {
        throw FormatError("the paths of the tensors exceed ", max_path_bytes,
                          " bytes (dict keys repeated along a deep nesting?)");
      }
      budget -= bytes;
    }
    TensorPath path(depth);
    for (size_t s = step; s != kNoParent; s = steps[s].parent) {
      if (steps[s].key != nullptr) {
        path[--depth] = steps[s].key->s;
      } else {
        path[--depth] = steps[s].index;
      }
    }
    return path;
  };
  if (root != nullptr) stack.emplace_back(root, kNoParent);
  std::vector<std::pair<const Value*, size_t>> children;
  while (!stack.empty()) {
    auto [v, step] = stack.back();
    stack.pop_back();
    // LibTorch's pickler (torch::pickle_save) wraps typed containers in
    // torch.jit._pickle.restore_type_tag(obj, "Dict[str, Tensor]") and
    // build_intlist(list) etc., which return their first argument: seen
    // through, they add no path component.
    while (v->kind == Kind::kObject && v->args != nullptr &&
           !v->args->items.empty() && v->args->items[0] != nullptr &&
           (v->IsObjectOf("torch.jit._pickle", "restore_type_tag") ||
            v->IsObjectOf("torch.jit._pickle", "build_tensorlist") ||
            v->IsObjectOf("torch.jit._pickle", "build_genericlist"))) {
      v = v->args->items[0];
    }
    const bool is_list = v->kind == Kind::kList || v->kind == Kind::kTuple;
    const bool is_dict = v->IsDictLike();
    if (!is_list && !is_dict) {
      if (wanted(v)) visit(v, materialize(step));
      continue;
    }
    if (!seen_containers.insert(v).second) continue;
    children.clear();
    if (is_list) {
      for (size_t i = 0; i < v->items.size(); ++i) {
        if (v->items[i] == nullptr) continue;
        steps.push_back({step, nullptr, static_cast<int64_t>(i)});
        children.emplace_back(v->items[i], steps.size() - 1);
      }
    } else {
      for (const auto& [key, value] : v->entries) {
        if (key == nullptr || value == nullptr) continue;
        if (key->kind == Kind::kStr) {
          steps.push_back({step, key, 0});
        } else if (key->kind == Kind::kInt && key->big.empty()) {
          steps.push_back({step, nullptr, key->i});
        } else {
          continue;
        }
        children.emplace_back(value, steps.size() - 1);
      }
    }
    for (size_t i = children.size(); i-- > 0;) stack.push_back(children[i]);
  }
}

}  // namespace ucp::torchfile::internal
