// The "megatron" format driver: Megatron-LM legacy (--ckpt-format torch)
// checkpoints, read and written (megatron.h).

#include "engine/formats/driver.h"

#include <string>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/megatron/iteration_driver.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron_legacy/megatron.h"

namespace ucp::megatron {
namespace {

namespace fs = std::filesystem;

class MegatronSource : public formats::Source {
 public:
  MegatronSource(Checkpoint c, const formats::SourceOptions& o)
      : checkpoint_(std::move(c)) {
    options_.layout = o.layout;
    options_.true_vocab_size = o.true_vocab_size;
    info_.format = "megatron";
    info_.dir = checkpoint_.dir;
    info_.path = checkpoint_.iter_dir;
    // Megatron names checkpoints by iteration (CheckpointInfo::Describe).
    info_.iteration = checkpoint_.iteration;
    info_.topology = checkpoint_.topology;
    info_.settings["distributed_optimizer"] = checkpoint_.distributed_optimizer;
    for (const auto& row : checkpoint_.rank_files)
      for (const fs::path& p : row) info_.files.push_back(p);
    for (const auto& row : checkpoint_.distrib_optim_files)
      for (const fs::path& p : row)
        if (!p.empty()) info_.files.push_back(p);
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override {
    return PlanSource(checkpoint_, options_);
  }
  NameListing ListNames() const override {
    megatron::NameListing n = megatron::ListNames(checkpoint_, options_);
    return {std::move(n.names), std::move(n.variables),
            std::move(n.layout_name), std::move(n.layout_yaml)};
  }
  // Megatron loads a legacy checkpoint only at the layout it was saved for;
  // an --rng-state other than keep rewrites the rank files.
  bool Fits(const formats::TargetOptions& o) const override {
    const layouts::Topology& t = checkpoint_.topology;
    return ParseRngStateMode(o.values) == RngStateMode::kKeep &&
           t.tp == o.topology.tp && t.pp == o.topology.pp &&
           t.vpp == o.topology.vpp && t.dp == o.topology.dp &&
           t.ep == o.topology.ep && t.ExpertTp() == o.topology.ExpertTp() &&
           checkpoint_.distributed_optimizer ==
               o.values.Flag(kDistributedOptimizerOption);
  }

 private:
  Checkpoint checkpoint_;
  SourceOptions options_;
  formats::CheckpointInfo info_;
};

bool IsRankDir(const fs::path& p) {
  return ParseRankDirName(p.filename().string()).has_value();
}

bool HoldsRankDir(const fs::path& dir) {
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec))
    if (IsRankDir(it->path())) return true;
  return false;
}

class MegatronDriver : public WritableIterationDriver {
 public:
  std::string_view Name() const override { return "megatron"; }
  std::string_view Summary() const override {
    return "Megatron-LM legacy checkpoints (--ckpt-format torch): "
           "latest_checkpointed_iteration.txt, iter_*/mp_rank_*/"
           "model_optim_rng.pt [+ distrib_optim.pt]";
  }
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    const bool tracker = fs::is_regular_file(path / kTrackerFile, ec);
    // An iter_* / release folder holding mp_rank_* folders, or a tracker
    // beside iter_* / release folders (Megatron-DeepSpeed writes the same
    // tracker beside DeepSpeed's global_step* tag folders: that is not ours).
    for (fs::directory_iterator it(path, ec), end; !ec && it != end;
         it.increment(ec)) {
      const std::string name = it->path().filename().string();
      // An iteration folder holding rank folders (not the DCP files of
      // Megatron's other format, torch_dist).
      if (tracker && (name == "release" || name.starts_with("iter_")) &&
          fs::is_directory(it->path(), ec) && HoldsRankDir(it->path()))
        return formats::Confidence::kYes;
      if (IsRankDir(it->path()) &&
          fs::is_regular_file(it->path() / kModelFile, ec))
        return formats::Confidence::kYes;
    }
    return tracker ? formats::Confidence::kMaybe : formats::Confidence::kNo;
  }
  std::vector<formats::OptionSpec> TargetOptionSpecs() const override {
    formats::OptionSpec d;
    d.name = kDistributedOptimizerOption;
    d.type = formats::OptionSpec::Type::kFlag;
    d.help = "Megatron: write distrib_optim.pt (--use-distributed-optimizer)";
    d.layout = true;
    d.abbrev = "do";
    return {d, RngStateOptionSpec("Megatron")};
  }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    TargetOptions o;
    o.topology = options.topology;
    o.distributed_optimizer = options.values.Flag(kDistributedOptimizerOption);
    o.true_vocab_size = options.true_vocab_size;
    o.no_optimizer = options.no_optimizer;
    o.rng_state = ParseRngStateMode(options.values);
    return megatron::PlanTarget(input, o, {});
  }

 protected:
  std::string_view HelpPrefix() const override { return "Megatron"; }
  // Not the DCP files of Megatron's other format (torch_dist).
  bool HoldsIteration(const fs::path& iter_dir) const override {
    std::error_code ec;
    return !fs::exists(iter_dir / "metadata.json", ec) &&
           !fs::exists(iter_dir / ".metadata", ec);
  }
  std::unique_ptr<formats::Source> OpenIteration(
      const fs::path& path, std::optional<int64_t> iteration,
      const formats::SourceOptions& options) const override {
    return std::make_unique<MegatronSource>(Discover(path, iteration), options);
  }
};

UCP_REGISTER_DRIVER(MegatronDriver);

}  // namespace
}  // namespace ucp::megatron
