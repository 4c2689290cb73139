// Layout::Parse: YAML (yaml-cpp) to Layout. yaml-cpp exceptions are
// translated to LayoutError here and nowhere else.

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <set>

#include "engine/core/error.h"
#include "layouts/layout.h"

namespace ucp::layouts {

class LayoutBuilder {
 public:
  LayoutBuilder(std::string_view text, std::string_view source)
      : text_(text), source_(source) {}

  Layout Build() {
    YAML::Node root;
    try {
      root = YAML::Load(std::string(text_));
    } catch (const YAML::Exception& e) {
      throw LayoutError(source_, ":", e.mark.line + 1, ":", e.mark.column + 1,
                        ": invalid YAML: ", e.msg);
    }
    try {
      return FromRoot(root);
    } catch (const YAML::Exception& e) {
      throw LayoutError(source_, ":", e.mark.line + 1, ":", e.mark.column + 1,
                        ": ", e.msg);
    }
  }

 private:
  template <typename... Args>
  [[noreturn]] void Fail(const YAML::Node& at, Args&&... args) const {
    const YAML::Mark mark = at.Mark();
    if (mark.is_null()) {
      throw LayoutError(source_, ": ", std::forward<Args>(args)...);
    }
    throw LayoutError(source_, ":", mark.line + 1, ":", mark.column + 1, ": ",
                      std::forward<Args>(args)...);
  }

  static int Line(const YAML::Node& node) {
    return node.Mark().is_null() ? 0 : node.Mark().line + 1;
  }

  // Rejects keys outside `allowed` and repeated keys.
  void CheckKeys(const YAML::Node& map, std::string_view what,
                 std::initializer_list<std::string_view> allowed) const {
    if (!map.IsMap()) Fail(map, what, " must be a mapping");
    std::set<std::string> seen;
    for (auto it = map.begin(); it != map.end(); ++it) {
      if (!it->first.IsScalar()) Fail(it->first, what, ": keys must be names");
      const std::string key = it->first.Scalar();
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        std::string list;
        for (std::string_view a : allowed) {
          list += list.empty() ? "" : ", ";
          list += a;
        }
        Fail(it->first, what, ": unknown key '", key, "' (allowed: ", list,
             ")");
      }
      if (!seen.insert(key).second) {
        Fail(it->first, what, ": key '", key, "' given twice");
      }
    }
  }

  std::string Scalar(const YAML::Node& node, std::string_view what) const {
    if (!node.IsScalar()) Fail(node, what, " must be a scalar");
    return node.Scalar();
  }

  int64_t Integer(const YAML::Node& node, std::string_view what) const {
    const std::string s = Scalar(node, what);
    int64_t value = 0;
    const auto [end, ec] =
        std::from_chars(s.data(), s.data() + s.size(), value);
    if (ec != std::errc() || end != s.data() + s.size()) {
      Fail(node, what, " must be an integer, not '", s, "'");
    }
    return value;
  }

  Expression Expr(const YAML::Node& node, std::string_view what) const {
    const std::string s = Scalar(node, what);
    try {
      return Expression::Parse(s);
    } catch (const LayoutError& e) {
      Fail(node, what, ": ", e.message());
    }
  }

  Glob Pattern(const YAML::Node& node, std::string_view what) const {
    const std::string s = Scalar(node, what);
    if (s.empty()) Fail(node, what, ": empty pattern");
    try {
      return Glob::Compile(s);
    } catch (const LayoutError& e) {
      Fail(node, what, ": ", e.message());
    }
  }

  // A string or a list of strings.
  std::vector<YAML::Node> OneOrMany(const YAML::Node& node,
                                    std::string_view what) const {
    std::vector<YAML::Node> out;
    if (node.IsScalar()) {
      out.push_back(node);
    } else if (node.IsSequence()) {
      for (const YAML::Node& item : node) out.push_back(item);
      if (out.empty()) Fail(node, what, " must not be empty");
    } else {
      Fail(node, what, " must be a string or a list of strings");
    }
    return out;
  }

  std::vector<Glob> Patterns(const YAML::Node& node,
                             std::string_view what) const {
    std::vector<Glob> out;
    for (const YAML::Node& item : OneOrMany(node, what)) {
      out.push_back(Pattern(item, what));
    }
    return out;
  }

  Layout FromRoot(const YAML::Node& root) {
    if (!root.IsMap()) Fail(root, "a layout descriptor must be a mapping");
    CheckKeys(root, "layout",
              {"name", "description", "detect", "defaults", "nesting", "layers",
               "experts", "rules"});
    Layout layout;
    layout.yaml_ = std::string(text_);
    layout.source_ = source_;
    if (!root["name"]) Fail(root, "layout: missing 'name'");
    layout.name_ = Scalar(root["name"], "name");
    if (layout.name_.empty()) Fail(root["name"], "name must not be empty");
    if (root["description"]) {
      layout.description_ = Scalar(root["description"], "description");
    }
    if (const YAML::Node d = root["detect"]) ParseDetect(d, layout.detection_);
    if (const YAML::Node d = root["defaults"]) ParseDefaults(d, layout);
    if (const YAML::Node n = root["nesting"]) ParseNesting(n, layout);
    layout.layer_count_ = Expression::Constant(0);  // no layers section
    if (const YAML::Node l = root["layers"]) ParseLayers(l, layout);
    if (const YAML::Node e = root["experts"]) ParseExperts(e, layout);
    if (!root["rules"]) Fail(root, "layout: missing 'rules'");
    ParseRules(root["rules"], layout);
    return layout;
  }

  void ParseDetect(const YAML::Node& node, Detection& d) const {
    CheckKeys(node, "detect", {"all", "any", "none", "priority"});
    if (node["all"]) d.all = Patterns(node["all"], "detect.all");
    if (node["any"]) d.any = Patterns(node["any"], "detect.any");
    if (node["none"]) d.none = Patterns(node["none"], "detect.none");
    if (node["priority"]) {
      d.priority =
          static_cast<int>(Integer(node["priority"], "detect.priority"));
    }
  }

  void ParseDefaults(const YAML::Node& node, Layout& layout) const {
    if (!node.IsMap()) Fail(node, "defaults must be a mapping");
    std::set<std::string> seen;
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string var = Scalar(it->first, "defaults key");
      if (!seen.insert(var).second) {
        Fail(it->first, "defaults: '", var, "' given twice");
      }
      if (IsTopologyVariable(var)) {
        Fail(it->first, "defaults: '", var,
             "' is a topology variable, not a model variable");
      }
      layout.defaults_.emplace_back(var,
                                    Expr(it->second, StrCat("defaults.", var)));
    }
  }

  void ParseNesting(const YAML::Node& node, Layout& layout) const {
    if (!node.IsSequence())
      Fail(node, "nesting must be a list of dotted prefixes");
    std::set<std::string> levels;
    for (const YAML::Node& item : node) {
      const std::string s = Scalar(item, "nesting entry");
      if (s.empty() || s.front() == '.' || s.back() == '.' ||
          s.find("..") != std::string::npos ||
          s.find('*') != std::string::npos) {
        Fail(item, "nesting entry '", s,
             "' must be a dotted prefix without '*' or empty parts");
      }
      // A level implies its ancestors.
      for (size_t dot = s.find('.'); dot != std::string::npos;
           dot = s.find('.', dot + 1)) {
        levels.insert(s.substr(0, dot));
      }
      levels.insert(s);
    }
    layout.nesting_.assign(levels.begin(), levels.end());
  }

  void ParseLayers(const YAML::Node& node, Layout& layout) const {
    CheckKeys(node, "layers", {"prefix", "count"});
    if (!node["prefix"]) Fail(node, "layers: missing 'prefix'");
    for (const YAML::Node& p : OneOrMany(node["prefix"], "layers.prefix")) {
      const std::string s = Scalar(p, "layers.prefix");
      if (s.empty() || s.back() != '.' ||
          s.find_first_of("*{},") != std::string::npos) {
        Fail(p, "layers.prefix '", s,
             "' must be a literal dotted prefix ending in '.' (e.g. "
             "\"decoder.layers.\")");
      }
      layout.layer_prefixes_.push_back(s);
    }
    if (!node["count"]) Fail(node, "layers: missing 'count' (e.g. num_layers)");
    layout.layer_count_ = Expr(node["count"], "layers.count");
  }

  void ParseExperts(const YAML::Node& node, Layout& layout) const {
    CheckKeys(node, "experts", {"infix", "count", "moe_layers"});
    if (layout.layer_prefixes_.empty()) {
      Fail(node, "experts: needs a layers section (experts sit in layers)");
    }
    if (!node["infix"])
      Fail(node, "experts: missing 'infix' (e.g. mlp.experts.)");
    const std::string infix = Scalar(node["infix"], "experts.infix");
    if (infix.empty() || infix.front() == '.' || infix.back() != '.' ||
        infix.find("..") != std::string::npos ||
        infix.find_first_of("*{},#") != std::string::npos) {
      Fail(node["infix"], "experts.infix '", infix,
           "' must be a literal dotted name ending in '.' (e.g. "
           "\"mlp.experts.\")");
    }
    if (!node["count"]) {
      Fail(node, "experts: missing 'count' (e.g. num_moe_experts)");
    }
    ExpertsSection experts{infix, Expr(node["count"], "experts.count"),
                           std::nullopt};
    if (node["moe_layers"]) {
      experts.moe_layers = Expr(node["moe_layers"], "experts.moe_layers");
      for (const std::string& v : experts.moe_layers->VariableNames()) {
        if (IsTopologyVariable(v)) {
          Fail(node["moe_layers"], "experts.moe_layers: '", v,
               "' is a topology variable; which layers are MoE is a property "
               "of the model");
        }
      }
    }
    for (const std::string& v : experts.count.VariableNames()) {
      if (IsTopologyVariable(v)) {
        Fail(node["count"], "experts.count: '", v,
             "' is a topology variable, not a model variable");
      }
    }
    layout.experts_ = std::move(experts);
  }

  void ParseTp(const YAML::Node& node, const std::string& where,
               TpPlacement& tp) const {
    if (node.IsScalar()) {
      if (node.Scalar() != "replicated") {
        Fail(node, where,
             ": tp must be 'replicated' or a mapping with 'split'");
      }
      tp = TpPlacement{};
      return;
    }
    CheckKeys(node, where + ": tp", {"split", "vocab", "groups", "heads"});
    if (!node["split"]) {
      Fail(node, where,
           ": tp needs 'split: {dim: N}' (or write tp: replicated)");
    }
    const YAML::Node split = node["split"];
    CheckKeys(split, where + ": tp.split", {"dim", "segments"});
    if (!split["dim"]) Fail(split, where, ": tp.split needs 'dim'");
    tp.split = true;
    const int64_t dim = Integer(split["dim"], "tp.split.dim");
    if (dim < 0 || dim > 64)
      Fail(split["dim"], where, ": tp.split.dim must be in [0, 64]");
    tp.dim = static_cast<int>(dim);
    if (split["segments"]) {
      const int64_t segments = Integer(split["segments"], "tp.split.segments");
      if (segments < 1 || segments > 1024) {
        Fail(split["segments"], where,
             ": tp.split.segments must be in [1, 1024]");
      }
      tp.segments = static_cast<int>(segments);
    }
    if (const YAML::Node vocab = node["vocab"]) {
      CheckKeys(vocab, where + ": tp.vocab", {"true_size", "divisible_by"});
      if (!vocab["true_size"] || !vocab["divisible_by"]) {
        Fail(vocab, where, ": tp.vocab needs 'true_size' and 'divisible_by'");
      }
      if (tp.segments != 1) {
        Fail(vocab, where, ": vocab padding cannot be combined with segments");
      }
      tp.vocab =
          VocabPadding{Expr(vocab["true_size"], "tp.vocab.true_size"),
                       Expr(vocab["divisible_by"], "tp.vocab.divisible_by")};
    }
    if (node["groups"]) tp.groups = Expr(node["groups"], "tp.groups");
    if (node["heads"]) tp.heads = Expr(node["heads"], "tp.heads");
    if (tp.groups.has_value() != tp.heads.has_value()) {
      Fail(node, where, ": tp.groups and tp.heads go together");
    }
  }

  // Whether the patterns' alternatives all start with a layer prefix, none
  // does, or some do.
  enum class PatternKind { kLayer, kOther, kMixed };
  PatternKind Classify(const std::vector<Glob>& globs,
                       const Layout& layout) const {
    bool any_layer = false, any_other = false;
    for (const Glob& g : globs) {
      for (const std::string& alt : g.alternatives()) {
        const bool layer = std::any_of(
            layout.layer_prefixes_.begin(), layout.layer_prefixes_.end(),
            [&](const std::string& p) { return alt.starts_with(p); });
        (layer ? any_layer : any_other) = true;
      }
    }
    if (any_layer && any_other) return PatternKind::kMixed;
    return any_layer ? PatternKind::kLayer : PatternKind::kOther;
  }

  void ParseRules(const YAML::Node& node, Layout& layout) const {
    if (!node.IsSequence() || node.size() == 0) {
      Fail(node, "rules must be a non-empty list");
    }
    std::vector<bool> tp_given;
    std::vector<YAML::Node> rule_nodes;
    for (const YAML::Node& r : node) {
      if (!r.IsMap()) Fail(r, "each rule must be a mapping");
      const std::string where_unnamed = StrCat("rule at line ", Line(r));
      CheckKeys(r, where_unnamed,
                {"name", "note", "match", "when", "entry", "stage", "tp", "ep",
                 "tied_to", "exists_when"});
      Rule rule;
      rule.line = Line(r);
      if (!r["name"]) Fail(r, where_unnamed, ": missing 'name'");
      rule.name = Scalar(r["name"], "rule name");
      if (rule.name.empty()) Fail(r["name"], "rule name must not be empty");
      const std::string where = StrCat("rule '", rule.name, "'");
      if (layout.RuleNamed(rule.name) != nullptr) {
        Fail(r["name"], where, ": a rule of this name is already defined");
      }
      if (r["note"]) Scalar(r["note"], "note");
      if (!r["match"]) Fail(r, where, ": missing 'match'");
      rule.match = Patterns(r["match"], where + ": match");
      if (r["when"]) {
        rule.when = Expr(r["when"], where + ": when");
        for (const std::string& v : rule.when->VariableNames()) {
          if (IsTopologyVariable(v)) {
            Fail(r["when"], where, ": when: '", v,
                 "' is a topology variable; conditions on the topology go in "
                 "exists_when");
          }
        }
      }
      if (r["entry"]) {
        const std::string e = Scalar(r["entry"], "entry");
        if (e == "param") {
          rule.entry = EntryKind::kParam;
        } else if (e == "buffer") {
          rule.entry = EntryKind::kBuffer;
        } else if (e == "opaque") {
          rule.entry = EntryKind::kOpaque;
        } else {
          Fail(r["entry"], where,
               ": entry must be param, buffer or opaque, not '", e, "'");
        }
      }
      const PatternKind kind = Classify(rule.match, layout);
      if (r["stage"]) {
        const std::string s = Scalar(r["stage"], "stage");
        if (s == "layer") {
          rule.stage = Stage::kLayer;
        } else if (s == "first") {
          rule.stage = Stage::kFirst;
        } else if (s == "last") {
          rule.stage = Stage::kLast;
        } else {
          Fail(r["stage"], where, ": stage must be layer, first or last, not '",
               s, "'");
        }
        if (kind == PatternKind::kMixed) {
          Fail(r["match"], where,
               ": mixes patterns under a layer prefix with others; split the "
               "rule");
        }
        if (rule.stage != Stage::kLayer && kind == PatternKind::kLayer) {
          Fail(r["stage"], where, ": stage ", s,
               " for patterns under a layer prefix (layer params belong to "
               "the stage that owns their layer)");
        }
      } else if (kind == PatternKind::kLayer) {
        rule.stage = Stage::kLayer;
      } else if (kind == PatternKind::kMixed) {
        Fail(r["match"], where,
             ": mixes patterns under a layer prefix with others; split the "
             "rule");
      } else {
        Fail(r, where,
             ": its patterns are not under a layer prefix, so it needs "
             "'stage: first' or 'stage: last'");
      }
      if (r["tp"]) ParseTp(r["tp"], where, rule.tp);
      if (r["ep"]) {
        const std::string e = Scalar(r["ep"], "ep");
        if (e == "split") {
          rule.expert = true;
        } else if (e != "replicated") {
          Fail(r["ep"], where, ": ep must be split or replicated, not '", e,
               "'");
        }
        if (rule.expert) {
          if (!layout.experts_) {
            Fail(r["ep"], where,
                 ": ep: split needs an experts section (infix, count)");
          }
          if (rule.stage != Stage::kLayer) {
            Fail(r["ep"], where, ": ep: split is for layer params");
          }
          const std::string needle = "." + layout.experts_->infix;
          for (const Glob& g : rule.match) {
            for (const std::string& alt : g.alternatives()) {
              if (alt.find(needle) == std::string::npos) {
                Fail(r["match"], where, ": ep: split, but the pattern '", alt,
                     "' does not contain the experts infix '", needle, "'");
              }
            }
          }
        }
      }
      if (rule.entry == EntryKind::kOpaque && rule.tp.split) {
        Fail(r["tp"], where, ": opaque entries cannot be split");
      }
      if (r["tied_to"]) {
        rule.tied_to = Scalar(r["tied_to"], "tied_to");
        if (rule.entry != EntryKind::kParam) {
          Fail(r["tied_to"], where, ": only params can be tied copies");
        }
      }
      if (r["exists_when"]) {
        rule.exists_when = Expr(r["exists_when"], where + ": exists_when");
      }
      tp_given.push_back(static_cast<bool>(r["tp"]));
      rule_nodes.push_back(r);
      layout.rules_.push_back(std::move(rule));
    }
    // Tied copies take the placement of their original.
    for (size_t i = 0; i < layout.rules_.size(); ++i) {
      Rule& rule = layout.rules_[i];
      if (!rule.tied_to) continue;
      const std::string where = StrCat("rule '", rule.name, "'");
      std::vector<const Rule*> originals;
      for (const Rule& other : layout.rules_) {
        if (&other != &rule && !other.tied_to &&
            other.MatchesPattern(*rule.tied_to)) {
          originals.push_back(&other);
        }
      }
      if (originals.empty()) {
        Fail(rule_nodes[i]["tied_to"], where, ": tied_to '", *rule.tied_to,
             "' is matched by no rule (that is not itself a tied copy)");
      }
      if (!tp_given[i]) {
        for (const Rule* o : originals) {
          if (!o->tp.SameAs(originals.front()->tp)) {
            Fail(rule_nodes[i], where, ": the rules for '", *rule.tied_to,
                 "' place it differently (", originals.front()->Describe(),
                 ": ", originals.front()->tp.ToString(), ", ", o->Describe(),
                 ": ", o->tp.ToString(), "); give tp explicitly");
          }
        }
        rule.tp = originals.front()->tp;
      } else if (std::none_of(
                     originals.begin(), originals.end(),
                     [&](const Rule* o) { return o->tp.SameAs(rule.tp); })) {
        Fail(rule_nodes[i]["tp"], where,
             ": a tied copy must be placed like its original (",
             originals.front()->Describe(), ": ",
             originals.front()->tp.ToString(), ")");
      }
    }
  }

  std::string_view text_;
  std::string source_;
};

Layout Layout::Parse(std::string_view yaml_text, std::string_view source_name) {
  return LayoutBuilder(yaml_text, source_name).Build();
}

}  // namespace ucp::layouts
