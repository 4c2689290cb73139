// The protocol-2 pickler: writes a Value graph the way CPython's C pickler
// (Modules/_pickle.c, as used by torch.save) writes the Python objects that
// the graph stands for.
//
// It mirrors CPython's recursive save() with an explicit task stack, so graphs
// of any depth (and cycles) are safe. The rules reproduced:
// - memo: every str, bytes, bytearray, non-empty tuple, list, dict, set,
//   object and global gets BINPUT/LONG_BINPUT with sequential indices at its
//   first emission and BINGET/LONG_BINGET afterwards; globals are memoised by
//   name (CPython memoises the class/function object); None, bools, ints,
//   floats, () and persistent ids are not memoised (except an int beyond
//   int64 that the graph shares, which no CPython pickle does: see
//   FindSharedBigInts);
// - a tuple (or reduced object) that got memoised while its own elements were
//   written is recursive: its pushes are dropped (POP.../POP_MARK or POP) and
//   it is fetched with BINGET;
// - exact lists: one item -> APPEND, else MARK ... APPENDS batches of 1000;
//   exact dicts: one item -> SETITEM, else MARK ... SETITEMS batches of 1000
//   plus an empty trailing batch when the size is a multiple of 1000; items
//   and entries of objects (OrderedDict, list subclasses) follow CPython's
//   iterator batching (batches of 1000, a lone last item as APPEND/SETITEM);
// - bytes: `_codecs.encode(latin-1 text, 'latin1')` with one shared 'latin1'
//   string, b'' as `__builtin__.bytes()`; bytearray as
//   `__builtin__.bytearray(bytes)`; set/frozenset as `__builtin__.set(list)`;
// - global names pass through fix_imports' reverse mapping (builtins ->
//   __builtin__, copyreg -> copy_reg, ...); a dotted qualname is written as
//   `getattr(parent, 'last')` like CPython does below protocol 4;
// - NEWOBJ_EX (protocol 4) is written as REDUCE of `copyreg.__newobj_ex__`
//   (cls, args, kwargs), which rebuilds the same object (CPython itself
//   writes a functools.partial of cls.__new__ here).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/core/error.h"
#include "engine/pickle/names.h"
#include "engine/pickle/opcodes.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/text.h"

namespace ucp::pickle {
namespace {

using namespace internal;  // NOLINT: opcode constants

constexpr size_t kBatchSize = 1000;

class Writer {
 public:
  std::string Run(const Value* root) {
    FindSharedBigInts(root);
    out_.push_back(static_cast<char>(kProto));
    out_.push_back(2);
    tasks_.push_back({TaskOp::kSave, 0, 0, root});
    while (!tasks_.empty()) {
      const Task task = tasks_.back();
      tasks_.pop_back();
      switch (task.op) {
        case TaskOp::kSave:
          Save(task.v);
          break;
        case TaskOp::kByte:
          out_.push_back(static_cast<char>(task.byte));
          break;
        case TaskOp::kTupleEnd:
          TupleEnd(task.v, task.n);
          break;
        case TaskOp::kReduceEnd:
          ReduceEnd(task.v);
          break;
        case TaskOp::kMemoizeGlobal:
          MemoizeGlobal(task.v);
          break;
      }
    }
    out_.push_back(static_cast<char>(kStop));
    return std::move(out_);
  }

 private:
  enum class TaskOp : uint8_t {
    kSave,           // save(v)
    kByte,           // write one opcode
    kTupleEnd,       // after a tuple's n elements
    kReduceEnd,      // after REDUCE/NEWOBJ: memoise v (or POP + GET)
    kMemoizeGlobal,  // after a getattr-spelled global
  };
  struct Task {
    TaskOp op;
    uint8_t byte;
    uint32_t n;
    const Value* v;
  };

  // Tasks are run last-in first-out: Schedule() takes them in run order.
  void Schedule(std::vector<Task>& seq) {
    tasks_.insert(tasks_.end(), seq.rbegin(), seq.rend());
    seq.clear();
  }
  static Task SaveTask(const Value* v) { return {TaskOp::kSave, 0, 0, v}; }
  static Task ByteTask(uint8_t op) { return {TaskOp::kByte, op, 0, nullptr}; }

  // Ints beyond int64 that the graph references more than once. CPython
  // never memoises ints, so no pickle it wrote shares one; a hostile stream
  // can (BINPUT once, BINGET a million times), and writing such an int out
  // at every reference would turn a few megabytes into terabytes. They are
  // memoised like strings instead.
  void FindSharedBigInts(const Value* root) {
    std::unordered_map<const Value*, int> refs;
    std::unordered_set<const Value*> seen;
    std::vector<const Value*> todo;
    auto edge = [&](const Value* c) {
      if (c == nullptr) return;
      if (c->kind == Kind::kInt) {
        if (!c->big.empty() && ++refs[c] == 2) shared_big_ints_.insert(c);
        return;
      }
      if (seen.insert(c).second) todo.push_back(c);
    };
    edge(root);
    while (!todo.empty()) {
      const Value* v = todo.back();
      todo.pop_back();
      for (const Value* c : v->items) edge(c);
      for (const auto& [k, x] : v->entries) {
        edge(k);
        edge(x);
      }
      for (const Value* c :
           {v->callable, v->args, v->kwargs, v->state, v->pid}) {
        edge(c);
      }
    }
  }

  // --- output
  // -----------------------------------------------------------------

  void Put(uint8_t op) { out_.push_back(static_cast<char>(op)); }

  void PutLE(uint64_t v, int n) {
    for (int k = 0; k < n; ++k) out_.push_back(static_cast<char>(v >> (8 * k)));
  }

  void PutMemoIndex(uint8_t short_op, uint8_t long_op, uint32_t index) {
    if (index < 256) {
      Put(short_op);
      PutLE(index, 1);
    } else {
      Put(long_op);
      PutLE(index, 4);
    }
  }

  uint32_t NextMemoIndex() {
    if (next_memo_ == UINT32_MAX) {
      throw InternalError("pickle: more than 2**32 memoised objects");
    }
    return next_memo_++;
  }

  void Memoize(const Value* v) {
    const uint32_t index = NextMemoIndex();
    memo_.emplace(v, index);
    PutMemoIndex(kBinPut, kLongBinPut, index);
  }

  bool PutGetIfMemoised(const Value* v) {
    auto it = memo_.find(v);
    if (it == memo_.end()) return false;
    PutMemoIndex(kBinGet, kLongBinGet, it->second);
    return true;
  }

  void PutInt(const Value* v) {
    if (v->big.empty()) {
      const int64_t i = v->i;
      if (i >= 0 && i <= 0xff) {
        Put(kBinInt1);
        PutLE(static_cast<uint64_t>(i), 1);
      } else if (i >= 0 && i <= 0xffff) {
        Put(kBinInt2);
        PutLE(static_cast<uint64_t>(i), 2);
      } else if (i >= INT32_MIN && i <= INT32_MAX) {
        Put(kBinInt);
        PutLE(static_cast<uint32_t>(static_cast<int32_t>(i)), 4);
      } else {
        const std::string bytes = EncodeLong(i);
        Put(kLong1);
        PutLE(bytes.size(), 1);
        out_ += bytes;
      }
      return;
    }
    if (v->big.size() < 256) {
      Put(kLong1);
      PutLE(v->big.size(), 1);
    } else {
      if (v->big.size() > INT32_MAX) {
        throw InternalError("pickle: int of ", v->big.size(),
                            " bytes is too large for LONG4");
      }
      Put(kLong4);
      PutLE(v->big.size(), 4);
    }
    out_ += v->big;
  }

  void PutFloat(double f) {
    uint64_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    Put(kBinFloat);
    for (int k = 7; k >= 0; --k)
      out_.push_back(static_cast<char>(bits >> (8 * k)));
  }

  void PutStr(const Value* v) {
    if (v->s.size() > UINT32_MAX) {
      throw InternalError("pickle: str of ", v->s.size(),
                          " bytes cannot be written with protocol 2");
    }
    Put(kBinUnicode);
    PutLE(v->s.size(), 4);
    out_ += v->s;
  }

  // --- temporaries (the objects CPython builds while reducing builtins) -----

  const Value* TempGlobal(const char* module, const char* name) {
    auto key = std::make_pair(std::string(module), std::string(name));
    auto it = temp_globals_.find(key);
    if (it != temp_globals_.end()) return it->second;
    Value* g = temp_.Global(module, name);
    temp_globals_.emplace(std::move(key), g);
    return g;
  }

  // The interned 'latin1' that CPython passes to every _codecs.encode.
  Value* Latin1() {
    if (latin1_ == nullptr) latin1_ = temp_.Str("latin1");
    return latin1_;
  }

  // --- save
  // -------------------------------------------------------------------

  void Save(const Value* v) {
    if (v == nullptr) throw InternalError("pickle: null Value in the graph");
    switch (v->kind) {
      case Kind::kPersId:
        seq_.push_back(SaveTask(v->pid));
        seq_.push_back(ByteTask(kBinPersId));
        Schedule(seq_);
        return;
      case Kind::kNone:
        Put(kNone);
        return;
      case Kind::kBool:
        Put(v->b ? kNewTrue : kNewFalse);
        return;
      case Kind::kInt:
        if (shared_big_ints_.count(v) != 0) {
          if (PutGetIfMemoised(v)) return;
          PutInt(v);
          Memoize(v);
          return;
        }
        PutInt(v);
        return;
      case Kind::kFloat:
        PutFloat(v->f);
        return;
      case Kind::kGlobal:
        SaveGlobal(v);
        return;
      default:
        break;
    }
    if (PutGetIfMemoised(v)) return;
    switch (v->kind) {
      case Kind::kStr:
        PutStr(v);
        Memoize(v);
        return;
      case Kind::kBytes:
        if (v->s.empty()) {
          SaveReduce(TempGlobal("builtins", "bytes"), temp_.Tuple({}), kReduce,
                     v);
        } else {
          const Value* args =
              temp_.Tuple({temp_.Str(Latin1ToUtf8(v->s)), Latin1()});
          SaveReduce(TempGlobal("_codecs", "encode"), args, kReduce, v);
        }
        return;
      case Kind::kByteArray:
        if (v->s.empty()) {
          SaveReduce(TempGlobal("builtins", "bytearray"), temp_.Tuple({}),
                     kReduce, v);
        } else {
          SaveReduce(TempGlobal("builtins", "bytearray"),
                     temp_.Tuple({temp_.Bytes(v->s)}), kReduce, v);
        }
        return;
      case Kind::kSet:
      case Kind::kFrozenSet:
        SaveReduce(
            TempGlobal("builtins", v->kind == Kind::kSet ? "set" : "frozenset"),
            temp_.Tuple({temp_.List(v->items)}), kReduce, v);
        return;
      case Kind::kTuple:
        SaveTuple(v);
        return;
      case Kind::kList:
        Put(kEmptyList);
        Memoize(v);
        BatchListExact(v->items);
        Schedule(seq_);
        return;
      case Kind::kDict:
        Put(kEmptyDict);
        Memoize(v);
        BatchDictExact(v->entries);
        Schedule(seq_);
        return;
      case Kind::kObject:
        SaveObject(v);
        return;
      default:
        throw InternalError("pickle: unexpected value kind ",
                            static_cast<int>(v->kind));
    }
  }

  void SaveTuple(const Value* v) {
    const size_t n = v->items.size();
    if (n == 0) {
      Put(kEmptyTuple);
      return;
    }
    if (n > 3) Put(kMark);
    for (const Value* item : v->items) seq_.push_back(SaveTask(item));
    seq_.push_back(
        {TaskOp::kTupleEnd, 0, static_cast<uint32_t>(n > 3 ? 4 : n), v});
    Schedule(seq_);
  }

  void TupleEnd(const Value* v, uint32_t n) {
    if (memo_.count(v) != 0) {  // recursive tuple: drop what we pushed
      if (n <= 3) {
        for (uint32_t k = 0; k < n; ++k) Put(kPop);
      } else {
        Put(kPopMark);
      }
      PutGetIfMemoised(v);
      return;
    }
    static constexpr uint8_t kSized[] = {0, kTuple1, kTuple2, kTuple3};
    Put(n <= 3 ? kSized[n] : static_cast<uint8_t>(kTuple));
    Memoize(v);
  }

  // save_reduce(): callable/cls, args, REDUCE/NEWOBJ, memoise obj, then an
  // object's items, entries and BUILD state.
  void SaveReduce(const Value* callable, const Value* args, uint8_t op,
                  const Value* obj) {
    if (args == nullptr || args->kind != Kind::kTuple) {
      throw InternalError("pickle: object arguments must be a tuple");
    }
    seq_.push_back(SaveTask(callable));
    seq_.push_back(SaveTask(args));
    seq_.push_back(ByteTask(op));
    seq_.push_back({TaskOp::kReduceEnd, 0, 0, obj});
    if (obj->kind == Kind::kObject) {
      BatchGeneric(obj->items.size(), kAppend, kAppends,
                   [&](size_t k) { seq_.push_back(SaveTask(obj->items[k])); });
      BatchGeneric(obj->entries.size(), kSetItem, kSetItems, [&](size_t k) {
        seq_.push_back(SaveTask(obj->entries[k].first));
        seq_.push_back(SaveTask(obj->entries[k].second));
      });
      if (obj->state != nullptr) {
        seq_.push_back(SaveTask(obj->state));
        seq_.push_back(ByteTask(kBuild));
      }
    }
    Schedule(seq_);
  }

  void ReduceEnd(const Value* obj) {
    if (memo_.count(obj) != 0) {  // recursive: drop the new object
      Put(kPop);
      PutGetIfMemoised(obj);
      return;
    }
    Memoize(obj);
  }

  void SaveObject(const Value* v) {
    if (v->callable == nullptr) {
      throw InternalError("pickle: object without a callable");
    }
    switch (v->op) {
      case ObjectOp::kReduce:
        SaveReduce(v->callable, v->args, kReduce, v);
        return;
      case ObjectOp::kNewObj:
        SaveReduce(v->callable, v->args, kNewObj, v);
        return;
      case ObjectOp::kNewObjEx: {
        if (v->args == nullptr || v->args->kind != Kind::kTuple) {
          throw InternalError("pickle: object arguments must be a tuple");
        }
        Value* kwargs = v->kwargs != nullptr ? v->kwargs : temp_.Dict();
        const Value* args = temp_.Tuple({v->callable, v->args, kwargs});
        SaveReduce(TempGlobal("copyreg", "__newobj_ex__"), args, kReduce, v);
        return;
      }
    }
  }

  void SaveGlobal(const Value* v) {
    if (v->module.find('\n') != std::string::npos ||
        v->name.find('\n') != std::string::npos) {
      throw InternalError("pickle: global name with a newline");
    }
    auto [m3, n3] = Py3Name(v->module, v->name);
    auto key = std::make_pair(std::string(m3), std::string(n3));
    auto it = global_memo_.find(key);
    if (it != global_memo_.end()) {
      PutMemoIndex(kBinGet, kLongBinGet, it->second);
      return;
    }
    const size_t dot = v->name.rfind('.');
    if (dot != std::string::npos) {
      // Nested qualname: getattr(parent, 'last'), then memoise the class.
      const Value* args =
          temp_.Tuple({temp_.Global(v->module, v->name.substr(0, dot)),
                       temp_.Str(v->name.substr(dot + 1))});
      seq_.push_back(SaveTask(TempGlobal("builtins", "getattr")));
      seq_.push_back(SaveTask(args));
      seq_.push_back(ByteTask(kReduce));
      seq_.push_back({TaskOp::kMemoizeGlobal, 0, 0, v});
      Schedule(seq_);
      return;
    }
    auto [m2, n2] = Py2Name(v->module, v->name);
    Put(kGlobal);
    out_.append(m2).push_back('\n');
    out_.append(n2).push_back('\n');
    MemoizeGlobal(v);
  }

  void MemoizeGlobal(const Value* v) {
    auto [m3, n3] = Py3Name(v->module, v->name);
    const uint32_t index = NextMemoIndex();
    global_memo_.emplace(std::make_pair(std::string(m3), std::string(n3)),
                         index);
    PutMemoIndex(kBinPut, kLongBinPut, index);
  }

  // batch_list_exact(): one item -> APPEND, else MARK..APPENDS per 1000.
  void BatchListExact(const std::vector<Value*>& items) {
    if (items.empty()) return;
    if (items.size() == 1) {
      seq_.push_back(SaveTask(items[0]));
      seq_.push_back(ByteTask(kAppend));
      return;
    }
    for (size_t start = 0; start < items.size(); start += kBatchSize) {
      const size_t end = std::min(items.size(), start + kBatchSize);
      seq_.push_back(ByteTask(kMark));
      for (size_t k = start; k < end; ++k) seq_.push_back(SaveTask(items[k]));
      seq_.push_back(ByteTask(kAppends));
    }
  }

  // batch_dict_exact(): one item -> SETITEM, else MARK..SETITEMS per 1000,
  // with an empty last batch when the size is a multiple of 1000.
  void BatchDictExact(const std::vector<std::pair<Value*, Value*>>& entries) {
    if (entries.empty()) return;
    if (entries.size() == 1) {
      seq_.push_back(SaveTask(entries[0].first));
      seq_.push_back(SaveTask(entries[0].second));
      seq_.push_back(ByteTask(kSetItem));
      return;
    }
    size_t start = 0;
    size_t batch;
    do {
      const size_t end = std::min(entries.size(), start + kBatchSize);
      batch = end - start;
      seq_.push_back(ByteTask(kMark));
      for (size_t k = start; k < end; ++k) {
        seq_.push_back(SaveTask(entries[k].first));
        seq_.push_back(SaveTask(entries[k].second));
      }
      seq_.push_back(ByteTask(kSetItems));
      start = end;
    } while (batch == kBatchSize);
  }

  // batch_list()/batch_dict() over an iterator: batches of 1000, a batch of
  // one item is written with the single-item opcode.
  template <typename SaveItem>
  void BatchGeneric(size_t n, uint8_t single_op, uint8_t batch_op,
                    SaveItem save_item) {
    for (size_t start = 0; start < n; start += kBatchSize) {
      const size_t end = std::min(n, start + kBatchSize);
      if (end - start == 1) {
        save_item(start);
        seq_.push_back(ByteTask(single_op));
        continue;
      }
      seq_.push_back(ByteTask(kMark));
      for (size_t k = start; k < end; ++k) save_item(k);
      seq_.push_back(ByteTask(batch_op));
    }
  }

  std::string out_;
  std::vector<Task> tasks_;
  std::vector<Task> seq_;  // scratch for Schedule()
  std::unordered_set<const Value*> shared_big_ints_;
  std::unordered_map<const Value*, uint32_t> memo_;
  std::map<std::pair<std::string, std::string>, uint32_t> global_memo_;
  uint32_t next_memo_ = 0;
  Arena temp_;
  std::map<std::pair<std::string, std::string>, const Value*> temp_globals_;
  Value* latin1_ = nullptr;
};

}  // namespace

std::string Pickle(const Value* root, const PickleOptions& options) {
  if (options.protocol != 2) {
    throw InternalError("pickle: only protocol 2 is written, not ",
                        options.protocol);
  }
  Writer writer;
  return writer.Run(root);
}

}  // namespace ucp::pickle
