// The "mindspore" format driver: MindSpore .ckpt files, read (mindspore.h).

#include "engine/formats/driver.h"

#include "engine/core/error.h"
#include "engine/formats/mindspore/mindspore.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

class MindSporeSource : public formats::Source {
 public:
  explicit MindSporeSource(Checkpoint c) : c_(std::move(c)) {
    info_.format = "mindspore";
    info_.dir = c_.dir;
    // The folder holding the file.
    info_.path = c_.path.has_parent_path() ? c_.path.parent_path() : ".";
    info_.iteration = c_.iteration;
    info_.name = c_.path.filename().string();
    info_.files = {c_.path};
    for (const CkptEntry& e : c_.index.entries) {
      if (auto d = DTypeOfTensorType(e.tensor_type)) {
        info_.dtype = std::string(DTypeName(*d));
        break;
      }
    }
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override { return PlanSource(c_); }
  // load_checkpoint takes an unsharded file into a network of any layout.
  bool Fits(const formats::TargetOptions&) const override { return true; }
  // A .ckpt file holds no torch.save archive.
  std::vector<formats::ArchiveSpan> Archives(const fs::path&) const override {
    return {};
  }

 private:
  Checkpoint c_;
  formats::CheckpointInfo info_;
};

class MindSporeDriver : public formats::Driver {
 public:
  std::string_view Name() const override { return "mindspore"; }
  std::string_view Summary() const override {
    return "MindSpore checkpoints (mindspore.save_checkpoint, MindFormers): "
           "a .ckpt file or a folder of them (rank_0/, meta.json), Adam "
           "moments as optimizer state; unsharded, written as one .ckpt "
           "in rank_0/ with meta.json";
  }
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (fs::is_regular_file(path, ec))
      return LooksLikeCkpt(path) ? formats::Confidence::kYes
                                 : formats::Confidence::kNo;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    return ListCheckpoints(path).empty() ? formats::Confidence::kNo
                                         : formats::Confidence::kYes;
  }
  std::vector<formats::OptionSpec> SourceOptionSpecs() const override {
    formats::OptionSpec o;
    o.name = kCheckpointOption;
    o.type = formats::OptionSpec::Type::kString;
    o.help =
        "MindSpore: the .ckpt file of a folder to read (default: the one "
        "meta.json names, else the newest by <epoch>_<step>)";
    return {o};
  }
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    return mindspore::ListCheckpoints(dir);
  }
  bool CanWrite() const override { return true; }
  formats::TopologyAxes TargetAxes() const override { return {}; }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    return mindspore::PlanTarget(input, options);
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    formats::CheckOptions(SourceOptionSpecs(), options.values, Name(),
                          "sources");
    return std::make_unique<MindSporeSource>(
        Discover(path, options.values.String(kCheckpointOption).value_or("")));
  }
};

UCP_REGISTER_DRIVER(MindSporeDriver);

}  // namespace
}  // namespace ucp::mindspore
