// Fuzz harness: a file of a DeepSpeed universal folder through the
// universal-folder reader (engine/formats/deepspeed/universal_folder.cc, the
// `deepspeed-universal` source). The folder is the one DeepSpeed's own
// ds_to_universal made of the real 0.14.5 ZeRO 1 bf16 world-2 save
// (regressions/deepspeed_universal/global_step2_universal, see
// make_deepspeed_universal_seed.py); the input is put in turn in place of
//   zero/fc1.weight/fp32.pt, zero/fc1.weight/exp_avg.pt,
//   zero/fc2.bias/exp_avg_sq.pt, zero/fc1.bias/step.pt,
//   zero/optimizer_state.pt and mp_rank_00_model_states.pt,
// and the folder is read as `ucp to-universal` reads it: DiscoverUniversal,
// PlanSource and every atom read (VerifySource). Any input either reads or
// throws a ucp::Error.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/universal/write_universal.h"
#include "tests/fuzz/fuzz_folder.h"

namespace {

namespace fs = std::filesystem;

const ucp::fuzz::ScratchFolders& Folders() {
  const fs::path folder = fs::path(UCP_FUZZ_SOURCE_DIR) / "regressions" /
                          "deepspeed_universal" / "global_step2_universal";
  std::vector<std::pair<fs::path, fs::path>> placements;
  for (const char* file :
       {"zero/fc1.weight/fp32.pt", "zero/fc1.weight/exp_avg.pt",
        "zero/fc2.bias/exp_avg_sq.pt", "zero/fc1.bias/step.pt",
        "zero/optimizer_state.pt", "mp_rank_00_model_states.pt"}) {
    placements.emplace_back(folder, file);
  }
  static const ucp::fuzz::ScratchFolders folders(placements,
                                                 "deepspeed-universal");
  return folders;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFolders& folders = Folders();
  for (size_t i = 0; i < folders.placements().size(); ++i) {
    folders.Run(i, data, size, [](const fs::path& dir) {
      try {
        const ucp::deepspeed::Checkpoint c =
            ucp::deepspeed::DiscoverUniversal(dir, "");
        ucp::universal::SourcePlan plan = ucp::deepspeed::PlanSource(c);
        ucp::reshape::ExecutorOptions o;
        o.threads = 1;
        ucp::universal::VerifySource(plan, o);
      } catch (const ucp::Error&) {
      }
    });
  }
  return 0;
}
