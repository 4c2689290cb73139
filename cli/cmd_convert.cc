// ucp to-universal / reshape / convert: Megatron-LM checkpoint <-> universal
// file <-> any TP/PP/VPP/DP layout.

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "cli/command.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/formats/megatron/megatron.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kToUniversalHelp =
    "usage: ucp to-universal SRC -o FILE [options]\n"
    "\n"
    "Reads a Megatron-LM checkpoint (the --save folder with\n"
    "latest_checkpointed_iteration.txt, or one iter_XXXXXXX folder) and writes "
    "one\n"
    "universal HDF5 file: every parameter once, whole, with its fp32 master "
    "weight,\n"
    "optimizer state (exp_avg, exp_avg_sq, ...), training-dtype weights, "
    "vocab\n"
    "padding rows, and everything else of the checkpoint (args, RNG states, "
    "TE\n"
    "extra state, scheduler) kept verbatim. Replicated tensors are checked to "
    "agree\n"
    "bit for bit. The file reads with h5py; its schema is in the README.\n"
    "\n"
    "examples:\n"
    "  ucp to-universal /ckpt/gpt -o gpt.ucp.h5\n"
    "  ucp to-universal /ckpt/gpt/iter_0002000 -o gpt-2000.ucp.h5 --layout "
    "mcore-gpt\n"
    "\n"
    "options";

constexpr const char* kReshapeHelp =
    "usage: ucp reshape FILE -o DIR --tp N --pp N --dp N [--vpp N]\n"
    "                   [--distributed-optimizer] [options]\n"
    "\n"
    "Writes, from a universal file, the Megatron-LM checkpoint for a new\n"
    "tensor/pipeline/virtual-pipeline/data-parallel layout, exactly as "
    "Megatron\n"
    "would save it for that configuration: args patched for the new topology,\n"
    "local layer numbering, vocab padded for the new TP, optimizer state laid "
    "out\n"
    "for the new DP (with --distributed-optimizer: distrib_optim.pt), tracker "
    "file\n"
    "last. DIR must not exist (or be empty); nothing appears under DIR on "
    "failure.\n"
    "\n"
    "examples:\n"
    "  ucp reshape gpt.ucp.h5 -o /ckpt/gpt-tp4 --tp 4 --pp 1 --dp 2 "
    "--distributed-optimizer\n"
    "  ucp reshape gpt.ucp.h5 -o /ckpt/gpt-pp4 --tp 1 --pp 4 --vpp 2 --dp 8\n"
    "\n"
    "options";

constexpr const char* kConvertHelp =
    "usage: ucp convert SRC -o DIR --tp N --pp N --dp N [--vpp N]\n"
    "                   [--distributed-optimizer] [options]\n"
    "\n"
    "to-universal and reshape in one step, streaming: reads the Megatron-LM\n"
    "checkpoint SRC and writes the checkpoint for the new layout into DIR; "
    "every\n"
    "target tensor is assembled directly from the source rank files (same "
    "checks\n"
    "as to-universal: coverage, replicas), no universal file is written.\n"
    "\n"
    "example:\n"
    "  ucp convert /ckpt/gpt -o /ckpt/gpt-tp1pp4 --tp 1 --pp 4 --dp 16\n"
    "\n"
    "options";

struct SourceArgs {
  std::string layout;
  int64_t iteration = -1;
  int64_t vocab_size = 0;

  void Add(po::options_description& d) {
    d.add_options()("layout", po::value<std::string>(&layout),
                    "layout descriptor: a builtin name (ucp layout list) or a "
                    "YAML file; default: detected")(
        "iteration", po::value<int64_t>(&iteration),
        "iteration to read (default: the tracker file's)")(
        "vocab-size", po::value<int64_t>(&vocab_size),
        "the tokenizer's true vocabulary size, when the args lack it");
  }
  megatron::SourceOptions Options() const {
    megatron::SourceOptions o;
    o.layout = layout;
    if (vocab_size > 0) o.true_vocab_size = vocab_size;
    return o;
  }
  std::optional<int64_t> Iteration() const {
    return iteration >= 0 ? std::optional<int64_t>(iteration) : std::nullopt;
  }
};

struct TargetArgs {
  int64_t tp = 0, pp = 0, vpp = 1, dp = 0;
  bool distributed_optimizer = false;
  bool no_optimizer = false;
  int64_t vocab_size = 0;

  void Add(po::options_description& d, bool with_vocab) {
    d.add_options()("tp", po::value<int64_t>(&tp)->required(),
                    "tensor-parallel size")(
        "pp", po::value<int64_t>(&pp)->required(), "pipeline-parallel size")(
        "vpp", po::value<int64_t>(&vpp)->default_value(1),
        "virtual pipeline chunks per pipeline rank (1: none)")(
        "dp", po::value<int64_t>(&dp)->required(), "data-parallel size")(
        "distributed-optimizer", po::bool_switch(&distributed_optimizer),
        "write distrib_optim.pt (Megatron --use-distributed-optimizer)")(
        "no-optimizer", po::bool_switch(&no_optimizer),
        "model weights only (Megatron --no-load-optim)");
    if (with_vocab) {
      d.add_options()("vocab-size", po::value<int64_t>(&vocab_size),
                      "the tokenizer's true vocabulary size, when the "
                      "universal file lacks it");
    }
  }
  megatron::TargetOptions Options() const {
    if (tp < 1 || pp < 1 || vpp < 1 || dp < 1) {
      throw UsageError("--tp, --pp, --vpp and --dp must be >= 1");
    }
    megatron::TargetOptions o;
    o.topology.tp = tp;
    o.topology.pp = pp;
    o.topology.vpp = vpp;
    o.topology.dp = dp;
    o.distributed_optimizer = distributed_optimizer;
    o.no_optimizer = no_optimizer;
    if (vocab_size > 0) o.true_vocab_size = vocab_size;
    return o;
  }
  std::string Describe() const {
    return StrCat("tp ", tp, ", pp ", pp, ", vpp ", vpp, ", dp ", dp,
                  distributed_optimizer ? ", distributed optimizer" : "");
  }
  std::string MegatronFlags() const {
    std::string s = StrCat("--tensor-model-parallel-size ", tp,
                           " --pipeline-model-parallel-size ", pp);
    if (vpp > 1) s += StrCat(" --num-virtual-stages-per-pipeline-rank ", vpp);
    if (distributed_optimizer) s += " --use-distributed-optimizer";
    if (no_optimizer) s += " --no-load-optim";
    return s;
  }
};

std::string SourceDescription(const megatron::Checkpoint& c) {
  const layouts::Topology& t = c.topology;
  return StrCat("Megatron-LM checkpoint ", c.iter_dir.string(), " (iteration ",
                c.iteration, ", tp ", t.tp, ", pp ", t.pp, ", vpp ", t.vpp,
                ", dp ", t.dp,
                c.distributed_optimizer ? ", distributed optimizer" : "", ")");
}

json::Value TopologyJson(const layouts::Topology& t, bool distopt) {
  json::Value j;
  j["tp"] = t.tp;
  j["pp"] = t.pp;
  j["vpp"] = t.vpp;
  j["dp"] = t.dp;
  j["distributed_optimizer"] = distopt;
  return j;
}

universal::WriteSummary ToUniversal(const megatron::Checkpoint& c,
                                    const SourceArgs& src, const fs::path& out,
                                    const reshape::ExecutorOptions& executor) {
  universal::SourcePlan plan = megatron::PlanSource(c, src.Options());
  return universal::WriteUniversal(plan, out, executor);
}

void CheckNewFile(const fs::path& out, bool force) {
  std::error_code ec;
  if (fs::exists(out, ec) && !force) {
    throw UsageError("output ", out.string(),
                     " already exists (pass --force to replace it)");
  }
}

}  // namespace

int RunToUniversal(const std::vector<std::string>& args) {
  po::options_description desc(kToUniversalHelp);
  std::string output;
  bool force = false;
  SourceArgs src;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the universal file to write")(
      "force", po::bool_switch(&force), "replace an existing output file");
  src.Add(desc);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"source"}, vm)) return 0;
  if (!vm.count("source"))
    throw UsageError("to-universal needs a source checkpoint folder");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  CheckNewFile(output, force);
  megatron::Checkpoint c =
      megatron::Discover(vm["source"].as<std::string>(), src.Iteration());
  universal::WriteSummary s = ToUniversal(c, src, output, executor);
  if (run.json) {
    json::Value j;
    j["command"] = "to-universal";
    j["source"] = c.iter_dir.string();
    j["iteration"] = c.iteration;
    j["source_topology"] = TopologyJson(c.topology, c.distributed_optimizer);
    j["output"] = output;
    j["params"] = s.params;
    j["atoms"] = s.atoms;
    j["atom_bytes"] = s.atom_bytes;
    j["bytes_read"] = s.bytes_read;
    j["replicas_verified"] = s.replicas_verified;
    j["seconds"] = s.seconds;
    PrintJson(j);
  } else {
    std::printf(
        "read %s\nwrote %s: %lld params, %lld atoms, %s (%lld replicas "
        "verified) in %.1f s\n",
        SourceDescription(c).c_str(), output.c_str(),
        static_cast<long long>(s.params), static_cast<long long>(s.atoms),
        HumanBytes(s.atom_bytes).c_str(),
        static_cast<long long>(s.replicas_verified), s.seconds);
  }
  return 0;
}

namespace {

void PrintTargetResult(const char* command, const fs::path& out,
                       const TargetArgs& target,
                       const megatron::TargetSummary& s, double seconds,
                       const RunOptions& run, json::Value extra) {
  if (run.json) {
    json::Value j = std::move(extra);
    j["command"] = command;
    j["output"] = out.string();
    j["target_topology"] =
        TopologyJson(target.Options().topology, target.distributed_optimizer);
    j["files"] = s.files;
    j["bytes"] = s.bytes;
    j["seconds"] = seconds;
    json::Value notes = json::Value::Array();
    for (const auto& n : s.notes) notes.Append(n);
    j["notes"] = std::move(notes);
    j["megatron_flags"] = target.MegatronFlags();
    PrintJson(j);
    return;
  }
  std::printf("wrote %s: %lld files, %s for %s in %.1f s\n",
              out.string().c_str(), static_cast<long long>(s.files),
              HumanBytes(s.bytes).c_str(), target.Describe().c_str(), seconds);
  for (const auto& n : s.notes) std::printf("note: %s\n", n.c_str());
  std::printf("resume with Megatron-LM: --load %s %s\n", out.string().c_str(),
              target.MegatronFlags().c_str());
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t)
      .count();
}

}  // namespace

int RunReshape(const std::vector<std::string>& args) {
  po::options_description desc(kReshapeHelp);
  std::string output;
  TargetArgs target;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the checkpoint folder to create");
  target.Add(desc, /*with_vocab=*/true);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"universal"}, vm)) return 0;
  if (!vm.count("universal"))
    throw UsageError("reshape needs a universal file");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  const auto start = std::chrono::steady_clock::now();
  megatron::TargetOptions options = target.Options();
  universal::StagedDirectory out(output);
  atoms::AtomStoreReader store =
      atoms::AtomStoreReader::Open(vm["universal"].as<std::string>());
  megatron::TargetSummary s =
      megatron::WriteTarget(store, out.path(), options, executor);
  out.Commit();
  json::Value extra;
  extra["universal"] = vm["universal"].as<std::string>();
  PrintTargetResult("reshape", output, target, s, Since(start), run,
                    std::move(extra));
  return 0;
}

int RunConvert(const std::vector<std::string>& args) {
  po::options_description desc(kConvertHelp);
  std::string output;
  SourceArgs src;
  TargetArgs target;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the checkpoint folder to create");
  src.Add(desc);
  target.Add(desc, /*with_vocab=*/false);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"source"}, vm)) return 0;
  if (!vm.count("source"))
    throw UsageError("convert needs a source checkpoint folder");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  const auto start = std::chrono::steady_clock::now();
  megatron::TargetOptions options = target.Options();
  if (src.vocab_size > 0) options.true_vocab_size = src.vocab_size;
  megatron::Checkpoint c =
      megatron::Discover(vm["source"].as<std::string>(), src.Iteration());
  universal::StagedDirectory out(output);
  // Streaming: every target tensor is composed from boxes of the source rank
  // files; no universal file is written.
  universal::SourcePlan plan = megatron::PlanSource(c, src.Options());
  std::unique_ptr<universal::UniversalInput> input =
      universal::PlanInput(plan, c.iter_dir, executor);
  megatron::TargetSummary s =
      megatron::WriteTarget(*input, out.path(), options, executor);
  out.Commit();
  json::Value extra;
  extra["source"] = c.iter_dir.string();
  extra["source_topology"] = TopologyJson(c.topology, c.distributed_optimizer);
  if (!run.json) std::printf("read %s\n", SourceDescription(c).c_str());
  PrintTargetResult("convert", output, target, s, Since(start), run,
                    std::move(extra));
  return 0;
}

}  // namespace ucp::cli
