#pragma once
// MindSpore parallel strategy files: how each parameter of a sharded save is
// split over the ranks (mindspore/ccsrc/utils/node_strategy.proto, package
// mindspore.straspb; written by set_auto_parallel_context(
// strategy_ckpt_save_file=...), MindFormers' strategy/ckpt_strategy_rank_R
// .ckpt, merge_pipeline_strategys).
//
// Protobuf (proto2), field numbers:
//   ParallelStrategyMap { uint32 current_stage = 1;
//                         repeated ParallelStrategyItem parallel_strategy_item
//                         = 2; repeated ParallelLayoutItem parallel_layout_item
//                         = 3; }
//   ParallelLayoutItem  { string param_name = 1; ParallelLayouts
//   parallel_layouts = 2; } ParallelLayouts     { repeated DevMatrix dev_matrix
//   = 1;   // [0] used
//                         repeated TensorMap tensor_map = 2;
//                         repeated ParamSplitShape param_split_shape = 3;
//                         repeated IndicesOffset indices_offset = 4;
//                         int32 field = 5; int32 opt_weight_shard_step = 6;
//                         int32 opt_weight_shard_size = 7; }
//   DevMatrix { repeated uint32 dim = 1; }  TensorMap { repeated int32 dim = 1;
//   } ParamSplitShape, IndicesOffset { repeated int64 dim = 1; }
// (repeated scalars unpacked, packed also read; a negative int32 is a
// 10-byte sign-extended varint). The JSON variant (a .json file) holds
// {"parallel_layout_item": {name: {dev_matrix, tensor_map, field,
// opt_weight_shard_step, opt_weight_shard_size, param_split_shape}}}.
//
// Semantics (mindspore/parallel/_tensor.py):
// - dev_matrix: the devices of one pipeline stage as a row-major array; a
//   rank's coordinate is its index in the stage in row-major order.
// - tensor_map: one TensorMap [m0, m1, ...] (one entry per tensor dim: the
//   device axis counted from the right, -1 = not split), or the "extend"
//   form, one TensorMap per tensor dim listing several axes (major first;
//   a 1-D tensor gets an extra empty TensorMap, so two TensorMaps or more
//   mean the extend form). A dim split by axes a, b, ... has
//   dev[a] * dev[b] * ... parts; a rank's part is its coordinates on those
//   axes as a mixed-radix number, the first axis most significant.
// - optimizer parallel (opt_weight_shard_size != 0 and _step != 0): dim 0
//   is split further over the device axes the tensor map leaves unused
//   (size > 1), taken from the right: whole axes while the remaining size
//   is at least the axis, then the minor part of one axis; those axes are
//   appended after dim 0's own, in dev-matrix order. Size -1 = all of them.
//   Except, as transform_checkpoints has it, for a classic map whose only
//   unused axis is the leading one (or that uses none): the devices are
//   then [dp / size (if > 1), size, split count of dim 0, of dim 1, ...]
//   (the split dims re-laid in tensor-dim order), dim 0 split by its count
//   and then by the size axis; opt_weight_shard_step must be the product
//   of the other axes.
// - pipeline: a merged file names a stage's params "<stage>-<name>"; per-
//   rank files carry current_stage. Rank r is in stage r / prod(dev_matrix).
// Uneven splits (param_split_shape) and embedding fields (field) are not
// supported.

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/box.h"
#include "engine/formats/placed_target.h"
#include "layouts/layout.h"
#include "layouts/variables.h"

namespace ucp::mindspore {

/// One parameter's layout in one pipeline stage.
struct TensorLayout {
  std::vector<int64_t> dev_matrix;
  /// Per tensor dim, the device axes splitting it (counted from the right,
  /// major first); empty = not split.
  std::vector<std::vector<int64_t>> dims;
  bool extend = false;  // the tensor map was in the extend form
  int64_t opt_shard_step = 0;
  int64_t opt_shard_size = 0;
  int64_t field = 0;
  std::vector<int64_t> split_shape;  // param_split_shape (uneven splits)
  friend bool operator==(const TensorLayout&, const TensorLayout&) = default;
};

struct Strategy {
  std::filesystem::path path;  // the file (or folder) read
  /// name -> stage -> layout.
  std::map<std::string, std::map<int64_t, TensorLayout>> layouts;
  /// The devices of one stage (every layout's dev_matrix has as many).
  int64_t stage_devices = 1;
  int64_t stages = 1;
  int64_t world() const { return stage_devices * stages; }

  /// The layout of `name` on `rank`; nullptr if the strategy has none
  /// (the parameter is whole on every rank). Throws FormatError if the
  /// param has layouts for other stages only.
  const TensorLayout* Find(const std::string& name, int64_t rank) const;
  /// Whether rank `rank` holds `name` (its stage has it, or the strategy
  /// names it in no stage).
  bool Holds(const std::string& name, int64_t rank) const;
};

/// Reads a strategy file (protobuf, or JSON for a .json name), or a folder
/// of them (per-rank files, merged: identical layouts once, stages from
/// current_stage). Throws FormatError naming the file and parameter for a
/// damaged file, an unsupported layout (uneven split, field) or files that
/// disagree; IoError if unreadable.
Strategy ReadStrategy(const std::filesystem::path& path);

/// The bytes of a strategy file (protobuf) holding the layouts `s` has for
/// pipeline stage `stage`, with current_stage = `stage` and one strategy
/// item of that stage (merge_pipeline_strategys takes a file's stage from
/// its first item): one such file per stage is what MindSpore's
/// save_param_strategy_file writes. Throws FormatError for a layout it
/// cannot express in the classic form (extend maps, fields, uneven splits).
std::string StrategyFileBytes(const Strategy& s, int64_t stage);

/// A tensor of a derived strategy: `name` takes the layout of `param`
/// (itself, or the param of an optimizer moment); `shape` is its whole
/// shape (a dim of 0: not known, not checked).
struct DerivedTensor {
  std::string name;
  std::string param;
  Shape shape;
};

/// The request `--tp/--pp/--dp` places params by (formats::PlaceTarget):
/// `topology` without virtual stages, num_layers counted from the names
/// when the content does not set it; for content without a layout
/// descriptor (`has_layout` false), the first built-in layout the params'
/// `names` match (the one for MindSpore names: mindformers-llama). Throws
/// UsageError naming the topology when no built-in layout matches them.
formats::PlaceRequest DerivedPlaceRequest(const layouts::Topology& topology,
                                          bool has_layout,
                                          std::span<const std::string> names);

/// The strategy of `--tp/--pp/--dp` (the mindspore README): on a dev
/// matrix [dp, tp] per pipeline stage, a param `placed`'s layout splits over
/// tp maps that dim to the tp axis (0), every other dim to none (-1); no
/// optimizer shard; stages by `placed`'s layer placement (layer i on stage
/// i / (num_layers / pp), first/last-stage params there); a tensor takes
/// the layout of its `param`. `placed` is null only for tp = pp = 1: every
/// tensor is whole on each rank. Throws UsageError naming the topology when
/// a split cannot be a tensor map (segments), LayoutError when a dim does
/// not divide by tp.
Strategy DeriveStrategy(std::span<const DerivedTensor> tensors,
                        const layouts::Topology& topology,
                        const formats::PlacedTarget* placed);

/// How many parts each dim of a tensor of `ndim` dims is cut into under
/// `layout` (dim 0 includes the optimizer shard). Throws FormatError (with
/// `where`) if the layout does not fit the tensor.
std::vector<int64_t> SplitCounts(const TensorLayout& layout, size_t ndim,
                                 const std::string& where);

/// The region of a tensor of `shape` that `rank` holds under `layout`.
/// Throws FormatError (with `where`) if a dim does not divide evenly.
Box RankBox(const TensorLayout& layout, const Shape& shape, int64_t rank,
            const std::string& where);

}  // namespace ucp::mindspore
