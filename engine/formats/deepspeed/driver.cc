// The "deepspeed" and "deepspeed-universal" format drivers (deepspeed.h).

#include "engine/formats/driver.h"

#include <string>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/deepspeed/deepspeed.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;

class NativeSource : public formats::Source {
 public:
  NativeSource(Checkpoint c, formats::SourceOptions options)
      : c_(std::move(c)), options_(std::move(options)) {
    info_.format = "deepspeed";
    info_.dir = c_.dir;
    info_.path = c_.tag_dir;
    info_.tag = c_.tag;
    info_.topology.tp = c_.tp;
    info_.topology.pp = c_.pp;
    info_.topology.dp = c_.dp;
    info_.zero_stage = c_.stage;
    for (const Checkpoint::MpRank& r : c_.mp_ranks) {
      info_.files.insert(info_.files.end(), r.model_files.begin(),
                         r.model_files.end());
      info_.files.insert(info_.files.end(), r.optim_files.begin(),
                         r.optim_files.end());
    }
    for (const auto& per_tp : c_.layer_files)
      for (const auto& [idx, file] : per_tp) info_.files.push_back(file);
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override {
    universal::SourcePlan plan = PlanSource(c_, options_);
    info_.iteration = plan.root.iteration;
    return plan;
  }
  NameListing ListNames() const override {
    return deepspeed::ListNames(c_, options_);
  }

 private:
  Checkpoint c_;
  formats::SourceOptions options_;
  mutable formats::CheckpointInfo info_;
};

class DeepSpeedDriver : public formats::Driver {
 public:
  std::string_view Name() const override { return "deepspeed"; }
  std::string_view Summary() const override {
    return "DeepSpeed native checkpoints, ZeRO 0-3, fp32/bf16/fp16: latest, "
           "<tag>/mp_rank_XX_model_states.pt, "
           "[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt; "
           "Megatron-DeepSpeed "
           "TP/PP (layer_LL-model_TT-model_states.pt) read and written";
  }
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    if (fs::is_regular_file(path / kLatestFile, ec))
      return formats::Confidence::kYes;
    if (HoldsModelStates(path) && !fs::is_directory(path / "zero", ec))
      return formats::Confidence::kYes;
    // A save folder without `latest` (a crash before it was written): tag
    // folders inside.
    for (fs::directory_iterator it(path, ec), end; !ec && it != end;
         it.increment(ec)) {
      if (HoldsModelStates(it->path()) &&
          !fs::is_directory(it->path() / "zero", ec))
        return formats::Confidence::kMaybe;
    }
    return formats::Confidence::kNo;
  }
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    return ListTags(dir);
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    if (options.selector.iteration) {
      throw UsageError(
          "DeepSpeed checkpoints are chosen with --tag, not "
          "--iteration");
    }
    return std::make_unique<NativeSource>(Discover(path, options.selector.tag),
                                          options);
  }
  void WriteTracker(const fs::path& dir,
                    const formats::CheckpointInfo& c) const override {
    WriteFileAtomically(dir / kLatestFile, c.tag);
  }
  bool CanWrite() const override { return true; }
  formats::TargetSummary Write(
      const universal::UniversalInput& input, const fs::path& out_dir,
      const formats::TargetOptions& options,
      const reshape::ExecutorOptions& executor) const override {
    return WriteNative(input, out_dir, options, executor);
  }
};

class UniversalSource : public formats::Source {
 public:
  explicit UniversalSource(Checkpoint f) : f_(std::move(f)) {
    info_.format = "deepspeed-universal";
    info_.dir = f_.dir;
    info_.path = f_.tag_dir;
    info_.tag = f_.tag;
    info_.topology.dp = f_.dp;
    info_.zero_stage = f_.stage;
    info_.files = f_.model_files;
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override {
    universal::SourcePlan plan = PlanSource(f_);
    info_.iteration = plan.root.iteration;
    return plan;
  }

 private:
  Checkpoint f_;
  mutable formats::CheckpointInfo info_;
};

class DeepSpeedUniversalDriver : public formats::Driver {
 public:
  std::string_view Name() const override { return "deepspeed-universal"; }
  std::string_view Summary() const override {
    return "DeepSpeed universal checkpoint folders (ds_to_universal, "
           "load_universal): latest_universal, <tag>_universal/zero/<param>/"
           "{fp32,exp_avg,exp_avg_sq,step}.pt";
  }
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    if (fs::is_directory(path / "zero", ec) && HoldsModelStates(path))
      return formats::Confidence::kYes;
    if (fs::is_regular_file(path / kLatestUniversalFile, ec)) {
      return fs::is_regular_file(path / kLatestFile, ec)
                 ? formats::Confidence::kMaybe
                 : formats::Confidence::kYes;
    }
    return formats::Confidence::kNo;
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    if (options.selector.iteration) {
      throw UsageError(
          "DeepSpeed checkpoints are chosen with --tag, not "
          "--iteration");
    }
    return std::make_unique<UniversalSource>(
        DiscoverUniversal(path, options.selector.tag));
  }
  bool CanWrite() const override { return true; }
  formats::TargetSummary Write(
      const universal::UniversalInput& input, const fs::path& out_dir,
      const formats::TargetOptions& options,
      const reshape::ExecutorOptions& executor) const override {
    return WriteUniversalFolder(input, out_dir, options, executor);
  }
};

UCP_REGISTER_DRIVER(DeepSpeedDriver);
UCP_REGISTER_DRIVER(DeepSpeedUniversalDriver);

}  // namespace
}  // namespace ucp::deepspeed
