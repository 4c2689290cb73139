#include "engine/formats/common/attrs.h"

#include "engine/core/error.h"

namespace ucp::formats {

json::Value ParseJsonAttr(const std::string& text, const char* what,
                          const std::filesystem::path& path) {
  if (text.empty()) return json::Value::Object();
  try {
    return json::Value::Parse(text);
  } catch (Error& e) {
    e.AddContext("universal file ", path.string(), " > attribute ", what);
    throw;
  }
}

}  // namespace ucp::formats
