// ucp resume: the elastic-training launcher pre-step. Parses the flags,
// asks the engine (engine/resume/resume.h: Decide, then Run) and prints its
// answer. Nothing here names a framework.

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>

#include "cli/command.h"
#include "cli/dist.h"
#include "cli/options.h"
#include "engine/core/error.h"
#include "engine/json/json.h"
#include "engine/resume/resume.h"

namespace ucp::cli {

namespace {

namespace fs = std::filesystem;

constexpr const char* kResumeHelp =
    "usage: ucp resume SAVE_DIR --dp N [--tp N --pp N --vpp N --ep N --etp "
    "N]\n"
    "                  [--distributed-optimizer | --zero-stage S] [--format "
    "F]\n"
    "                  [--global-batch-size B] [--ignore-data-skip | "
    "--data-skip-steps N]\n"
    "                  [-o OUT] [--json]\n"
    "\n"
    "A launcher pre-step for elastic training. Finds the newest checkpoint in\n"
    "SAVE_DIR (a checkpoint of any readable format, see ucp formats, or a\n"
    "universal file) that is complete and intact, and explains each newer one\n"
    "it skips. Checked: for a checkpoint folder every rank file present and\n"
    "parsing, every tensor covered, replicas identical, the CRC-32 of every\n"
    "torch.save record, and sizes and xxh3 against its ucp.manifest.json if "
    "it\n"
    "has one (ucp manifest); for a universal file the xxh3 of every dataset.\n"
    "\n"
    "If that checkpoint already has the requested layout and the tracker /\n"
    "latest names it, prints SAVE_DIR and changes nothing (for a format that\n"
    "loads at any layout and keeps no tracker, such as PyTorch DCP, it prints\n"
    "the checkpoint folder itself). Otherwise it makes\n"
    "a load folder (default SAVE_DIR/ucp-resume/<name>-tpT-ppP-vppV-dpD...)\n"
    "and prints it: hard links to the checkpoint's files beside a tracker\n"
    "naming it when only the tracker was wrong, else the checkpoint reshaped\n"
    "for the new layout, with a ucp.manifest.json. A load folder already\n"
    "there is verified against its manifest and reused. The source is never\n"
    "modified, and nothing is written into SAVE_DIR but that load folder\n"
    "(under SAVE_DIR/ucp-resume/): a read-only save folder works with -o.\n"
    "Runs at once (not one launcher's job) take turns (an advisory flock on\n"
    "SAVE_DIR itself) and print the same answer; on a filesystem without\n"
    "flock (some NFS or FUSE mounts) they run at once, and the first load\n"
    "folder written is the one all of them verify and print.\n"
    "\n"
    "Under a launcher (torchrun, srun, mpirun; see ucp convert --help) it "
    "runs\n"
    "as one job: rank 0 decides and alone prints; a reshape is written by "
    "every\n"
    "process. UCP_DIST=0: each process runs it whole (taking turns).\n"
    "\n"
    "data_skip_steps = consumed samples / --global-batch-size (floor), 0 with\n"
    "--ignore-data-skip, or --data-skip-steps.\n"
    "\n"
    "examples:\n"
    "  ucp resume /ckpt/gpt --tp 2 --pp 2 --dp 4 --distributed-optimizer\n"
    "  ucp resume /ckpt/ds --dp 3 --zero-stage 2 --global-batch-size 96 "
    "--json\n"
    "\n"
    "options";

// The flags of `ucp resume` beyond the target's and the run's.
struct ResumeArgs {
  std::string output;
  int64_t global_batch = 0, skip_steps = -1;
  bool ignore_skip = false;
  TargetArgs target;
  RunOptions run;
};

void AddResumeOptions(po::options_description& desc, ResumeArgs& a) {
  desc.add_options()("output,o", po::value<std::string>(&a.output),
                     "the load folder to create (default: "
                     "SAVE_DIR/ucp-resume/<name>-<layout>)")(
      "global-batch-size", po::value<int64_t>(&a.global_batch),
      "the new run's global batch size (for data_skip_steps)")(
      "ignore-data-skip", po::bool_switch(&a.ignore_skip),
      "data_skip_steps = 0")("data-skip-steps",
                             po::value<int64_t>(&a.skip_steps),
                             "data_skip_steps as given");
  // Source options select checkpoints here: every target option is its own.
  a.target.Add(desc, /*with_vocab=*/false);
  AddRunOptions(desc, a.run);
}

// The engine's request from the parsed flags (checked here first, so that
// errors name the flags); its target callback refers to `a`, which must
// outlive it. Throws UsageError.
resume::ResumeRequest MakeRequest(const po::variables_map& vm,
                                  const ResumeArgs& a) {
  if (!vm.count("save_dir")) throw UsageError("resume needs a SAVE_DIR");
  if (vm.count("global-batch-size") && a.global_batch < 1)
    throw UsageError("--global-batch-size must be >= 1");
  if (a.ignore_skip && a.skip_steps >= 0)
    throw UsageError(
        "--ignore-data-skip and --data-skip-steps exclude each other");
  if (vm.count("data-skip-steps") && a.skip_steps < 0)
    throw UsageError("--data-skip-steps must be >= 0");
  resume::ResumeRequest r;
  r.executor = a.run.Executor();  // checks first
  SetProgressMode(a.run.quiet, a.run.progress);
  if (!a.target.format.empty())
    a.target.Options(TargetDriver(a.target.format, ""));
  r.save_dir = vm["save_dir"].as<std::string>();
  r.output = a.output;
  r.names = a.target.names;
  r.model_vars = a.target.model_vars;
  if (a.global_batch > 0) r.data_skip.global_batch_size = a.global_batch;
  if (a.skip_steps >= 0) r.data_skip.steps = a.skip_steps;
  r.data_skip.ignore = a.ignore_skip;
  const TargetArgs* target = &a.target;
  r.target = [target](const std::string& source_format) {
    const formats::Driver& d = TargetDriver(target->format, source_format);
    return resume::ResumeTarget{&d, target->Options(d)};
  };
  if (!a.run.json) {
    r.on_skipped = [](const resume::SkippedCheckpoint& s) {
      std::fprintf(stderr, "ucp: skipped %s (iteration %lld): %s\n",
                   OneLine(s.name).c_str(), static_cast<long long>(s.iteration),
                   OneLine(s.reason).c_str());
    };
  }
  r.on_note = [](const std::string& note) {
    std::fprintf(stderr, "ucp: note: %s\n", OneLine(note).c_str());
  };
  return r;
}

void PrintResumeJson(const resume::ResumeDecision& d,
                     const resume::ResumeOutcome& o, const ResumeArgs& a,
                     double seconds) {
  json::Value skipped = json::Value::Array();
  for (const resume::SkippedCheckpoint& s : d.skipped) {
    json::Value j;
    j["name"] = s.name;
    j["iteration"] = s.iteration;
    j["reason"] = s.reason;
    skipped.Append(std::move(j));
  }
  json::Value j;
  j["ok"] = true;
  j["load"] = o.load.string();
  j["checkpoint"] = d.checkpoint;
  j["iteration"] = d.iteration;
  j["format"] = std::string(d.target.driver->Name());
  j["reshaped"] = d.reshaped();
  if (!a.target.names.empty()) j["names"] = a.target.names;
  j["linked_files"] = o.linked_files;
  j["copied_files"] = o.copied_files;
  j["skipped"] = std::move(skipped);
  j["consumed_samples"] = d.consumed_samples;
  if (a.global_batch > 0) j["global_batch_size"] = a.global_batch;
  json::Value skip;  // null when unknown
  if (d.data_skip_steps) skip = *d.data_skip_steps;
  j["data_skip_steps"] = std::move(skip);
  j["seconds"] = seconds;
  const json::Value processes = JobProcesses();
  if (!processes.is_null() && d.reshaped() && !o.reused)
    j["processes"] = processes;
  PrintJson(j);
}

void PrintResumeText(const resume::ResumeDecision& d,
                     const resume::ResumeOutcome& o, const ResumeArgs& a) {
  std::printf("%s\n", o.load.string().c_str());
  std::string how = ", as saved";
  if (d.reshaped()) {
    how = ", reshaped for " + a.target.Describe(*d.target.driver);
    if (!a.target.names.empty()) how += " under the names of " + a.target.names;
  }
  std::fprintf(stderr, "ucp: resume from %s (iteration %lld)%s\n",
               d.checkpoint.c_str(), static_cast<long long>(d.iteration),
               how.c_str());
  if (o.linked_files + o.copied_files > 0) {
    std::fprintf(stderr,
                 "ucp: %s is not the tracked checkpoint: %lld files "
                 "hard-linked%s into the load folder\n",
                 d.checkpoint.c_str(), static_cast<long long>(o.linked_files),
                 o.copied_files ? StrCat(" (", o.copied_files,
                                         " copied: another filesystem)")
                                      .c_str()
                                : "");
  }
  if (d.data_skip_steps) {
    std::fprintf(stderr, "ucp: data_skip_steps %lld\n",
                 static_cast<long long>(*d.data_skip_steps));
  }
}

// rank 0's choice as published: "<checkpoint>\t<action>\t<load folder>".
std::string ChoiceText(const resume::ResumeDecision& d) {
  return StrCat(d.checkpoint, "\t", static_cast<int>(d.action), "\t",
                d.load.string());
}

// A job's process other than rank 0: rank 0 decides; when it reshapes,
// this process decides the same checkpoint (checked alike) and writes its
// share of the load folder into rank 0's staging folder.
void FollowResume(DistJob& job, resume::ResumeRequest request) {
  dist::Coordinator& c = job.coordinator();
  const std::string choice = c.Fetch("choice");
  const std::string staging = c.Fetch("staging");
  if (!staging.empty()) {
    request.only = choice.substr(0, choice.find('\t'));
    request.lock = false;  // rank 0 holds it
    request.on_skipped = {};
    request.on_note = {};
    resume::ResumeDecision d = resume::Decide(request);
    if (ChoiceText(d) != choice) {
      throw UsageError("process ", c.rank(),
                       " chose another resume than rank 0: checkpoint, "
                       "action, load folder '",
                       OneLine(ChoiceText(d)), "' against rank 0's '",
                       OneLine(choice),
                       "' (the same ucp build and the same view of the save "
                       "folder on every process?)");
    }
    resume::WriteShare(d, staging);
  }
  c.Fetch("committed");
}

}  // namespace

int RunResume(const std::vector<std::string>& args) {
  po::options_description desc(kResumeHelp);
  ResumeArgs a;
  AddResumeOptions(desc, a);
  po::variables_map vm;
  if (!Parse(args, desc, {"save_dir"}, vm)) return 0;
  a.target.Read(vm);
  resume::ResumeRequest request = MakeRequest(vm, a);
  const auto start = std::chrono::steady_clock::now();
  // Under a launcher: rank 0 decides and prints; a reshape is written by
  // every process (its files split as convert's).
  DistJob* job = StartJob("resume", request.save_dir.string());
  if (job && !job->leader()) {
    ReportingFailures([&] { FollowResume(*job, std::move(request)); });
    return 0;
  }
  bool reshapes = false;  // set once decided
  bool published = false;
  fs::path staging;  // rank 0's, which an abort removes
  if (job) {
    request.on_staging = [job, &reshapes, &published,
                          &staging](const fs::path& p) {
      if (!reshapes || published) return;
      staging = fs::absolute(p);
      RemoveOnAbort(staging);
      job->coordinator().Publish("staging", staging.string());
      published = true;
    };
  }
  resume::ResumeDecision decision;
  resume::ResumeOutcome outcome;
  ReportingFailures([&] {
    decision = resume::Decide(request);
    reshapes = decision.reshaped();
    if (job) job->coordinator().Publish("choice", ChoiceText(decision));
    outcome = resume::Run(decision);
    if (!staging.empty()) KeepOnAbort(staging);  // committed
    if (job) {
      if (!published) job->coordinator().Publish("staging", "");
      job->coordinator().Publish("committed", "1");
    }
  });
  if (a.run.json) {
    PrintResumeJson(decision, outcome, a, Since(start));
  } else {
    PrintResumeText(decision, outcome, a);
  }
  return 0;
}

}  // namespace ucp::cli
