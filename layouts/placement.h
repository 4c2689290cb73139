#pragma once
// Placement math: which pipeline stage, model chunk and tensor-parallel rank
// holds which part of each tensor. Pure functions of a rule, shapes and a
// Topology; no I/O.
//
// Pipeline layers (Megatron get_transformer_layer_offset): pipeline stage p
// holds n_p layers (n_p = L/PP, or first/last_stage_layers for p = 0 / PP-1
// and the rest shared evenly by the middle stages); each of its VPP model
// chunks holds n_p/VPP consecutive layers. Global layer order is chunk-major,
// then stage: chunk v of stage p starts at v*L/VPP + sum_{q<p} n_q/VPP
// (even case: v*L/VPP + p*L/(PP*VPP)). Local indices count from 0 per chunk.
//
// Tensor parallelism (see TpPlacement): a LocalShard lists the pieces of a
// rank's local tensor; each maps a box of the local tensor to a box of the
// full tensor (Region::kMain, at its true, unpadded shape) or of the padding
// rows (Region::kPad: a tensor of pad_rows_available rows, the source's
// padding rows counted from the true vocab size). Local elements covered by
// no piece are padding the writer fills (zeros). A writer copies full -> local
// along the pieces; a reader, knowing (rule, tp, tp_rank, local tensor), uses
// the same pieces to copy local -> full.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/box.h"
#include "engine/core/strided.h"
#include "layouts/layout.h"
#include "layouts/variables.h"

namespace ucp::layouts {

/// Megatron's padded vocabulary size: ceil(V / (div*tp)) * div * tp.
/// Throws LayoutError if vocab_size < 0, divisible_by < 1, tp < 1 or the
/// result overflows.
int64_t PaddedVocabSize(int64_t vocab_size, int64_t divisible_by, int64_t tp);

/// Global layers (or experts) [begin, end).
struct LayerRange {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
  friend bool operator==(const LayerRange&, const LayerRange&) = default;
};

/// Checks the parallel sizes of `topology` (not the layers): every size
/// >= 1, etp x ep x pp dividing the world tp x pp x dp (the expert grid
/// etp x ep x edp x pp carved out of the same ranks as the dense one), no
/// overflow. Throws LayoutError "topology <t>: <problem, with the numbers>".
/// LayerPlacement calls it.
void ValidateParallelSizes(const Topology& topology);

/// A rank's coordinates in Megatron's two grids (default order
/// tp-cp-ep-dp-pp, cp = 1): dense rank = tp + TP*(dp + DP*pp), expert rank =
/// etp + ETP*(ep + EP*(edp + EDP*pp)).
struct RankCoordinates {
  int64_t tp = 0;
  int64_t dp = 0;
  int64_t pp = 0;
  int64_t etp = 0;
  int64_t ep = 0;
  int64_t edp = 0;
  friend bool operator==(const RankCoordinates&,
                         const RankCoordinates&) = default;
};
/// tp x pp x dp. Throws LayoutError as ValidateParallelSizes.
int64_t WorldSize(const Topology& topology);
/// Throws LayoutError as ValidateParallelSizes, or if `rank` is not in
/// [0, WorldSize).
RankCoordinates CoordinatesOf(const Topology& topology, int64_t rank);
/// The global rank of dense coordinates / of expert coordinates. Throw
/// LayoutError as ValidateParallelSizes, or naming a coordinate out of range.
int64_t DenseRank(const Topology& topology, int64_t tp_rank, int64_t dp_rank,
                  int64_t pp_rank);
int64_t ExpertRank(const Topology& topology, int64_t etp_rank, int64_t ep_rank,
                   int64_t edp_rank, int64_t pp_rank);

/// The tensor-parallel size a rule's `tp` placement is applied over: the
/// expert tensor-parallel size for expert rules (`ep: split`), tp otherwise.
int64_t TpSizeFor(const Rule& rule, const Topology& topology);
/// The data-parallel size over which the distributed optimizer shards a
/// rule's params (and over which they are replicated): the expert
/// data-parallel size for expert rules, dp otherwise.
int64_t DpSizeFor(const Rule& rule, const Topology& topology);

struct ExpertLocation {
  int64_t ep_rank = 0;
  int64_t local_index = 0;
  friend bool operator==(const ExpertLocation&,
                         const ExpertLocation&) = default;
};

/// The routed experts of one MoE layer over the expert-parallel ranks
/// (Megatron's local_expert_indices): ep rank r holds the E/EP consecutive
/// global experts [r*E/EP, (r+1)*E/EP), local index = global - r*E/EP.
class ExpertPlacement {
 public:
  /// Throws LayoutError naming the numbers if num_experts < 1, ep < 1 or ep
  /// does not divide num_experts.
  ExpertPlacement(int64_t num_experts, int64_t ep);

  int64_t num_experts() const { return num_experts_; }
  int64_t ep() const { return ep_; }
  /// Experts per ep rank (E/EP).
  int64_t local_experts() const { return num_experts_ / ep_; }
  /// Throws LayoutError if the expert is out of range.
  ExpertLocation Locate(int64_t global_expert) const;
  /// Throws LayoutError if a coordinate is out of range.
  int64_t Global(int64_t ep_rank, int64_t local_index) const;
  /// The global experts [begin, end) of ep rank `ep_rank`. Throws LayoutError
  /// if it is out of range.
  LayerRange ExpertsOf(int64_t ep_rank) const;

 private:
  int64_t num_experts_;
  int64_t ep_;
};

struct LayerLocation {
  int64_t pp_rank = 0;
  int64_t vp_chunk = 0;
  int64_t local_index = 0;
  friend bool operator==(const LayerLocation&, const LayerLocation&) = default;
};

class LayerPlacement {
 public:
  /// Throws LayoutError (naming the numbers) if a size is < 1, if
  /// first/last_stage_layers are set with pp == 1 or are negative, if the
  /// layers do not divide evenly over the (middle) stages, or if a stage's
  /// layer count is not divisible by vpp.
  LayerPlacement(int64_t num_layers, const Topology& topology);

  int64_t num_layers() const { return num_layers_; }
  const Topology& topology() const { return topology_; }
  /// Layers held by pipeline stage `pp_rank` over all its chunks.
  int64_t StageLayers(int64_t pp_rank) const;
  /// The layers of chunk `vp_chunk` of stage `pp_rank`. Throws LayoutError if
  /// either is out of range.
  LayerRange LayersOf(int64_t pp_rank, int64_t vp_chunk) const;
  /// Throws LayoutError if the layer is out of range.
  LayerLocation Locate(int64_t global_layer) const;
  /// Throws LayoutError if a coordinate is out of range (including a local
  /// index beyond the chunk's layers).
  int64_t Global(int64_t pp_rank, int64_t vp_chunk, int64_t local_index) const;

 private:
  void CheckStage(int64_t pp_rank, int64_t vp_chunk) const;
  int64_t num_layers_;
  Topology topology_;
  std::vector<int64_t> chunk_layers_;  // per stage: layers per chunk
  std::vector<int64_t> chunk_start_;   // per stage: offset inside a chunk row
  int64_t layers_per_chunk_row_ = 0;   // num_layers / vpp
};

/// Where an entry lives: a pipeline stage, one of its model chunks and, for
/// layer entries, the local layer index.
struct Home {
  int64_t pp_rank = 0;
  int64_t vp_chunk = 0;
  std::optional<int64_t> local_layer;
  friend bool operator==(const Home&, const Home&) = default;
};

/// The home of canonical name `name` matched by `rule`: its layer's chunk
/// (stage layer), (0, 0) (first) or (pp-1, vpp-1) (last). Throws LayoutError
/// if a layer rule's name has no layer index or the index is out of range.
Home HomeOf(const Layout& layout, const Rule& rule, std::string_view name,
            const LayerPlacement& placement);

/// The name as it appears in the rank file of chunk `vp_chunk` of stage
/// `pp_rank` (global layer index -> local), and back. Names without a layer
/// index are returned unchanged. Throw LayoutError as LayerPlacement::Locate
/// / Global.
std::string LocalName(const Layout& layout, std::string_view canonical,
                      const LayerPlacement& placement);
std::string CanonicalName(const Layout& layout, std::string_view local_name,
                          const LayerPlacement& placement, int64_t pp_rank,
                          int64_t vp_chunk);

enum class Region { kMain, kPad };

struct Piece {
  Box local;
  Box global;  // in the full tensor (kMain) or the padding rows (kPad)
  Region region = Region::kMain;
  friend bool operator==(const Piece&, const Piece&) = default;
};

struct LocalShard {
  Shape local_shape;
  std::vector<Piece> pieces;  // disjoint, in local row-major order
};

/// The local tensor of rank `tp_rank` of `tp` for a tensor placed by `rule`
/// whose full (true, unpadded) shape is `full_shape`.
///  - replicated: one piece, the whole tensor.
///  - split, segments k: k pieces (empty ones omitted).
///  - vocab-padded split: `padded_dim_size` (>= the true size, divisible by
///    tp; see PaddedDimSize) is the padded size of the split dim; the local
///    rows beyond the true size map to Region::kPad rows while
///    `pad_rows_available` lasts, the rest are filled.
/// A tied copy's rule carries its original's placement. A reader of a rank
/// file passes padded_dim_size = local rows x tp and pad_rows_available =
/// padded_dim_size - true size, so that every local row lands in a piece.
/// Throws LayoutError if the rule is opaque, tp < 1, tp_rank is out of
/// range, the split dim is not a dim of the shape, or the sizes do not divide
/// (the message names the rule and the numbers).
LocalShard ShardFor(const Rule& rule, std::span<const int64_t> full_shape,
                    int64_t tp, int64_t tp_rank, int64_t padded_dim_size = 0,
                    int64_t pad_rows_available = 0);

/// For a vocab-padded rule: PaddedVocabSize(true_size, divisible_by, tp)
/// evaluated on `vars` (resolve them with Layout::Resolve); absent for other
/// rules. Throws LayoutError if a variable is not set.
std::optional<int64_t> PaddedDimSize(const Rule& rule, const Variables& vars,
                                     int64_t tp);

/// The full (true) shape of a tensor from one rank's local shape: the split
/// dim times tp, or for a vocab-padded rule the true size from `vars`.
/// Throws LayoutError if the split dim is missing, the local size is not
/// divisible by the segments, or the padded size is below the true size.
Shape FullShapeFromLocal(const Rule& rule, std::span<const int64_t> local_shape,
                         int64_t tp, const Variables& vars);

/// A param and its full (true) shape.
struct ParamShape {
  std::string name;  // canonical
  Shape shape;
};

/// Checks that `topology` can hold the model: positive sizes
/// (ValidateParallelSizes); layers over pp*vpp (honouring uneven first/last
/// stages); every param matched by exactly one rule, a layer rule's name
/// carrying a layer index < num_layers; an expert rule's name (and only an
/// expert rule's) carrying an expert index < the expert count, which ep
/// divides, in a layer experts.moe_layers makes MoE; split dims inside the
/// shape and divisible by tp*segments (etp for expert rules; vocab-padded dims:
/// the shape holds the true vocab size, padding makes it divisible); tp
/// dividing query groups and heads; a tied copy's original among the params
/// with the same shape. Throws one LayoutError naming the topology, the first
/// offending param (and its rule) and the problem, plus how many other problems
/// were found.
void ValidateTopology(const Layout& layout, std::span<const ParamShape> params,
                      const Variables& vars, const Topology& topology);

}  // namespace ucp::layouts
