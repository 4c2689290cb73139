// Fuzz harness: a DeepSpeed rank file through the DeepSpeed reader
// (engine/formats/deepspeed/deepspeed.h). The input is put in turn in place
// of one rank file of a real DeepSpeed 0.14.5 save (../shared/fixtures,
// the other files kept):
//   - ZeRO 1, bf16, world 2: mp_rank_00_model_states.pt, then
//     bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt (BF16_Optimizer's flat
//     partitions);
//   - ZeRO 0, fp32, world 1: mp_rank_00_model_states.pt (the torch
//     optimizer's state inside the model states);
//   - ZeRO 3, fp32, world 2: zero_pp_rank_0_mp_rank_00_model_states.pt, then
//     zero_pp_rank_0_mp_rank_00_optim_states.pt;
// and each folder is read as `ucp to-universal` reads it: discovery (the
// `latest` tag, the rank files, the topology), PlanSource and every atom
// read (VerifySource: fragments cover each atom exactly, replicas agree).
// Any input either reads or throws a ucp::Error.
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
  const fs::path ds = ucp::fuzz::FixturesDir() / "deepspeed-0.14.5";
  const fs::path tag = "global_step2";
  static const ucp::fuzz::ScratchFolders folders(
      {
          {ds / "ds0145_z1_bf16_w2_mlp", tag / "mp_rank_00_model_states.pt"},
          {ds / "ds0145_z1_bf16_w2_mlp",
           tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"},
          {ds / "ds0145_z0_fp32_w1_mlp", tag / "mp_rank_00_model_states.pt"},
          {ds / "ds0145_z3_fp32_w2_mlp",
           tag / "zero_pp_rank_0_mp_rank_00_model_states.pt"},
          {ds / "ds0145_z3_fp32_w2_mlp",
           tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"},
      },
      "deepspeed");
  return folders;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFolders& folders = Folders();
  for (size_t i = 0; i < folders.placements().size(); ++i) {
    folders.Run(i, data, size, [](const fs::path& dir) {
      try {
        const ucp::deepspeed::Checkpoint c = ucp::deepspeed::Discover(dir, "");
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
