// The DeepSpeed samples of the conformance suite: real DeepSpeed 0.14.5
// files (ZeRO-2, bf16, world 2; ../shared/fixtures), ZeRO-1 on 3 ranks as the
// other layout; and a DeepSpeed universal folder that ucp itself writes from
// them (ucp's deepspeed-universal writer, not DeepSpeed's ds_to_universal:
// tests/cli/test_deepspeed_real.py compares the two, and reads DeepSpeed's).

#include <filesystem>

#include "engine/formats/driver.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/engine/formats/conformance/conformance.h"

namespace ucp::formats::conformance {
namespace {

namespace fs = std::filesystem;

fs::path CopyFixture(const fs::path& dir) {
  const fs::path fx =
      testutil::FixturesDir() / "deepspeed-0.14.5" / "ds0145_z2_bf16_w2_mlp";
  fs::create_directories(dir);
  fs::copy(fx / "latest", dir / "latest");
  fs::copy(fx / "global_step2", dir / "global_step2",
           fs::copy_options::recursive);
  return dir;
}

TargetOptions Native(int64_t dp, int stage) {
  TargetOptions o;
  o.topology.dp = dp;
  o.values.Set("zero-stage", std::to_string(stage));
  return o;
}

TargetOptions Stage(int stage) {
  TargetOptions o;
  o.values.Set("zero-stage", std::to_string(stage));
  return o;
}

const bool kNative = RegisterSample({
    .driver = "deepspeed",
    .make = CopyFixture,
    .same = Native(2, 2),
    .other = Native(3, 1),
    .not_reproduced = {},
});

// ucp's own universal folder of the fixture (written by ucp's
// deepspeed-universal driver in the layout of ds_to_universal's folders; not
// DeepSpeed's output, which tests/cli/test_deepspeed_real.py checks against).
const bool kUniversal = RegisterSample({
    .driver = "deepspeed-universal",
    .make =
        [](const fs::path& dir) {
          const fs::path native = CopyFixture(dir.string() + "-native");
          const std::unique_ptr<Source> s =
              GetDriver("deepspeed").Open(native, {});
          const universal::SourcePlan plan = s->Plan();
          const auto input = universal::PlanInput(plan, s->info().path, {});
          universal::StagedDirectory staged(dir);
          WriteTarget(GetDriver("deepspeed-universal"), *input, staged.path(),
                      Stage(2), {});
          staged.Commit();
          return dir;
        },
    .same = Stage(2),
    .other = Stage(1),
    .not_reproduced = {},
});

}  // namespace
}  // namespace ucp::formats::conformance
