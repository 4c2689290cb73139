#pragma once
// Pickle VM (protocols 2-5) and a protocol-2 pickler.
//
// Unpickle() interprets the opcodes of one pickle and builds a Value graph in
// an Arena (see value.h); it never imports or calls anything. Pickle() writes
// a graph back exactly as CPython's C pickler (protocol 2, as torch.save
// uses) would write the objects Python rebuilds from it: the same opcodes,
// the same memo (BINPUT/BINGET) numbering, batches of 1000 in
// APPENDS/SETITEMS, SETITEM for one-item batches, globals memoised by name and
// `bytes` as `_codecs.encode(str, 'latin1')`. For pickles that CPython wrote
// with protocol 2, Pickle(Unpickle(x)) == x byte for byte.

#include <cstddef>
#include <string>
#include <string_view>

#include "engine/pickle/value.h"

namespace ucp::pickle {

struct UnpickleOptions {
  /// Deepest nesting of containers/objects accepted (Python's own recursion
  /// limit is 1000); deeper graphs are rejected as recursion bombs.
  size_t max_depth = 1000;
};

/// Parses one pickle from the start of `data` up to and including STOP.
/// If `consumed` is non-null it receives the number of bytes used (the legacy
/// torch format stores several pickles back to back).
/// Throws FormatError "pickle: <what> at byte <offset>" on a truncated stream,
/// unknown opcode, stack or memo misuse, absurd declared lengths or nesting
/// beyond max_depth. Never allocates more than a small multiple of data.size().
Value* Unpickle(std::string_view data, Arena& arena,
                size_t* consumed = nullptr, const UnpickleOptions& options = {});

struct PickleOptions {
  /// Only protocol 2 is written.
  int protocol = 2;
};

/// Serialises the graph rooted at `root`. Throws InternalError on a malformed
/// graph (e.g. a kObject without callable).
std::string Pickle(const Value* root, const PickleOptions& options = {});

}  // namespace ucp::pickle
