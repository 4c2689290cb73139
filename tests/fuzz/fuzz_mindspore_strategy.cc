// Fuzz harness: a MindSpore parallel strategy file
// (engine/formats/mindspore/strategy.h) read, and every layout's slices
// placed on every rank (up to 64) of a tensor three times its part count;
// each stage written back (StrategyFileBytes, as `--tp/--pp/--dp` writes
// strategies) must read back to the same layouts. Any input either reads or
// throws a ucp::Error.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>

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
    std::set<int64_t> stages;
    for (const auto& [name, by_stage] : s.layouts)
      for (const auto& [stage, l] : by_stage) stages.insert(stage);
    for (int64_t stage : stages) {
      std::string bytes;
      try {
        bytes = ucp::mindspore::StrategyFileBytes(s, stage);
      } catch (const ucp::FormatError&) {
        continue;  // a layout the classic form cannot express
      }
      const ucp::fuzz::ScratchFile again(
          reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
          "strategy-again");
      const ucp::mindspore::Strategy t =
          ucp::mindspore::ReadStrategy(again.path());
      for (const auto& [name, by_stage] : s.layouts) {
        const auto it = by_stage.find(stage);
        if (it == by_stage.end()) continue;
        const auto back = t.layouts.find(name);
        if (back == t.layouts.end() || back->second.size() != 1 ||
            !(back->second.begin()->second == it->second))
          std::abort();  // written, it reads back otherwise
      }
    }
  } catch (const ucp::Error&) {
  }
  return 0;
}
