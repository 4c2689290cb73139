// The "megatron-fsdp" format driver: Megatron-FSDP's fsdp_dtensor
// checkpoints, read (megatron_fsdp.h).

#include "engine/formats/driver.h"

#include "engine/core/error.h"
#include "engine/formats/megatron/iteration_driver.h"
#include "engine/formats/megatron_fsdp/megatron_fsdp.h"

namespace ucp::megatron_fsdp {
namespace {

namespace fs = std::filesystem;

class FsdpSource : public formats::Source {
 public:
  FsdpSource(Checkpoint c, formats::SourceOptions o)
      : c_(std::move(c)), o_(std::move(o)) {
    info_.format = "megatron-fsdp";
    info_.dir = c_.dir;
    info_.path = c_.iter_dir;
    info_.iteration = c_.iteration;
    info_.topology = c_.topology;
    info_.settings["optimizer_sharding"] = "fsdp_dtensor";
    info_.files = c_.dcp.files;
    for (const dcp::Entry& e : c_.dcp.metadata.entries) {
      if (e.tensor && e.fqn.starts_with("model.")) {
        info_.dtype = std::string(DTypeName(e.dtype));
        break;
      }
    }
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override { return PlanSource(c_, o_); }
  // Megatron-FSDP loads fsdp_dtensor at any layout (DCP reshards it).
  bool Fits(const formats::TargetOptions&) const override { return true; }
  std::vector<formats::ArchiveSpan> Archives(
      const fs::path& file) const override {
    return dcp::Archives(c_.dcp, file);
  }
  json::Value Inventory() const override {
    return dcp::Inventory(c_.dcp, "megatron-fsdp",
                          "Megatron-FSDP fsdp_dtensor");
  }

 private:
  Checkpoint c_;
  formats::SourceOptions o_;
  formats::CheckpointInfo info_;
};

class FsdpDriver : public megatron::IterationDriver {
 public:
  std::string_view Name() const override { return "megatron-fsdp"; }
  std::string_view Summary() const override {
    return "Megatron-FSDP (--use-megatron-fsdp --ckpt-format fsdp_dtensor): "
           "iter_N/ DCP folders of module-path keys, fp32 main weights and "
           "Adam state; read only (write megatron-torch-dist, megatron, dcp, "
           "...)";
  }
  // Its iteration folders are DCP checkpoint folders too: ours first.
  std::vector<std::string_view> Refines() const override { return {"dcp"}; }
  formats::Confidence Probe(const fs::path& path) const override {
    return IsFsdpFolder(path) ? formats::Confidence::kYes
                              : formats::Confidence::kNo;
  }

 protected:
  std::string_view HelpPrefix() const override { return "Megatron-FSDP"; }
  bool HoldsIteration(const fs::path& iter_dir) const override {
    return HoldsFsdpFiles(iter_dir);
  }
  std::unique_ptr<formats::Source> OpenIteration(
      const fs::path& path, std::optional<int64_t> iteration,
      const formats::SourceOptions& options) const override {
    return std::make_unique<FsdpSource>(Discover(path, iteration), options);
  }
};

UCP_REGISTER_DRIVER(FsdpDriver);

}  // namespace
}  // namespace ucp::megatron_fsdp
