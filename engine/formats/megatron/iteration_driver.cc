// The Megatron drivers' base (iteration_driver.h): the iteration option, the
// save folder's iterations, Open.

#include "engine/formats/megatron/iteration_driver.h"

#include <string>
#include <system_error>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/megatron/megatron_format.h"

namespace ucp::megatron {

namespace fs = std::filesystem;

std::vector<formats::OptionSpec> IterationDriver::SourceOptionSpecs() const {
  std::vector<formats::OptionSpec> specs = {
      {.name = kIterationOption,
       .type = formats::OptionSpec::Type::kInt,
       .help = StrCat(HelpPrefix(),
                      ": the iteration to read (default: the tracker's)"),
       .min = 0}};
  for (formats::OptionSpec& s : MoreSourceOptionSpecs())
    specs.push_back(std::move(s));
  return specs;
}

std::vector<formats::SavedCheckpoint> IterationDriver::ListCheckpoints(
    const fs::path& dir) const {
  std::vector<formats::SavedCheckpoint> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    std::string name = it->path().filename().string();
    const std::optional<int64_t> n = ParseIterDirName(name);
    std::error_code e2;
    if (!n || !it->is_directory(e2) || !HoldsIteration(it->path())) continue;
    formats::SavedCheckpoint c;
    c.name = std::move(name);
    c.iteration = *n;
    c.selector.Set(kIterationOption, std::to_string(*n));
    out.push_back(std::move(c));
  }
  return out;
}

std::unique_ptr<formats::Source> IterationDriver::Open(
    const fs::path& path, const formats::SourceOptions& options) const {
  formats::CheckOptions(SourceOptionSpecs(), options.values, Name(), "sources");
  return OpenIteration(path, options.values.Int(kIterationOption), options);
}

void IterationDriver::WriteTracker(const std::filesystem::path& dir,
                                   const formats::CheckpointInfo& c) const {
  WriteFileAtomically(dir / kTrackerFile, c.path.filename() == kReleaseDir
                                              ? std::string(kReleaseDir)
                                              : std::to_string(c.iteration));
}

}  // namespace ucp::megatron
