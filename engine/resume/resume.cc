#include "engine/resume/resume.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/atoms/atom_store.h"
#include "engine/atoms/signature.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/integrity.h"
#include "engine/formats/emit.h"
#include "engine/formats/name_map.h"
#include "engine/formats/options.h"
#include "engine/formats/target_layout.h"
#include "engine/json/json.h"
#include "engine/universal/input.h"
#include "engine/universal/model.h"
#include "engine/universal/output_dir.h"
#include "engine/universal/write_universal.h"

namespace ucp::resume {

namespace fs = std::filesystem;

namespace {

// Serialises the runs on one save folder: an exclusive flock on the folder
// itself, opened read-only, so that nothing is created in it and a
// read-only folder (a snapshot, another user's checkpoints) can be locked
// too. Where the filesystem offers no flock (some NFS and FUSE mounts) the
// runs are not serialised: each may write the same load folder, the first
// rename wins and the others verify and take it (Run).
class SaveFolderLock {
 public:
  SaveFolderLock(const fs::path& dir,
                 const std::function<void(const std::string&)>& on_note) {
    fd_ = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd_ < 0) {
      throw IoError("cannot open the save folder ", dir.string(), ": ",
                    std::strerror(errno));
    }
    while (::flock(fd_, LOCK_EX) != 0) {
      if (errno == EINTR) continue;
      if (errno == ENOLCK || errno == EOPNOTSUPP || errno == EINVAL ||
          errno == EBADF) {
        if (on_note) {
          on_note(StrCat(dir.string(), ": the filesystem offers no flock (",
                         std::strerror(errno),
                         "): ranks running ucp resume at once are not "
                         "serialised; the first load folder written is the "
                         "one every rank takes"));
        }
        break;
      }
      const int err = errno;
      ::close(fd_);
      throw IoError("cannot lock the save folder ", dir.string(), ": ",
                    std::strerror(err));
    }
  }
  ~SaveFolderLock() { ::close(fd_); }  // releases the lock
  SaveFolderLock(const SaveFolderLock&) = delete;
  SaveFolderLock& operator=(const SaveFolderLock&) = delete;

 private:
  int fd_ = -1;
};

// A checkpoint folder of a registered format, or a universal file.
struct Candidate {
  const formats::Driver* driver = nullptr;  // nullptr: universal file
  formats::SavedCheckpoint checkpoint;      // name: folder or file name
  fs::path universal;
  // The universal file, opened once to sort by iteration (nullptr if it
  // does not open: CheckCandidate says why).
  std::shared_ptr<atoms::AtomStoreReader> store;

  CandidateKey Key() const {
    CandidateKind kind = CandidateKind::kUniversalFile;
    if (driver != nullptr) {
      kind = driver->CanWrite() && !driver->TargetAxes().any()
                 ? CandidateKind::kTopologyFree
                 : CandidateKind::kRankFiles;
    }
    return {checkpoint.name, checkpoint.iteration, kind};
  }
};

// Every checkpoint any format lists in `dir` and every universal file in
// it, newest first (NewerFirst).
std::vector<Candidate> FindCheckpoints(const fs::path& dir) {
  std::vector<Candidate> out;
  for (formats::ListedCheckpoint& c : formats::ListSavedCheckpoints(dir))
    out.push_back({c.driver, std::move(c.checkpoint), {}, nullptr});
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file(ec) || !atoms::IsHdf5File(e.path())) continue;
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
  std::sort(out.begin(), out.end(), [](const Candidate& a, const Candidate& b) {
    return NewerFirst(a.Key(), b.Key());
  });
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

}  // namespace

namespace internal {

// The chosen checkpoint, opened and checked, what Run writes from it, and
// the save folder's lock.
struct Chosen {
  std::unique_ptr<SaveFolderLock> lock;
  formats::CheckpointInfo info;  // checkpoint folders only
  std::unique_ptr<formats::Source> source;
  std::optional<universal::SourcePlan> plan;
  std::optional<atoms::AtomStoreReader> store;  // universal files only
  reshape::ExecutorOptions executor;
  // Views stack (kReshape): the source, under --names, with a target layout
  // (each refers to the one before; none touches it when destroyed).
  std::vector<std::unique_ptr<universal::UniversalInput>> views;
  std::unique_ptr<formats::TargetPlan> target_plan;
  std::function<void(const fs::path&)> on_staging;  // the request's

  std::unique_ptr<universal::UniversalInput> Input() const {
    return store ? universal::StoreInput(*store)
                 : universal::PlanInput(*plan, info.path, executor);
  }
};

}  // namespace internal

namespace {

using internal::Chosen;

// Opens and checks `c` completely (see resume.h): on success the opened
// checkpoint goes into `out` and its iteration, consumed samples and format
// into `d`; on failure neither is touched. Throws what the checks throw.
void CheckCandidate(Candidate& c, const fs::path& save, Chosen& out,
                    ResumeDecision& d) {
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
    d.iteration = store.root().iteration;
    d.consumed_samples = store.root().consumed_samples;
    d.source_format = NativeFormat(store.root());
    out.store.emplace(std::move(store));
    return;
  }
  formats::SourceOptions so;
  so.values = c.checkpoint.selector;
  std::unique_ptr<formats::Source> source = c.driver->Open(save, so);
  universal::SourcePlan plan = source->Plan();
  // One read of every byte: the CRC-32 pass skips what the replica check
  // read, or, with a manifest, hashes the replicas as it reads every record.
  const formats::Source* s = source.get();
  universal::VerifySource(
      plan, out.executor,
      formats::IntegrityPassFor(
          s->info().path, s->info().files, nullptr,
          [s](const fs::path& f) { return s->Archives(f); }));
  out.info = source->info();
  d.iteration = out.info.iteration;
  d.consumed_samples = plan.model.consumed_samples;
  d.source_format = std::string(c.driver->Name());
  out.source = std::move(source);
  out.plan.emplace(std::move(plan));
}

// The newest candidate that passes CheckCandidate, into `d`. Throws
// FormatError when there is none.
void ChooseCheckpoint(const ResumeRequest& request, ResumeDecision& d) {
  Chosen& chosen = *d.chosen;
  std::vector<Candidate> candidates = FindCheckpoints(request.save_dir);
  if (!request.only.empty()) {
    // Rank 0's choice: that one alone.
    std::erase_if(candidates, [&](const Candidate& c) {
      return c.Key().name != request.only;
    });
  }
  std::vector<CandidateKey> keys;
  for (const Candidate& c : candidates) keys.push_back(c.Key());
  const Selection selection = SelectNewestIntact(
      keys,
      [&](size_t i) {
        CheckCandidate(candidates[i], request.save_dir, chosen, d);
      },
      request.on_skipped);
  d.skipped = selection.skipped;
  if (candidates.empty()) {
    std::string kinds;
    for (const formats::Driver* x : formats::Drivers())
      if (x->CanRead()) kinds += StrCat(kinds.empty() ? "" : ", ", x->Name());
    throw FormatError("no checkpoint in ", request.save_dir.string(),
                      " (looked for ", kinds,
                      " checkpoints and universal files)");
  }
  if (!selection.chosen) {
    throw FormatError("no complete and intact checkpoint in ",
                      request.save_dir.string(), " (", candidates.size(),
                      " found, all skipped)");
  }
  d.checkpoint = candidates[*selection.chosen].checkpoint.name;
}

// Plans the rewrite of the chosen checkpoint for the target (kReshape):
// nothing is made yet, so that a target the model cannot take fails without
// a trace.
void PlanRewrite(const ResumeRequest& request, ResumeDecision& d) {
  Chosen& c = *d.chosen;
  c.views.push_back(c.Input());
  if (!request.names.empty()) {
    c.views.push_back(
        formats::MapNames(*c.views.back(), request.names, request.model_vars));
  }
  if (d.target.driver->PlacesByLayout()) {
    if (auto laid =
            formats::WithTargetLayout(*c.views.back(), "", request.model_vars))
      c.views.push_back(std::move(laid));
  }
  c.target_plan =
      d.target.driver->PlanTarget(*c.views.back(), d.target.options);
}

// Makes d.load once in a staging folder: hard links and a tracker, or the
// planned rewrite with a manifest. Throws what they throw.
void WriteLoadFolder(const ResumeDecision& d, ResumeOutcome& outcome) {
  const Chosen& c = *d.chosen;
  universal::StagedDirectory staged(d.load);
  if (c.on_staging) c.on_staging(staged.path());
  if (d.action == LoadAction::kLinkTracked) {
    // The right layout, not the tracked one: hard links and a tracker.
    const LinkCounts n =
        LinkTree(c.info.path, staged.path() / c.info.path.filename());
    d.target.driver->WriteTracker(staged.path(), c.info);
    outcome.linked_files = n.linked;
    outcome.copied_files = n.copied;
  } else {
    const universal::UniversalInput& input = *c.views.back();
    universal::CheckFreeSpace(
        d.load,
        universal::MinimumTargetBytes(input, d.target.options.no_optimizer));
    formats::EmitOptions emit;
    emit.executor = c.executor;
    emit.manifest = true;  // checked before a reuse
    formats::Emit(*c.target_plan, input, staged.path(), emit);
  }
  staged.Commit();
}

// A load folder already there (made by an earlier run or another rank):
// true if whole and intact (against its ucp.manifest.json), so that it is
// handed out; false after removing a damaged one of ucp's own. Throws for a
// damaged output folder (not ucp's to delete) or one it cannot remove.
bool TakeExistingLoadFolder(const ResumeDecision& d) {
  try {
    CheckLoadFolder(*d.target.driver, d.load, d.iteration);
    return true;
  } catch (Error& e) {
    e.AddContext("load folder ", d.load.string());
    if (!d.own_load_folder) throw;  // -o: not ours to delete
    if (d.on_note) d.on_note(StrCat("remaking ", e.what()));
    std::error_code ec;
    fs::remove_all(d.load, ec);
    if (ec) {
      throw IoError("cannot remove the damaged load folder ", d.load.string(),
                    ": ", ec.message());
    }
    return false;
  }
}

}  // namespace

ResumeDecision::ResumeDecision() = default;
ResumeDecision::ResumeDecision(ResumeDecision&&) noexcept = default;
ResumeDecision& ResumeDecision::operator=(ResumeDecision&&) noexcept = default;
ResumeDecision::~ResumeDecision() = default;

ResumeDecision Decide(const ResumeRequest& request) {
  UCP_CHECK(request.target != nullptr, "ResumeRequest::target is required");
  CheckDataSkip(request.data_skip);
  if (!request.names.empty()) formats::CheckNameMapName(request.names);
  const fs::path& save = request.save_dir;
  std::error_code ec;
  if (!fs::is_directory(save, ec)) {
    throw IoError("save folder ", save.string(),
                  " does not exist or is not a folder");
  }
  ResumeDecision d;
  d.on_note = request.on_note;
  d.chosen = std::make_unique<Chosen>();
  d.chosen->executor = request.executor;
  if (request.lock)
    d.chosen->lock = std::make_unique<SaveFolderLock>(save, request.on_note);
  d.chosen->on_staging = request.on_staging;
  ChooseCheckpoint(request, d);

  d.target = request.target(d.source_format);
  UCP_CHECK(d.target.driver != nullptr, "no target driver");
  const formats::Driver& driver = *d.target.driver;
  FitFacts facts;
  facts.checkpoint_folder = d.chosen->source != nullptr;
  facts.same_format = driver.Name() == d.source_format;
  facts.renamed = !request.names.empty();
  // Fits is asked only of a checkpoint folder in the target format under
  // its own names.
  facts.layout_fits = facts.checkpoint_folder && facts.same_format &&
                      !facts.renamed &&
                      d.chosen->source->Fits(d.target.options);
  facts.has_tracker = driver.HasTracker();
  // Tracked opens the save folder: asked only when it decides.
  facts.tracked = LoadsAsSaved(facts) && facts.has_tracker &&
                  Tracked(driver, save, d.checkpoint);
  d.action = ChooseAction(facts);
  d.data_skip_steps = DataSkipSteps(request.data_skip, d.consumed_samples);

  switch (d.action) {
    case LoadAction::kSaveDir:
      d.load = save;
      return d;
    case LoadAction::kCheckpointDir:
      // The framework loads the checkpoint folder itself.
      d.load = d.chosen->info.path;
      return d;
    case LoadAction::kLinkTracked:
    case LoadAction::kReshape:
      break;
  }
  // Inside the save folder only under ucp-resume/ (ucp's own), else output.
  d.own_load_folder = request.output.empty();
  if (d.own_load_folder) {
    LoadFolderParts parts;
    parts.checkpoint = d.checkpoint;
    if (driver.TargetAxes().any()) parts.topology = d.target.options.topology;
    parts.options_suffix = formats::LayoutOptionsSuffix(
        driver.TargetOptionSpecs(), d.target.options.values);
    if (driver.Name() != d.source_format)
      parts.other_format = std::string(driver.Name());
    parts.names = request.names;
    d.load = save / "ucp-resume" / LoadFolderName(parts);
  } else {
    d.load = request.output;
  }
  if (d.action == LoadAction::kReshape) PlanRewrite(request, d);
  return d;
}

ResumeOutcome Run(ResumeDecision& d) {
  UCP_CHECK(d.chosen != nullptr, "Run on a decision Decide did not make");
  ResumeOutcome outcome;
  outcome.load = d.load;
  if (!d.writes()) return outcome;
  std::error_code ec;
  // SAVE_DIR/ucp-resume made by this run goes again if the run fails.
  std::optional<RemoveIfEmpty> made_parent;
  const fs::path parent = d.load.parent_path();
  for (int attempt = 0;; ++attempt) {
    if (fs::exists(d.load, ec) && TakeExistingLoadFolder(d)) {
      outcome.reused = true;
      return outcome;
    }
    if (d.own_load_folder && !fs::is_directory(parent, ec)) {
      fs::create_directory(parent, ec);
      if (!ec) made_parent.emplace(parent);
      if (ec) {
        throw IoError("cannot make the load folder ", d.load.string(),
                      " inside the save folder (", ec.message(),
                      "): pass -o DIR to write it elsewhere (the save "
                      "folder is only read)");
      }
    }
    try {
      WriteLoadFolder(d, outcome);
      if (made_parent) made_parent->Keep();
      return outcome;
    } catch (const Error&) {
      // Without flock another run may have committed it first: take it.
      if (attempt == 0 && fs::exists(d.load, ec) && !fs::is_empty(d.load, ec)) {
        outcome.linked_files = outcome.copied_files = 0;
        continue;
      }
      throw;
    }
  }
}

void WriteShare(const ResumeDecision& d, const fs::path& staging) {
  UCP_CHECK(d.chosen != nullptr && d.reshaped() && d.chosen->target_plan,
            "WriteShare of a decision that does not reshape");
  formats::EmitOptions emit;
  emit.executor = d.chosen->executor;
  emit.manifest = true;  // as WriteLoadFolder
  formats::Emit(*d.chosen->target_plan, *d.chosen->views.back(), staging, emit);
}

std::string NativeFormat(const universal::Model& model) {
  const universal::SourceInfo& src = model.source;
  if (src.driver) return *src.driver;
  if (src.framework) {
    for (const formats::Driver* d : formats::Drivers()) {
      if (d->CanWrite() && src.framework->starts_with(d->Name()))
        return std::string(d->Name());
    }
  }
  return "";
}

std::string NativeFormat(const atoms::RootInfo& root) {
  try {
    return NativeFormat(universal::ModelFromRoot(root, ""));
  } catch (const Error&) {
    return "";  // malformed attributes: no native format
  }
}

}  // namespace ucp::resume
