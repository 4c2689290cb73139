#pragma once
// The generic Python-value graph that the pickle VM builds and the pickler
// writes back.
//
// Nothing is ever executed. A GLOBAL becomes a kGlobal node (module + name);
// REDUCE / NEWOBJ / NEWOBJ_EX build a kObject node that records the callable,
// its arguments, any BUILD state and any APPEND(S)/SETITEM(S) applied to it.
// So argparse.Namespace, numpy arrays, enums, io.BytesIO, OrderedDict,
// DeepSpeed/Megatron classes and torch's _rebuild_tensor_v2 calls all survive
// as opaque, re-serialisable objects. The one decoding the VM performs is
// `_codecs.encode(str, 'latin1')` (and `bytes()`), which protocol 2 uses for
// Python `bytes`: it becomes a kBytes node, and the pickler re-encodes it.
//
// All nodes live in an Arena and refer to each other by raw pointer, so
// sharing (memo BINGET) and even cycles are represented exactly and nothing is
// destroyed recursively.

#include <cstdint>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ucp::pickle {

enum class Kind : uint8_t {
  kNone,
  kBool,
  kInt,
  kFloat,
  kStr,        // text (UTF-8 in `s`)
  kBytes,      // raw bytes in `s`
  kByteArray,  // raw bytes in `s` (BYTEARRAY8, protocol 5)
  kTuple,      // `items`
  kList,       // `items`
  kDict,       // `entries`, insertion order kept
  kSet,        // `items`
  kFrozenSet,  // `items`
  kGlobal,     // `module`, `name` exactly as written in the pickle
  kObject,     // `op`, `callable`, `args`, [`kwargs`], [`state`], [`items`], [`entries`]
  kPersId,     // `pid`: a persistent id (torch storages)
};

/// The opcode that created a kObject.
enum class ObjectOp : uint8_t { kReduce, kNewObj, kNewObjEx };

struct Value {
  Kind kind = Kind::kNone;

  bool b = false;  // kBool
  /// kInt: the value when it fits int64 (then `big` is empty).
  int64_t i = 0;
  /// kInt that does not fit int64: two's-complement little-endian bytes, as
  /// LONG1/LONG4 store them (minimal length).
  std::string big;
  double f = 0;   // kFloat
  std::string s;  // kStr / kBytes / kByteArray

  std::string module;  // kGlobal
  std::string name;    // kGlobal

  /// kTuple/kList/kSet/kFrozenSet elements; for kObject the items that
  /// APPEND/APPENDS added to it (e.g. a list subclass).
  std::vector<Value*> items;
  /// kDict entries; for kObject the entries SETITEM/SETITEMS added to it
  /// (collections.OrderedDict, defaultdict, ...).
  std::vector<std::pair<Value*, Value*>> entries;

  ObjectOp op = ObjectOp::kReduce;  // kObject
  Value* callable = nullptr;        // kObject: usually a kGlobal (the class)
  Value* args = nullptr;            // kObject: a kTuple
  Value* kwargs = nullptr;          // kObject created by NEWOBJ_EX: a kDict
  Value* state = nullptr;           // kObject: BUILD argument, nullptr if none
  Value* pid = nullptr;             // kPersId: the persistent id value

  // --- Convenience accessors (never throw) -------------------------------

  /// Int value if kInt and it fits int64; also accepts kBool.
  std::optional<int64_t> AsInt() const noexcept;
  /// Float value if kFloat, or kInt that fits int64.
  std::optional<double> AsFloat() const noexcept;
  /// Text if kStr.
  std::optional<std::string_view> AsStr() const noexcept;
  /// True for kGlobal nodes naming module.name, with Python 2 names aliased
  /// (`__builtin__` = `builtins`, `copy_reg` = `copyreg`, ...).
  bool IsGlobal(std::string_view module, std::string_view name) const noexcept;
  /// True for kObject nodes whose callable IsGlobal(module, name).
  bool IsObjectOf(std::string_view module,
                  std::string_view name) const noexcept;
  /// "module.name" of a kGlobal, or of a kObject's callable when that is a
  /// kGlobal; "" otherwise.
  std::string ClassName() const;
  /// kDict, or a kObject whose class is collections.OrderedDict (with or
  /// without entries).
  bool IsDictLike() const noexcept;
  /// For dict-likes: the value of the str key, nullptr if absent.
  const Value* Get(std::string_view key) const noexcept;
  Value* Get(std::string_view key) noexcept;
  /// For a kObject whose BUILD state is a kDict (argparse.Namespace,
  /// dataclasses, plain objects): that attribute, nullptr if absent.
  const Value* Attr(std::string_view attribute) const noexcept;
  Value* Attr(std::string_view attribute) noexcept;
};

/// Owns every Value of one graph. Nodes never move (deque) and are freed all
/// at once with the arena.
class Arena {
 public:
  Arena() = default;
  Arena(Arena&&) noexcept = default;
  Arena& operator=(Arena&&) noexcept = default;
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  Value* New(Kind kind);
  Value* None();
  Value* Bool(bool b);
  Value* Int(int64_t i);
  Value* Float(double f);
  Value* Str(std::string s);
  Value* Bytes(std::string s);
  Value* Tuple(std::vector<Value*> items);
  Value* List(std::vector<Value*> items);
  Value* Dict(std::vector<std::pair<Value*, Value*>> entries = {});
  Value* Global(std::string module, std::string name);
  /// A kObject: op(callable, args); `args` must be a kTuple.
  Value* Object(ObjectOp op, Value* callable, Value* args);
  Value* PersId(Value* pid);

  /// Deep-copies the graph reachable from `v` (which may live in another
  /// arena) into this arena, preserving sharing and cycles. If `substitute`
  /// returns non-null for a node, that node is used instead of a copy (and
  /// its children are not visited).
  Value* Copy(const Value* v,
              const std::function<Value*(const Value*)>& substitute = {});

  size_t size() const noexcept { return nodes_.size(); }
  const std::deque<Value>& nodes() const noexcept { return nodes_; }

 private:
  std::deque<Value> nodes_;
};

/// Structural equality: same kinds, values, order and class names; cycle-safe.
/// Sharing is not compared (two equal copies equal one shared node).
bool DeepEqual(const Value* a, const Value* b);

/// A short Python-like rendering for messages and `ucp inspect`
/// ("OrderedDict(3 items)", "'str'", "argparse.Namespace(...)"), at most
/// `max_len` characters.
std::string Repr(const Value* v, size_t max_len = 80);

/// True for globals that a malicious pickle would use to run code when loaded
/// by Python (os.system, builtins.eval/exec, subprocess.*, ...). ucp never
/// executes them; `ucp inspect` reports them.
bool IsSuspiciousGlobal(std::string_view module, std::string_view name) noexcept;

/// "module.name" of every suspicious kGlobal in the arena, sorted, unique.
std::vector<std::string> SuspiciousGlobals(const Arena& arena);

}  // namespace ucp::pickle
