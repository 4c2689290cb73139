#pragma once
// Reversible escaping of names (param fqns, state kinds, opaque key parts)
// into HDF5 link names (see the schema in atom_store.h).
//
// An HDF5 link name cannot contain "/" and cannot be "." or "" (and ".."
// confuses path parsing). EscapeLinkName percent-encodes:
//   '%' -> "%25", '/' -> "%2F",
//   a name that is exactly "." or ".." -> first '.' as "%2E",
//   a name equal to `reserved` (e.g. "pad" among a param's state kinds) ->
//     its first byte as %XX ("pad" -> "%70ad").
// Every other byte (UTF-8 included) is kept. UnescapeLinkName decodes every
// "%XX" (hex digits of either case) and so inverts EscapeLinkName.

#include <optional>
#include <string>
#include <string_view>

namespace ucp::atoms {

/// Escapes `name` (non-empty) for use as one HDF5 link name. Throws
/// InternalError if `name` is empty.
std::string EscapeLinkName(std::string_view name,
                           std::string_view reserved = {});

/// Inverse of EscapeLinkName. Absent if `link` has a '%' not followed by two
/// hex digits, or decodes to an empty name.
std::optional<std::string> UnescapeLinkName(std::string_view link);

}  // namespace ucp::atoms
