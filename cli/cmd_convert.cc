// ucp to-universal / reshape / convert: a checkpoint of any registered format
// <-> universal file <-> any layout of any writable format. The formats are
// picked through the driver registry (engine/formats/driver.h); nothing here
// names a framework.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "cli/command.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/integrity.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

std::string FormatList(bool writable) {
  std::string s;
  for (const formats::Driver* d : formats::Drivers()) {
    if (writable ? !d->CanWrite() : !d->CanRead()) continue;
    s += StrCat("  ", d->Name(),
                std::string(22 - std::min<size_t>(20, d->Name().size()), ' '),
                d->Summary(), "\n");
  }
  return s;
}

const std::string& ToUniversalHelp() {
  static const std::string h =
      "usage: ucp to-universal SRC -o FILE [options]\n"
      "\n"
      "Reads a training checkpoint and writes one universal HDF5 file: every\n"
      "parameter once, whole, with its fp32 master weight, optimizer state\n"
      "(exp_avg, exp_avg_sq, step, ...), training-dtype weights, vocab "
      "padding\n"
      "rows, and everything else of the checkpoint (args, RNG states, "
      "scheduler,\n"
      "client state) kept verbatim. Replicated tensors are checked to agree "
      "bit\n"
      "for bit. The file reads with h5py; its schema is in the README.\n"
      "\n"
      "The source format is detected (--from to force one):\n" +
      FormatList(false) +
      "\n"
      "examples:\n"
      "  ucp to-universal /ckpt/gpt -o gpt.ucp.h5\n"
      "  ucp to-universal /ckpt/gpt/iter_0002000 -o gpt-2000.ucp.h5 --layout "
      "mcore-gpt\n"
      "  ucp to-universal /ckpt/ds --tag global_step500 -o ds.ucp.h5\n"
      "\n"
      "options";
  return h;
}

const std::string& ReshapeHelp() {
  static const std::string h =
      "usage: ucp reshape FILE -o DIR --dp N [--tp N] [--pp N] [--vpp N]\n"
      "                   [--format NAME] [--distributed-optimizer | "
      "--zero-stage S]\n"
      "                   [options]\n"
      "\n"
      "Writes, from a universal file, the checkpoint for a new tensor / "
      "pipeline /\n"
      "virtual-pipeline / data-parallel layout, exactly as the framework "
      "would save\n"
      "it for that configuration, optimizer state included. --format picks "
      "the\n"
      "target (default: the format the universal file was made from):\n" +
      FormatList(true) +
      "DIR must not exist (or be empty); nothing appears under DIR on "
      "failure.\n"
      "\n"
      "examples:\n"
      "  ucp reshape gpt.ucp.h5 -o /ckpt/gpt-tp4 --tp 4 --pp 1 --dp 2 "
      "--distributed-optimizer\n"
      "  ucp reshape gpt.ucp.h5 -o /ckpt/gpt-pp4 --tp 1 --pp 4 --vpp 2 --dp 8\n"
      "  ucp reshape ds.ucp.h5 -o /ckpt/ds-8 --format deepspeed --dp 8 "
      "--zero-stage 3\n"
      "\n"
      "options";
  return h;
}

const std::string& ConvertHelp() {
  static const std::string h =
      "usage: ucp convert SRC -o DIR --dp N [--tp N] [--pp N] [--vpp N]\n"
      "                   [--format NAME] [--distributed-optimizer | "
      "--zero-stage S]\n"
      "                   [options]\n"
      "\n"
      "to-universal and reshape in one step, streaming: reads the checkpoint "
      "SRC\n"
      "(any readable format, detected) and writes the checkpoint for the new\n"
      "layout into DIR; every target tensor is assembled directly from the "
      "source\n"
      "rank files (same checks as to-universal: coverage, replicas), no "
      "universal\n"
      "file is written. Target formats (--format, default: the source's):\n" +
      FormatList(true) +
      "\n"
      "examples:\n"
      "  ucp convert /ckpt/gpt -o /ckpt/gpt-tp1pp4 --tp 1 --pp 4 --dp 16\n"
      "  ucp convert /ckpt/ds -o /ckpt/ds-3ranks --dp 3 --zero-stage 1\n"
      "  ucp convert /ckpt/mds -o /ckpt/mds-tp1pp4 --tp 1 --pp 4 --dp 2 "
      "--zero-stage 1\n"
      "  ucp convert /ckpt/ds -o /ckpt/ds-uc --format deepspeed-universal "
      "--dp 1\n"
      "\n"
      "options";
  return h;
}

}  // namespace

void SourceArgs::Add(po::options_description& d) {
  d.add_options()("from", po::value<std::string>(&from),
                  "source format (default: detected)")(
      "layout", po::value<std::string>(&layout),
      "layout descriptor: a builtin name (ucp layout list) or a YAML file; "
      "default: detected")("iteration", po::value<int64_t>(&iteration),
                           "Megatron: iteration to read (default: the "
                           "tracker file's)")(
      "tag", po::value<std::string>(&tag),
      "DeepSpeed: tag to read (default: the one `latest` names)")(
      "vocab-size", po::value<int64_t>(&vocab_size),
      "the tokenizer's true vocabulary size, when the args lack it");
}

formats::SourceOptions SourceArgs::Options() const {
  formats::SourceOptions o;
  o.layout = layout;
  if (vocab_size > 0) o.true_vocab_size = vocab_size;
  if (iteration >= 0) o.selector.iteration = iteration;
  o.selector.tag = tag;
  return o;
}

std::unique_ptr<formats::Source> SourceArgs::Open(const fs::path& path) const {
  const formats::Driver& d = formats::DetectDriver(path, from);
  return d.Open(path, Options());
}

void TargetArgs::Add(po::options_description& d, bool with_vocab,
                     const char* tag_option) {
  d.add_options()("format", po::value<std::string>(&format),
                  "target format (default: the source's)")(
      "tp", po::value<int64_t>(&tp)->default_value(1), "tensor-parallel size")(
      "pp", po::value<int64_t>(&pp)->default_value(1),
      "pipeline-parallel size")(
      "vpp", po::value<int64_t>(&vpp)->default_value(1),
      "virtual pipeline chunks per pipeline rank (1: none)")(
      "dp", po::value<int64_t>(&dp)->required(), "data-parallel size")(
      "distributed-optimizer", po::bool_switch(&distributed_optimizer),
      "Megatron: write distrib_optim.pt (--use-distributed-optimizer)")(
      "zero-stage", po::value<int>(&zero_stage),
      "DeepSpeed: ZeRO stage 0-3 of the target (default: the source's); "
      "at stage 0 the training dtype picks the optimizer: the torch optimizer "
      "(fp32) or FP16_Optimizer (fp16) in the model states, BF16_Optimizer "
      "files (bf16)")(tag_option, po::value<std::string>(&tag),
                      "DeepSpeed: the target tag (default: the source's, or "
                      "global_step<N>)")(
      "no-optimizer", po::bool_switch(&no_optimizer),
      "model weights only (no optimizer state)");
  if (with_vocab) {
    d.add_options()("vocab-size", po::value<int64_t>(&vocab_size),
                    "the tokenizer's true vocabulary size, when the "
                    "universal file lacks it");
  }
}

formats::TargetOptions TargetArgs::Options() const {
  if (tp < 1 || pp < 1 || vpp < 1 || dp < 1) {
    throw UsageError("--tp, --pp, --vpp and --dp must be >= 1");
  }
  formats::TargetOptions o;
  o.topology.tp = tp;
  o.topology.pp = pp;
  o.topology.vpp = vpp;
  o.topology.dp = dp;
  if (zero_stage >= 0) o.zero_stage = zero_stage;
  o.distributed_optimizer = distributed_optimizer;
  o.no_optimizer = no_optimizer;
  o.tag = tag;
  if (vocab_size > 0) o.true_vocab_size = vocab_size;
  return o;
}

std::string TargetArgs::Describe() const {
  return StrCat("tp ", tp, ", pp ", pp, ", vpp ", vpp, ", dp ", dp,
                distributed_optimizer ? ", distributed optimizer" : "",
                zero_stage >= 0 ? StrCat(", zero stage ", zero_stage) : "");
}

json::Value TopologyJson(const layouts::Topology& t, bool distopt,
                         std::optional<int> zero_stage) {
  json::Value j;
  j["tp"] = t.tp;
  j["pp"] = t.pp;
  j["vpp"] = t.vpp;
  j["dp"] = t.dp;
  j["distributed_optimizer"] = distopt;
  if (zero_stage) j["zero_stage"] = *zero_stage;
  return j;
}

// The driver a universal file was made from: the source JSON's "driver", or
// the driver whose name starts its "framework" ("megatron-lm").
std::string NativeFormat(const atoms::RootInfo& root) {
  json::Value src;
  try {
    src = json::Value::Parse(root.source.empty() ? "{}" : root.source);
  } catch (const Error&) {
    return "";
  }
  if (!src.is_object()) return "";
  if (const json::Value* d = src.Find("driver"); d && d->is_string())
    return d->AsString();
  if (const json::Value* f = src.Find("framework"); f && f->is_string()) {
    for (const formats::Driver* d : formats::Drivers()) {
      if (d->CanWrite() && f->AsString().rfind(std::string(d->Name()), 0) == 0)
        return std::string(d->Name());
    }
  }
  return "";
}

const formats::Driver& TargetDriver(const std::string& format,
                                    const std::string& native) {
  const std::string name = format.empty() ? native : format;
  if (name.empty()) {
    throw UsageError("the source's format is unknown: pass --format NAME");
  }
  const formats::Driver& d = formats::GetDriver(name);
  if (!d.CanWrite()) {
    std::string writable;
    for (const formats::Driver* x : formats::Drivers())
      if (x->CanWrite())
        writable += (writable.empty() ? "" : ", ") + std::string(x->Name());
    throw UsageError("format '", name,
                     "' cannot be written (writable: ", writable, ")");
  }
  return d;
}

double Since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t)
      .count();
}

namespace {

void CheckNewFile(const fs::path& out, bool force) {
  std::error_code ec;
  if (fs::exists(out, ec) && !force) {
    throw UsageError("output ", out.string(),
                     " already exists (pass --force to replace it)");
  }
}

void PrintTargetResult(const char* command, const fs::path& out,
                       const formats::Driver& driver, const TargetArgs& target,
                       const formats::TargetSummary& s, double seconds,
                       const RunOptions& run, json::Value extra) {
  const formats::TargetOptions o = target.Options();
  if (run.json) {
    json::Value j = std::move(extra);
    j["command"] = command;
    j["output"] = out.string();
    j["format"] = std::string(driver.Name());
    j["target_topology"] =
        TopologyJson(o.topology, o.distributed_optimizer, o.zero_stage);
    j["files"] = s.files;
    j["bytes"] = s.bytes;
    j["seconds"] = seconds;
    json::Value notes = json::Value::Array();
    for (const auto& n : s.notes) notes.Append(n);
    j["notes"] = std::move(notes);
    if (s.details.is_object())
      for (const auto& [k, v] : s.details.members()) j[k] = v;
    if (!s.resume_hint.empty()) j["resume"] = s.resume_hint;
    PrintJson(j);
    return;
  }
  std::printf("wrote %s: %s checkpoint, %lld files, %s for %s in %.1f s\n",
              out.string().c_str(), std::string(driver.Name()).c_str(),
              static_cast<long long>(s.files), HumanBytes(s.bytes).c_str(),
              target.Describe().c_str(), seconds);
  for (const auto& n : s.notes) std::printf("note: %s\n", n.c_str());
  if (!s.resume_hint.empty()) {
    std::string hint = s.resume_hint;
    const std::string marker = "<output>";
    if (size_t at = hint.find(marker); at != std::string::npos)
      hint.replace(at, marker.size(), out.string());
    std::printf("resume with %s\n", hint.c_str());
  }
}

}  // namespace

int RunToUniversal(const std::vector<std::string>& args) {
  po::options_description desc(ToUniversalHelp());
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
  std::unique_ptr<formats::Source> source =
      src.Open(vm["source"].as<std::string>());
  const formats::CheckpointInfo& c = source->info();
  universal::SourcePlan plan = source->Plan();
  CheckFreeSpace(output, UniversalBytes(plan));
  universal::WriteSummary s = universal::WriteUniversal(plan, output, executor);
  if (run.json) {
    json::Value j;
    j["command"] = "to-universal";
    j["source"] = c.path.string();
    j["format"] = c.format;
    j["iteration"] = c.iteration;
    if (!c.tag.empty()) j["tag"] = c.tag;
    j["source_topology"] =
        TopologyJson(c.topology, c.distributed_optimizer, c.zero_stage);
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
        c.Describe().c_str(), output.c_str(), static_cast<long long>(s.params),
        static_cast<long long>(s.atoms), HumanBytes(s.atom_bytes).c_str(),
        static_cast<long long>(s.replicas_verified), s.seconds);
  }
  return 0;
}

void WriteManifestOf(const formats::Driver& driver, const fs::path& dir) {
  const std::unique_ptr<formats::Source> written = driver.Open(dir, {});
  formats::WriteManifest(written->info().path, written->info().files);
}

namespace {

constexpr const char* kManifestOption =
    "also write ucp.manifest.json (sizes and xxh3 of every record) into the "
    "checkpoint folder, which ucp verify / resume then check";

}  // namespace

int RunReshape(const std::vector<std::string>& args) {
  po::options_description desc(ReshapeHelp());
  std::string output;
  TargetArgs target;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the checkpoint folder to create");
  target.Add(desc, /*with_vocab=*/true, "tag");
  bool manifest = false;
  desc.add_options()("manifest", po::bool_switch(&manifest), kManifestOption);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"universal"}, vm)) return 0;
  if (!vm.count("universal"))
    throw UsageError("reshape needs a universal file");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  const auto start = std::chrono::steady_clock::now();
  formats::TargetOptions options = target.Options();
  if (!target.format.empty()) TargetDriver(target.format, "");  // checks
  universal::StagedDirectory out(output);
  atoms::AtomStoreReader store =
      atoms::AtomStoreReader::Open(vm["universal"].as<std::string>());
  const formats::Driver& driver =
      TargetDriver(target.format, NativeFormat(store.root()));
  std::unique_ptr<universal::UniversalInput> input =
      universal::StoreInput(store);
  CheckFreeSpace(output, MinimumTargetBytes(*input, options.no_optimizer));
  formats::TargetSummary s =
      driver.Write(*input, out.path(), options, executor);
  if (manifest) WriteManifestOf(driver, out.path());
  out.Commit();
  json::Value extra;
  extra["universal"] = vm["universal"].as<std::string>();
  PrintTargetResult("reshape", output, driver, target, s, Since(start), run,
                    std::move(extra));
  return 0;
}

int RunConvert(const std::vector<std::string>& args) {
  po::options_description desc(ConvertHelp());
  std::string output;
  SourceArgs src;
  TargetArgs target;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the checkpoint folder to create");
  src.Add(desc);
  target.Add(desc, /*with_vocab=*/false, "target-tag");
  bool manifest = false;
  desc.add_options()("manifest", po::bool_switch(&manifest), kManifestOption);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"source"}, vm)) return 0;
  if (!vm.count("source"))
    throw UsageError("convert needs a source checkpoint folder");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  const auto start = std::chrono::steady_clock::now();
  formats::TargetOptions options = target.Options();
  if (src.vocab_size > 0) options.true_vocab_size = src.vocab_size;
  if (!target.format.empty()) TargetDriver(target.format, "");  // checks
  std::unique_ptr<formats::Source> source =
      src.Open(vm["source"].as<std::string>());
  const formats::CheckpointInfo& c = source->info();
  const formats::Driver& driver = TargetDriver(target.format, c.format);
  universal::StagedDirectory out(output);
  // Streaming: every target tensor is composed from boxes of the source rank
  // files; no universal file is written.
  universal::SourcePlan plan = source->Plan();
  std::unique_ptr<universal::UniversalInput> input =
      universal::PlanInput(plan, c.path, executor);
  CheckFreeSpace(output, MinimumTargetBytes(*input, options.no_optimizer));
  formats::TargetSummary s =
      driver.Write(*input, out.path(), options, executor);
  if (manifest) WriteManifestOf(driver, out.path());
  out.Commit();
  json::Value extra;
  extra["source"] = c.path.string();
  extra["source_format"] = c.format;
  extra["source_topology"] =
      TopologyJson(c.topology, c.distributed_optimizer, c.zero_stage);
  if (!run.json) std::printf("read %s\n", c.Describe().c_str());
  PrintTargetResult("convert", output, driver, target, s, Since(start), run,
                    std::move(extra));
  return 0;
}

}  // namespace ucp::cli
