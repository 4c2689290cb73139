#include "engine/formats/emit.h"

#include <map>
#include <memory>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/formats/common/integrity.h"
#include "engine/reshape/plan.h"

namespace ucp::formats {

namespace fs = std::filesystem;

TargetSummary Emit(const TargetPlan& plan,
                   const universal::UniversalInput& input,
                   const fs::path& out_dir, const EmitOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(out_dir, ec)) {
    throw IoError("output folder ", out_dir.string(), " does not exist");
  }
  const size_t batch_limit = std::max<size_t>(1, options.batch_files);
  const fs::path checkpoint =
      (out_dir / plan.checkpoint_dir()).lexically_normal();
  std::vector<fs::path> manifest_files;
  std::map<fs::path, std::vector<ArchiveSpan>> manifest_archives;
  int64_t files = 0;
  uint64_t bytes = 0;
  int64_t first = 1;
  std::vector<std::unique_ptr<PlannedFile>> batch;

  auto flush = [&] {
    if (batch.empty()) return;
    std::vector<reshape::Job> jobs;
    for (auto& f : batch) {
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
    input.Run(jobs, o);
    progress.Finish();
    for (auto& f : batch) {
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
          manifest_files.push_back(full);
          manifest_archives[full] = f->archives();
        }
      }
    }
    first = last + 1;
    batch.clear();
  };

  for (size_t u = 0; u < plan.units(); ++u) {
    for (std::unique_ptr<PlannedFile>& f : plan.Plan(u)) {
      batch.push_back(std::move(f));
      if (batch.size() >= batch_limit) flush();
    }
  }
  flush();
  if (options.manifest) {
    // A torch.save file is one archive at 0: listed only for a run of them.
    WriteManifest(checkpoint, manifest_files, [&](const fs::path& p) {
      auto it = manifest_archives.find(p.lexically_normal());
      return it != manifest_archives.end() && it->second.size() > 1
                 ? it->second
                 : std::vector<ArchiveSpan>();
    });
  }
  TargetSummary summary = plan.Summary();
  summary.files = files;
  summary.bytes = bytes;
  return summary;
}

}  // namespace ucp::formats
