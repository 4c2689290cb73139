// ucp to-universal / reshape / convert: a checkpoint of any registered format
// <-> universal file <-> any layout of any writable format. The formats are
// picked through the driver registry (engine/formats/driver.h); nothing here
// names a framework.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <tuple>

#include "cli/command.h"
#include "cli/dist.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/integrity.h"
#include "engine/formats/driver.h"
#include "engine/formats/name_map.h"
#include "engine/formats/target_layout.h"
#include "engine/json/json.h"
#include "engine/resume/resume.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

// One line per readable / writable format; for targets, also the topology
// sizes and the options each takes.
std::string FormatList(bool writable) {
  std::string s;
  for (const formats::Driver* d : formats::Drivers()) {
    if (writable ? !d->CanWrite() : !d->CanRead()) continue;
    s += StrCat("  ", d->Name(),
                std::string(22 - std::min<size_t>(20, d->Name().size()), ' '),
                d->Summary(), "\n");
    std::string takes;
    if (writable) {
      const formats::TopologyAxes a = d->TargetAxes();
      for (const auto& [on, flag] :
           {std::pair{a.tp, "--tp"}, std::pair{a.pp, "--pp"},
            std::pair{a.vpp, "--vpp"}, std::pair{a.dp, "--dp"},
            std::pair{a.ep, "--ep"}, std::pair{a.etp, "--etp"}}) {
        if (on) takes += StrCat(takes.empty() ? "" : " ", flag);
      }
      if (!a.any()) takes = "no topology (any world size)";
    }
    for (const formats::OptionSpec& o :
         writable ? d->TargetOptionSpecs() : d->SourceOptionSpecs()) {
      takes += StrCat(takes.empty() ? "" : " ", "--", o.name,
                      o.type == formats::OptionSpec::Type::kFlag  ? ""
                      : o.type == formats::OptionSpec::Type::kInt ? " N"
                                                                  : " TEXT");
    }
    if (!takes.empty())
      s += StrCat(std::string(24, ' '), "takes ", takes, "\n");
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
      "Under a launcher (torchrun, srun, mpirun; see ucp convert --help) the\n"
      "processes write the one file between them: rank 0 allocates it, each\n"
      "process writes its datasets (balanced by bytes), rank 0 commits and\n"
      "alone prints (--json: a processes array); the same bytes as one "
      "process.\n"
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

// The paragraph of reshape's and convert's --help on launchers.
std::string LauncherHelp() {
  return "Under a launcher (torchrun, srun, mpirun: RANK/WORLD_SIZE, "
         "SLURM_PROCID/\n"
         "SLURM_NTASKS, OMPI_COMM_WORLD_RANK/SIZE or PMI_RANK/SIZE with "
         "MASTER_ADDR and\n"
         "MASTER_PORT) the processes write the target files between them "
         "(balanced\n"
         "by bytes) on a shared filesystem; rank 0 hosts ucp's c10d TCPStore "
         "on\n"
         "UCP_STORE_PORT, else MASTER_PORT + 1 under torchrun, else "
         "MASTER_PORT, and\n"
         "alone prints (--json: a processes array). UCP_DIST=0: one process.\n"
         "  torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\\n"
         "      --rdzv-endpoint host0:29400 --no-python ucp convert ...\n"
         "  MASTER_ADDR=host0 MASTER_PORT=29500 srun -N 2 --ntasks-per-node 4 "
         "ucp convert ...\n"
         "\n";
}

const std::string& ReshapeHelp() {
  static const std::string h =
      "usage: ucp reshape FILE -o DIR [--format NAME] [--dp N --tp N --pp N\n"
      "                   --vpp N --ep N --etp N] [format options] [options]\n"
      "\n"
      "Writes, from a universal file, the checkpoint for a new tensor / "
      "pipeline /\n"
      "virtual-pipeline / data-parallel layout, exactly as the framework "
      "would save\n"
      "it for that configuration, optimizer state included. --format picks "
      "the\n"
      "target (default: the format the universal file was made from), and\n"
      "each format takes the topology sizes and options listed with it:\n" +
      FormatList(true) +
      "DIR must not exist (or be empty); nothing appears under DIR on "
      "failure.\n"
      "\n" +
      LauncherHelp() +
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
      "usage: ucp convert SRC -o DIR [--format NAME] [--dp N --tp N --pp N\n"
      "                   --vpp N --ep N --etp N] [format options] [options]\n"
      "\n"
      "to-universal and reshape in one step, streaming: reads the checkpoint "
      "SRC\n"
      "(any readable format, detected) and writes the checkpoint for the new\n"
      "layout into DIR; every target tensor is assembled directly from the "
      "source\n"
      "rank files (same checks as to-universal: coverage, replicas), no "
      "universal\n"
      "file is written. Target formats (--format, default: the source's), "
      "with\n"
      "the topology sizes and options each takes (a target option that a\n"
      "source option shares the name of is --target-<name>):\n" +
      FormatList(true) + "\n" + LauncherHelp() +
      "examples:\n"
      "  ucp convert /ckpt/gpt -o /ckpt/gpt-tp1pp4 --tp 1 --pp 4 --dp 16\n"
      "  ucp convert /ckpt/ds -o /ckpt/ds-3ranks --dp 3 --zero-stage 1\n"
      "  ucp convert /ckpt/mds -o /ckpt/mds-tp1pp4 --tp 1 --pp 4 --dp 2 "
      "--zero-stage 1\n"
      "  ucp convert /ckpt/ds -o /ckpt/ds-uc --format deepspeed-universal\n"
      "  ucp convert llama.ckpt -o ms-tp2dp4/ --format mindspore --tp 2 --dp "
      "4\n"
      "  ucp convert /ckpt/gpt-dist -o ms/ --format mindspore --tp 2 --dp 2 "
      "--names mindformers-llama\n"
      "  ucp convert output/checkpoint -o gpt/ --format megatron-torch-dist "
      "--tp 2 --pp 1 --dp 4\n"
      "      --distributed-optimizer --names mcore-llama "
      "--model-var num_attention_heads=32\n"
      "      --model-var num_query_groups=8\n"
      "\n"
      "options";
  return h;
}

}  // namespace

void DriverOptionArgs::Add(po::options_description& desc, bool target,
                           const std::vector<std::string>& rename,
                           const std::string& prefix) {
  // Each option once, with the help of every driver that declares it.
  struct Merged {
    formats::OptionSpec spec;
    std::vector<std::string> helps;
  };
  std::vector<Merged> merged;
  for (const formats::Driver* d : formats::Drivers()) {
    if (target ? !d->CanWrite() : !d->CanRead()) continue;
    for (const formats::OptionSpec& o :
         target ? d->TargetOptionSpecs() : d->SourceOptionSpecs()) {
      auto it =
          std::find_if(merged.begin(), merged.end(),
                       [&](const Merged& m) { return m.spec.name == o.name; });
      if (it == merged.end()) {
        merged.push_back({o, {}});
        it = std::prev(merged.end());
      }
      UCP_CHECK(it->spec.type == o.type, "drivers declare option --", o.name,
                " with different types");
      std::string help = o.help;
      if (!o.default_text.empty()) help += " (default: " + o.default_text + ")";
      if (std::find(it->helps.begin(), it->helps.end(), help) ==
          it->helps.end())
        it->helps.push_back(help);
    }
  }
  for (Merged& m : merged) {
    Entry e;
    e.name = m.spec.name;
    e.type = m.spec.type;
    e.flag = std::find(rename.begin(), rename.end(), e.name) != rename.end()
                 ? prefix + e.name
                 : e.name;
    std::string help;
    for (const std::string& h : m.helps) help += (help.empty() ? "" : "; ") + h;
    if (e.type == formats::OptionSpec::Type::kFlag) {
      desc.add_options()(e.flag.c_str(), po::bool_switch(), help.c_str());
    } else if (!m.spec.implicit_text.empty()) {  // --name or --name=TEXT
      desc.add_options()(e.flag.c_str(),
                         po::value<std::string>()
                             ->implicit_value(m.spec.implicit_text)
                             ->value_name("TEXT"),
                         help.c_str());
    } else {
      desc.add_options()(
          e.flag.c_str(),
          po::value<std::string>()->value_name(
              e.type == formats::OptionSpec::Type::kInt ? "N" : "TEXT"),
          help.c_str());
    }
    entries_.push_back(std::move(e));
  }
}

formats::OptionValues DriverOptionArgs::Values(
    const po::variables_map& vm) const {
  formats::OptionValues v;
  for (const Entry& e : entries_) {
    if (!vm.count(e.flag)) continue;
    if (e.type == formats::OptionSpec::Type::kFlag) {
      if (vm[e.flag].as<bool>()) v.Set(e.name, "true");
    } else {
      v.Set(e.name, vm[e.flag].as<std::string>());
    }
  }
  return v;
}

std::vector<std::string> DriverOptionArgs::Names() const {
  std::vector<std::string> out;
  for (const Entry& e : entries_) out.push_back(e.name);
  return out;
}

void SourceArgs::Add(po::options_description& d) {
  d.add_options()("from", po::value<std::string>(&from),
                  "source format (default: detected)")(
      "layout", po::value<std::string>(&layout),
      "layout descriptor: a builtin name (ucp layout list) or a YAML file; "
      "default: detected")(
      "vocab-size", po::value<int64_t>(&vocab_size),
      "the tokenizer's true vocabulary size, when the args lack it");
  driver_options.Add(d, /*target=*/false);
}

void SourceArgs::Read(const po::variables_map& vm) {
  values = driver_options.Values(vm);
}

void AddModelVarOption(po::options_description& d,
                       std::vector<std::string>& args, const char* what) {
  d.add_options()(
      "model-var",
      po::value<std::vector<std::string>>(&args)->composing()->value_name(
          "NAME=N"),
      StrCat("a model variable the source does not record, ", what,
             " (repeatable: --model-var num_attention_heads=32 "
             "--model-var num_query_groups=8)")
          .c_str());
}

layouts::Variables ParseModelVars(const std::vector<std::string>& args) {
  layouts::Variables vars;
  for (const std::string& a : args) {
    const size_t eq = a.find('=');
    int64_t v = 0;
    const char* end = a.data() + a.size();
    const bool ok =
        eq != std::string::npos && eq > 0 && eq + 1 < a.size() && [&] {
          const auto r = std::from_chars(a.data() + eq + 1, end, v);
          return r.ec == std::errc() && r.ptr == end;
        }();
    if (!ok)
      throw UsageError("--model-var ", a, ": expected NAME=N (an integer)");
    vars.Set(a.substr(0, eq), v);
  }
  return vars;
}

formats::SourceOptions SourceArgs::Options() const {
  formats::SourceOptions o;
  o.layout = layout;
  if (vocab_size > 0) o.true_vocab_size = vocab_size;
  o.values = values;
  return o;
}

std::unique_ptr<formats::Source> SourceArgs::Open(const fs::path& path) const {
  const formats::Driver& d = formats::DetectDriver(path, from);
  return d.Open(path, Options());
}

void TargetArgs::Add(po::options_description& d, bool with_vocab,
                     const std::vector<std::string>& rename,
                     const std::string& prefix) {
  d.add_options()("format", po::value<std::string>(&format),
                  "target format (default: the source's)")(
      "tp", po::value<int64_t>(&tp)->value_name("N"),
      "tensor-parallel size (default 1; formats with a topology)")(
      "pp", po::value<int64_t>(&pp)->value_name("N"),
      "pipeline-parallel size (default 1)")(
      "vpp", po::value<int64_t>(&vpp)->value_name("N"),
      "virtual pipeline chunks per pipeline rank (default 1: none)")(
      "dp", po::value<int64_t>(&dp)->value_name("N"),
      "data-parallel size (required by formats with a topology; formats "
      "without one, such as deepspeed-universal, take none)")(
      "ep", po::value<int64_t>(&ep)->value_name("N"),
      "expert-parallel size of a mixture-of-experts model (default 1; must "
      "divide the expert count)")(
      "etp", po::value<int64_t>(&etp)->value_name("N"),
      "expert tensor-parallel size (default: --tp); etp x ep x pp must "
      "divide the world tp x pp x dp")(
      "no-optimizer", po::bool_switch(&no_optimizer),
      "model weights only (no optimizer state)");
  std::string maps;
  for (const std::string& n : formats::NameMapNames())
    maps += (maps.empty() ? "" : ", ") + n;
  d.add_options()("names", po::value<std::string>(&names)->value_name("MAP"),
                  StrCat("write the model under another framework's param "
                         "names, fused weights split or joined, with every "
                         "optimizer state (",
                         maps,
                         "; e.g. a Megatron-core LLaMA as MindFormers' "
                         "LLaMA: --names mindformers-llama)")
                      .c_str());
  AddModelVarOption(d, model_var_args, "for a Megatron target or --names");
  if (with_vocab) {
    d.add_options()("vocab-size", po::value<int64_t>(&vocab_size),
                    "the tokenizer's true vocabulary size, when the "
                    "universal file lacks it")(
        "layout", po::value<std::string>(&layout),
        "for a Megatron target, the layout of a universal file that holds "
        "none (a built-in name or a YAML file; default: detected from the "
        "names)");
  }
  driver_options.Add(d, /*target=*/true, rename, prefix);
}

void TargetArgs::Read(const po::variables_map& vm) {
  values = driver_options.Values(vm);
  model_vars = ParseModelVars(model_var_args);
  if (!names.empty()) formats::CheckNameMapName(names);  // before any reading
}

formats::TargetOptions TargetArgs::Options(
    const formats::Driver& driver) const {
  const formats::TopologyAxes axes = driver.TargetAxes();
  struct Axis {
    const char* name;
    const char* what;
    int64_t value;
    bool taken;
    int64_t* out;
  };
  formats::TargetOptions o;
  const Axis list[] = {
      {"tp", "tensor parallelism", tp, axes.tp, &o.topology.tp},
      {"pp", "pipeline parallelism", pp, axes.pp, &o.topology.pp},
      {"vpp", "virtual pipeline", vpp, axes.vpp, &o.topology.vpp},
      {"dp", "data-parallel size", dp, axes.dp, &o.topology.dp},
      {"ep", "expert parallelism", ep, axes.ep, &o.topology.ep},
      {"etp", "expert tensor parallelism", etp, axes.etp, nullptr}};
  std::string taken;
  for (const Axis& a : list)
    if (a.taken) taken += StrCat(taken.empty() ? "" : ", ", "--", a.name);
  for (const Axis& a : list) {
    if (a.value == 0) continue;
    if (!axes.any()) {
      throw UsageError("--", a.name, ": format '", driver.Name(),
                       "' is written without a topology (it loads at any "
                       "world size): give no --tp, --pp, --vpp, --dp, --ep "
                       "or --etp");
    }
    if (!a.taken) {
      throw UsageError("--", a.name, ": format '", driver.Name(), "' has no ",
                       a.what, " (its topology options: ", taken, ")");
    }
    if (a.value < 1) throw UsageError("--", a.name, " must be >= 1");
    if (a.out != nullptr) *a.out = a.value;
  }
  if (etp != 0) o.topology.etp = etp;
  if (axes.dp && axes.dp_required && dp == 0) {
    throw UsageError("format '", driver.Name(),
                     "' needs the data-parallel size: pass --dp N");
  }
  // Megatron carves the expert grid (etp x ep x edp x pp) out of the same
  // ranks as the dense one (initialize_model_parallel: "world_size is not
  // divisible by expert_tensor_model_pipeline_parallel size").
  if (ep != 0 || etp != 0) {
    const layouts::Topology& t = o.topology;
    const int64_t world = t.tp * t.pp * t.dp;
    const int64_t grid = t.ExpertTp() * t.ep * t.pp;
    if (world % grid != 0 && !axes.etp) {  // expert groups split the dp ranks
      throw UsageError("--ep ", t.ep, " does not divide --dp ", t.dp,
                       " (each expert group is a set of --ep data-parallel "
                       "ranks; the expert data-parallel size is dp / ep)");
    }
    if (world % grid != 0) {
      throw UsageError("--etp ", t.ExpertTp(), " x --ep ", t.ep, " x --pp ",
                       t.pp, " = ", grid, " does not divide the world of --tp ",
                       t.tp, " x --pp ", t.pp, " x --dp ", t.dp, " = ", world,
                       " ranks (the expert data-parallel size world / (etp x "
                       "ep x pp) must be whole)");
    }
  }
  formats::CheckOptions(driver.TargetOptionSpecs(), values, driver.Name(),
                        "targets");
  o.values = values;
  o.no_optimizer = no_optimizer;
  if (vocab_size > 0) o.true_vocab_size = vocab_size;
  return o;
}

std::string TargetArgs::Describe(const formats::Driver& driver) const {
  const formats::TopologyAxes axes = driver.TargetAxes();
  const formats::TargetOptions o = Options(driver);
  std::string s;
  if (!axes.any()) {
    s = "any topology";
  } else {
    for (const auto& [taken, name, value] :
         {std::tuple{axes.tp, "tp", o.topology.tp},
          std::tuple{axes.pp, "pp", o.topology.pp},
          std::tuple{axes.vpp, "vpp", o.topology.vpp},
          std::tuple{axes.dp, "dp", o.topology.dp}}) {
      if (taken) s += StrCat(s.empty() ? "" : ", ", name, " ", value);
    }
    if (axes.ep && (ep != 0 || etp != 0)) {
      s += StrCat(", ep ", o.topology.ep, ", etp ", o.topology.ExpertTp());
    }
  }
  const std::string extra =
      formats::DescribeLayoutOptions(driver.TargetOptionSpecs(), values);
  if (!axes.any() && !extra.empty()) return extra;
  return extra.empty() ? s : s + ", " + extra;
}

json::Value TargetArgs::TopologyJson(const formats::Driver& driver) const {
  const formats::TargetOptions o = Options(driver);
  json::Value j = json::Value::Object();
  if (driver.TargetAxes().any()) {
    j["tp"] = o.topology.tp;
    j["pp"] = o.topology.pp;
    j["vpp"] = o.topology.vpp;
    j["dp"] = o.topology.dp;
    if (driver.TargetAxes().ep) {
      j["ep"] = o.topology.ep;
      j["etp"] = o.topology.ExpertTp();
    }
  }
  formats::LayoutOptionsJson(driver.TargetOptionSpecs(), values, j);
  return j;
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
    if (format.empty()) {
      throw UsageError(
          "the source's format '", name,
          "' cannot be written: pass --format NAME (writable: ", writable, ")");
    }
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
  // The driver's hint names the output "<output>" (as often as it needs).
  std::string hint = s.resume_hint;
  const std::string marker = "<output>";
  for (size_t at = hint.find(marker); at != std::string::npos;
       at = hint.find(marker, at + out.string().size()))
    hint.replace(at, marker.size(), out.string());
  if (run.json) {
    json::Value j = std::move(extra);
    j["command"] = command;
    j["output"] = out.string();
    j["format"] = std::string(driver.Name());
    j["target_topology"] = target.TopologyJson(driver);
    j["files"] = s.files;
    j["bytes"] = s.bytes;
    j["seconds"] = seconds;
    json::Value notes = json::Value::Array();
    for (const auto& n : s.notes) notes.Append(n);
    j["notes"] = std::move(notes);
    if (s.details.is_object())
      for (const auto& [k, v] : s.details.members()) j[k] = v;
    if (!hint.empty()) j["resume"] = hint;
    PrintJson(j);
    return;
  }
  std::printf("wrote %s: %s checkpoint, %lld files, %s for %s in %.1f s\n",
              out.string().c_str(), std::string(driver.Name()).c_str(),
              static_cast<long long>(s.files), HumanBytes(s.bytes).c_str(),
              target.Describe(driver).c_str(), seconds);
  for (const auto& n : s.notes) std::printf("note: %s\n", n.c_str());
  if (!hint.empty()) std::printf("resume with %s\n", hint.c_str());
}

constexpr const char* kManifestOption =
    "also write ucp.manifest.json (sizes and xxh3 of every record) into the "
    "checkpoint folder, which ucp verify / resume then check";

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
  src.Read(vm);
  if (!vm.count("source"))
    throw UsageError("to-universal needs a source checkpoint folder");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  // Under a launcher, the processes write the one file between them
  // (WriteUniversal with a job); rank 0 alone prints.
  DistJob* job = StartJob("to-universal", output);
  std::unique_ptr<universal::UniversalJob> shared;
  if (job) shared = UniversalJobOf(*job);
  std::unique_ptr<formats::Source> source;
  universal::SourcePlan plan;
  universal::WriteSummary s;
  ReportingFailures([&] {
    if (PrintsResult()) CheckNewFile(output, force);
    source = src.Open(vm["source"].as<std::string>());
    plan = source->Plan();
    if (PrintsResult()) universal::CheckFreeSpace(output, UniversalBytes(plan));
    s = universal::WriteUniversal(plan, output, executor, shared.get());
  });
  if (!PrintsResult()) return 0;
  const formats::CheckpointInfo& c = source->info();
  if (run.json) {
    json::Value j;
    j["command"] = "to-universal";
    j["source"] = c.path.string();
    j["format"] = c.format;
    j["iteration"] = c.iteration;
    if (!c.name.empty()) j["tag"] = c.name;
    j["source_topology"] = c.TopologyJson();
    j["output"] = output;
    j["params"] = s.params;
    j["atoms"] = s.atoms;
    j["atom_bytes"] = s.atom_bytes;
    j["bytes_read"] = s.bytes_read;
    j["replicas_verified"] = s.replicas_verified;
    j["seconds"] = s.seconds;
    if (job) {
      // Per process: the datasets it wrote (JobSplit's "files").
      json::Value processes = json::Value::Array();
      const json::Value reports = JobProcesses();
      for (const json::Value& p : reports.items()) {
        json::Value q = json::Value::Object();
        for (const auto& [k, v] : p.members())
          q[k == "files" ? std::string_view("datasets") : k] = v;
        processes.Append(std::move(q));
      }
      j["processes"] = std::move(processes);
    }
    PrintJson(j);
  } else {
    std::printf(
        "read %s\nwrote %s: %lld params, %lld atoms, %s (%lld replicas "
        "verified) in %.1f s\n",
        c.Describe().c_str(), output.c_str(), static_cast<long long>(s.params),
        static_cast<long long>(s.atoms), HumanBytes(s.atom_bytes).c_str(),
        static_cast<long long>(s.replicas_verified), s.seconds);
    if (job) {
      std::printf("written by %d processes\n", job->coordinator().world());
    }
  }
  return 0;
}

namespace {

// The name of the layout a target_layout view gives.
std::string LayoutName(const universal::UniversalInput& input) {
  return input.model().source.layout.value_or("?");
}

// The second half of reshape and convert: the target checkpoint of `input`
// (universal content made from a format named `native`) written into
// `output` and reported.
void WriteAndReport(const char* command, const universal::UniversalInput& input,
                    const std::string& native, const std::string& output,
                    const TargetArgs& target, bool manifest,
                    const RunOptions& run,
                    const reshape::ExecutorOptions& executor,
                    std::chrono::steady_clock::time_point start,
                    json::Value extra) {
  const formats::Driver& driver = TargetDriver(target.format, native);
  const formats::TargetOptions options = target.Options(driver);
  std::unique_ptr<universal::UniversalInput> mapped;
  if (!target.names.empty()) {
    mapped = formats::MapNames(input, target.names, target.model_vars);
    extra["names"] = target.names;
  }
  const universal::UniversalInput& named = mapped ? *mapped : input;
  // A Megatron target of content without a layout: the built-in one its
  // names match (or --layout's), with the model variables it needs.
  std::unique_ptr<universal::UniversalInput> laid;
  if (driver.PlacesByLayout())
    laid = formats::WithTargetLayout(named, target.layout, target.model_vars);
  const universal::UniversalInput& content = laid ? *laid : named;
  JobOutput out(output);
  formats::TargetSummary s;
  ReportingFailures([&] {
    if (out.owner()) {
      universal::CheckFreeSpace(
          output, universal::MinimumTargetBytes(content, options.no_optimizer));
    }
    try {
      s = formats::WriteTarget(driver, content, out.path(), options, executor,
                               manifest);
    } catch (LayoutError& e) {
      if (laid) {
        e.AddContext("layout ", LayoutName(*laid),
                     " from the param names (--model-var NAME=N sets a model "
                     "variable the source does not record)");
      }
      throw;
    }
  });
  if (laid) {
    s.notes.insert(s.notes.begin(),
                   StrCat("laid out by ", LayoutName(*laid),
                          " (the source has no layout; found from its param "
                          "names)"));
  }
  if (mapped) {
    s.notes.insert(s.notes.begin(),
                   StrCat(mapped->params().size(),
                          " params under the names of ", target.names));
  }
  out.Commit();
  if (!PrintsResult()) return;
  const json::Value processes = JobProcesses();
  if (!processes.is_null()) extra["processes"] = processes;
  PrintTargetResult(command, output, driver, target, s, Since(start), run,
                    std::move(extra));
}

}  // namespace

int RunReshape(const std::vector<std::string>& args) {
  po::options_description desc(ReshapeHelp());
  std::string output;
  TargetArgs target;
  RunOptions run;
  desc.add_options()("output,o", po::value<std::string>(&output)->required(),
                     "the checkpoint folder to create");
  target.Add(desc, /*with_vocab=*/true);
  bool manifest = false;
  desc.add_options()("manifest", po::bool_switch(&manifest), kManifestOption);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"universal"}, vm)) return 0;
  target.Read(vm);
  if (!vm.count("universal"))
    throw UsageError("reshape needs a universal file");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  StartJob("reshape", output);
  const auto start = std::chrono::steady_clock::now();
  if (!target.format.empty()) target.Options(TargetDriver(target.format, ""));
  const std::string file = vm["universal"].as<std::string>();
  const atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(file);
  json::Value extra;
  extra["universal"] = file;
  const std::unique_ptr<universal::UniversalInput> input =
      universal::StoreInput(store);
  WriteAndReport("reshape", *input, resume::NativeFormat(input->model()),
                 output, target, manifest, run, executor, start,
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
  target.Add(desc, /*with_vocab=*/false, src.driver_options.Names(), "target-");
  bool manifest = false;
  desc.add_options()("manifest", po::bool_switch(&manifest), kManifestOption);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"source"}, vm)) return 0;
  src.Read(vm);
  target.Read(vm);
  if (!vm.count("source"))
    throw UsageError("convert needs a source checkpoint folder");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  StartJob("convert", output);
  const auto start = std::chrono::steady_clock::now();
  if (!target.format.empty()) target.Options(TargetDriver(target.format, ""));
  target.vocab_size = src.vocab_size;
  target.layout = src.layout;
  std::unique_ptr<formats::Source> source =
      src.Open(vm["source"].as<std::string>());
  const formats::CheckpointInfo& c = source->info();
  // Streaming: every target tensor is composed from boxes of the source rank
  // files; no universal file is written.
  const universal::SourcePlan plan = source->Plan();
  json::Value extra;
  extra["source"] = c.path.string();
  extra["source_format"] = c.format;
  extra["source_topology"] = c.TopologyJson();
  if (!run.json && PrintsResult())
    std::printf("read %s\n", c.Describe().c_str());
  WriteAndReport(
      "convert",
      *universal::PlanInput(plan, c.path, executor, JobReplicaShare()),
      c.format, output, target, manifest, run, executor, start,
      std::move(extra));
  return 0;
}

}  // namespace ucp::cli
