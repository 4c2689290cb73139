// Finding a Megatron checkpoint on disk: tracker, iteration folder, rank
// folders (naming in megatron_format.h).

#include <system_error>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron_legacy/megatron.h"
#include "engine/torchfile/torch_file.h"

namespace ucp::megatron {
namespace fs = std::filesystem;

RunConfig ReadLegacyRunConfig(const ArgsView& args) {
  RunConfig run = ReadRunConfig(args, /*experts=*/true);
  // A dense model's expert sizes (Megatron's args always carry them) place
  // nothing.
  if (!run.variables.Has("num_moe_experts")) {
    if (run.topology.ep > 1) {
      throw FormatError(args.where(), ": expert_model_parallel_size ",
                        run.topology.ep, " but no num_experts");
    }
    run.topology.etp.reset();
  }
  return run;
}

Checkpoint Discover(const fs::path& dir, std::optional<int64_t> iteration) {
  IterationFolder at =
      LocateIteration(dir, iteration, ReleaseFolder::kAccepted);
  if (!at.named) {
    throw FormatError(dir.string(), ": no ", kTrackerFile,
                      " and not an iter_NNNNNNN / release folder: not a "
                      "Megatron checkpoint");
  }
  Checkpoint c;
  c.dir = std::move(at.dir);
  c.iter_dir = std::move(at.iter_dir);
  c.iteration = at.iteration;
  c.release = at.release;
  std::error_code ec;

  // Rank (0, 0) names the topology: mp_rank_00 (PP 1), mp_rank_00_000 (PP
  // or EP > 1) or mp_rank_00_000_000 (both).
  fs::path first;
  for (const char* name :
       {"mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000"}) {
    const fs::path p = c.iter_dir / name / kModelFile;
    if (fs::exists(p, ec)) {
      first = p;
      break;
    }
  }
  if (first.empty()) {
    throw FormatError(c.iter_dir.string(), ": missing ",
                      (c.iter_dir / "mp_rank_00" / kModelFile).string(),
                      " (or mp_rank_00_000/", kModelFile,
                      "): no rank file of tensor/pipeline rank 0");
  }
  RunConfig run;
  bool has_optimizer = false;
  torchfile::TorchFile f = torchfile::TorchFile::Open(first);  // names `first`
  try {
    const pickle::Value* root = f.root();
    const pickle::Value* args =
        root != nullptr && root->IsDictLike() ? root->Get("args") : nullptr;
    if (args == nullptr) throw FormatError("no 'args' entry");
    run = ReadLegacyRunConfig(ArgsView(args, "args"));
    if (run.topology.etp && *run.topology.etp != run.topology.tp) {
      throw FormatError(
          "args say expert_tensor_parallel_size ", *run.topology.etp,
          " but tensor_model_parallel_size ", run.topology.tp,
          ": Megatron's legacy format keeps one folder per (tp, pp, ep) and "
          "needs ETP = TP (save with --ckpt-format torch_dist instead)");
    }
    const pickle::Value* opt = root->Get("optimizer");
    has_optimizer = opt != nullptr && opt->kind != pickle::Kind::kNone;
  } catch (Error& e) {
    e.AddContext("rank file ", first.string());
    throw;
  }
  c.topology = run.topology;
  c.distributed_optimizer = run.distributed_optimizer;
  const layouts::Topology& t = c.topology;
  // Saved with --no-save-optim: no optimizer entry and no distrib_optim.pt.
  const bool distrib_files = c.distributed_optimizer && has_optimizer;

  c.rank_files.assign(static_cast<size_t>(t.pp), {});
  if (distrib_files)
    c.distrib_optim_files.assign(static_cast<size_t>(t.pp), {});
  for (int64_t p = 0; p < t.pp; ++p) {
    for (int64_t x = 0; x < t.ep * t.tp; ++x) {
      const int64_t r = x % t.tp;
      const fs::path rd = c.iter_dir / RankDirName(r, p, t.pp, x / t.tp, t.ep);
      const fs::path mf = rd / kModelFile;
      if (!fs::is_regular_file(mf, ec)) {
        throw FormatError("missing rank file ", mf.string(), " (topology ",
                          t.ToString(), " from ", first.string(), ")");
      }
      c.rank_files[static_cast<size_t>(p)].push_back(mf);
      if (distrib_files) {
        const fs::path df = rd / kDistribOptimFile;
        if (!fs::is_regular_file(df, ec)) {
          throw FormatError("missing ", df.string(),
                            " (args say use_distributed_optimizer and ",
                            first.string(), " holds optimizer state)");
        }
        c.distrib_optim_files[static_cast<size_t>(p)].push_back(df);
      }
    }
  }
  // Rank folders the topology does not explain (expert parallelism, a
  // mixed-up folder) would be silently ignored otherwise.
  fs::directory_iterator it(c.iter_dir, ec);
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    auto nums = ParseRankDirName(name);
    if (!nums) continue;
    // The suffixes the topology gives: _PPP with PP > 1, then _EEE with
    // EP > 1.
    std::vector<int64_t> suffixes;
    if (nums->second) suffixes.push_back(*nums->second);
    if (nums->third) suffixes.push_back(*nums->third);
    std::vector<int64_t> limits;
    if (t.pp > 1) limits.push_back(t.pp);
    if (t.ep > 1) limits.push_back(t.ep);
    bool ok = nums->tp_rank < t.tp && suffixes.size() == limits.size();
    for (size_t k = 0; ok && k < limits.size(); ++k)
      ok = suffixes[k] < limits[k];
    if (!ok) {
      throw FormatError(c.iter_dir.string(), ": unexpected rank folder '", name,
                        "' for topology ", t.ToString(), " (args of ",
                        first.string(), ")");
    }
  }
  if (ec) {
    throw IoError("cannot list ", c.iter_dir.string(), ": ", ec.message());
  }
  return c;
}

}  // namespace ucp::megatron
