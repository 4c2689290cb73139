#pragma once
// The "dcp" driver: plain PyTorch DCP checkpoints (FSDP2, DTensor,
// torchtitan: torch's own state-dict keys, ../dcp/dcp.h), read through the
// family's reader and written by writer.cc.

#include <memory>

#include "engine/formats/driver.h"
#include "engine/formats/target_plan.h"
#include "engine/universal/input.h"

namespace ucp::dcp {

/// The target: N files __R_0.distcp, every tensor chunked along dim 0 over
/// N ranks as FSDP2 / DTensor Shard(0) chunks it (torch.chunk sizes; 0-d
/// tensors whole, on the rank torch's save-plan dedup gives them), BYTE_IO
/// items for the rest, and .metadata last. From DCP content the source's
/// keys, BYTE_IO items and planner_data come back; from other formats
/// model.<param>, optimizer.state.<param>.<kind> and the param groups.
/// torchtitan's stacked experts (../dcp/experts.h), held one param per
/// expert, are restacked; at --ep N (options.topology.ep) placed Shard(0)
/// over N ep ranks with FSDP's shard on top, as torchtitan does.
/// Throws FormatError if the universal content lacks a param's weights (an
/// expert's too), UsageError if --ep N is given for a model without stacked
/// experts or does not divide their count.
std::unique_ptr<formats::TargetPlan> PlanTarget(
    const universal::UniversalInput& input,
    const formats::TargetOptions& options);

}  // namespace ucp::dcp
