// The "deepspeed" and "deepspeed-universal" format drivers (deepspeed.h).

#include "engine/formats/driver.h"

#include <string>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/deepspeed/deepspeed.h"

namespace ucp::deepspeed {
namespace {

namespace fs = std::filesystem;

formats::OptionSpec TagSpec(std::string help) {
  formats::OptionSpec o;
  o.name = kTagOption;
  o.type = formats::OptionSpec::Type::kString;
  o.help = StrCat("DeepSpeed: ", help);
  return o;
}

formats::OptionSpec ZeroStageSpec(std::string help) {
  formats::OptionSpec o;
  o.name = kZeroStageOption;
  o.type = formats::OptionSpec::Type::kInt;
  o.help = StrCat("DeepSpeed: ", help);
  o.layout = true;
  o.abbrev.push_back('z');  // (GCC 12 -Wrestrict false positive on = "z")
  o.min = 0;
  o.max = 3;
  return o;
}

class NativeSource : public formats::Source {
 public:
  NativeSource(Checkpoint c, formats::SourceOptions options)
      : c_(std::move(c)), options_(std::move(options)) {
    info_.format = "deepspeed";
    info_.dir = c_.dir;
    info_.path = c_.tag_dir;
    info_.name = c_.tag;
    info_.topology.tp = c_.tp;
    info_.topology.pp = c_.pp;
    info_.topology.dp = c_.dp;
    info_.topology.ep = c_.ep;
    info_.settings["zero_stage"] = c_.stage;
    for (const auto& [key, file] : c_.expert_files) info_.files.push_back(file);
    for (const auto& [rank, file] : c_.expert_optim_files)
      info_.files.push_back(file);
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
    info_.iteration = plan.model.iteration;
    return plan;
  }
  NameListing ListNames() const override {
    return deepspeed::ListNames(c_, options_);
  }
  // DeepSpeed loads native files only at the world size, model parallelism,
  // expert parallelism and ZeRO stage they were saved for.
  bool Fits(const formats::TargetOptions& o) const override {
    const std::optional<int64_t> stage = o.values.Int(kZeroStageOption);
    return c_.tp == o.topology.tp && c_.pp == o.topology.pp &&
           c_.dp == o.topology.dp && c_.ep == o.topology.ep &&
           (!stage || *stage == c_.stage);
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
  std::vector<formats::OptionSpec> SourceOptionSpecs() const override {
    return {TagSpec("the tag to read (default: the one `latest` names)")};
  }
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    return ListTags(dir);
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    formats::CheckOptions(SourceOptionSpecs(), options.values, Name(),
                          "sources");
    return std::make_unique<NativeSource>(
        Discover(path, options.values.String(kTagOption).value_or("")),
        options);
  }
  bool HasTracker() const override { return true; }
  void WriteTracker(const fs::path& dir,
                    const formats::CheckpointInfo& c) const override {
    WriteFileAtomically(dir / kLatestFile, c.name);
  }
  bool CanWrite() const override { return true; }
  formats::TopologyAxes TargetAxes() const override {
    // --ep: a mixture-of-experts model's expert-parallel size.
    return {.tp = true, .pp = true, .vpp = false, .dp = true, .ep = true};
  }
  std::vector<formats::OptionSpec> TargetOptionSpecs() const override {
    formats::OptionSpec fp16;
    fp16.name = kFp16OptimizerOption;
    fp16.type = formats::OptionSpec::Type::kString;
    fp16.help =
        "DeepSpeed: the optimizer of a stage 0 fp16 target: fused "
        "(FP16_Optimizer, DeepSpeed's with FusedAdam) or unfused "
        "(FP16_UnfusedOptimizer: any other optimizer, e.g. on CPU); default: "
        "the source's, else fused";
    return {ZeroStageSpec(
                "the ZeRO stage 0-3 of the target (default: the source's); "
                "at stage 0 the training dtype picks the optimizer: the "
                "torch optimizer (fp32), FP16_Optimizer or "
                "FP16_UnfusedOptimizer (fp16: --fp16-optimizer) in the model "
                "states, BF16_Optimizer files (bf16; FP16_UnfusedOptimizer "
                "for a DeepSpeed >= 0.17.6 source without a pipeline)"),
            std::move(fp16),
            TagSpec("the target's tag (default: the source's, or "
                    "global_step<N>)")};
  }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    return PlanNative(input, options);
  }
};

class UniversalSource : public formats::Source {
 public:
  explicit UniversalSource(Checkpoint f) : f_(std::move(f)) {
    info_.format = "deepspeed-universal";
    info_.dir = f_.dir;
    info_.path = f_.tag_dir;
    info_.name = f_.tag;
    info_.topology.dp = f_.dp;
    info_.settings["zero_stage"] = f_.stage;
    info_.files = f_.model_files;
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override {
    universal::SourcePlan plan = PlanSource(f_);
    info_.iteration = plan.model.iteration;
    return plan;
  }
  // load_universal reads a universal folder at any world size.
  bool Fits(const formats::TargetOptions& o) const override {
    const std::optional<int64_t> stage = o.values.Int(kZeroStageOption);
    return !stage || *stage == f_.stage;
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
  std::vector<formats::OptionSpec> SourceOptionSpecs() const override {
    return {TagSpec(
        "the universal folder to read (default: the one `latest_universal` "
        "names)")};
  }
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    return ListUniversalFolders(dir);
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    formats::CheckOptions(SourceOptionSpecs(), options.values, Name(),
                          "sources");
    return std::make_unique<UniversalSource>(DiscoverUniversal(
        path, options.values.String(kTagOption).value_or("")));
  }
  bool HasTracker() const override { return true; }
  void WriteTracker(const fs::path& dir,
                    const formats::CheckpointInfo& c) const override {
    WriteFileAtomically(dir / kLatestUniversalFile, c.path.filename().string());
  }
  bool CanWrite() const override { return true; }
  // No topology: load_universal reads the folder at any world size.
  std::vector<formats::OptionSpec> TargetOptionSpecs() const override {
    return {ZeroStageSpec("the ZeRO stage the folder records (default: the "
                          "source's)"),
            TagSpec("the folder is named <tag>_universal (default: the "
                    "source's tag, or global_step<N>)")};
  }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    return PlanUniversalFolder(input, options);
  }
};

UCP_REGISTER_DRIVER(DeepSpeedDriver);
UCP_REGISTER_DRIVER(DeepSpeedUniversalDriver);

}  // namespace
}  // namespace ucp::deepspeed
