// The Megatron-FSDP sample of the conformance suite (a read-only format):
// the real megatron-core torch_dist save of ../shared/fixtures/megatron-core-
// torch-dist under Megatron-FSDP's keys, written by ucp's DCP writer into a
// Megatron save folder: every param as module.<name> (fp32 main weight and
// Adam moments), SwiGLU's fc1 in its _w / _v halves, iter_0000010/ beside the
// tracker. No args object (the reader's fallback: the names' layout, the
// stored rows). Real Megatron-FSDP saves read and converted, loaded back by
// megatron-core: tests/cli/test_megatron_fsdp.py.

#include <filesystem>

#include "engine/formats/driver.h"
#include "engine/universal/input.h"
#include "engine/universal/mapped_input.h"
#include "engine/universal/output_dir.h"
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

fs::path Make(const fs::path& dir) {
  const std::unique_ptr<Source> s =
      GetDriver("megatron-torch-dist")
          .Open(testutil::FixturesDir() / "megatron-core-torch-dist" /
                    "tp2pp1dp1" / "ckpt",
                {});
  const universal::SourcePlan plan = s->Plan();
  const std::unique_ptr<universal::UniversalInput> input =
      universal::PlanInput(plan, s->info().path, {});
  std::vector<universal::MappedParam> params;
  for (const atoms::StoredParam& p : input->params()) {
    const std::string name = "module." + p.info.fqn;
    if (!p.info.fqn.ends_with(".linear_fc1.weight")) {
      params.push_back(universal::WholeParam(p, name));
      continue;
    }
    for (int half = 0; half < 2; ++half) {  // [gate; up] -> _w, _v
      universal::MappedParam m;
      m.info = p.info;
      m.info.fqn = name + (half == 0 ? "_w" : "_v");
      m.info.shape[0] /= 2;
      Box src = Box::Whole(p.info.shape);
      src.size[0] /= 2;
      src.offset[0] = half * src.size[0];
      m.pieces.push_back({p.info.fqn, src, Box::Whole(m.info.shape)});
      params.push_back(std::move(m));
    }
  }
  universal::Model model = input->model();
  model.layout_yaml.clear();
  model.extras.clear();
  model.extra_texts.clear();
  const std::unique_ptr<universal::UniversalInput> mapped =
      universal::MappedInput(*input, std::move(params), model);
  fs::create_directories(dir / "save");
  universal::StagedDirectory staged(dir / "save" / "iter_0000010");
  WriteTarget(GetDriver("dcp"), *mapped, staged.path(), Ranks(2), {});
  staged.Commit();
  testutil::WriteFile(dir / "save" / "latest_checkpointed_iteration.txt", "10");
  return dir / "save";
}

const bool kRegistered = RegisterSample({
    .driver = "megatron-fsdp",
    .make = Make,
    .same = Ranks(2),
    .other = Ranks(3),
    .not_reproduced = {},
    // Megatron-FSDP reshards fsdp_dtensor at load.
    .loads_at_any_layout = true,
});

}  // namespace
}  // namespace ucp::formats::conformance
