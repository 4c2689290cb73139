// The pickle VM: interprets opcodes into a Value graph, executing nothing.
//
// Robustness rules (this is the first code that touches untrusted bytes):
// - iterative: no recursion while parsing; the nesting depth of the result is
//   checked afterwards with an explicit stack;
// - every read is bounds-checked, and declared lengths are compared with the
//   remaining input before anything is allocated;
// - the memo is a hash map, so huge memo indices cost nothing;
// - every node costs at least one input byte, and the decoding of builtins
//   (`set(list)`, `_codecs.encode(str)` ...) shares a copy budget of the
//   input size, so memory stays proportional to the input.

#include <charconv>
#include <cstring>
#include <limits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "engine/core/error.h"
#include "engine/pickle/opcodes.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/text.h"

namespace ucp::pickle {
namespace internal {

namespace {

struct OpNameEntry {
  uint8_t op;
  const char* name;
};

// clang-format off
constexpr OpNameEntry kOpNames[] = {
    {kMark, "MARK"}, {kStop, "STOP"}, {kPop, "POP"}, {kPopMark, "POP_MARK"},
    {kDup, "DUP"}, {kFloat, "FLOAT"}, {kInt, "INT"}, {kBinInt, "BININT"},
    {kBinInt1, "BININT1"}, {kLong, "LONG"}, {kBinInt2, "BININT2"},
    {kNone, "NONE"}, {kPersId, "PERSID"}, {kBinPersId, "BINPERSID"},
    {kReduce, "REDUCE"}, {kString, "STRING"}, {kBinString, "BINSTRING"},
    {kShortBinString, "SHORT_BINSTRING"}, {kUnicode, "UNICODE"},
    {kBinUnicode, "BINUNICODE"}, {kAppend, "APPEND"}, {kBuild, "BUILD"},
    {kGlobal, "GLOBAL"}, {kDict, "DICT"}, {kEmptyDict, "EMPTY_DICT"},
    {kAppends, "APPENDS"}, {kGet, "GET"}, {kBinGet, "BINGET"}, {kInst, "INST"},
    {kLongBinGet, "LONG_BINGET"}, {kList, "LIST"}, {kEmptyList, "EMPTY_LIST"},
    {kObj, "OBJ"}, {kPut, "PUT"}, {kBinPut, "BINPUT"},
    {kLongBinPut, "LONG_BINPUT"}, {kSetItem, "SETITEM"}, {kTuple, "TUPLE"},
    {kEmptyTuple, "EMPTY_TUPLE"}, {kSetItems, "SETITEMS"},
    {kBinFloat, "BINFLOAT"}, {kProto, "PROTO"}, {kNewObj, "NEWOBJ"},
    {kExt1, "EXT1"}, {kExt2, "EXT2"}, {kExt4, "EXT4"}, {kTuple1, "TUPLE1"},
    {kTuple2, "TUPLE2"}, {kTuple3, "TUPLE3"}, {kNewTrue, "NEWTRUE"},
    {kNewFalse, "NEWFALSE"}, {kLong1, "LONG1"}, {kLong4, "LONG4"},
    {kBinBytes, "BINBYTES"}, {kShortBinBytes, "SHORT_BINBYTES"},
    {kShortBinUnicode, "SHORT_BINUNICODE"}, {kBinUnicode8, "BINUNICODE8"},
    {kBinBytes8, "BINBYTES8"}, {kEmptySet, "EMPTY_SET"},
    {kAddItems, "ADDITEMS"}, {kFrozenSet, "FROZENSET"},
    {kNewObjEx, "NEWOBJ_EX"}, {kStackGlobal, "STACK_GLOBAL"},
    {kMemoize, "MEMOIZE"}, {kFrame, "FRAME"}, {kByteArray8, "BYTEARRAY8"},
    {kNextBuffer, "NEXT_BUFFER"}, {kReadonlyBuffer, "READONLY_BUFFER"},
};
// clang-format on

}  // namespace

const char* OpName(uint8_t op) noexcept {
  for (const OpNameEntry& e : kOpNames) {
    if (e.op == op) return e.name;
  }
  return nullptr;
}

}  // namespace internal

namespace {

using namespace internal;  // NOLINT: opcode constants

// Python refuses int <-> decimal text conversions beyond this many digits
// (sys.int_info.default_max_str_digits).
constexpr size_t kMaxDecimalDigits = 4300;

class Machine {
 public:
  Machine(std::string_view data, Arena& arena, const UnpickleOptions& options)
      : data_(data),
        arena_(arena),
        options_(options),
        copy_budget_(data.size() + 4096) {}

  Value* Run(size_t* consumed) {
    while (true) {
      if (pos_ >= data_.size()) {
        throw FormatError("pickle: truncated at byte ", pos_,
                          ": no STOP opcode");
      }
      op_pos_ = pos_;
      op_ = static_cast<uint8_t>(data_[pos_++]);
      if (op_ == kStop) break;
      Step();
    }
    if (!marks_.empty()) Fail("STOP with an unclosed MARK");
    if (stack_.size() != 1) {
      Fail("STOP with ", stack_.size(), " values on the stack (expected 1)");
    }
    if (consumed != nullptr) *consumed = pos_;
    Value* root = stack_.back();
    CheckDepth(root);
    return root;
  }

 private:
  // --- errors ---------------------------------------------------------------

  template <typename... Args>
  [[noreturn]] void Fail(Args&&... args) const {
    throw FormatError("pickle: ", std::forward<Args>(args)..., " at byte ",
                      op_pos_);
  }

  const char* Name() const {
    const char* name = OpName(op_);
    return name != nullptr ? name : "?";
  }

  // --- reading
  // ----------------------------------------------------------------

  size_t Remaining() const { return data_.size() - pos_; }

  std::string_view Read(size_t n) {
    if (n > Remaining()) Fail("truncated ", Name());
    std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }

  // A payload whose length the stream declares: checked before any copy.
  std::string_view ReadDeclared(uint64_t n) {
    CheckDeclared(n);
    return Read(static_cast<size_t>(n));
  }

  void CheckDeclared(uint64_t n) const {
    if (n > Remaining()) {
      throw FormatError("pickle: truncated ", Name(), " at byte ", op_pos_,
                        " (declares ", n, " bytes, ", Remaining(), " remain)");
    }
  }

  uint64_t ReadLE(size_t n) {
    std::string_view b = Read(n);
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) {
      v |= uint64_t{static_cast<unsigned char>(b[k])} << (8 * k);
    }
    return v;
  }

  // A protocol-0 argument: up to and excluding '\n'.
  std::string_view ReadLine() {
    const size_t end = data_.find('\n', pos_);
    if (end == std::string_view::npos) Fail("truncated ", Name());
    std::string_view line = data_.substr(pos_, end - pos_);
    pos_ = end + 1;
    return line;
  }

  // --- stack ----------------------------------------------------------------

  size_t Fence() const { return marks_.empty() ? 0 : marks_.back(); }

  void Push(Value* v) { stack_.push_back(v); }

  Value* Pop() {
    if (stack_.size() <= Fence()) Fail("stack underflow in ", Name());
    Value* v = stack_.back();
    stack_.pop_back();
    return v;
  }

  Value* Top() {
    if (stack_.size() <= Fence()) Fail("stack underflow in ", Name());
    return stack_.back();
  }

  // The values pushed since the last MARK (which is removed).
  std::vector<Value*> PopMark() {
    if (marks_.empty()) Fail(Name(), " without MARK");
    const size_t mark = marks_.back();
    marks_.pop_back();
    std::vector<Value*> items(stack_.begin() + static_cast<ptrdiff_t>(mark),
                              stack_.end());
    stack_.resize(mark);
    return items;
  }

  // Values from the top of the stack for TUPLE1/2/3.
  std::vector<Value*> PopN(size_t n) {
    if (stack_.size() < Fence() + n) Fail("stack underflow in ", Name());
    std::vector<Value*> items(stack_.end() - static_cast<ptrdiff_t>(n),
                              stack_.end());
    stack_.resize(stack_.size() - n);
    return items;
  }

  // --- memo -----------------------------------------------------------------

  void MemoPut(uint64_t index) { memo_.insert_or_assign(index, Top()); }

  void MemoGet(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) Fail(Name(), " of unknown memo index ", index);
    Push(it->second);
  }

  uint64_t LineIndex() {
    std::string_view line = ReadLine();
    uint64_t index = 0;
    auto res = std::from_chars(line.data(), line.data() + line.size(), index);
    if (res.ec != std::errc() || res.ptr != line.data() + line.size() ||
        line.empty()) {
      Fail("bad memo index in ", Name());
    }
    return index;
  }

  // --- values ---------------------------------------------------------------

  // Decimal text of INT/LONG ("123", "-5", "12L").
  Value* DecimalInt(std::string_view text) {
    if (!text.empty() && text.back() == 'L') text.remove_suffix(1);
    if (text.size() > kMaxDecimalDigits + 1) {
      Fail(Name(), " has more than ", kMaxDecimalDigits, " digits");
    }
    std::optional<std::string> bytes = DecimalToBigInt(text);
    if (!bytes) Fail("invalid number in ", Name());
    return arena_.BigInt(*bytes);
  }

  Value* Text(std::string_view utf8) {
    if (!IsValidUtf8(utf8)) Fail("invalid UTF-8 in ", Name());
    return arena_.Str(std::string(utf8));
  }

  // Python 2 str (STRING/BINSTRING/SHORT_BINSTRING): text when it is valid
  // UTF-8 (as torch.load's encoding='utf-8' decodes it), else bytes.
  Value* Py2String(std::string_view raw) {
    if (IsValidUtf8(raw)) return arena_.Str(std::string(raw));
    return arena_.Bytes(std::string(raw));
  }

  // STRING's argument: a Python 2 repr, quoted, with backslash escapes.
  std::string EscapeDecode(std::string_view line) {
    if (line.size() < 2 || (line[0] != '\'' && line[0] != '"') ||
        line.back() != line[0]) {
      Fail("STRING argument is not quoted");
    }
    std::string_view body = line.substr(1, line.size() - 2);
    std::string out;
    out.reserve(body.size());
    for (size_t k = 0; k < body.size(); ++k) {
      char c = body[k];
      if (c != '\\' || k + 1 == body.size()) {
        if (c == '\\') Fail("STRING ends in a backslash");
        out += c;
        continue;
      }
      c = body[++k];
      switch (c) {
        case '\n':
          break;
        case '\\':
          out += '\\';
          break;
        case '\'':
          out += '\'';
          break;
        case '"':
          out += '"';
          break;
        case 'a':
          out += '\a';
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'v':
          out += '\v';
          break;
        case 'x': {
          if (k + 2 >= body.size()) {
            Fail("truncated \\x escape in STRING");
          }
          int v = 0;
          for (int d = 0; d < 2; ++d) {
            const char h = body[++k];
            int nibble;
            if (h >= '0' && h <= '9') {
              nibble = h - '0';
            } else if (h >= 'a' && h <= 'f') {
              nibble = h - 'a' + 10;
            } else if (h >= 'A' && h <= 'F') {
              nibble = h - 'A' + 10;
            } else {
              Fail("invalid \\x escape in STRING");
            }
            v = v * 16 + nibble;
          }
          out += static_cast<char>(v);
          break;
        }
        default:
          if (c >= '0' && c <= '7') {
            int v = c - '0';
            for (int d = 0; d < 2 && k + 1 < body.size() &&
                            body[k + 1] >= '0' && body[k + 1] <= '7';
                 ++d) {
              v = v * 8 + (body[++k] - '0');
            }
            out += static_cast<char>(v & 0xff);
          } else {
            out += '\\';
            out += c;
          }
      }
    }
    return out;
  }

  // UNICODE's argument: raw-unicode-escape (latin-1 bytes plus \uXXXX and
  // \UXXXXXXXX after an odd number of backslashes).
  std::string RawUnicodeEscapeDecode(std::string_view raw) {
    std::string out;
    out.reserve(raw.size());
    size_t k = 0;
    while (k < raw.size()) {
      const auto c = static_cast<unsigned char>(raw[k]);
      if (c != '\\') {
        AppendUtf8(c, out);
        ++k;
        continue;
      }
      size_t run = 0;
      while (k < raw.size() && raw[k] == '\\') {
        out += '\\';
        ++run;
        ++k;
      }
      if (run % 2 == 0 || k >= raw.size() || (raw[k] != 'u' && raw[k] != 'U')) {
        continue;
      }
      out.pop_back();
      const size_t digits = raw[k] == 'u' ? 4 : 8;
      ++k;
      if (raw.size() - k < digits) Fail("truncated \\u escape in UNICODE");
      uint32_t cp = 0;
      for (size_t d = 0; d < digits; ++d, ++k) {
        const char h = raw[k];
        uint32_t nibble;
        if (h >= '0' && h <= '9') {
          nibble = static_cast<uint32_t>(h - '0');
        } else if (h >= 'a' && h <= 'f') {
          nibble = static_cast<uint32_t>(h - 'a' + 10);
        } else if (h >= 'A' && h <= 'F') {
          nibble = static_cast<uint32_t>(h - 'A' + 10);
        } else {
          Fail("invalid \\u escape in UNICODE");
        }
        cp = cp * 16 + nibble;
      }
      if (cp > 0x10ffff) Fail("\\U escape beyond U+10FFFF in UNICODE");
      AppendUtf8(static_cast<int32_t>(cp), out);
    }
    return out;
  }

  bool TakeBudget(size_t n) {
    if (n > copy_budget_) return false;
    copy_budget_ -= n;
    return true;
  }

  // REDUCE: callable(*args). A few builtins that only spell plain values are
  // decoded, `copyreg.__newobj_ex__(cls, args, kwargs)` becomes the NEWOBJ_EX
  // it stands for; everything else stays an opaque kObject.
  Value* Reduce(Value* callable, Value* args) {
    if (args->kind != Kind::kTuple) {
      Fail("REDUCE argument is a ", KindName(args->kind), ", not a tuple");
    }
    const std::vector<Value*>& a = args->items;
    if (callable->kind == Kind::kGlobal) {
      if (callable->IsGlobal("_codecs", "encode") && a.size() == 2 &&
          a[0]->kind == Kind::kStr && a[1]->kind == Kind::kStr &&
          a[1]->s == "latin1") {
        std::optional<std::string> bytes = Utf8ToLatin1(a[0]->s);
        if (bytes && TakeBudget(bytes->size())) {
          return arena_.Bytes(std::move(*bytes));
        }
      } else if (callable->IsGlobal("copyreg", "__newobj_ex__") &&
                 a.size() == 3 && a[1]->kind == Kind::kTuple &&
                 a[2]->kind == Kind::kDict) {
        // What the pickler writes for NEWOBJ_EX: the same call.
        Value* obj = arena_.Object(ObjectOp::kNewObjEx, a[0], a[1]);
        obj->kwargs = a[2];
        return obj;
      } else if (callable->IsGlobal("builtins", "bytes") && a.empty()) {
        return arena_.Bytes("");
      } else if (callable->IsGlobal("builtins", "bytearray")) {
        if (a.empty()) return arena_.ByteArray("");
        if (a.size() == 1 && a[0]->kind == Kind::kBytes &&
            TakeBudget(a[0]->s.size())) {
          return arena_.ByteArray(a[0]->s);
        }
      } else if ((callable->IsGlobal("builtins", "set") ||
                  callable->IsGlobal("builtins", "frozenset")) &&
                 a.size() == 1 && a[0]->kind == Kind::kList &&
                 TakeBudget(a[0]->items.size())) {
        Value* set =
            arena_.New(callable->name == "set" ? Kind::kSet : Kind::kFrozenSet);
        set->items = a[0]->items;
        return set;
      }
    }
    return arena_.Object(ObjectOp::kReduce, callable, args);
  }

  void Append(Value* target, std::vector<Value*> items) {
    if (target->kind != Kind::kList && target->kind != Kind::kObject) {
      Fail(Name(), " to a ", KindName(target->kind));
    }
    if (target->items.empty()) {
      target->items = std::move(items);
    } else {
      target->items.insert(target->items.end(), items.begin(), items.end());
    }
  }

  void SetItems(Value* target, const std::vector<Value*>& flat) {
    if (target->kind != Kind::kDict && target->kind != Kind::kObject) {
      Fail(Name(), " on a ", KindName(target->kind));
    }
    if (flat.size() % 2 != 0) {
      Fail(Name(), " with an odd number of items (", flat.size(), ")");
    }
    target->entries.reserve(target->entries.size() + flat.size() / 2);
    for (size_t k = 0; k < flat.size(); k += 2) {
      target->entries.emplace_back(flat[k], flat[k + 1]);
    }
  }

  Value* GlobalFromLines() {
    std::string_view module = ReadLine();
    std::string_view name = ReadLine();
    if (!IsValidUtf8(module) || !IsValidUtf8(name)) {
      Fail("invalid UTF-8 in ", Name());
    }
    return arena_.Global(std::string(module), std::string(name));
  }

  // INST/OBJ: cls(*args), or cls.__new__(cls) without arguments.
  Value* Instantiate(Value* cls, std::vector<Value*> args) {
    const ObjectOp op = args.empty() ? ObjectOp::kNewObj : ObjectOp::kReduce;
    return arena_.Object(op, cls, arena_.Tuple(std::move(args)));
  }

  // --- the interpreter
  // --------------------------------------------------------

  // One opcode (op_): each group of opcodes is one function that returns
  // whether op_ is one of its own.
  void Step() {
    if (StepStack() || StepScalar() || StepText() || StepContainer() ||
        StepObject() || StepMemo())
      return;
    const char* hex = "0123456789abcdef";
    const char code[] = {'0', 'x', hex[op_ >> 4], hex[op_ & 0xf], '\0'};
    Fail("unknown opcode ", code);
  }

  // PROTO, FRAME and the stack: MARK, POP, POP_MARK, DUP.
  bool StepStack() {
    switch (op_) {
      case kProto: {
        const uint64_t version = ReadLE(1);
        if (version > 5) Fail("unsupported protocol ", version);
        return true;
      }
      case kFrame: {
        CheckDeclared(ReadLE(8));
        return true;
      }
      case kMark:
        marks_.push_back(stack_.size());
        return true;
      case kPop:
        if (stack_.size() > Fence()) {
          stack_.pop_back();
        } else if (!marks_.empty()) {
          marks_.pop_back();
        } else {
          Fail("stack underflow in POP");
        }
        return true;
      case kPopMark:
        PopMark();
        return true;
      case kDup:
        Push(Top());
        return true;
      default:
        return false;
    }
  }

  // None, bools, ints and floats.
  bool StepScalar() {
    switch (op_) {
      case kNone:
        Push(arena_.None());
        return true;
      case kNewTrue:
        Push(arena_.Bool(true));
        return true;
      case kNewFalse:
        Push(arena_.Bool(false));
        return true;
      case kInt: {
        std::string_view line = ReadLine();
        if (line == "01" || line == "00") {
          Push(arena_.Bool(line == "01"));
        } else {
          Push(DecimalInt(line));
        }
        return true;
      }
      case kLong:
        Push(DecimalInt(ReadLine()));
        return true;
      case kBinInt:
        Push(
            arena_.Int(static_cast<int32_t>(static_cast<uint32_t>(ReadLE(4)))));
        return true;
      case kBinInt1:
        Push(arena_.Int(static_cast<int64_t>(ReadLE(1))));
        return true;
      case kBinInt2:
        Push(arena_.Int(static_cast<int64_t>(ReadLE(2))));
        return true;
      case kLong1:
        Push(arena_.BigInt(ReadDeclared(ReadLE(1))));
        return true;
      case kLong4: {
        const auto n = static_cast<int32_t>(static_cast<uint32_t>(ReadLE(4)));
        if (n < 0) Fail("LONG4 with negative byte count ", n);
        Push(arena_.BigInt(ReadDeclared(static_cast<uint64_t>(n))));
        return true;
      }
      case kFloat: {
        std::string_view line = ReadLine();
        double f = 0;
        auto res = std::from_chars(line.data(), line.data() + line.size(), f);
        if (res.ec != std::errc() || res.ptr != line.data() + line.size()) {
          Fail("invalid FLOAT ", BytesRepr(line.substr(0, 40)));
        }
        Push(arena_.Float(f));
        return true;
      }
      case kBinFloat: {
        const uint64_t be = ReadLE(8);
        uint64_t bits = 0;
        for (int k = 0; k < 8; ++k)
          bits = (bits << 8) | ((be >> (8 * k)) & 0xff);
        double f;
        std::memcpy(&f, &bits, sizeof f);
        Push(arena_.Float(f));
        return true;
      }
      default:
        return false;
    }
  }

  // str, Python 2 strings, bytes; refused: out-of-band buffers, extensions.
  bool StepText() {
    switch (op_) {
      case kBinUnicode:
        Push(Text(ReadDeclared(ReadLE(4))));
        return true;
      case kShortBinUnicode:
        Push(Text(ReadDeclared(ReadLE(1))));
        return true;
      case kBinUnicode8:
        Push(Text(ReadDeclared(ReadLE(8))));
        return true;
      case kUnicode:
        Push(arena_.Str(RawUnicodeEscapeDecode(ReadLine())));
        return true;
      case kString:
        Push(Py2String(EscapeDecode(ReadLine())));
        return true;
      case kBinString: {
        const auto n = static_cast<int32_t>(static_cast<uint32_t>(ReadLE(4)));
        if (n < 0) Fail("BINSTRING with negative length ", n);
        Push(Py2String(ReadDeclared(static_cast<uint64_t>(n))));
        return true;
      }
      case kShortBinString:
        Push(Py2String(ReadDeclared(ReadLE(1))));
        return true;
      case kBinBytes:
        Push(arena_.Bytes(std::string(ReadDeclared(ReadLE(4)))));
        return true;
      case kShortBinBytes:
        Push(arena_.Bytes(std::string(ReadDeclared(ReadLE(1)))));
        return true;
      case kBinBytes8:
        Push(arena_.Bytes(std::string(ReadDeclared(ReadLE(8)))));
        return true;
      case kByteArray8:
        Push(arena_.ByteArray(std::string(ReadDeclared(ReadLE(8)))));
        return true;
      case kNextBuffer:
      case kReadonlyBuffer:
        Fail("unsupported opcode ", Name(), " (out-of-band buffers)");
      case kExt1:
      case kExt2:
      case kExt4:
        Fail("unsupported opcode ", Name(), " (extension registry)");
      default:
        return false;
    }
  }

  // Tuples, lists, dicts, sets.
  bool StepContainer() {
    switch (op_) {
      case kEmptyTuple:
        Push(arena_.Tuple({}));
        return true;
      case kTuple:
        Push(arena_.Tuple(PopMark()));
        return true;
      case kTuple1:
        Push(arena_.Tuple(PopN(1)));
        return true;
      case kTuple2:
        Push(arena_.Tuple(PopN(2)));
        return true;
      case kTuple3:
        Push(arena_.Tuple(PopN(3)));
        return true;
      case kEmptyList:
        Push(arena_.List({}));
        return true;
      case kList:
        Push(arena_.List(PopMark()));
        return true;
      case kAppend: {
        Value* v = Pop();
        Append(Top(), {v});
        return true;
      }
      case kAppends: {
        std::vector<Value*> items = PopMark();
        Append(Top(), std::move(items));
        return true;
      }
      case kEmptyDict:
        Push(arena_.Dict());
        return true;
      case kDict: {
        std::vector<Value*> flat = PopMark();
        Value* dict = arena_.Dict();
        Push(dict);
        SetItems(dict, flat);
        return true;
      }
      case kSetItem: {
        Value* v = Pop();
        Value* k = Pop();
        SetItems(Top(), {k, v});
        return true;
      }
      case kSetItems: {
        std::vector<Value*> flat = PopMark();
        SetItems(Top(), flat);
        return true;
      }
      case kEmptySet:
        Push(arena_.Set({}));
        return true;
      case kAddItems: {
        std::vector<Value*> items = PopMark();
        Value* target = Top();
        if (target->kind != Kind::kSet) {
          Fail("ADDITEMS on a ", KindName(target->kind));
        }
        target->items.insert(target->items.end(), items.begin(), items.end());
        return true;
      }
      case kFrozenSet:
        Push(arena_.FrozenSet(PopMark()));
        return true;
      default:
        return false;
    }
  }

  // Globals, objects (REDUCE, NEWOBJ, INST, OBJ, BUILD), persistent ids.
  bool StepObject() {
    switch (op_) {
      case kGlobal:
        Push(GlobalFromLines());
        return true;
      case kStackGlobal: {
        Value* name = Pop();
        Value* module = Pop();
        if (module->kind != Kind::kStr || name->kind != Kind::kStr) {
          Fail("STACK_GLOBAL needs str module and name, got ",
               KindName(module->kind), " and ", KindName(name->kind));
        }
        if (module->s.find('\n') != std::string::npos ||
            name->s.find('\n') != std::string::npos) {
          Fail("STACK_GLOBAL name with a newline");
        }
        Push(arena_.Global(module->s, name->s));
        return true;
      }
      case kReduce: {
        Value* args = Pop();
        Value* callable = Pop();
        Push(Reduce(callable, args));
        return true;
      }
      case kNewObj: {
        Value* args = Pop();
        Value* cls = Pop();
        if (args->kind != Kind::kTuple) {
          Fail("NEWOBJ argument is a ", KindName(args->kind), ", not a tuple");
        }
        Push(arena_.Object(ObjectOp::kNewObj, cls, args));
        return true;
      }
      case kNewObjEx: {
        Value* kwargs = Pop();
        Value* args = Pop();
        Value* cls = Pop();
        if (args->kind != Kind::kTuple) {
          Fail("NEWOBJ_EX argument is a ", KindName(args->kind),
               ", not a tuple");
        }
        if (kwargs->kind != Kind::kDict) {
          Fail("NEWOBJ_EX keyword arguments are a ", KindName(kwargs->kind),
               ", not a dict");
        }
        Value* obj = arena_.Object(ObjectOp::kNewObjEx, cls, args);
        obj->kwargs = kwargs;
        Push(obj);
        return true;
      }
      case kInst: {
        Value* cls = GlobalFromLines();
        Push(Instantiate(cls, PopMark()));
        return true;
      }
      case kObj: {
        std::vector<Value*> items = PopMark();
        if (items.empty()) Fail("OBJ without a class");
        Value* cls = items.front();
        items.erase(items.begin());
        Push(Instantiate(cls, std::move(items)));
        return true;
      }
      case kBuild: {
        Value* state = Pop();
        Value* target = Top();
        if (target->kind != Kind::kObject) {
          Fail("BUILD on a ", KindName(target->kind));
        }
        target->state = state;
        return true;
      }
      case kPersId: {
        std::string_view line = ReadLine();
        Push(arena_.PersId(Text(line)));
        return true;
      }
      case kBinPersId:
        Push(arena_.PersId(Pop()));
        return true;
      default:
        return false;
    }
  }

  // The memo: PUT, GET and their binary forms, MEMOIZE.
  bool StepMemo() {
    switch (op_) {
      case kPut:
        MemoPut(LineIndex());
        return true;
      case kBinPut:
        MemoPut(ReadLE(1));
        return true;
      case kLongBinPut:
        MemoPut(ReadLE(4));
        return true;
      case kMemoize:
        MemoPut(memo_.size());
        return true;
      case kGet:
        MemoGet(LineIndex());
        return true;
      case kBinGet:
        MemoGet(ReadLE(1));
        return true;
      case kLongBinGet:
        MemoGet(ReadLE(4));
        return true;
      default:
        return false;
    }
  }

  // Rejects graphs nested deeper than options_.max_depth: depth is counted
  // in the order a recursive walk (Repr, Pickle) would first reach each node.
  void CheckDepth(const Value* root) {
    std::unordered_set<const Value*> seen;
    std::vector<std::pair<const Value*, size_t>> todo{{root, 0}};
    auto push = [&](const Value* child, size_t depth) {
      if (child != nullptr) todo.emplace_back(child, depth);
    };
    while (!todo.empty()) {
      auto [v, depth] = todo.back();
      todo.pop_back();
      if (!seen.insert(v).second) continue;
      switch (v->kind) {
        case Kind::kTuple:
        case Kind::kList:
        case Kind::kDict:
        case Kind::kSet:
        case Kind::kFrozenSet:
        case Kind::kObject:
        case Kind::kPersId:
          break;
        default:
          continue;  // scalars and globals do not nest
      }
      if (depth >= options_.max_depth) {
        throw FormatError(
            "pickle: object graph nested deeper than ", options_.max_depth,
            " levels (recursion bomb?), stream of ", data_.size(), " bytes");
      }
      // Reverse order so that the first child is visited first.
      for (size_t k = v->entries.size(); k-- > 0;) {
        push(v->entries[k].second, depth + 1);
        push(v->entries[k].first, depth + 1);
      }
      for (size_t k = v->items.size(); k-- > 0;) push(v->items[k], depth + 1);
      push(v->state, depth + 1);
      push(v->kwargs, depth + 1);
      push(v->args, depth + 1);
      push(v->callable, depth + 1);
      push(v->pid, depth + 1);
    }
  }

  std::string_view data_;
  Arena& arena_;
  const UnpickleOptions& options_;
  size_t copy_budget_;
  size_t pos_ = 0;
  size_t op_pos_ = 0;
  uint8_t op_ = 0;
  std::vector<Value*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, Value*> memo_;
};

}  // namespace

Value* Unpickle(std::string_view data, Arena& arena, size_t* consumed,
                const UnpickleOptions& options) {
  Machine machine(data, arena, options);
  return machine.Run(consumed);
}

}  // namespace ucp::pickle
