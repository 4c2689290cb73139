#pragma once
// Model variables and the parallel topology that layout descriptors are
// evaluated against.

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace ucp::layouts {

/// Named integer model variables (bools as 0/1), e.g. num_layers,
/// hidden_size, num_attention_heads, num_query_groups, ffn_hidden_size,
/// vocab_size, make_vocab_size_divisible_by, swiglu, tied, add_bias_linear.
/// A framework driver fills them from the checkpoint's arguments.
class Variables {
 public:
  Variables() = default;
  Variables(std::initializer_list<std::pair<const std::string, int64_t>> init)
      : values_(init) {}

  /// Sets (or replaces) a variable.
  void Set(std::string_view name, int64_t value);
  /// Absent if the variable is not set.
  std::optional<int64_t> Find(std::string_view name) const;
  /// Throws LayoutError naming the variable if it is not set.
  int64_t Get(std::string_view name) const;
  bool Has(std::string_view name) const { return Find(name).has_value(); }

  /// A copy with the values of `overrides` replacing or adding to ours.
  Variables Merged(const Variables& overrides) const;
  const std::map<std::string, int64_t, std::less<>>& values() const {
    return values_;
  }
  /// "a=1, b=2" (sorted by name).
  std::string ToString() const;
  friend bool operator==(const Variables&, const Variables&) = default;

 private:
  std::map<std::string, int64_t, std::less<>> values_;
};

/// A parallel layout: tensor-, pipeline-, virtual-pipeline- (model chunks
/// per pipeline rank) and data-parallel sizes. With pp > 1 the first and/or
/// last pipeline stage may hold a given number of layers (Megatron's
/// --decoder-first/last-pipeline-num-layers); the middle stages share the
/// rest evenly.
///
/// Mixture of experts: the routed experts of a MoE layer are split over `ep`
/// expert-parallel ranks and each expert's matrices over `etp` expert
/// tensor-parallel ranks (unset: the tp size). Megatron carves the expert
/// grid (etp x ep x edp x pp) out of the same world = tp x pp x dp ranks as
/// the dense grid, so the expert data-parallel size is
/// edp = world / (etp x ep x pp) = tp x dp / (etp x ep) (ExpertDp).
/// ValidateParallelSizes (placement.h) checks that the grids fit.
struct Topology {
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t vpp = 1;
  int64_t dp = 1;
  std::optional<int64_t> first_stage_layers;
  std::optional<int64_t> last_stage_layers;
  int64_t ep = 1;
  std::optional<int64_t> etp;

  /// The expert tensor-parallel size: etp, or tp when unset.
  int64_t ExpertTp() const { return etp.value_or(tp); }
  /// The expert data-parallel size tp x dp / (etp x ep); 0 when that does
  /// not divide (ValidateParallelSizes says why).
  int64_t ExpertDp() const;
  /// "tp=2 pp=4 vpp=1 dp=1" (+ " first_stage_layers=3 ..." when set; + " ep=4"
  /// when ep != 1 or etp is set; + " etp=1" when etp is set).
  std::string ToString() const;
  friend bool operator==(const Topology&, const Topology&) = default;
};

/// The names a descriptor's `exists_when` expressions may use in addition to
/// the model variables; they are not allowed in `when` conditions.
inline constexpr std::string_view kTopologyVariables[] = {"tp", "pp", "vpp",
                                                          "dp", "ep", "etp"};
bool IsTopologyVariable(std::string_view name);

/// `vars` plus tp, pp, vpp and dp from `topology` (these replace any model
/// variables of the same names).
Variables WithTopology(const Variables& vars, const Topology& topology);

}  // namespace ucp::layouts
