// The Megatron-core torch_dist sample of the conformance suite: the real
// megatron-core save of ../shared/fixtures/megatron-core-torch-dist
// (TP2, fully_reshardable optimizer state, the common state as a DCP item)
// written once by ucp at its own layout (TP2 PP1 DP1: its items placed the
// way ucp places them, common.pt beside the item), so that a rewrite must
// reproduce every file; TP2 PP2 DP2 as the other layout. The real framework
// loading ucp's files is tests/cli/test_torch_dist_cli.py.

#include <filesystem>

#include "engine/formats/driver.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/formats/conformance/conformance.h"

namespace ucp::formats::conformance {
namespace {

namespace fs = std::filesystem;

TargetOptions Layout(int64_t tp, int64_t pp, int64_t dp) {
  TargetOptions o;
  o.topology.tp = tp;
  o.topology.pp = pp;
  o.topology.dp = dp;
  o.values.Set("distributed-optimizer", "true");
  return o;
}

const bool kRegistered = RegisterSample({
    .driver = "megatron-torch-dist",
    .make =
        [](const fs::path& dir) {
          const Driver& d = GetDriver("megatron-torch-dist");
          const std::unique_ptr<Source> s =
              d.Open(testutil::FixturesDir() / "megatron-core-torch-dist" /
                         "tp2pp1dp1" / "ckpt",
                     {});
          const universal::SourcePlan plan = s->Plan();
          fs::create_directories(dir);
          const std::unique_ptr<universal::UniversalInput> input =
              universal::PlanInput(plan, s->info().path, {});
          universal::StagedDirectory staged(dir / "save");
          WriteTarget(d, *input, staged.path(), Layout(2, 1, 1), {});
          staged.Commit();
          return dir / "save";
        },
    .same = Layout(2, 1, 1),
    // Every (tp, pp) rank of the source exists there too: the RNG states
    // (per rank, not universal content) come back as well.
    .other = Layout(2, 2, 2),
    // It names the save (a uuid, the path it was written to).
    .not_reproduced = {".metadata"},
    .loads_at_any_layout = true,
});

}  // namespace
}  // namespace ucp::formats::conformance
