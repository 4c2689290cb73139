#pragma once
// Reading the JSON attributes of universal content (atom_store.h RootInfo,
// ParamInfo::tied_copies) in a format driver's writer.

#include <filesystem>
#include <string>

#include "engine/json/json.h"

namespace ucp::formats {

/// The attribute's JSON; an empty object for empty text. Throws FormatError
/// "universal file <path> > attribute <what> > ..." if it does not parse.
json::Value ParseJsonAttr(const std::string& text, const char* what,
                          const std::filesystem::path& path);

}  // namespace ucp::formats
