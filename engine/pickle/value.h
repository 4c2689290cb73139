#pragma once
// The generic Python-value graph that the pickle VM builds and the pickler
// writes back.
//
// Nothing is ever executed. A GLOBAL becomes a kGlobal node (module + name);
// REDUCE / NEWOBJ / NEWOBJ_EX build a kObject node that records the callable,
// its arguments, any BUILD state and any APPEND(S)/SETITEM(S) applied to it.
// So argparse.Namespace, numpy arrays, enums, io.BytesIO, OrderedDict,
// DeepSpeed/Megatron classes and torch's _rebuild_tensor_v2 calls all survive
// as opaque, re-serialisable objects. The only decoding the VM performs is of
// builtins whose result is a plain value and which protocol 2 uses to spell
// such values: `_codecs.encode(str, 'latin1')` and `bytes()` become kBytes,
// `bytearray(...)` kByteArray, `set(list)` kSet, `frozenset(list)`
// kFrozenSet, and `copyreg.__newobj_ex__(cls, args, kwargs)` a kNewObjEx
// object; the pickler spells them again the way CPython does.
//
// All nodes live in an Arena and refer to each other by raw pointer, so
// sharing (memo BINGET) and even cycles are represented exactly and nothing is
// destroyed recursively. Every function here is iterative or depth-bounded:
// graphs of any depth and cyclic graphs are safe.

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
  kObject,     // `op`, `callable`, `args`, [`kwargs`], [`state`], [`items`],
               // [`entries`]
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
  /// LONG1/LONG4 store them (minimal length; never set for values that fit
  /// int64).
  std::string big;
  double f = 0;  // kFloat
  /// kStr: UTF-8 (lone surrogates allowed, as Python's 'surrogatepass');
  /// kBytes / kByteArray: raw bytes.
  std::string s;

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
  /// "module.qualname" of a kGlobal, or of a kObject's callable when that
  /// names a global; "" otherwise. Python 2 names are normalised (fix_imports
  /// mapping), and a callable spelled `getattr(Outer, 'Inner')` (nested
  /// classes below protocol 4) reads "module.Outer.Inner". For objects built
  /// by `copyreg._reconstructor(cls, ...)`, numpy's `_reconstruct(cls, ...)`,
  /// `copyreg.__newobj_ex__(cls, ...)` or `builtins.getattr(cls, name)` (enum
  /// members in Python >= 3.11) the class in args[0] is named instead, and
  /// numpy's protocol-5 `_frombuffer(...)` reads "numpy.ndarray", so the
  /// result equals Python's `type(obj).__module__ + '.' + __qualname__`
  /// (numpy scalars, built by `numpy.core.multiarray.scalar`, are an
  /// exception: their dtype is not a class reference).
  std::string ClassName() const;
  /// kDict, or a kObject whose class is collections.OrderedDict (with or
  /// without entries).
  bool IsDictLike() const noexcept;
  /// For dict-likes: the value of the str key (the last one if a stream
  /// repeats a key, as in Python), nullptr if absent. Linear in the size.
  const Value* Get(std::string_view key) const noexcept;
  Value* Get(std::string_view key) noexcept;
  /// For a kObject whose BUILD state is a kDict (argparse.Namespace,
  /// dataclasses, plain objects) or a (dict-or-None, slots-dict) pair: that
  /// attribute, nullptr if absent.
  const Value* Attr(std::string_view attribute) const noexcept;
  Value* Attr(std::string_view attribute) noexcept;
};

/// The value of str key `key` of `dict` if `dict` is a dict-like holding it,
/// nullptr otherwise (also when `dict` is nullptr or not a dict-like).
const Value* DictGet(const Value* dict, std::string_view key) noexcept;

/// Owns every Value of one graph. Nodes never move (deque; moving the Arena
/// keeps them in place too) and are freed all at once with the arena.
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
  /// An int from two's-complement little-endian bytes of any length (LONG1
  /// style); stored in `i` when it fits int64, else minimal bytes in `big`.
  Value* BigInt(std::string_view le_bytes);
  Value* Float(double f);
  Value* Str(std::string s);
  Value* Bytes(std::string s);
  Value* ByteArray(std::string s);
  Value* Tuple(std::vector<Value*> items);
  Value* List(std::vector<Value*> items);
  Value* Dict(std::vector<std::pair<Value*, Value*>> entries = {});
  Value* Set(std::vector<Value*> items);
  Value* FrozenSet(std::vector<Value*> items);
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

/// The Python-ish name of a kind for messages: "None", "int", "str", "dict",
/// "global", "object", "persistent id", ...
std::string_view KindName(Kind kind) noexcept;

/// Structural equality: same kinds, values, order and class names (Python 2
/// global names normalised); cycle-safe and iterative. Floats compare by bit
/// pattern except that every NaN equals every NaN (so 0.0 != -0.0). Sharing
/// is not compared (two equal copies equal one shared node).
bool DeepEqual(const Value* a, const Value* b);

/// A Python-like rendering for messages and `ucp inspect`, at most `max_len`
/// characters (longer renderings are cut and end in "..."; pass
/// std::string::npos for no limit). None, bool, int, float, str, bytes and
/// bytearray render exactly as CPython 3.11's repr() (printable non-ASCII
/// text is kept, per Unicode 14 as in Python 3.11; ints above 2048 bytes read
/// "<int of N bytes>", as Python itself refuses to print them). Containers
/// render like Python's repr ("[...]" for a list inside itself, nesting
/// beyond 64 levels as "..."); objects as "module.Class(...)" with their
/// entries, attributes or arguments; globals as "<global module.name>";
/// persistent ids as "persid(...)".
std::string Repr(const Value* v, size_t max_len = 80);

/// True for globals that a malicious pickle would use to run code when loaded
/// by Python: anything in os/posix/nt, subprocess, sys, shutil, socket, pty,
/// runpy, importlib, ctypes, webbrowser, code, commands, multiprocessing,
/// marshal, pdb, timeit, imp, zipimport; builtins eval/exec/compile/
/// __import__/open/execfile/input/breakpoint/globals/locals/vars/apply/file/
/// reload/setattr/delattr/__build_class__; pickle-style loads/load/Unpickler;
/// codecs/io open and FileIO; types.FunctionType/CodeType; ... Python 2 names
/// count as their Python 3 equivalents. Never what checkpoints legitimately
/// use (getattr, set, bytes, _codecs.encode, OrderedDict, torch/numpy
/// rebuild functions). ucp never executes any global; `ucp inspect` reports
/// these.
bool IsSuspiciousGlobal(std::string_view module,
                        std::string_view name) noexcept;

/// "module.name" (as written in the stream) of every suspicious kGlobal in the
/// arena, sorted, unique; includes globals the stream POPs again.
std::vector<std::string> SuspiciousGlobals(const Arena& arena);

}  // namespace ucp::pickle
