#pragma once
// Pickle VM (protocols 0-5) and a protocol-2 pickler.
//
// Format (CPython Lib/pickletools.py is the reference): a pickle is a stream
// of one-byte opcodes, each followed by its inline argument, run by a stack
// machine with a "mark" stack and a memo (index -> object). Arguments are
// little-endian except BINFLOAT (big-endian IEEE double):
//   PROTO u8 | FRAME u64 (protocol 4 framing, ignored) | STOP
//   MARK | POP | POP_MARK | DUP
//   NONE | NEWTRUE | NEWFALSE | BININT i32 | BININT1 u8 | BININT2 u16 |
//   LONG1 u8 n + n bytes | LONG4 i32 n + n bytes (two's complement) |
//   BINFLOAT f64be
//   BINUNICODE u32 | SHORT_BINUNICODE u8 | BINUNICODE8 u64   (+ UTF-8)
//   BINBYTES u32 | SHORT_BINBYTES u8 | BINBYTES8 u64 | BYTEARRAY8 u64
//   EMPTY_TUPLE | TUPLE (to mark) | TUPLE1..3 | EMPTY_LIST | APPEND | APPENDS |
//   LIST | EMPTY_DICT | SETITEM | SETITEMS | DICT | EMPTY_SET | ADDITEMS |
//   FROZENSET
//   GLOBAL "module\nname\n" | STACK_GLOBAL (module, name from the stack)
//   REDUCE (callable, args) | NEWOBJ (cls, args) | NEWOBJ_EX (cls, args,
//   kwargs) | BUILD (state) | PERSID "text\n" | BINPERSID (pid)
//   BINPUT u8 | LONG_BINPUT u32 | MEMOIZE (index = memo size) |
//   BINGET u8 | LONG_BINGET u32
//   protocol 0/1 text forms: INT LONG FLOAT STRING UNICODE PUT GET ("...\n"),
//   BINSTRING i32, SHORT_BINSTRING u8, INST "module\nname\n" (to mark), OBJ.
//   Not supported (FormatError): EXT1/2/4 (extension registry) and
//   NEXT_BUFFER/READONLY_BUFFER (out-of-band buffers).
//
// Unpickle() interprets the opcodes of one pickle and builds a Value graph in
// an Arena (see value.h); it never imports or calls anything. Pickle() writes
// a graph back exactly as CPython's C pickler (protocol 2, as torch.save uses)
// would write the objects Python rebuilds from it: the same opcodes, the same
// memo (BINPUT/BINGET) numbering, batches of 1000 in APPENDS/SETITEMS, APPEND/
// SETITEM for one-item batches, globals memoised by name and in their Python 2
// spelling, `bytes` as `_codecs.encode(str, 'latin1')`, sets as
// `set(list)`. For pickles that CPython wrote with protocol 2,
// Pickle(Unpickle(x)) == x byte for byte. Values that protocol 2 cannot spell
// directly get CPython's protocol-2 fallback: bytearray as
// `bytearray(bytes)`, a nested class (dotted STACK_GLOBAL name) as
// `getattr(Outer, 'Inner')`, NEWOBJ_EX as REDUCE of
// `copyreg.__newobj_ex__(cls, args, kwargs)` (which rebuilds the same object;
// CPython itself writes a functools.partial of cls.__new__ there).
//
// One deliberate difference: an int beyond int64 that the graph shares
// (which only a hand-made stream can produce: CPython never memoises ints)
// is memoised and fetched with BINGET, so a stream that BINGETs one huge int
// many times does not blow up when written again.
//
// Known limits: a BUILD through a state_setter (reduce tuples of 6, written
// as REDUCE + POP) and any other value a stream computes and then POPs is
// not part of the graph and is not written again.

#include <cstddef>
#include <string>
#include <string_view>

#include "engine/pickle/value.h"

namespace ucp::pickle {

struct UnpickleOptions {
  /// Deepest nesting of containers/objects accepted (Python's own recursion
  /// limit is 1000); deeper graphs are rejected as recursion bombs. The
  /// depth of a node is where a depth-first walk from the root first meets
  /// it.
  size_t max_depth = 1000;
};

/// Parses one pickle from the start of `data` up to and including STOP.
/// If `consumed` is non-null it receives the number of bytes used (the legacy
/// torch format stores several pickles back to back).
/// Throws FormatError "pickle: <what> at byte <offset of the opcode>" on a
/// truncated stream, unknown or unsupported opcode, stack or mark underflow,
/// unknown memo index, a declared length beyond the input, an opcode applied
/// to the wrong kind of value, invalid UTF-8, or a STOP with other than one
/// value; and "pickle: object graph nested deeper than N levels" beyond
/// options.max_depth. Never executes anything; memory stays proportional to
/// data.size() (at most one node per input byte).
Value* Unpickle(std::string_view data, Arena& arena, size_t* consumed = nullptr,
                const UnpickleOptions& options = {});

struct PickleOptions {
  /// Only protocol 2 is written.
  int protocol = 2;
};

/// Serialises the graph rooted at `root` (iteratively: any depth, cycles
/// allowed). Throws InternalError on a malformed graph (a null child, a
/// kObject without callable or with non-tuple args, a global name with a
/// newline, a str over 4 GiB) or a protocol other than 2.
std::string Pickle(const Value* root, const PickleOptions& options = {});

}  // namespace ucp::pickle
