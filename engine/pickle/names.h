#pragma once
// Python 2 <-> Python 3 global names, as CPython's `_compat_pickle` maps them
// (Unpickler(fix_imports=True) maps 2 -> 3 for protocols < 3, and the
// protocol-2 pickler maps 3 -> 2). Internal to ucp::pickle.

#include <string>
#include <string_view>
#include <utility>

namespace ucp::pickle::internal {

/// (module, name) as Python 3 spells it: NAME_MAPPING first, then
/// IMPORT_MAPPING on the module. Unknown names are returned unchanged.
std::pair<std::string_view, std::string_view> Py3Name(
    std::string_view module, std::string_view name) noexcept;

/// (module, name) as CPython's protocol-2 pickler writes it:
/// REVERSE_NAME_MAPPING first, then REVERSE_IMPORT_MAPPING on the module.
std::pair<std::string_view, std::string_view> Py2Name(
    std::string_view module, std::string_view name) noexcept;

}  // namespace ucp::pickle::internal
