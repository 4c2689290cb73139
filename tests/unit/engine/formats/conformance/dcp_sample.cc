// The PyTorch DCP sample of the conformance suite: a real torch 2.6 save of
// DTensor Shard(0) state on 2 ranks (../shared/fixtures/dcp-torch-2.6), in a
// save folder as torchtitan keeps them (step-10/); 3 ranks as the other
// layout.

#include <filesystem>

#include "tests/testutil/testutil.h"
#include "tests/unit/engine/formats/conformance/conformance.h"

namespace ucp::formats::conformance {
namespace {

namespace fs = std::filesystem;

TargetOptions Ranks(int64_t n) {
  TargetOptions o;
  o.topology.dp = n;
  return o;
}

const bool kRegistered = RegisterSample({
    .driver = "dcp",
    .make =
        [](const fs::path& dir) {
          fs::create_directories(dir);
          fs::copy(testutil::FixturesDir() / "dcp-torch-2.6" /
                       "dtensor_shard0_w2" / "ckpt",
                   dir / "step-10", fs::copy_options::recursive);
          for (const auto& e : fs::recursive_directory_iterator(dir))
            fs::permissions(e.path(), fs::perms::owner_write,
                            fs::perm_options::add);
          return dir;
        },
    .same = Ranks(2),
    .other = Ranks(3),
    // It names the save (a uuid, the path it was written to).
    .not_reproduced = {".metadata"},
    .loads_at_any_layout = true,
});

}  // namespace
}  // namespace ucp::formats::conformance
