#pragma once
// Layout descriptors: ordered rules that map a param's canonical name to its
// placement (see layouts/README.md for the YAML language and examples).
//
// A canonical name is the state-dict key with nested dict keys joined by "."
// and the layer index made global, e.g.
//   decoder.layers.5.self_attention.linear_qkv.weight               (mcore)
//   language_model.encoder.layers.5.self_attention.query_key_value.weight
//                                                                   (legacy)
// Every name must be matched by exactly one rule whose `when` condition holds
// for the model variables. The rule says what the entry is (param, buffer or
// opaque bytes), which pipeline stage owns it (by layer, first or last
// stage), how it is placed over tensor-parallel ranks (replicated or split,
// see TpPlacement) and whether it is a tied copy of another param.

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "layouts/expression.h"
#include "layouts/glob.h"
#include "layouts/variables.h"

namespace ucp::layouts {

/// What a state-dict entry is. Params are tensors with optimizer state;
/// buffers are tensors without; opaque entries (Transformer Engine
/// `_extra_state`, None values) are carried as pickled bytes, never resharded.
enum class EntryKind { kParam, kBuffer, kOpaque };
/// Which pipeline stage holds a name: the one that owns its layer, the first
/// stage (pp 0, chunk 0) or the last stage (pp PP-1, chunk VPP-1).
enum class Stage { kLayer, kFirst, kLast };

std::string_view EntryKindName(EntryKind kind);  // "param", "buffer", "opaque"
std::string_view StageName(Stage stage);         // "layer", "first", "last"

/// Vocabulary padding of a split dimension: the universal file holds the true
/// size; a rank file of a topology with tp ranks holds
/// PaddedVocabSize(true_size, divisible_by, tp) rows split evenly.
struct VocabPadding {
  Expression true_size;     // e.g. vocab_size
  Expression divisible_by;  // e.g. make_vocab_size_divisible_by
};

/// How a tensor is placed over the tp ranks of one pipeline stage.
///  - replicated: every rank holds the whole tensor (bit-identical copies).
///  - split along `dim`: the dim is cut into `segments` equal segments, each
///    segment into tp equal pieces; rank r's local tensor is its piece of
///    segment 0, then of segment 1, ... concatenated along `dim` (segments: 2
///    is SwiGLU's fc1 [gate_r; up_r]; segments: 1 is a plain even split).
///  - `vocab`: the split dim is vocabulary-padded (segments must be 1).
///  - `groups`/`heads`: fused QKV with query groups; the placement is a plain
///    split, valid only if tp divides both numbers.
struct TpPlacement {
  bool split = false;
  int dim = 0;
  int segments = 1;
  std::optional<VocabPadding> vocab;
  std::optional<Expression> groups;
  std::optional<Expression> heads;

  /// "replicated", "split{dim: 0, segments: 2}", "split{dim: 0, vocab: ...}".
  std::string ToString() const;
  /// Same placement (expressions compared by their text).
  bool SameAs(const TpPlacement& other) const;
};

struct Rule {
  std::string name;
  std::vector<Glob> match;         // any of these patterns
  std::optional<Expression> when;  // model variables only
  EntryKind entry = EntryKind::kParam;
  Stage stage = Stage::kLayer;
  TpPlacement tp;
  /// `ep: split`: a routed expert's entry, one per (layer, global expert
  /// index): the expert index places it over the ep ranks (ExpertPlacement),
  /// `tp` is applied over the expert tensor-parallel ranks (TpSizeFor) and the
  /// distributed optimizer shards it over expert data parallel (DpSizeFor).
  bool expert = false;
  std::optional<std::string> tied_to;     // canonical name of the original
  std::optional<Expression> exists_when;  // may use tp, pp, vpp, dp
  int line = 0;                           // 1-based line in the descriptor

  /// The name matches one of the patterns (ignores `when`).
  bool MatchesPattern(std::string_view param) const;
  /// Whether the entry exists in a rank file set of this topology
  /// (`exists_when`, true if absent). `vars` must be resolved
  /// (Layout::Resolve). Throws LayoutError if a variable is not set.
  bool Exists(const Variables& vars, const Topology& topology) const;
  /// "rule 'qkv' (line 12)".
  std::string Describe() const;
};

/// A name split at its layer index: prefix + index + suffix, where prefix is
/// one of the layout's layer prefixes ("decoder.layers.") and suffix starts
/// with "." (".mlp.linear_fc1.weight").
struct LayerName {
  std::string prefix;
  int64_t index = 0;
  std::string suffix;
  friend bool operator==(const LayerName&, const LayerName&) = default;
};

/// A canonical expert name split at its global expert index: prefix (up to
/// and including the experts infix) + index + suffix:
/// "decoder.layers.3.mlp.experts." + 5 + ".linear_fc1.weight".
struct ExpertName {
  std::string prefix;
  int64_t layer = 0;
  int64_t index = 0;
  std::string suffix;
  friend bool operator==(const ExpertName&, const ExpertName&) = default;
};

/// The `experts` section of a descriptor: the model has routed experts.
/// Canonical expert names are <layer prefix><l>.<infix><e>.<rest> with the
/// global expert index e in [0, count); `moe_layers` (over model variables and
/// `layer`, the global layer index) says which layers are MoE (absent: all).
struct ExpertsSection {
  std::string infix;  // "mlp.experts."
  Expression count;   // num_moe_experts
  std::optional<Expression> moe_layers;
};

/// One finding of Layout::Check: the rule that matched a name, or a problem.
struct Diagnostic {
  std::string name;
  std::string rule;     // the one matching rule; empty if there is a problem
  std::string problem;  // empty if the name is fine
  bool ok() const { return problem.empty(); }
};

/// Auto-detection: a layout accepts a set of names if every `all` pattern
/// matches some name, at least one `any` pattern matches some name (when
/// `any` is given) and no `none` pattern matches any name. Among accepted
/// layouts the highest priority wins. A layout with neither `all` nor `any`
/// patterns is never detected.
struct Detection {
  std::vector<Glob> all;
  std::vector<Glob> any;
  std::vector<Glob> none;
  int priority = 0;
};

class Layout {
 public:
  /// Parses a descriptor. `source_name` (a file name) prefixes messages.
  /// Throws LayoutError "<source>:<line>:<column>: <problem>" on invalid YAML
  /// or an invalid descriptor (unknown key, missing name/match, bad
  /// expression or pattern, duplicate rule name, `when` using a topology
  /// variable, vocab padding with segments, tied_to naming no rule, ...).
  static Layout Parse(std::string_view yaml_text, std::string_view source_name);
  /// Reads and parses a file. Throws IoError if it cannot be read,
  /// LayoutError as Parse.
  static Layout Load(const std::filesystem::path& path);
  /// Parses the descriptor stored in a universal file (`file`, attribute
  /// `layout`). A ucp-written file always holds a valid one, so an invalid
  /// one means a damaged file: throws FormatError "universal file <file> >
  /// attribute layout > <line>:<column>: <problem>".
  static Layout ParseStored(std::string_view yaml_text,
                            const std::filesystem::path& file);
  /// A descriptor compiled into the library. Throws LayoutError naming the
  /// built-in layouts if there is none of that name.
  static Layout Builtin(std::string_view name);
  static std::vector<std::string> BuiltinNames();
  /// The built-in layouts that accept `names`, best first (priority, then
  /// name).
  static std::vector<std::string> DetectBuiltins(
      std::span<const std::string> names);
  /// The best built-in layout for `names`. Throws LayoutError if none accepts
  /// them or two of the highest priority do.
  static Layout DetectBuiltin(std::span<const std::string> names);
  /// What a --layout option names: a built-in layout, else a YAML file; an
  /// empty `spec` detects the built-in for `names`. Throws as Builtin /
  /// Load / DetectBuiltin.
  static Layout FromSpec(std::string_view spec,
                         std::span<const std::string> names = {});

  const std::string& name() const { return name_; }
  const std::string& description() const { return description_; }
  /// Where the descriptor came from ("builtin:mcore-gpt", a path, ...).
  const std::string& source() const { return source_; }
  /// The descriptor's original text (stored in the universal file).
  const std::string& yaml() const { return yaml_; }
  const std::vector<Rule>& rules() const { return rules_; }
  /// Dotted prefixes that are nested dict levels, as written plus implied
  /// ancestors, sorted.
  const std::vector<std::string>& nesting() const { return nesting_; }
  const std::vector<std::string>& layer_prefixes() const {
    return layer_prefixes_;
  }
  /// The number of layers (`layers.count`, e.g. num_layers; 0 without a
  /// layers section).
  const Expression& layer_count() const { return layer_count_; }
  const Detection& detection() const { return detection_; }
  /// The experts section; absent for a model without routed experts.
  const std::optional<ExpertsSection>& experts() const { return experts_; }
  /// The `defaults` entries in order: variable name and expression.
  const std::vector<std::pair<std::string, Expression>>& defaults() const {
    return defaults_;
  }

  /// `vars` plus every `defaults` entry not set there, evaluated in order,
  /// each against the variables known so far; a default whose expression
  /// uses a variable that is still unset is skipped (the variable stays
  /// unset). Throws LayoutError if a default's expression fails (division by
  /// zero, overflow).
  Variables Resolve(const Variables& vars) const;
  /// layer_count() evaluated on Resolve(vars). Throws LayoutError if a
  /// variable is not set or the count is negative.
  int64_t NumLayers(const Variables& vars) const;

  /// Whether the detect section accepts these names.
  bool Detect(std::span<const std::string> names) const;

  /// Absent if the name does not start with a layer prefix followed by a
  /// decimal index and ".".
  std::optional<LayerName> SplitLayer(std::string_view name) const;
  /// The name with its layer index replaced. Throws LayoutError if the name
  /// has no layer index or `index` is negative.
  std::string WithLayer(std::string_view name, int64_t index) const;

  /// Absent if the layout has no experts section or the name is not
  /// <layer prefix><l>.<infix><e>.<rest> with decimal l and e.
  std::optional<ExpertName> SplitExpert(std::string_view name) const;
  /// The name with its expert index replaced (a driver's local index, or
  /// back). Throws LayoutError if the name has no expert index or `index` is
  /// negative.
  std::string WithExpert(std::string_view name, int64_t index) const;
  /// The number of routed experts per MoE layer (`experts.count` on
  /// Resolve(vars)); 0 without an experts section. Throws LayoutError if a
  /// variable is not set or the count is below 1.
  int64_t NumExperts(const Variables& vars) const;
  /// Whether global layer `layer` is a MoE layer: `experts.moe_layers` with
  /// `layer` set (true without the expression; false without an experts
  /// section). Throws LayoutError if a variable is not set or the expression
  /// fails.
  bool IsMoeLayer(int64_t layer, const Variables& vars) const;

  /// The dict keys under which a canonical name sits in a nested state dict:
  /// with nesting ["language_model", "language_model.encoder"],
  /// "language_model.encoder.layers.0.x.weight" ->
  /// ["language_model", "encoder", "layers.0.x.weight"]. Throws LayoutError
  /// if the name is itself a dict level or empty.
  std::vector<std::string> KeyPath(std::string_view name) const;
  /// The inverse of KeyPath. Throws LayoutError if the path does not follow
  /// the nesting (a dict level missing from it, or a leaf key that is one).
  std::string FromKeyPath(std::span<const std::string> path) const;

  /// Every rule whose pattern matches and whose `when` holds, in order.
  /// Throws LayoutError if a `when` needs a variable that is not set.
  std::vector<const Rule*> MatchAll(std::string_view name,
                                    const Variables& vars) const;
  /// The one matching rule; nullptr if none. Throws LayoutError if two or
  /// more match (naming them).
  const Rule* Find(std::string_view name, const Variables& vars) const;
  /// The one matching rule. Throws LayoutError naming the param and the rules
  /// that matched, or, if none did, saying so, naming the rules whose
  /// pattern matched but whose condition is false, and the closest patterns.
  const Rule& Match(std::string_view name, const Variables& vars) const;
  /// The rule called `rule_name`; nullptr if none.
  const Rule* RuleNamed(std::string_view rule_name) const;

  /// One diagnostic per name: its rule, or the problem (no rule, two rules,
  /// a layer rule for a name without layer index, a non-layer rule for a name
  /// with one, an expert rule (`ep: split`) for a name without expert index,
  /// another rule for a name with one, a `when` that cannot be evaluated).
  /// Never throws for a problem with a name; throws LayoutError if the defaults
  /// cannot be resolved.
  std::vector<Diagnostic> Check(std::span<const std::string> names,
                                const Variables& vars) const;

 private:
  friend class LayoutBuilder;
  Layout() = default;
  std::vector<const Rule*> MatchAllResolved(std::string_view name,
                                            const Variables& resolved) const;
  std::string NoRuleMessage(std::string_view name,
                            const Variables& resolved) const;

  std::string name_;
  std::string description_;
  std::string source_;
  std::string yaml_;
  std::vector<Rule> rules_;
  std::vector<std::string> nesting_;
  std::vector<std::string> layer_prefixes_;
  Expression layer_count_;
  Detection detection_;
  std::vector<std::pair<std::string, Expression>> defaults_;
  std::optional<ExpertsSection> experts_;
};

}  // namespace ucp::layouts
