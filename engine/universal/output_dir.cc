#include "engine/universal/output_dir.h"

#include <unistd.h>

#include "engine/core/error.h"

namespace ucp::universal {

namespace fs = std::filesystem;

StagedDirectory::StagedDirectory(fs::path final_dir)
    : final_(std::move(final_dir)) {
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
  staging_ = parent / StrCat(".", final_.filename().string(), ".ucp-partial-",
                             ::getpid());
  fs::remove_all(staging_, ec);
  if (!fs::create_directory(staging_, ec) || ec) {
    throw IoError("cannot create ", staging_.string(), ": ", ec.message());
  }
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

}  // namespace ucp::universal
