// ucp resume: the elastic-training launcher pre-step. Finds the newest
// complete and intact checkpoint of a save folder (any registered format, or
// a universal file), explains every newer one it skips, and hands out a load
// folder for the requested layout. Nothing here names a framework.

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>

#include "cli/command.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/integrity.h"
#include "engine/formats/driver.h"
#include "engine/formats/emit.h"
#include "engine/formats/name_map.h"
#include "engine/formats/target_layout.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"

namespace ucp::cli {

namespace {

namespace fs = std::filesystem;

constexpr const char* kResumeHelp =
    "usage: ucp resume SAVE_DIR --dp N [--tp N --pp N --vpp N]\n"
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
    "Ranks that run it at once take turns (an advisory flock on SAVE_DIR\n"
    "itself) and print the same answer; on a filesystem without flock (some\n"
    "NFS or FUSE mounts) they run at once, and the first load folder written\n"
    "is the one all of them verify and print.\n"
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

// A checkpoint folder of a registered format, or a universal file.
struct Candidate {
  const formats::Driver* driver = nullptr;  // nullptr: universal file
  formats::SavedCheckpoint checkpoint;      // name: folder or file name
  fs::path universal;
  // The universal file, opened once to sort by iteration (nullptr if it
  // does not open: Check says why).
  std::shared_ptr<atoms::AtomStoreReader> store;
};

// A candidate that passed its checks.
struct Chosen {
  std::string name;
  int64_t iteration = 0;
  int64_t consumed_samples = -1;
  std::string native;  // the driver the checkpoint is in / was made from
  formats::CheckpointInfo info;  // checkpoint folders only
  std::unique_ptr<formats::Source> source;
  std::optional<universal::SourcePlan> plan;
  std::optional<atoms::AtomStoreReader> store;  // universal files only

  std::unique_ptr<universal::UniversalInput> Input(
      const reshape::ExecutorOptions& executor) const {
    return store ? universal::StoreInput(*store)
                 : universal::PlanInput(*plan, info.path, executor);
  }
};

// Every checkpoint any format lists in `dir` and every universal file in
// it, newest first.
std::vector<Candidate> FindCheckpoints(const fs::path& dir) {
  std::vector<Candidate> out;
  for (const formats::Driver* d : formats::Drivers()) {
    if (!d->CanRead()) continue;
    for (formats::SavedCheckpoint& c : d->ListCheckpoints(dir))
      out.push_back({d, std::move(c), {}});
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec) || !IsHdf5File(e.path())) continue;
    Candidate c;
    c.universal = e.path();
    c.checkpoint.name = e.path().filename().string();
    try {
      c.store = std::make_shared<atoms::AtomStoreReader>(
          atoms::AtomStoreReader::Open(e.path()));
      c.checkpoint.iteration = c.store->root().iteration;
    } catch (const Error&) {
      c.checkpoint.iteration = -1;  // the check says what is wrong
    }
    out.push_back(std::move(c));
  }
  // At one iteration: checkpoints of a format with a topology (the rank
  // files training wrote) before those of a format without one (a universal
  // folder made from them), before universal files.
  auto rank = [](const Candidate& c) {
    if (c.driver == nullptr) return 2;
    return c.driver->CanWrite() && !c.driver->TargetAxes().any() ? 1 : 0;
  };
  std::sort(out.begin(), out.end(),
            [&](const Candidate& a, const Candidate& b) {
              if (a.checkpoint.iteration != b.checkpoint.iteration)
                return a.checkpoint.iteration > b.checkpoint.iteration;
              if (rank(a) != rank(b)) return rank(a) < rank(b);
              return a.checkpoint.name > b.checkpoint.name;
            });
  return out;
}

// Opens and checks `c` completely (see kResumeHelp). Throws what the
// checks throw.
Chosen Check(Candidate& c, const fs::path& save,
             const reshape::ExecutorOptions& executor) {
  Chosen out;
  out.name = c.checkpoint.name;
  if (c.driver == nullptr) {
    // The store FindCheckpoints opened (checked once: taken from `c`).
    atoms::AtomStoreReader store =
        c.store != nullptr ? std::move(*c.store)
                           : atoms::AtomStoreReader::Open(c.universal);
    c.store.reset();
    const std::vector<atoms::HashMismatch> bad = store.Verify();
    if (!bad.empty()) {
      throw FormatError(c.universal.string(), ": ", bad.size(),
                        " dataset(s) fail their xxh3 checksum, first ",
                        bad.front().path);
    }
    out.iteration = store.root().iteration;
    out.consumed_samples = store.root().consumed_samples;
    out.native = NativeFormat(store.root());
    out.store.emplace(std::move(store));
    return out;
  }
  formats::SourceOptions so;
  so.values = c.checkpoint.selector;
  out.source = c.driver->Open(save, so);
  out.plan = out.source->Plan();
  // One read of every byte: the CRC-32 pass skips what the replica check
  // read, or, with a manifest, hashes the replicas as it reads every record.
  const formats::Source* source = out.source.get();
  universal::VerifySource(
      *out.plan, executor,
      formats::IntegrityPassFor(
          source->info().path, source->info().files, nullptr,
          [source](const fs::path& f) { return source->Archives(f); }));
  out.info = out.source->info();
  out.iteration = out.info.iteration;
  out.consumed_samples = out.plan->model.consumed_samples;
  out.native = std::string(c.driver->Name());
  return out;
}

// Whether the save folder's own tracker / `latest` names checkpoint `name`:
// what the driver opens without a selector.
bool Tracked(const formats::Driver& d, const fs::path& save,
             const std::string& name) {
  try {
    return d.Open(save, {})->info().path.filename() == name;
  } catch (const Error&) {
    return false;
  }
}

// Removes an empty folder when it goes out of scope, unless kept.
class RemoveIfEmpty {
 public:
  explicit RemoveIfEmpty(fs::path dir) : dir_(std::move(dir)) {}
  ~RemoveIfEmpty() {
    if (!dir_.empty()) ::rmdir(dir_.c_str());  // fails if not empty: kept
  }
  RemoveIfEmpty(const RemoveIfEmpty&) = delete;
  RemoveIfEmpty& operator=(const RemoveIfEmpty&) = delete;
  void Keep() { dir_.clear(); }

 private:
  fs::path dir_;
};

// Checks that the load folder `out` (made by an earlier run or another
// rank) holds iteration `iteration`, whole and intact against its
// ucp.manifest.json. Throws what the checks throw.
void CheckLoadFolder(const formats::Driver& driver, const fs::path& out,
                     int64_t iteration) {
  const std::unique_ptr<formats::Source> made = driver.Open(out, {});
  made->Plan();
  formats::CheckIntegrity(
      made->info().path, made->info().files, nullptr, {},
      [&made](const fs::path& f) { return made->Archives(f); });
  if (made->info().iteration != iteration) {
    throw FormatError("holds iteration ", made->info().iteration, ", not ",
                      iteration);
  }
}

// Serialises the `ucp resume` runs of one save folder: an exclusive flock on
// the folder itself, opened read-only, so that nothing is created in it and
// a read-only folder (a snapshot, another user's checkpoints) can be locked
// too. Where the filesystem offers no flock (some NFS and FUSE mounts) the
// runs are not serialised: each may write the same load folder, the first
// rename wins and the others verify and take it (ProvideLoadFolder).
class ResumeLock {
 public:
  explicit ResumeLock(const fs::path& dir) {
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ < 0) {
      throw IoError("cannot open the save folder ", dir.string(), ": ",
                    std::strerror(errno));
    }
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      if (errno == ENOLCK || errno == EOPNOTSUPP || errno == EINVAL ||
          errno == EBADF) {
        std::fprintf(stderr,
                     "ucp: note: %s: the filesystem offers no flock (%s): "
                     "ranks running ucp resume at once are not serialised; "
                     "the first load folder written is the one every rank "
                     "takes\n",
                     OneLine(dir.string()).c_str(), std::strerror(errno));
        break;
      }
      throw IoError("cannot lock the save folder ", dir.string(), ": ",
                    std::strerror(errno));
    }
  }
  ~ResumeLock() {
    if (fd_ >= 0) ::close(fd_);  // releases the lock
  }
  ResumeLock(const ResumeLock&) = delete;
  ResumeLock& operator=(const ResumeLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace

int RunResume(const std::vector<std::string>& args) {
  po::options_description desc(kResumeHelp);
  std::string output;
  TargetArgs target;
  RunOptions run;
  int64_t global_batch = 0, skip_steps = -1;
  bool ignore_skip = false;
  desc.add_options()("output,o", po::value<std::string>(&output),
                     "the load folder to create (default: "
                     "SAVE_DIR/ucp-resume/<name>-<layout>)")(
      "global-batch-size", po::value<int64_t>(&global_batch),
      "the new run's global batch size (for data_skip_steps)")(
      "ignore-data-skip", po::bool_switch(&ignore_skip), "data_skip_steps = 0")(
      "data-skip-steps", po::value<int64_t>(&skip_steps),
      "data_skip_steps as given");
  // Source options select checkpoints here: every target option is its own.
  target.Add(desc, /*with_vocab=*/false);
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"save_dir"}, vm)) return 0;
  target.Read(vm);
  if (!vm.count("save_dir")) throw UsageError("resume needs a SAVE_DIR");
  if (vm.count("global-batch-size") && global_batch < 1)
    throw UsageError("--global-batch-size must be >= 1");
  if (ignore_skip && skip_steps >= 0)
    throw UsageError(
        "--ignore-data-skip and --data-skip-steps exclude each other");
  if (vm.count("data-skip-steps") && skip_steps < 0)
    throw UsageError("--data-skip-steps must be >= 0");
  const reshape::ExecutorOptions executor = run.Executor();  // checks first
  SetProgressMode(run.quiet, run.progress);
  if (!target.format.empty()) target.Options(TargetDriver(target.format, ""));
  const fs::path save = vm["save_dir"].as<std::string>();
  std::error_code ec;
  if (!fs::is_directory(save, ec)) {
    throw IoError("save folder ", save.string(),
                  " does not exist or is not a folder");
  }
  const auto start = std::chrono::steady_clock::now();
  ResumeLock lock(save);

  // The newest checkpoint that is whole and intact.
  json::Value skipped = json::Value::Array();
  std::optional<Chosen> chosen;
  std::vector<Candidate> candidates = FindCheckpoints(save);
  for (Candidate& c : candidates) {
    try {
      chosen = Check(c, save, executor);
      break;
    } catch (const Error& e) {
      json::Value j;
      j["name"] = c.checkpoint.name;
      j["iteration"] = c.checkpoint.iteration;
      j["reason"] = std::string(e.what());
      skipped.Append(std::move(j));
      if (!run.json) {
        std::fprintf(stderr, "ucp: skipped %s (iteration %lld): %s\n",
                     OneLine(c.checkpoint.name).c_str(),
                     static_cast<long long>(c.checkpoint.iteration),
                     OneLine(e.what()).c_str());
      }
    }
  }
  if (candidates.empty()) {
    std::string kinds;
    for (const formats::Driver* d : formats::Drivers())
      if (d->CanRead()) kinds += StrCat(kinds.empty() ? "" : ", ", d->Name());
    throw FormatError("no checkpoint in ", save.string(), " (looked for ",
                      kinds, " checkpoints and universal files)");
  }
  if (!chosen) {
    throw FormatError("no complete and intact checkpoint in ", save.string(),
                      " (", candidates.size(), " found, all skipped)");
  }
  const std::string& name = chosen->name;
  const formats::Driver& driver = TargetDriver(target.format, chosen->native);
  const formats::TargetOptions options = target.Options(driver);
  const formats::CheckpointInfo& info = chosen->info;
  const layouts::Topology& want = options.topology;
  // A universal file never fits: the framework cannot load it.
  // Under other names (--names) it is always rewritten.
  const bool fits = chosen->source != nullptr && target.names.empty() &&
                    driver.Name() == chosen->native &&
                    chosen->source->Fits(options);

  fs::path load = save;
  bool reshaped = false;
  int64_t linked = 0, copied = 0;
  if (fits && !driver.HasTracker()) {
    // The framework loads the checkpoint folder itself: nothing to write.
    load = info.path;
  } else if (!fits || !Tracked(driver, save, name)) {
    // Inside the save folder only under ucp-resume/ (ucp's own), else -o.
    const bool inside = output.empty();
    const std::string layout = driver.TargetAxes().any()
                                   ? StrCat("-tp", want.tp, "-pp", want.pp,
                                            "-vpp", want.vpp, "-dp", want.dp)
                                   : std::string();
    const fs::path out =
        inside ? save / "ucp-resume" /
                     StrCat(name, layout,
                            formats::LayoutOptionsSuffix(
                                driver.TargetOptionSpecs(), options.values),
                            driver.Name() != chosen->native
                                ? StrCat("-", std::string(driver.Name()))
                                : "",
                            target.names.empty() ? "" : "-" + target.names)
               : fs::path(output);
    load = out;
    reshaped = !fits;
    // Planned before anything is made, so that a target the model cannot
    // take fails without a trace.
    // Views stack: the source, under --names, with a target layout (each
    // refers to the one before; none touches it when destroyed).
    std::vector<std::unique_ptr<universal::UniversalInput>> views;
    std::unique_ptr<formats::TargetPlan> plan;
    if (!fits) {
      views.push_back(chosen->Input(executor));
      if (!target.names.empty())
        views.push_back(
            formats::MapNames(*views.back(), target.names, target.model_vars));
      if (driver.PlacesByLayout()) {
        if (auto laid =
                formats::WithTargetLayout(*views.back(), "", target.model_vars))
          views.push_back(std::move(laid));
      }
    }
    const universal::UniversalInput* input =
        views.empty() ? nullptr : views.back().get();
    if (!fits) {
      plan = driver.PlanTarget(*input, options);
    }
    // SAVE_DIR/ucp-resume made by this run goes again if the run fails.
    std::optional<RemoveIfEmpty> made_parent;
    for (int attempt = 0;; ++attempt) {
      if (fs::exists(out, ec)) {
        // Made by an earlier run (or another rank): it must be whole and
        // intact (against its ucp.manifest.json) before it is handed out.
        try {
          CheckLoadFolder(driver, out, chosen->iteration);
          break;
        } catch (Error& e) {
          e.AddContext("load folder ", out.string());
          if (!inside) throw;  // -o: not ours to delete
          std::fprintf(stderr, "ucp: note: remaking %s\n",
                       OneLine(e.what()).c_str());
          fs::remove_all(out, ec);
          if (ec) {
            throw IoError("cannot remove the damaged load folder ",
                          out.string(), ": ", ec.message());
          }
        }
      }
      if (inside && !fs::is_directory(out.parent_path(), ec)) {
        fs::create_directory(out.parent_path(), ec);
        if (!ec) made_parent.emplace(out.parent_path());
        if (ec) {
          throw IoError("cannot make the load folder ", out.string(),
                        " inside the save folder (", ec.message(),
                        "): pass -o DIR to write it elsewhere (the save "
                        "folder is only read)");
        }
      }
      try {
        universal::StagedDirectory staged(out);
        if (fits) {
          // The right layout, not the tracked one: hard links and a tracker.
          const LinkCounts n =
              LinkTree(info.path, staged.path() / info.path.filename());
          driver.WriteTracker(staged.path(), info);
          linked = n.linked;
          copied = n.copied;
        } else {
          CheckFreeSpace(out, MinimumTargetBytes(*input, options.no_optimizer));
          formats::EmitOptions emit;
          emit.executor = executor;
          emit.manifest = true;  // checked before a reuse
          formats::Emit(*plan, *input, staged.path(), emit);
        }
        staged.Commit();
        if (made_parent) made_parent->Keep();
        break;
      } catch (const Error&) {
        // Without flock another run may have committed it first: take it.
        if (attempt == 0 && fs::exists(out, ec) && !fs::is_empty(out, ec)) {
          linked = copied = 0;
          continue;
        }
        throw;
      }
    }
  }

  const int64_t consumed = chosen->consumed_samples;
  json::Value skip_json;  // null when unknown
  if (ignore_skip) {
    skip_json = int64_t{0};
  } else if (skip_steps >= 0) {
    skip_json = skip_steps;
  } else if (global_batch > 0 && consumed >= 0) {
    skip_json = consumed / global_batch;
  }
  if (run.json) {
    json::Value j;
    j["ok"] = true;
    j["load"] = load.string();
    j["checkpoint"] = name;
    j["iteration"] = chosen->iteration;
    j["format"] = std::string(driver.Name());
    j["reshaped"] = reshaped;
    if (!target.names.empty()) j["names"] = target.names;
    j["linked_files"] = linked;
    j["copied_files"] = copied;
    j["skipped"] = std::move(skipped);
    j["consumed_samples"] = consumed;
    if (global_batch > 0) j["global_batch_size"] = global_batch;
    j["data_skip_steps"] = std::move(skip_json);
    j["seconds"] = Since(start);
    PrintJson(j);
  } else {
    std::printf("%s\n", load.string().c_str());
    std::fprintf(stderr, "ucp: resume from %s (iteration %lld)%s%s\n",
                 name.c_str(), static_cast<long long>(chosen->iteration),
                 reshaped ? ", reshaped for " : ", as saved",
                 reshaped ? (target.Describe(driver) +
                             (target.names.empty()
                                  ? std::string()
                                  : " under the names of " + target.names))
                                .c_str()
                          : "");
    if (linked + copied > 0) {
      std::fprintf(
          stderr,
          "ucp: %s is not the tracked checkpoint: %lld files "
          "hard-linked%s into the load folder\n",
          name.c_str(), static_cast<long long>(linked),
          copied ? StrCat(" (", copied, " copied: another filesystem)").c_str()
                 : "");
    }
    if (!skip_json.is_null()) {
      std::fprintf(stderr, "ucp: data_skip_steps %lld\n",
                   static_cast<long long>(skip_json.AsInt()));
    }
  }
  return 0;
}

}  // namespace ucp::cli
