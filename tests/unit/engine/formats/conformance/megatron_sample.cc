// The Megatron-LM legacy sample of the conformance suite: the generator's
// TP2·PP2·DP2 checkpoint with the distributed optimizer (GQA, SwiGLU, bf16;
// tests/tools/make_megatron_ckpts.py), and TP4·PP2·DP1 as the other layout.

#include <filesystem>

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
    .driver = "megatron",
    .make =
        [](const fs::path& dir) {
          fs::copy(testutil::TestDataDir() / "megatron" /
                       "gqa_swiglu_bias_untied" / "tp2_pp2_vpp1_dp2_do",
                   dir, fs::copy_options::recursive);
          return dir;
        },
    .same = Layout(2, 2, 2),
    // Every (tp, pp) rank of the source exists there too: the RNG states
    // (per rank, not universal content) come back as well.
    .other = Layout(4, 2, 1),
    .not_reproduced = {},
});

}  // namespace
}  // namespace ucp::formats::conformance
