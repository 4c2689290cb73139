// Fuzz harness: PyTorch DCP `.metadata` (engine/formats/dcp/metadata.h). Any
// input either parses or throws ucp::FormatError; a parsed metadata is
// written again (PickleMetadata) and must parse to the same entries, items
// and planner_data.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/core/error.h"
#include "engine/formats/dcp/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ucp::dcp::Metadata m;
  try {
    m = ucp::dcp::ParseMetadata(bytes, "fuzz.metadata");
  } catch (const ucp::FormatError&) {
    return 0;
  }
  const std::string again = ucp::dcp::PickleMetadata(m, "fuzz");
  const ucp::dcp::Metadata back = ucp::dcp::ParseMetadata(again, "again");
  if (back.entries.size() != m.entries.size() ||
      back.storage.size() != m.storage.size() ||
      back.planner_data.size() != m.planner_data.size()) {
    __builtin_trap();
  }
  for (size_t i = 0; i < m.entries.size(); ++i) {
    const auto& a = m.entries[i];
    const auto& b = back.entries[i];
    if (a.fqn != b.fqn || a.tensor != b.tensor ||
        (a.tensor && (a.dtype != b.dtype || a.size != b.size ||
                      a.chunks.size() != b.chunks.size())))
      __builtin_trap();
  }
  return 0;
}
