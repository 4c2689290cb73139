#pragma once
// Internal: the built-in descriptors compiled into the library (generated
// builtin_layouts_data.cc, see embed_builtins.cmake). Use Layout::Builtin().

#include <string_view>

namespace ucp::layouts::internal {

struct BuiltinText {
  std::string_view name;  // file name without ".yaml"
  std::string_view text;  // the YAML bytes
};

extern const BuiltinText kBuiltinLayouts[];
extern const int kNumBuiltinLayouts;

}  // namespace ucp::layouts::internal
