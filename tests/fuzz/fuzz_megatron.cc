// Fuzz harness: a Megatron-LM legacy rank file (model_optim_rng.pt) through
// the Megatron reader (engine/formats/megatron_legacy/megatron.h). The input is
// placed as the only rank file of a save folder at iteration 100 (tracker
// "100", iter_0000100/mp_rank_00/; the generator's TP1 PP1 files read
// through), then in place of rank 0's file of the two real Megatron-LM 23.06
// saves (../shared/fixtures/megatron-23.06: TP 2, and PP 2; the other rank
// file kept, fuzz_folder.h), and each folder is discovered, planned and read
// completely (VerifySource). Any input either reads or throws a ucp::Error.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "engine/core/error.h"
#include "engine/formats/megatron_legacy/megatron.h"
#include "engine/universal/write_universal.h"
#include "tests/fuzz/fuzz_folder.h"

namespace {

namespace fs = std::filesystem;

void Write(const fs::path& path, const void* data, size_t size) {
  if (FILE* f = std::fopen(path.c_str(), "wb")) {
    if (size > 0) std::fwrite(data, 1, size, f);
    std::fclose(f);
  }
}

void Read(const fs::path& dir) {
  try {
    const ucp::megatron::Checkpoint c = ucp::megatron::Discover(dir);
    ucp::universal::SourcePlan plan =
        ucp::megatron::PlanSource(c, ucp::megatron::SourceOptions{});
    ucp::reshape::ExecutorOptions o;
    o.threads = 1;
    ucp::universal::VerifySource(plan, o);
  } catch (const ucp::Error&) {
  }
}

const ucp::fuzz::ScratchFolders& Folders() {
  const fs::path mg = ucp::fuzz::FixturesDir() / "megatron-23.06";
  const fs::path iter = "iter_0000010";
  static const ucp::fuzz::ScratchFolders folders(
      {
          {mg / "synth_tp2", iter / "mp_rank_00" / "model_optim_rng.pt"},
          {mg / "from_tp2_to_tp1_pp2",
           iter / "mp_rank_00_000" / "model_optim_rng.pt"},
      },
      "megatron-real");
  return folders;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const char* tmp = std::getenv("TMPDIR");
  const fs::path dir = fs::path(tmp != nullptr && *tmp ? tmp : "/tmp") /
                       ("ucp-fuzz-megatron-" + std::to_string(::getpid()));
  std::error_code ec;
  fs::remove_all(dir, ec);
  fs::create_directories(dir / "iter_0000100" / "mp_rank_00", ec);
  Write(dir / "latest_checkpointed_iteration.txt", "100", 3);
  Write(dir / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt", data, size);
  Read(dir);
  fs::remove_all(dir, ec);
  const ucp::fuzz::ScratchFolders& folders = Folders();
  for (size_t i = 0; i < folders.placements().size(); ++i)
    folders.Run(i, data, size, Read);
  return 0;
}
