#include "engine/universal/output_dir.h"

#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "engine/core/error.h"
#include "engine/core/staging.h"

namespace ucp::universal {

namespace fs = std::filesystem;

StagedDirectory::StagedDirectory(fs::path final_dir)
    : final_(OutputName(std::move(final_dir))) {
  std::error_code ec;
  if (fs::exists(final_, ec)) {
    if (!fs::is_directory(final_, ec) || !fs::is_empty(final_, ec)) {
      throw UsageError("output ", final_.string(),
                       " already exists and is not an empty folder (ucp never "
                       "overwrites; choose a new -o)");
    }
  }
  fs::path parent = final_.parent_path();
  if (parent.empty()) parent = ".";
  if (!fs::is_directory(parent, ec)) {
    throw IoError("cannot write ", final_.string(), ": folder ",
                  parent.string(), " does not exist");
  }
  // Staging of this name left by runs that no longer exist (kill -9).
  ReclaimLeftovers(final_);
  // A fresh name (mkdtemp): never another run's staging folder; the pid and
  // start time name this process (core/staging.h).
  std::string name =
      (parent / StrCat(".", final_.filename().string(), ".ucp-partial-",
                       StagingToken(), "-XXXXXX"))
          .string();
  if (::mkdtemp(name.data()) == nullptr) {
    throw IoError("cannot create a staging folder next to ", final_.string(),
                  ": ", std::strerror(errno));
  }
  staging_ = name;
  // mkdtemp makes it 0700; the output gets the permissions any new folder
  // gets (0777 less the umask), so that the job's other users can read it.
  const mode_t mask = ::umask(0);
  ::umask(mask);
  ::chmod(staging_.c_str(), 0777 & ~mask);
}

StagedDirectory::~StagedDirectory() {
  if (!committed_) {
    std::error_code ec;
    fs::remove_all(staging_, ec);
  }
}

void StagedDirectory::Commit() {
  std::error_code ec;
  if (fs::exists(final_, ec)) fs::remove(final_, ec);  // an empty folder
  fs::rename(staging_, final_, ec);
  if (ec) {
    throw IoError("cannot rename ", staging_.string(), " to ", final_.string(),
                  ": ", ec.message());
  }
  committed_ = true;
}

void CheckFreeSpace(const std::filesystem::path& output, uint64_t needed) {
  const std::filesystem::path dir = OutputName(output).parent_path();
  std::error_code ec;
  // A missing folder is the writer's error to report ("does not exist").
  if (!std::filesystem::is_directory(dir.empty() ? "." : dir, ec)) return;
  RequireFreeSpace(dir, needed, output.string());
}

}  // namespace ucp::universal
