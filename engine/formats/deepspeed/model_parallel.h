#pragma once
// Merging the per-mp-rank plans of a model-parallel DeepSpeed checkpoint
// (Megatron-DeepSpeed: TP, and PP through a PipelineModule) into one plan of
// whole tensors.
//
// Each mp rank (mp = pp_rank * tp + tp_rank) is planned on its own, as if it
// were a plain DeepSpeed checkpoint: its atoms have the rank's local shapes.
// The merge maps every local fragment through the layout's TP placement
// (layouts::ShardFor) onto the full tensor (vocabulary padding rows onto the
// pad atom). A name held by several pipeline stages (the tied embedding of
// the first and the last stage) is taken from the first stage only, as
// DeepSpeed's ds_to_universal does; every stage's tp ranks must list the
// same names with the same local shapes.

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "engine/universal/source_plan.h"
#include "layouts/layout.h"
#include "layouts/variables.h"

namespace ucp::deepspeed::internal {

struct ModelParallel {
  int64_t tp = 1;
  int64_t pp = 1;
  bool pipeline = false;
  /// Required when tp > 1 (names are matched against its rules); at tp 1 it
  /// strips vocabulary padding rows (optional).
  const layouts::Layout* layout = nullptr;
  /// Resolved model variables (vocab_size, swiglu, ...).
  layouts::Variables vars;
  /// Where vocab_size came from (recorded in the universal file).
  std::string vocab_source;
  /// The model-states file of each mp rank, for messages.
  std::vector<std::filesystem::path> model_files;
  /// Pipeline: the layer index whose file holds each tied module
  /// ("tied_modules.embed" -> 1), kept for writers.
  std::map<std::string, int64_t> tied_layers;
};

/// `ranks[mp]` is the plan of mp rank mp. Throws FormatError naming the rank
/// file and param when tp ranks disagree (names, shapes, dtypes), LayoutError
/// (with the param) when no rule places a name or shapes do not divide.
universal::SourcePlan MergeModelParallel(
    std::vector<universal::SourcePlan> ranks, const ModelParallel& mp);

}  // namespace ucp::deepspeed::internal
