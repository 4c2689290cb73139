// The "megatron_torch_dist" root attribute (torch_dist.h): its one
// serializer.

#include "engine/universal/extras.h"

#include <utility>

#include "engine/core/error.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"
#include "engine/universal/model.h"

namespace ucp::torch_dist {

std::optional<TorchDistExtras> ReadTorchDistExtras(
    const universal::Model& model, const std::filesystem::path& file) {
  std::optional<universal::RecordReader> r =
      universal::RecordReader::ForExtras(model, kMetaAttr, file);
  if (!r) return std::nullopt;
  TorchDistExtras x;
  r->Member("content_metadata", true, [&](const json::Value& v) {
    if (!v.is_object()) throw FormatError("not a JSON object");
    x.content_metadata = v;
  });
  r->Get("common_in", x.common_in);
  r->Get("optimizer", x.optimizer);
  x.other = r->Rest();
  return x;
}

void WriteTorchDistExtras(const TorchDistExtras& x, universal::Model& model) {
  json::Value o = json::Value::Object();
  o["content_metadata"] = x.content_metadata;
  o["common_in"] = x.common_in;
  o["optimizer"] = x.optimizer;
  universal::PutOpaque(o, x.other);
  model.extras[kMetaAttr] = std::move(o);
}

}  // namespace ucp::torch_dist
