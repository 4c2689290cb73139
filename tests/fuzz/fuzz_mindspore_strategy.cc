// Fuzz harness: a MindSpore parallel strategy file
// (engine/formats/mindspore/strategy.h) read, and every layout's slices
// placed on every rank (up to 64) of a tensor three times its part count.
// Any input either reads or throws a ucp::Error.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "engine/core/error.h"
#include "engine/formats/mindspore/strategy.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFile file(data, size, "strategy");
  try {
    const ucp::mindspore::Strategy s =
        ucp::mindspore::ReadStrategy(file.path());
    for (const auto& [name, stages] : s.layouts) {
      for (const auto& [stage, l] : stages) {
        const std::vector<int64_t> counts =
            ucp::mindspore::SplitCounts(l, l.dims.size(), name);
        ucp::Shape shape;
        for (int64_t c : counts) shape.push_back(3 * c);
        for (int64_t r = 0; r < std::min<int64_t>(s.world(), 64); ++r)
          ucp::mindspore::RankBox(l, shape, r, name);
      }
    }
  } catch (const ucp::Error&) {
  }
  return 0;
}
