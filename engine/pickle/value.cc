#include "engine/pickle/value.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <unordered_map>
#include <unordered_set>

#include "engine/pickle/names.h"

namespace ucp::pickle {
namespace {

// Dict-like lookup of a str key; the last entry wins, as in Python when a
// stream repeats a key.
Value* FindStrKey(const std::vector<std::pair<Value*, Value*>>& entries,
                  std::string_view key) noexcept {
  for (auto it = entries.rbegin(); it != entries.rend(); ++it) {
    const Value* k = it->first;
    if (k != nullptr && k->kind == Kind::kStr && k->s == key) return it->second;
  }
  return nullptr;
}

Value* AttrOf(const Value* v, std::string_view attribute) noexcept {
  if (v == nullptr || v->kind != Kind::kObject || v->state == nullptr) {
    return nullptr;
  }
  const Value* state = v->state;
  if (state->kind == Kind::kDict) return FindStrKey(state->entries, attribute);
  // (instance dict or None, slots dict), as objects with __slots__ pickle.
  if (state->kind == Kind::kTuple && state->items.size() == 2) {
    for (const Value* part : state->items) {
      if (part != nullptr && part->kind == Kind::kDict) {
        if (Value* found = FindStrKey(part->entries, attribute)) return found;
      }
    }
  }
  return nullptr;
}

// "module.qualname" of a node that names a global: a kGlobal, or
// getattr(<global>, 'name') as protocols < 4 spell nested classes.
std::string QualifiedName(const Value* v) {
  std::vector<std::string_view> suffix;
  for (int guard = 0; v != nullptr && guard < 64; ++guard) {
    if (v->kind == Kind::kGlobal) {
      auto [m, n] = internal::Py3Name(v->module, v->name);
      std::string out;
      out.append(m).append(".").append(n);
      for (auto it = suffix.rbegin(); it != suffix.rend(); ++it) {
        out.append(".").append(*it);
      }
      return out;
    }
    if (v->kind != Kind::kObject || v->op != ObjectOp::kReduce ||
        v->callable == nullptr ||
        !v->callable->IsGlobal("builtins", "getattr") || v->args == nullptr ||
        v->args->kind != Kind::kTuple || v->args->items.size() != 2 ||
        v->args->items[1] == nullptr || v->args->items[1]->kind != Kind::kStr) {
      return "";
    }
    suffix.push_back(v->args->items[1]->s);
    v = v->args->items[0];
  }
  return "";
}

// The class of a kObject: its callable, except for the reductions whose
// result is an instance of args[0].
std::string ClassOf(const Value* v) {
  const Value* callable = v->callable;
  if (callable == nullptr) return "";
  // numpy >= 1.23 with protocol 5 rebuilds arrays from a buffer.
  if (callable->IsGlobal("numpy.core.numeric", "_frombuffer") ||
      callable->IsGlobal("numpy._core.numeric", "_frombuffer")) {
    return "numpy.ndarray";
  }
  const bool via_first_arg =
      callable->kind == Kind::kGlobal &&
      (callable->IsGlobal("copyreg", "_reconstructor") ||
       callable->IsGlobal("copyreg", "__newobj_ex__") ||
       callable->IsGlobal("numpy.core.multiarray", "_reconstruct") ||
       callable->IsGlobal("numpy._core.multiarray", "_reconstruct") ||
       callable->IsGlobal("builtins", "getattr"));
  if (via_first_arg) {
    if (v->args == nullptr || v->args->kind != Kind::kTuple ||
        v->args->items.empty()) {
      return "";
    }
    return QualifiedName(v->args->items[0]);
  }
  return QualifiedName(callable);
}

struct PairHash {
  size_t operator()(const std::pair<const Value*, const Value*>& p) const {
    const size_t a = std::hash<const Value*>()(p.first);
    const size_t b = std::hash<const Value*>()(p.second);
    return a ^ (b + 0x9e3779b97f4a7c15ULL + (a << 6) + (a >> 2));
  }
};

bool SameFloat(double a, double b) {
  if (std::isnan(a) && std::isnan(b)) return true;
  uint64_t x;
  uint64_t y;
  std::memcpy(&x, &a, sizeof x);
  std::memcpy(&y, &b, sizeof y);
  return x == y;
}

// Compares everything except child pointers.
bool SameScalars(const Value& a, const Value& b) {
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kNone:
      return true;
    case Kind::kBool:
      return a.b == b.b;
    case Kind::kInt:
      return a.i == b.i && a.big == b.big;
    case Kind::kFloat:
      return SameFloat(a.f, b.f);
    case Kind::kStr:
    case Kind::kBytes:
    case Kind::kByteArray:
      return a.s == b.s;
    case Kind::kGlobal:
      return internal::Py3Name(a.module, a.name) ==
             internal::Py3Name(b.module, b.name);
    case Kind::kObject:
      return a.op == b.op && a.items.size() == b.items.size() &&
             a.entries.size() == b.entries.size();
    case Kind::kTuple:
    case Kind::kList:
    case Kind::kSet:
    case Kind::kFrozenSet:
      return a.items.size() == b.items.size();
    case Kind::kDict:
      return a.entries.size() == b.entries.size();
    case Kind::kPersId:
      return true;
  }
  return false;
}

bool StartsWithModule(std::string_view module, std::string_view prefix) {
  return module == prefix ||
         (module.size() > prefix.size() && module.starts_with(prefix) &&
          module[prefix.size()] == '.');
}

}  // namespace

// --- Value ----------------------------------------------------------------

std::optional<int64_t> Value::AsInt() const noexcept {
  if (kind == Kind::kInt && big.empty()) return i;
  if (kind == Kind::kBool) return b ? 1 : 0;
  return std::nullopt;
}

std::optional<double> Value::AsFloat() const noexcept {
  if (kind == Kind::kFloat) return f;
  if (kind == Kind::kInt && big.empty()) return static_cast<double>(i);
  return std::nullopt;
}

std::optional<std::string_view> Value::AsStr() const noexcept {
  if (kind == Kind::kStr) return std::string_view(s);
  return std::nullopt;
}

bool Value::IsGlobal(std::string_view module_name,
                     std::string_view global_name) const noexcept {
  if (kind != Kind::kGlobal) return false;
  if (module == module_name && name == global_name) return true;
  return internal::Py3Name(module, name) ==
         internal::Py3Name(module_name, global_name);
}

bool Value::IsObjectOf(std::string_view module_name,
                       std::string_view global_name) const noexcept {
  return kind == Kind::kObject && callable != nullptr &&
         callable->IsGlobal(module_name, global_name);
}

std::string Value::ClassName() const {
  if (kind == Kind::kGlobal) return QualifiedName(this);
  if (kind == Kind::kObject) return ClassOf(this);
  return "";
}

bool Value::IsDictLike() const noexcept {
  return kind == Kind::kDict || IsObjectOf("collections", "OrderedDict");
}

const Value* Value::Get(std::string_view key) const noexcept {
  if (!IsDictLike()) return nullptr;
  return FindStrKey(entries, key);
}

Value* Value::Get(std::string_view key) noexcept {
  if (!IsDictLike()) return nullptr;
  return FindStrKey(entries, key);
}

const Value* DictGet(const Value* dict, std::string_view key) noexcept {
  return dict != nullptr ? dict->Get(key) : nullptr;
}

const Value* Value::Attr(std::string_view attribute) const noexcept {
  return AttrOf(this, attribute);
}

Value* Value::Attr(std::string_view attribute) noexcept {
  return AttrOf(this, attribute);
}

// --- Arena ----------------------------------------------------------------

Value* Arena::New(Kind kind) {
  Value& v = nodes_.emplace_back();
  v.kind = kind;
  return &v;
}

Value* Arena::None() { return New(Kind::kNone); }

Value* Arena::Bool(bool b) {
  Value* v = New(Kind::kBool);
  v->b = b;
  return v;
}

Value* Arena::Int(int64_t i) {
  Value* v = New(Kind::kInt);
  v->i = i;
  return v;
}

Value* Arena::BigInt(std::string_view le_bytes) {
  Value* v = New(Kind::kInt);
  // Drop redundant sign-extension bytes.
  size_t n = le_bytes.size();
  while (n > 1) {
    const auto top = static_cast<unsigned char>(le_bytes[n - 1]);
    const auto next = static_cast<unsigned char>(le_bytes[n - 2]);
    if ((top == 0x00 && (next & 0x80) == 0) ||
        (top == 0xff && (next & 0x80) != 0)) {
      --n;
    } else {
      break;
    }
  }
  if (n <= 8) {
    uint64_t u = 0;
    for (size_t k = 0; k < n; ++k) {
      u |= uint64_t{static_cast<unsigned char>(le_bytes[k])} << (8 * k);
    }
    if (n > 0 && n < 8 &&
        (static_cast<unsigned char>(le_bytes[n - 1]) & 0x80)) {
      u |= ~uint64_t{0} << (8 * n);  // sign-extend
    }
    v->i = static_cast<int64_t>(u);
  } else {
    v->big.assign(le_bytes.substr(0, n));
  }
  return v;
}

Value* Arena::Float(double f) {
  Value* v = New(Kind::kFloat);
  v->f = f;
  return v;
}

Value* Arena::Str(std::string s) {
  Value* v = New(Kind::kStr);
  v->s = std::move(s);
  return v;
}

Value* Arena::Bytes(std::string s) {
  Value* v = New(Kind::kBytes);
  v->s = std::move(s);
  return v;
}

Value* Arena::ByteArray(std::string s) {
  Value* v = New(Kind::kByteArray);
  v->s = std::move(s);
  return v;
}

Value* Arena::Tuple(std::vector<Value*> items) {
  Value* v = New(Kind::kTuple);
  v->items = std::move(items);
  return v;
}

Value* Arena::List(std::vector<Value*> items) {
  Value* v = New(Kind::kList);
  v->items = std::move(items);
  return v;
}

Value* Arena::Dict(std::vector<std::pair<Value*, Value*>> entries) {
  Value* v = New(Kind::kDict);
  v->entries = std::move(entries);
  return v;
}

Value* Arena::Set(std::vector<Value*> items) {
  Value* v = New(Kind::kSet);
  v->items = std::move(items);
  return v;
}

Value* Arena::FrozenSet(std::vector<Value*> items) {
  Value* v = New(Kind::kFrozenSet);
  v->items = std::move(items);
  return v;
}

Value* Arena::Global(std::string module, std::string name) {
  Value* v = New(Kind::kGlobal);
  v->module = std::move(module);
  v->name = std::move(name);
  return v;
}

Value* Arena::Object(ObjectOp op, Value* callable, Value* args) {
  Value* v = New(Kind::kObject);
  v->op = op;
  v->callable = callable;
  v->args = args;
  return v;
}

Value* Arena::PersId(Value* pid) {
  Value* v = New(Kind::kPersId);
  v->pid = pid;
  return v;
}

Value* Arena::Copy(const Value* v,
                   const std::function<Value*(const Value*)>& substitute) {
  if (v == nullptr) return nullptr;
  std::unordered_map<const Value*, Value*> copies;
  // Copies whose child pointers still point into the source graph.
  std::vector<std::pair<const Value*, Value*>> pending;
  auto map = [&](const Value* src) -> Value* {
    if (src == nullptr) return nullptr;
    auto it = copies.find(src);
    if (it != copies.end()) return it->second;
    if (substitute) {
      if (Value* replacement = substitute(src)) {
        copies.emplace(src, replacement);
        return replacement;
      }
    }
    Value* copy = &nodes_.emplace_back(*src);
    copies.emplace(src, copy);
    pending.emplace_back(src, copy);
    return copy;
  };
  Value* root = map(v);
  while (!pending.empty()) {
    auto [src, dst] = pending.back();
    pending.pop_back();
    dst->callable = map(src->callable);
    dst->args = map(src->args);
    dst->kwargs = map(src->kwargs);
    dst->state = map(src->state);
    dst->pid = map(src->pid);
    for (size_t k = 0; k < src->items.size(); ++k) {
      dst->items[k] = map(src->items[k]);
    }
    for (size_t k = 0; k < src->entries.size(); ++k) {
      dst->entries[k].first = map(src->entries[k].first);
      dst->entries[k].second = map(src->entries[k].second);
    }
  }
  return root;
}

// --- Free functions -------------------------------------------------------

bool DeepEqual(const Value* a, const Value* b) {
  // Co-inductive comparison: a pair already under comparison is assumed
  // equal, which makes cyclic graphs compare correctly and terminate.
  std::unordered_set<std::pair<const Value*, const Value*>, PairHash> assumed;
  std::vector<std::pair<const Value*, const Value*>> todo{{a, b}};
  while (!todo.empty()) {
    auto [x, y] = todo.back();
    todo.pop_back();
    if (x == y) continue;
    if (x == nullptr || y == nullptr) return false;
    if (!assumed.emplace(x, y).second) continue;
    if (!SameScalars(*x, *y)) return false;
    todo.emplace_back(x->callable, y->callable);
    todo.emplace_back(x->args, y->args);
    todo.emplace_back(x->kwargs, y->kwargs);
    todo.emplace_back(x->state, y->state);
    todo.emplace_back(x->pid, y->pid);
    for (size_t k = 0; k < x->items.size(); ++k) {
      todo.emplace_back(x->items[k], y->items[k]);
    }
    for (size_t k = 0; k < x->entries.size(); ++k) {
      todo.emplace_back(x->entries[k].first, y->entries[k].first);
      todo.emplace_back(x->entries[k].second, y->entries[k].second);
    }
  }
  return true;
}

bool IsSuspiciousGlobal(std::string_view module,
                        std::string_view name) noexcept {
  auto [m, n] = internal::Py3Name(module, name);
  // Whole modules whose globals run commands, load code or touch the
  // process/filesystem/network.
  static constexpr std::string_view kModules[] = {"os",
                                                  "posix",
                                                  "nt",
                                                  "subprocess",
                                                  "sys",
                                                  "shutil",
                                                  "socket",
                                                  "_socket",
                                                  "pty",
                                                  "runpy",
                                                  "importlib",
                                                  "ctypes",
                                                  "_ctypes",
                                                  "webbrowser",
                                                  "code",
                                                  "commands",
                                                  "_posixsubprocess",
                                                  "multiprocessing",
                                                  "asyncio.subprocess",
                                                  "pdb",
                                                  "timeit",
                                                  "imp",
                                                  "zipimport",
                                                  "marshal"};
  for (std::string_view bad : kModules) {
    if (StartsWithModule(m, bad)) return true;
  }
  // Python 2's `commands` maps to subprocess already; keep the raw name too.
  if (StartsWithModule(module, "commands")) return true;
  if (m == "builtins") {
    static constexpr std::string_view kBuiltins[] = {
        "eval",     "exec",       "compile",        "__import__", "open",
        "execfile", "input",      "breakpoint",     "globals",    "locals",
        "vars",     "apply",      "file",           "reload",     "setattr",
        "delattr",  "__loader__", "__build_class__"};
    for (std::string_view bad : kBuiltins) {
      if (n == bad) return true;
    }
    return false;
  }
  if (m == "pickle" || m == "_pickle" || m == "cPickle" || m == "dill" ||
      m == "cloudpickle" || m == "joblib" || m == "torch.serialization" ||
      m == "numpy" || m == "torch") {
    return n == "loads" || n == "load" || n == "Unpickler" || n == "_loads" ||
           n == "_load";
  }
  if (m == "codecs" || m == "io" || m == "_io") {
    return n == "open" || n == "FileIO" || n == "open_code";
  }
  if (m == "types")
    return n == "FunctionType" || n == "CodeType" || n == "LambdaType" ||
           n == "ModuleType";
  if (m == "operator") return n == "methodcaller";
  if (m == "numpy.testing._private.utils") return n == "runstring";
  return false;
}

std::vector<std::string> SuspiciousGlobals(const Arena& arena) {
  std::vector<std::string> out;
  for (const Value& v : arena.nodes()) {
    if (v.kind == Kind::kGlobal && IsSuspiciousGlobal(v.module, v.name)) {
      out.push_back(v.module + "." + v.name);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string_view KindName(Kind kind) noexcept {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kByteArray:
      return "bytearray";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kSet:
      return "set";
    case Kind::kFrozenSet:
      return "frozenset";
    case Kind::kGlobal:
      return "global";
    case Kind::kObject:
      return "object";
    case Kind::kPersId:
      return "persistent id";
  }
  return "?";
}

}  // namespace ucp::pickle
