// Fuzz harness: a MindSpore .ckpt file (engine/formats/mindspore/ckpt.h)
// through the record reader, planning and a full read. Any input either
// reads or throws a ucp::Error.
#include <cstddef>
#include <cstdint>

#include "engine/core/error.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/universal/write_universal.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFile file(data, size, "mindspore");
  try {
    const ucp::mindspore::Checkpoint c =
        ucp::mindspore::Discover(file.path(), "");
    ucp::universal::SourcePlan plan = ucp::mindspore::PlanSource(c);
    ucp::reshape::ExecutorOptions o;
    o.threads = 1;
    ucp::universal::VerifySource(plan, o);
  } catch (const ucp::Error&) {
  }
  return 0;
}
