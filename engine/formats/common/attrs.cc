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

atoms::ParamInfo ParamRow(const ParamRowSpec& spec) {
  atoms::ParamInfo info;
  info.fqn = spec.fqn;
  info.shape = spec.shape;
  info.dtype = spec.dtype;
  info.rule = spec.rule;
  info.kind = spec.buffer ? atoms::ParamKind::kBuffer : atoms::ParamKind::kParam;
  info.group = spec.group;
  info.order = spec.order;
  info.frozen = spec.frozen;
  json::Value tc = json::Value::Array();
  for (const std::string& c : spec.tied_copies) tc.Append(c);
  info.tied_copies = tc.Dump();
  return info;
}

}  // namespace ucp::formats
