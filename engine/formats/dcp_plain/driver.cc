// The "dcp" format driver: PyTorch Distributed Checkpoint folders, read
// (../dcp/dcp.h) and written (dcp_plain.h).

#include "engine/formats/driver.h"

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/dcp_plain/dcp_plain.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;

class DcpSource : public formats::Source {
 public:
  explicit DcpSource(Checkpoint c) : c_(std::move(c)) {
    info_.format = "dcp";
    info_.dir = c_.dir;
    info_.path = c_.path;
    info_.iteration = c_.iteration;
    info_.topology.dp = c_.world;
    if (c_.rank_local) info_.settings["rank_local_metadata"] = true;
    info_.files = c_.files;
    for (const Entry& e : c_.metadata.entries) {
      if (e.tensor && e.fqn.starts_with("model.")) {
        info_.dtype = std::string(DTypeName(e.dtype));
        break;
      }
    }
  }
  const formats::CheckpointInfo& info() const noexcept override {
    return info_;
  }
  universal::SourcePlan Plan() const override { return PlanSource(c_); }
  // dcp.load reads a checkpoint at any world size.
  bool Fits(const formats::TargetOptions&) const override { return true; }
  std::vector<formats::ArchiveSpan> Archives(
      const fs::path& file) const override {
    return dcp::Archives(c_, file);
  }
  json::Value Inventory() const override { return dcp::Inventory(c_); }

 private:
  Checkpoint c_;
  formats::CheckpointInfo info_;
};

class DcpDriver : public formats::Driver {
 public:
  std::string_view Name() const override { return "dcp"; }
  std::string_view Summary() const override {
    return "PyTorch Distributed Checkpoint (torch.distributed.checkpoint: "
           "FSDP2, DTensor, torchtitan): .metadata + __R_I.distcp, any "
           "layout; written chunked over --dp ranks, loads at any world size";
  }
  // A DCP checkpoint folder, or a save folder holding some. Formats whose
  // folders are DCP folders too (Driver::Refines) take theirs first.
  formats::Confidence Probe(const fs::path& path) const override {
    std::error_code ec;
    if (!fs::is_directory(path, ec)) return formats::Confidence::kNo;
    if (IsCheckpointFolder(path) || !dcp::ListCheckpoints(path).empty())
      return formats::Confidence::kYes;
    return formats::Confidence::kNo;
  }
  std::vector<formats::OptionSpec> SourceOptionSpecs() const override {
    formats::OptionSpec o;
    o.name = kCheckpointOption;
    o.type = formats::OptionSpec::Type::kString;
    o.help =
        "DCP: the checkpoint folder of a save folder to read (default: the "
        "newest complete one)";
    return {o};
  }
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const fs::path& dir) const override {
    return dcp::ListCheckpoints(dir);
  }
  std::unique_ptr<formats::Source> Open(
      const fs::path& path,
      const formats::SourceOptions& options) const override {
    formats::CheckOptions(SourceOptionSpecs(), options.values, Name(),
                          "sources");
    return std::make_unique<DcpSource>(
        Discover(path, options.values.String(kCheckpointOption).value_or("")));
  }
  bool CanWrite() const override { return true; }
  // --ep: torchtitan's stacked experts sharded over an ep mesh (writer.cc).
  formats::TopologyAxes TargetAxes() const override {
    return {.dp = true, .ep = true};
  }
  std::unique_ptr<formats::TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const formats::TargetOptions& options) const override {
    return dcp::PlanTarget(input, options);
  }
};

UCP_REGISTER_DRIVER(DcpDriver);

}  // namespace
}  // namespace ucp::dcp
