// ucp verify: checks a universal file or a Megatron-LM checkpoint folder.

#include <cstdio>
#include <filesystem>

#include "cli/command.h"
#include "cli/dist.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/atoms/signature.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/dist/assign.h"
#include "engine/formats/common/integrity.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "engine/universal/model.h"
#include "engine/universal/write_universal.h"
#include "layouts/layout.h"

namespace ucp::cli {
namespace {

namespace fs = std::filesystem;

constexpr const char* kVerifyHelp =
    "usage: ucp verify PATH [options]\n"
    "\n"
    "Checks without writing anything.\n"
    "  A universal file: its structure, the xxh3 checksum of every dataset, "
    "and\n"
    "  that every parameter still matches the stored layout descriptor.\n"
    "  A checkpoint folder (any readable format): every rank file present and "
    "parsing, "
    "every\n"
    "  parameter matched by exactly one layout rule, every tensor fully "
    "covered by\n"
    "  the rank files, and replicated tensors (TP-replicated norms, tied\n"
    "  embedding copies) identical bit for bit, and the CRC-32 of every\n"
    "  torch.save record (a byte flipped inside a tensor is caught), and,\n"
    "  when the checkpoint folder holds ucp.manifest.json (ucp manifest),\n"
    "  each file's size and each record's xxh3 against it. Each byte is\n"
    "  read once: without a manifest the CRC-32 pass skips the replicated\n"
    "  regions the replica check read; with one, the replicas are hashed as\n"
    "  the records are read whole for their xxh3.\n"
    "Exit code 0 if everything holds, 3 (format), 4 (layout) or 5 (i/o)\n"
    "otherwise, with the first problem on stderr.\n"
    "\n"
    "examples:\n"
    "  ucp verify gpt.ucp.h5\n"
    "  ucp verify /ckpt/gpt --json\n"
    "\n"
    "options";

struct Report {
  json::Value checks = json::Value::Array();
  void Add(const std::string& name, const std::string& detail) {
    json::Value c;
    c["check"] = name;
    c["ok"] = true;
    c["detail"] = detail;
    checks.Append(std::move(c));
  }
};

void VerifyUniversal(const fs::path& path, Report& report) {
  atoms::AtomStoreReader store = atoms::AtomStoreReader::Open(path);
  report.Add("structure",
             StrCat(store.params().size(), " params, ", store.datasets().size(),
                    " datasets, schema v", store.root().version));
  uint64_t total = 0;
  for (const auto& d : store.datasets()) total += d.nbytes;
  Progress progress("verify", total);
  std::vector<atoms::HashMismatch> bad =
      store.Verify([&](uint64_t n) { progress.Add(n); });
  progress.Finish();
  if (!bad.empty()) {
    throw FormatError(path.string(), ": ", bad.size(),
                      " dataset(s) fail their xxh3 checksum, first ",
                      bad.front().path);
  }
  report.Add("checksums", StrCat("xxh3 of ", store.datasets().size(),
                                 " datasets (", HumanBytes(total), ") match"));
  const universal::Model model = universal::ModelFromRoot(store.root(), path);
  if (!model.layout_yaml.empty()) {
    layouts::Layout layout =
        layouts::Layout::ParseStored(model.layout_yaml, path);
    layouts::Variables vars;
    for (const universal::ModelVariable& v : model.variables.variables)
      vars.Set(v.name, v.value);
    for (const atoms::StoredParam& p : store.params()) {
      const layouts::Rule& rule = layout.Match(p.info.fqn, vars);
      if (rule.name != p.info.rule) {
        throw LayoutError(path.string(), ": param ", p.info.fqn,
                          " is stored with rule '", p.info.rule,
                          "' but the layout now matches ", rule.Describe());
      }
    }
    report.Add("layout",
               StrCat("every param matches layout '", layout.name(), "'"));
  }
}

// Returns the format name.
std::string VerifyCheckpoint(const fs::path& path, const SourceArgs& src,
                             const reshape::ExecutorOptions& executor,
                             Report& report) {
  std::unique_ptr<formats::Source> source = src.Open(path);
  const formats::CheckpointInfo& c = source->info();
  universal::SourcePlan plan = source->Plan();  // (also fills c.iteration)
  report.Add("completeness",
             StrCat(c.format, " ", c.name.empty() ? "" : c.name + ", ",
                    "iteration ", c.iteration, ": all ", c.files.size(),
                    " rank files of tp ", c.topology.tp, " x pp ",
                    c.topology.pp, " x dp ", c.topology.dp, " present"));
  report.Add("parse", StrCat("every rank file parses; ", plan.params.size(),
                             " params planned"));
  // One read of every byte: the CRC-32 pass skips what the replica check
  // read, or, with a manifest, hashes the replicas as it reads each record
  // whole (and runs before the replicas are compared).
  formats::IntegrityReport integrity;
  const formats::Source* src_ptr = source.get();
  const formats::ArchivesOf archives = [src_ptr](const fs::path& f) {
    return src_ptr->Archives(f);
  };
  universal::VerifySummary v;
  if (DistJob* job = CurrentJob()) {
    // A job: each process checks the CRC-32s (and manifest) of its share of
    // the files, balanced by size; rank 0 also the coverage and replicas.
    std::vector<dist::FileLoad> loads;
    std::error_code ec;
    for (const fs::path& f : c.files)
      loads.push_back({static_cast<uint64_t>(fs::file_size(f, ec)), true});
    const std::vector<int> owner =
        dist::AssignFiles(loads, job->coordinator().world());
    std::vector<fs::path> mine;
    for (size_t i = 0; i < c.files.size(); ++i)
      if (owner[i] == job->coordinator().rank()) mine.push_back(c.files[i]);
    if (job->leader()) v = universal::VerifySource(plan, executor);
    const formats::IntegrityReport part =
        formats::CheckIntegrity(c.path, mine, nullptr, {}, archives);
    json::Value counts;
    counts["files"] = part.files;
    counts["zips"] = part.zips;
    counts["records"] = part.records;
    integrity.manifest = part.manifest;
    for (const std::string& text :
         job->coordinator().Gather("integrity", counts.Dump())) {
      const json::Value r = json::Value::Parse(text);
      integrity.files += r.At("files").AsInt();
      integrity.zips += r.At("zips").AsInt();
      integrity.records += r.At("records").AsInt();
    }
  } else {
    v = universal::VerifySource(
        plan, executor,
        formats::IntegrityPassFor(c.path, c.files, &integrity, archives));
  }
  report.Add("integrity", integrity.Summary());
  report.Add("coverage", StrCat(v.atoms, " atoms (", HumanBytes(v.atom_bytes),
                                ") fully covered by the rank files"));
  report.Add("replicas", StrCat(v.replicas_verified,
                                " replicated regions identical bit for bit"));
  return c.format;
}

}  // namespace

int RunVerify(const std::vector<std::string>& args) {
  po::options_description desc(kVerifyHelp);
  SourceArgs src;
  RunOptions run;
  src.Add(desc);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"path"}, vm)) return 0;
  src.Read(vm);
  if (!vm.count("path")) throw UsageError("verify needs a PATH");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  const fs::path path = vm["path"].as<std::string>();
  DistJob* job = StartJob("verify", path.string());
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw IoError("cannot open ", path.string(), ": no such file or directory");
  }
  Report report;
  std::string kind = "universal";
  const bool directory = fs::is_directory(path, ec);
  const bool universal = !directory && atoms::IsHdf5File(path);
  if (universal) {
    // (Under a launcher, rank 0 alone: one HDF5 file.)
    if (!job || job->leader()) VerifyUniversal(path, report);
  } else if (directory) {
    kind = VerifyCheckpoint(path, src, executor, report);
  } else {
    throw FormatError(
        path.string(),
        ": neither a universal (HDF5) file nor a checkpoint folder");
  }
  // A job's processes other than rank 0 (done with their share) wait for
  // its verdict and print nothing.
  if (job && !job->leader()) {
    job->coordinator().Fetch("verified");
    return 0;
  }
  if (job) job->coordinator().Publish("verified", "1");
  json::Value leftovers = ReportLeftovers(path);
  if (run.json) {
    json::Value j;
    j["path"] = path.string();
    j["kind"] = kind;
    j["ok"] = true;
    j["checks"] = std::move(report.checks);
    j["leftovers"] = std::move(leftovers);
    PrintJson(j);
  } else {
    for (const auto& c : report.checks.items()) {
      std::printf("ok  %-12s %s\n", c.At("check").AsString().c_str(),
                  c.At("detail").AsString().c_str());
    }
    std::printf("%s: verified\n", path.string().c_str());
  }
  return 0;
}

}  // namespace ucp::cli

namespace ucp::cli {
namespace {

constexpr const char* kManifestHelp =
    "usage: ucp manifest CHECKPOINT [options]\n"
    "\n"
    "Writes CHECKPOINT_FOLDER/ucp.manifest.json: the size of every rank file\n"
    "of the checkpoint and the xxh3 of every torch.save record (of the whole\n"
    "file when it is not a zip). Run it right after a framework saved a\n"
    "checkpoint (a post-save hook); `ucp verify` and `ucp resume` then check\n"
    "the files against it, so a truncated, replaced or damaged file is found\n"
    "even where no CRC-32 would catch it. The files must be complete and "
    "parse,\n"
    "and their CRC-32s must hold: a manifest never blesses damaged files.\n"
    "\n"
    "examples:\n"
    "  ucp manifest /ckpt/gpt                       (the tracker's iteration)\n"
    "  ucp manifest /ckpt/gpt --iteration 2000\n"
    "  ucp manifest /ckpt/ds --tag global_step500 --json\n"
    "\n"
    "options";

}  // namespace

int RunManifest(const std::vector<std::string>& args) {
  po::options_description desc(kManifestHelp);
  SourceArgs src;
  RunOptions run;
  src.Add(desc);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"path"}, vm)) return 0;
  src.Read(vm);
  if (!vm.count("path")) throw UsageError("manifest needs a CHECKPOINT folder");
  SetProgressMode(run.quiet, run.progress);
  const fs::path path = vm["path"].as<std::string>();
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("checkpoint folder ", path.string(),
                  " does not exist or is not a folder");
  }
  std::unique_ptr<formats::Source> source = src.Open(path);
  const formats::CheckpointInfo& c = source->info();
  source->Plan();  // every rank file parses
  const formats::IntegrityReport r = formats::WriteManifest(
      c.path, c.files,
      [&source](const fs::path& f) { return source->Archives(f); });
  const fs::path written = c.path / formats::kManifestName;
  if (run.json) {
    json::Value j;
    j["ok"] = true;
    j["manifest"] = written.string();
    j["format"] = c.format;
    j["iteration"] = c.iteration;
    j["files"] = r.files;
    j["records"] = r.records;
    PrintJson(j);
  } else {
    std::printf("%s: %lld files, %lld records\n", written.string().c_str(),
                static_cast<long long>(r.files),
                static_cast<long long>(r.records));
  }
  return 0;
}

}  // namespace ucp::cli
