// The "megatron-torch-dist" format driver: Megatron-core torch_dist
// checkpoints, read and written (torch_dist.h).

#include "engine/formats/driver.h"

#include <algorithm>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/megatron/iteration_driver.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron_torch_dist/keys.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"

namespace ucp::torch_dist {
namespace {

namespace fs = std::filesystem;

class TorchDistSource : public formats::Source {
 public:
  TorchDistSource(Checkpoint c, const formats::SourceOptions& o)
      : c_(std::move(c)) {
    options_.layout = o.layout;
    options_.true_vocab_size = o.true_vocab_size;
    options_.transformer_impl =
        o.values.String(kTransformerImplOption).value_or("");
    info_.format = "megatron-torch-dist";
    info_.dir = c_.dir;
    info_.path = c_.iter_dir;
    info_.iteration = c_.iteration;
    info_.topology = c_.topology;
    info_.settings["optimizer_sharding"] = c_.optimizer;
    info_.files = c_.files;
    for (const dcp::Entry& e : c_.dcp.metadata.entries) {
      if (e.tensor && e.fqn == "embedding.word_embeddings.weight")
        info_.dtype = std::string(DTypeName(e.dtype));
      experts_ = experts_ || e.fqn.find(kExpertsInfix) != std::string::npos;
    }
    // A mixture-of-experts model: its expert parallel sizes too.
    if (experts_) {
      info_.settings["ep"] = c_.topology.ep;
      info_.settings["etp"] = c_.topology.ExpertTp();
    }
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override {
    return PlanSource(c_, options_);
  }
  // The universal content's names (params, buffers, the experts' and layers'
  // extra states) and the layout the reader chose.
  NameListing ListNames() const override {
    const universal::SourcePlan plan = PlanSource(c_, options_);
    NameListing n;
    for (const atoms::ParamInfo& p : plan.params) n.names.push_back(p.fqn);
    for (const universal::OpaqueBlob& b : plan.opaque)
      if (b.key.starts_with("extra_state/"))
        n.names.push_back(
            b.key.substr(std::string_view("extra_state/").size()));
    for (const universal::ModelVariable& v : plan.model.variables.variables)
      n.variables.Set(v.name, v.value);
    n.layout_name = plan.model.source.layout.value_or("");
    n.layout_yaml = plan.model.layout_yaml;
    return n;
  }
  // Megatron reshards a torch_dist checkpoint at load: model weights always;
  // the distributed optimizer's fully_reshardable state too, dp_reshardable
  // and dp_zero_gather_scatter state only across DP. The optimizer's kind must
  // be the run's.
  //
  // A mixture-of-experts model fits only at its own TP/PP/VPP/DP/EP/ETP: the
  // optimizer's structure changes with EP (a ChainedOptimizer with an expert
  // half only at EP > 1) and the expert half's dp_reshardable buckets with
  // the expert data-parallel size; otherwise ucp writes a load folder.
  bool Fits(const formats::TargetOptions& o) const override {
    const bool distributed = o.values.Flag(kDistributedOptimizerOption);
    if (experts_) {
      const layouts::Topology& t = c_.topology;
      const layouts::Topology& w = o.topology;
      if (t.tp != w.tp || t.pp != w.pp || t.vpp != w.vpp || t.dp != w.dp ||
          t.ep != w.ep || t.ExpertTp() != w.ExpertTp())
        return false;
    }
    if (c_.optimizer == "none") return true;
    if (c_.optimizer == "non_distributed") return !distributed;
    if (!distributed) return false;
    if (c_.optimizer == "fully_reshardable") return true;
    const layouts::Topology& t = c_.topology;
    return (c_.optimizer == "dp_reshardable" ||
            c_.optimizer == "dp_zero_gather_scatter") &&
           t.tp == o.topology.tp && t.pp == o.topology.pp &&
           t.vpp == o.topology.vpp;
  }
  std::vector<formats::ArchiveSpan> Archives(
      const fs::path& file) const override {
    // One archive at the start: the file is that archive.
    std::vector<formats::ArchiveSpan> out = dcp::Archives(c_.dcp, file);
    return out.size() == 1 && out[0].offset == 0 ? decltype(out)() : out;
  }
  json::Value Inventory() const override {
    return dcp::Inventory(c_.dcp, "megatron-torch-dist",
                          "Megatron-core torch_dist");
  }

 private:
  Checkpoint c_;
  SourceOptions options_;
  formats::CheckpointInfo info_;
  bool experts_ = false;  // routed experts (mixture of experts)
};

class TorchDistDriver : public megatron::WritableIterationDriver {
 public:
  std::string_view Name() const override { return "megatron-torch-dist"; }
  std::string_view Summary() const override {
    return "Megatron-core torch_dist checkpoints (--ckpt-format torch_dist): "
           "latest_checkpointed_iteration.txt, iter_*/{metadata.json, "
           ".metadata, __R_I.distcp, common.pt}; written for any TP/PP/VPP/DP";
  }
  // Its iteration folders are DCP checkpoint folders too: ours first.
  std::vector<std::string_view> Refines() const override { return {"dcp"}; }
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    if (IsTorchDistFolder(path)) return formats::Confidence::kYes;
    if (!fs::exists(path / megatron::kTrackerFile, ec))
      return formats::Confidence::kNo;
    for (const formats::SavedCheckpoint& c : ListCheckpoints(path))
      if (IsTorchDistFolder(path / c.name)) return formats::Confidence::kYes;
    // A `release` folder (ucp's import of a transformers folder).
    if (IsTorchDistFolder(path / megatron::kReleaseDir))
      return formats::Confidence::kYes;
    return formats::Confidence::kNo;
  }
  std::vector<formats::OptionSpec> TargetOptionSpecs() const override {
    formats::OptionSpec d;
    d.name = kDistributedOptimizerOption;
    d.type = formats::OptionSpec::Type::kFlag;
    d.help =
        "torch_dist: the run uses --use-distributed-optimizer; its state is "
        "written fully_reshardable (without it: the non-distributed "
        "optimizer's form)";
    d.layout = true;
    d.abbrev = "do";
    formats::OptionSpec sh;
    sh.name = kOptimizerShardingOption;
    sh.type = formats::OptionSpec::Type::kString;
    sh.help =
        "torch_dist: the distributed optimizer's state as fully_reshardable "
        "(default; loads at any TP/PP/DP) or dp_reshardable (Megatron's "
        "default form: the DDP buckets of the target DP)";
    return {d, sh};
  }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    TargetOptions o;
    o.topology = options.topology;
    o.distributed_optimizer = options.values.Flag(kDistributedOptimizerOption);
    o.optimizer_sharding = options.values.String(kOptimizerShardingOption);
    o.no_optimizer = options.no_optimizer;
    o.true_vocab_size = options.true_vocab_size;
    return torch_dist::PlanTarget(input, o);
  }

 protected:
  std::string_view HelpPrefix() const override { return "torch_dist"; }
  std::vector<formats::OptionSpec> MoreSourceOptionSpecs() const override {
    return {{.name = kTransformerImplOption,
             .type = formats::OptionSpec::Type::kString,
             .help = "torch_dist: the layer spec the run used, local or "
                     "transformer_engine (default: args.transformer_impl, "
                     "else transformer_engine); local names the norms "
                     "input_layernorm / pre_mlp_layernorm"}};
  }
  bool HoldsIteration(const fs::path& iter_dir) const override {
    return HoldsTorchDistFiles(iter_dir);
  }
  std::unique_ptr<formats::Source> OpenIteration(
      const fs::path& path, std::optional<int64_t> iteration,
      const formats::SourceOptions& options) const override {
    return std::make_unique<TorchDistSource>(Discover(path, iteration),
                                             options);
  }
};

UCP_REGISTER_DRIVER(TorchDistDriver);

}  // namespace
}  // namespace ucp::torch_dist
