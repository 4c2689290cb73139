#include "engine/formats/emit.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/integrity.h"
#include "engine/reshape/plan.h"

namespace ucp::formats {

namespace fs = std::filesystem;

namespace {

EmitSplit* g_split = nullptr;  // ScopedEmitSplit's
// Split emits so far in this process (the same sequence in every process of
// a job): names the manifest part files of each.
std::atomic<int64_t> g_split_emits{0};

// A process's manifest rows of split emit `seq`, in the staging folder.
fs::path ManifestPart(const fs::path& out_dir, int64_t seq, int rank) {
  return out_dir / StrCat(".ucp-manifest-part-", seq, "-", rank, ".json");
}

uint64_t SlotBytes(const PlannedFile& f) {
  uint64_t total = 0;
  for (const reshape::Job& j : f.jobs()) total += reshape::NumBytes(j.tensor);
  return total;
}

// Pass 1 of a split emit: every file of the plan, planned and dropped.
std::vector<EmitSplit::File> PlanLoads(const TargetPlan& plan) {
  std::vector<EmitSplit::File> files;
  for (size_t u = 0; u < plan.units(); ++u) {
    for (const std::unique_ptr<PlannedFile>& f : plan.Plan(u)) {
      files.push_back({f->path(), SlotBytes(*f), !f->jobs().empty()});
    }
  }
  return files;
}

}  // namespace

ScopedEmitSplit::ScopedEmitSplit(EmitSplit* split) noexcept
    : previous_(g_split) {
  g_split = split;
}

ScopedEmitSplit::~ScopedEmitSplit() { g_split = previous_; }

TargetSummary Emit(const TargetPlan& plan,
                   const universal::UniversalInput& input,
                   const fs::path& out_dir, const EmitOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  std::error_code ec;
  if (!fs::is_directory(out_dir, ec)) {
    throw IoError("output folder ", out_dir.string(), " does not exist");
  }
  EmitSplit* const split = options.split ? options.split : g_split;
  const size_t batch_limit = std::max<size_t>(1, options.batch_files);
  const fs::path checkpoint =
      (out_dir / plan.checkpoint_dir()).lexically_normal();
  // The files this process committed under the checkpoint folder, with
  // their plan index (the manifest lists them in plan order).
  std::vector<std::pair<size_t, fs::path>> manifest_files;
  std::map<fs::path, std::vector<ArchiveSpan>> manifest_archives;
  int64_t files = 0;
  uint64_t bytes = 0;
  uint64_t bytes_read = 0;
  int64_t first = 1;
  std::vector<std::pair<size_t, std::unique_ptr<PlannedFile>>> batch;

  auto flush = [&] {
    if (batch.empty()) return;
    std::vector<reshape::Job> jobs;
    for (auto& [index, f] : batch) {
      try {
        f->Open(out_dir);
      } catch (Error& e) {
        e.AddContext("file ", (out_dir / f->path()).string());
        throw;
      }
      for (reshape::Job& j : f->jobs()) {
        j.stream = f.get();
        jobs.push_back(std::move(j));
      }
    }
    uint64_t total = 0;
    for (const reshape::Job& j : jobs) total += reshape::NumBytes(j.tensor);
    const int64_t last = first + static_cast<int64_t>(batch.size()) - 1;
    Progress progress(StrCat(plan.label(), " (files ", first, "-", last, ")"),
                      total);
    reshape::ExecutorOptions o = options.executor;
    o.progress = &progress;
    bytes_read += input.Run(jobs, o).bytes_read;
    progress.Finish();
    for (auto& [index, f] : batch) {
      const fs::path full = (out_dir / f->path()).lexically_normal();
      try {
        f->Commit();
      } catch (Error& e) {
        e.AddContext("file ", full.string());
        throw;
      }
      ++files;
      bytes += fs::file_size(full, ec);
      if (options.manifest) {
        const fs::path rel = full.lexically_relative(checkpoint);
        if (!rel.empty() && *rel.begin() != "..") {
          manifest_files.emplace_back(index, full);
          manifest_archives[full] = f->archives();
        }
      }
    }
    first = last + 1;
    batch.clear();
  };
  // A torch.save file is one archive at 0: listed only for a run of them.
  const ArchivesOf archives_of = [&](const fs::path& p) {
    auto it = manifest_archives.find(p.lexically_normal());
    return it != manifest_archives.end() && it->second.size() > 1
               ? it->second
               : std::vector<ArchiveSpan>();
  };
  // Manifest rows (plan index, path, entry) of manifest_files[from...].
  using Row = std::pair<size_t, std::pair<std::string, json::Value>>;
  auto entries_of = [&](size_t from) {
    std::vector<fs::path> paths;
    for (size_t i = from; i < manifest_files.size(); ++i)
      paths.push_back(manifest_files[i].second);
    std::vector<Row> out;
    if (paths.empty()) return out;
    const json::Value e = ManifestEntries(checkpoint, paths, archives_of);
    UCP_CHECK(e.members().size() == paths.size(), "manifest of ", paths.size(),
              " files lists ", e.members().size());
    for (size_t k = 0; k < paths.size(); ++k)
      out.push_back({manifest_files[from + k].first, e.members()[k]});
    return out;
  };

  if (split == nullptr) {
    size_t index = 0;
    for (size_t u = 0; u < plan.units(); ++u) {
      for (std::unique_ptr<PlannedFile>& f : plan.Plan(u)) {
        batch.emplace_back(index++, std::move(f));
        if (batch.size() >= batch_limit) flush();
      }
    }
    flush();
    if (options.manifest) {
      std::vector<fs::path> paths;
      for (const auto& [i, p] : manifest_files) paths.push_back(p);
      WriteManifest(checkpoint, paths, archives_of);
    }
    TargetSummary summary = plan.Summary();
    summary.files = files;
    summary.bytes = bytes;
    return summary;
  }

  // Pass 2: this process's files with slots, in plan order; rank 0 keeps the
  // files without slots for the end.
  const std::vector<EmitSplit::File> loads = PlanLoads(plan);
  const std::vector<int> owner = split->Assign(loads);
  UCP_CHECK(owner.size() == loads.size(), "an assignment of ", owner.size(),
            " files for ", loads.size());
  std::vector<std::pair<size_t, std::unique_ptr<PlannedFile>>> finals;
  size_t index = 0;
  for (size_t u = 0; u < plan.units(); ++u) {
    for (std::unique_ptr<PlannedFile>& f : plan.Plan(u)) {
      const size_t i = index++;
      UCP_CHECK(i < loads.size() && f->path() == loads[i].path,
                "the plan changed between its passes at ", f->path().string());
      if (!loads[i].slots) {
        if (split->rank() == 0) finals.emplace_back(i, std::move(f));
        continue;
      }
      if (owner[i] != split->rank()) continue;
      batch.emplace_back(i, std::move(f));
      if (batch.size() >= batch_limit) flush();
    }
  }
  flush();
  json::Value report;
  report["files"] = files;
  report["bytes"] = bytes;
  report["bytes_read"] = bytes_read;
  // The manifest entries (one hash per record) go through the shared folder,
  // not the store: each other process writes its rows as a hidden part file
  // that rank 0 merges and deletes; the report carries their count.
  const int64_t seq = g_split_emits++;
  std::vector<Row> own_rows;
  if (options.manifest) {
    own_rows = entries_of(0);
    if (split->rank() != 0) {
      json::Value part = json::Value::Array();
      for (auto& [i, kv] : own_rows) {
        json::Value row = json::Value::Array();
        row.Append(static_cast<int64_t>(i));
        row.Append(kv.first);
        row.Append(std::move(kv.second));
        part.Append(std::move(row));
      }
      WriteFileAtomically(ManifestPart(out_dir, seq, split->rank()),
                          part.Dump());
    }
  }
  report["manifest"] = static_cast<int64_t>(own_rows.size());
  report["seconds"] =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  const std::optional<std::vector<json::Value>> reports =
      split->Finished(std::move(report));
  TargetSummary summary = plan.Summary();
  if (!reports) {
    summary.files = files;
    summary.bytes = bytes;
    return summary;
  }
  // Rank 0: every process finished its files; now the files without slots.
  const size_t own = manifest_files.size();
  for (auto& f : finals) {
    batch.push_back(std::move(f));
    if (batch.size() >= batch_limit) flush();
  }
  flush();
  int64_t total_files = files;
  uint64_t total_bytes = bytes;
  // Every file with slots written once: the processes' files add up.
  int64_t with_slots = 0;
  int64_t reported = 0;
  for (const EmitSplit::File& f : loads) with_slots += f.slots ? 1 : 0;
  for (const json::Value& rep : *reports) reported += rep.At("files").AsInt();
  UCP_CHECK(reported == with_slots, "the processes wrote ", reported,
            " files of ", with_slots, " with tensor data");
  std::vector<Row> rows;
  for (size_t r = 0; r < reports->size(); ++r) {
    const json::Value& rep = (*reports)[r];
    if (r != 0) {
      total_files += rep.At("files").AsInt();
      total_bytes += static_cast<uint64_t>(rep.At("bytes").AsInt());
    }
    if (r == 0 || !options.manifest) continue;
    const fs::path part = ManifestPart(out_dir, seq, static_cast<int>(r));
    const json::Value items =
        json::Value::Parse(ReadSmallFile(part, size_t{1} << 34));
    UCP_CHECK(static_cast<int64_t>(items.items().size()) ==
                  rep.At("manifest").AsInt(),
              part.string(), " lists ", items.items().size(), " entries of ",
              rep.At("manifest").AsInt());
    for (const json::Value& row : items.items()) {
      rows.push_back({static_cast<size_t>(row.items().at(0).AsInt()),
                      {row.items().at(1).AsString(), row.items().at(2)}});
    }
    fs::remove(part, ec);
    if (ec) throw IoError("cannot remove ", part.string(), ": ", ec.message());
  }
  if (options.manifest) {
    for (Row& row : own_rows) rows.push_back(std::move(row));
    for (Row& row : entries_of(own)) rows.push_back(std::move(row));
    std::stable_sort(
        rows.begin(), rows.end(),
        [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<std::pair<std::string, json::Value>> list;
    for (auto& [i, kv] : rows) list.push_back(std::move(kv));
    WriteManifestEntries(checkpoint, json::Value::FromMembers(std::move(list)));
  }
  summary.files = total_files;
  summary.bytes = total_bytes;
  return summary;
}

}  // namespace ucp::formats
