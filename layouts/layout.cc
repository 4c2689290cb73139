#include "layouts/layout.h"

#include <algorithm>
#include <charconv>
#include <mutex>
#include <optional>
#include <tuple>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "layouts/builtin_layouts.h"

namespace ucp::layouts {

std::string_view EntryKindName(EntryKind kind) {
  switch (kind) {
    case EntryKind::kParam:
      return "param";
    case EntryKind::kBuffer:
      return "buffer";
    case EntryKind::kOpaque:
      return "opaque";
  }
  return "?";
}

std::string_view StageName(Stage stage) {
  switch (stage) {
    case Stage::kLayer:
      return "layer";
    case Stage::kFirst:
      return "first";
    case Stage::kLast:
      return "last";
  }
  return "?";
}

std::string TpPlacement::ToString() const {
  if (!split) return "replicated";
  std::string out = StrCat("split{dim: ", dim);
  if (segments != 1) out += StrCat(", segments: ", segments);
  if (vocab) {
    out += StrCat(", vocab: {true_size: ", vocab->true_size.text(),
                  ", divisible_by: ", vocab->divisible_by.text(), "}");
  }
  if (groups) out += StrCat(", groups: ", groups->text());
  if (heads) out += StrCat(", heads: ", heads->text());
  return out + "}";
}

bool TpPlacement::SameAs(const TpPlacement& o) const {
  auto text = [](const std::optional<Expression>& e) {
    return e ? e->text() : std::string("\x01");
  };
  auto vocab_text = [](const std::optional<VocabPadding>& v) {
    return v ? v->true_size.text() + "/" + v->divisible_by.text()
             : std::string("\x01");
  };
  return split == o.split &&
         (!split ||
          (dim == o.dim && segments == o.segments &&
           vocab_text(vocab) == vocab_text(o.vocab) &&
           text(groups) == text(o.groups) && text(heads) == text(o.heads)));
}

bool Rule::MatchesPattern(std::string_view param) const {
  return std::any_of(match.begin(), match.end(),
                     [&](const Glob& g) { return g.Matches(param); });
}

bool Rule::Exists(const Variables& vars, const Topology& topology) const {
  if (!exists_when) return true;
  try {
    return exists_when->IsTrue(WithTopology(vars, topology));
  } catch (Error& e) {
    e.AddContext(Describe(), " exists_when");
    throw;
  }
}

std::string Rule::Describe() const {
  return StrCat("rule '", name, "' (line ", line, ")");
}

// ---------------------------------------------------------------- built-ins

Layout Layout::Load(const std::filesystem::path& path) {
  std::string text;
  try {
    text = ReadSmallFile(path);
  } catch (const FormatError& e) {
    throw LayoutError("layout descriptor ", path.string(), ": ", e.message());
  }
  return Parse(text, path.string());
}

Layout Layout::ParseStored(std::string_view yaml_text,
                           const std::filesystem::path& file) {
  try {
    return Parse(yaml_text, "attribute layout");
  } catch (const LayoutError& e) {
    FormatError f(e.message());
    f.AddContext("universal file ", file.string());
    throw f;
  }
}

std::vector<std::string> Layout::BuiltinNames() {
  std::vector<std::string> out;
  for (int i = 0; i < internal::kNumBuiltinLayouts; ++i) {
    out.emplace_back(internal::kBuiltinLayouts[i].name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

namespace {

// The built-in descriptors parsed once per process (detection tries every
// one of them for each checkpoint read; YAML parsing was most of its cost).
// A descriptor that fails to parse is parsed (and throws) again next time.
const Layout& ParsedBuiltin(int index) {
  static std::mutex mu;
  static std::vector<std::optional<Layout>> parsed(
      static_cast<size_t>(internal::kNumBuiltinLayouts));
  const std::lock_guard<std::mutex> lock(mu);
  std::optional<Layout>& slot = parsed[static_cast<size_t>(index)];
  if (!slot) {
    const internal::BuiltinText& b = internal::kBuiltinLayouts[index];
    slot = Layout::Parse(b.text, StrCat("builtin:", b.name));
  }
  return *slot;
}

}  // namespace

Layout Layout::Builtin(std::string_view name) {
  for (int i = 0; i < internal::kNumBuiltinLayouts; ++i) {
    if (internal::kBuiltinLayouts[i].name == name) return ParsedBuiltin(i);
  }
  std::string list;
  for (const std::string& n : BuiltinNames())
    list += (list.empty() ? "" : ", ") + n;
  throw LayoutError("no built-in layout '", name, "' (built-in: ", list, ")");
}

std::vector<std::string> Layout::DetectBuiltins(
    std::span<const std::string> names) {
  std::vector<std::pair<int, std::string>> accepted;
  for (int i = 0; i < internal::kNumBuiltinLayouts; ++i) {
    const Layout& layout = ParsedBuiltin(i);
    if (layout.Detect(names)) {
      accepted.emplace_back(layout.detection().priority,
                            std::string(internal::kBuiltinLayouts[i].name));
    }
  }
  std::sort(accepted.begin(), accepted.end(), [](const auto& a, const auto& b) {
    return std::tie(b.first, a.second) < std::tie(a.first, b.second);
  });
  std::vector<std::string> out;
  for (auto& [priority, n] : accepted) out.push_back(std::move(n));
  return out;
}

Layout Layout::FromSpec(std::string_view spec,
                        std::span<const std::string> names) {
  if (spec.empty()) return DetectBuiltin(names);
  for (const std::string& b : BuiltinNames())
    if (b == spec) return Builtin(b);
  return Load(std::filesystem::path(spec));
}

Layout Layout::DetectBuiltin(std::span<const std::string> names) {
  const std::vector<std::string> accepted = DetectBuiltins(names);
  if (accepted.empty()) {
    std::string sample;
    for (size_t i = 0; i < names.size() && i < 3; ++i) {
      sample += (i ? ", " : "") + names[i];
    }
    throw LayoutError("no built-in layout recognises these ", names.size(),
                      " names (e.g. ", sample.empty() ? "none" : sample,
                      "); pass a layout descriptor");
  }
  if (accepted.size() > 1) {
    Layout first = Builtin(accepted[0]);
    Layout second = Builtin(accepted[1]);
    if (first.detection().priority == second.detection().priority) {
      throw LayoutError("built-in layouts '", accepted[0], "' and '",
                        accepted[1],
                        "' both recognise these names; choose one");
    }
    return first;
  }
  return Builtin(accepted[0]);
}

bool Layout::Detect(std::span<const std::string> names) const {
  auto any_name = [&](const Glob& g) {
    return std::any_of(names.begin(), names.end(),
                       [&](const std::string& n) { return g.Matches(n); });
  };
  const Detection& d = detection_;
  if (d.all.empty() && d.any.empty()) return false;  // no detect section
  return std::all_of(d.all.begin(), d.all.end(), any_name) &&
         (d.any.empty() || std::any_of(d.any.begin(), d.any.end(), any_name)) &&
         std::none_of(d.none.begin(), d.none.end(), any_name);
}

// ---------------------------------------------------------------- variables

Variables Layout::Resolve(const Variables& vars) const {
  Variables out = vars;
  for (const auto& [name, expr] : defaults_) {
    if (out.Has(name)) continue;
    const std::vector<std::string> inputs = expr.VariableNames();
    if (!std::all_of(inputs.begin(), inputs.end(),
                     [&](const std::string& v) { return out.Has(v); })) {
      continue;  // its inputs are unknown: the variable stays unset
    }
    try {
      out.Set(name, expr.Evaluate(out));
    } catch (Error& e) {
      e.AddContext("layout '", name_, "' > default for '", name, "'");
      throw;
    }
  }
  return out;
}

int64_t Layout::NumLayers(const Variables& vars) const {
  int64_t n = 0;
  try {
    n = layer_count_.Evaluate(Resolve(vars));
  } catch (Error& e) {
    e.AddContext("layout '", name_, "' > layers.count");
    throw;
  }
  if (n < 0) {
    throw LayoutError("layout '", name_, "': layers.count '",
                      layer_count_.text(), "' is negative (", n, ")");
  }
  return n;
}

// ---------------------------------------------------------------- names

std::optional<LayerName> Layout::SplitLayer(std::string_view name) const {
  for (const std::string& prefix : layer_prefixes_) {
    if (!name.starts_with(prefix)) continue;
    const std::string_view rest = name.substr(prefix.size());
    size_t digits = 0;
    while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') {
      ++digits;
    }
    if (digits == 0 || digits > 18 || digits >= rest.size() ||
        rest[digits] != '.') {
      continue;
    }
    int64_t index = 0;
    std::from_chars(rest.data(), rest.data() + digits, index);
    return LayerName{prefix, index, std::string(rest.substr(digits))};
  }
  return std::nullopt;
}

std::string Layout::WithLayer(std::string_view name, int64_t index) const {
  const std::optional<LayerName> split = SplitLayer(name);
  if (!split) {
    std::string prefixes;
    for (const std::string& p : layer_prefixes_) {
      prefixes += (prefixes.empty() ? "'" : ", '") + p + "'";
    }
    throw LayoutError("'", name,
                      "' has no layer index (layer prefixes of layout '", name_,
                      "': ", prefixes.empty() ? "none" : prefixes, ")");
  }
  if (index < 0)
    throw LayoutError("negative layer index ", index, " for '", name, "'");
  return StrCat(split->prefix, index, split->suffix);
}

std::optional<ExpertName> Layout::SplitExpert(std::string_view name) const {
  if (!experts_) return std::nullopt;
  const std::optional<LayerName> layer = SplitLayer(name);
  if (!layer) return std::nullopt;
  // suffix = "." + infix + digits + "." + rest
  const std::string_view suffix = layer->suffix;
  const std::string& infix = experts_->infix;
  if (suffix.size() < 1 + infix.size() ||
      suffix.substr(1, infix.size()) != infix) {
    return std::nullopt;
  }
  const std::string_view rest = suffix.substr(1 + infix.size());
  size_t digits = 0;
  while (digits < rest.size() && rest[digits] >= '0' && rest[digits] <= '9') {
    ++digits;
  }
  if (digits == 0 || digits > 18 || digits >= rest.size() ||
      rest[digits] != '.') {
    return std::nullopt;
  }
  int64_t index = 0;
  std::from_chars(rest.data(), rest.data() + digits, index);
  return ExpertName{StrCat(layer->prefix, layer->index, ".", infix),
                    layer->index, index, std::string(rest.substr(digits))};
}

std::string Layout::WithExpert(std::string_view name, int64_t index) const {
  const std::optional<ExpertName> split = SplitExpert(name);
  if (!split) {
    throw LayoutError(
        "'", name, "' has no expert index (layout '", name_, "': ",
        experts_ ? StrCat("experts after '<layer>.", experts_->infix, "'")
                 : std::string("no experts section"),
        ")");
  }
  if (index < 0)
    throw LayoutError("negative expert index ", index, " for '", name, "'");
  return StrCat(split->prefix, index, split->suffix);
}

int64_t Layout::NumExperts(const Variables& vars) const {
  if (!experts_) return 0;
  int64_t n = 0;
  try {
    n = experts_->count.Evaluate(Resolve(vars));
  } catch (Error& e) {
    e.AddContext("layout '", name_, "' > experts.count");
    throw;
  }
  if (n < 1) {
    throw LayoutError("layout '", name_, "': experts.count '",
                      experts_->count.text(), "' is ", n, ", not >= 1");
  }
  return n;
}

bool Layout::IsMoeLayer(int64_t layer, const Variables& vars) const {
  if (!experts_) return false;
  if (!experts_->moe_layers) return true;
  Variables v = Resolve(vars);
  v.Set("layer", layer);
  try {
    return experts_->moe_layers->IsTrue(v);
  } catch (Error& e) {
    e.AddContext("layout '", name_, "' > experts.moe_layers for layer ", layer);
    throw;
  }
}

std::vector<std::string> Layout::KeyPath(std::string_view name) const {
  if (name.empty()) throw LayoutError("empty param name");
  std::vector<std::string> path;
  size_t start = 0;  // start of the remaining key
  while (true) {
    const size_t dot = name.find('.', start);
    if (dot == std::string_view::npos) break;
    const std::string_view level = name.substr(0, dot);
    if (!std::binary_search(nesting_.begin(), nesting_.end(), level)) break;
    path.emplace_back(name.substr(start, dot - start));
    start = dot + 1;
  }
  if (std::binary_search(nesting_.begin(), nesting_.end(), name)) {
    throw LayoutError("'", name, "' is a nested dict level of layout '", name_,
                      "', not a param name");
  }
  path.emplace_back(name.substr(start));
  return path;
}

std::string Layout::FromKeyPath(std::span<const std::string> path) const {
  if (path.empty()) throw LayoutError("empty key path");
  std::string name;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i].empty())
      throw LayoutError("empty key in key path at position ", i);
    if (i) name += '.';
    name += path[i];
    const bool level =
        std::binary_search(nesting_.begin(), nesting_.end(), name);
    if (i + 1 < path.size() && !level) {
      throw LayoutError("key path: '", name,
                        "' is a nested dict in the state dict "
                        "but not a nesting level of layout '",
                        name_, "'");
    }
  }
  // The leaf must not continue a nesting level ("a" then key "b.c" where
  // "a.b" is a level): KeyPath would split it differently.
  if (KeyPath(name) != std::vector<std::string>(path.begin(), path.end())) {
    const std::string parent =
        path.size() > 1 ? name.substr(0, name.size() - path.back().size() - 1)
                        : "the root";
    throw LayoutError("key path: the key '", path.back(), "' under '", parent,
                      "' starts with a nesting level of layout '", name_,
                      "', so it cannot be a leaf");
  }
  return name;
}

// ---------------------------------------------------------------- matching

std::vector<const Rule*> Layout::MatchAllResolved(
    std::string_view name, const Variables& resolved) const {
  std::vector<const Rule*> out;
  for (const Rule& rule : rules_) {
    if (!rule.MatchesPattern(name)) continue;
    if (rule.when) {
      bool holds = false;
      try {
        holds = rule.when->IsTrue(resolved);
      } catch (Error& e) {
        e.AddContext(rule.Describe(), " when");
        throw;
      }
      if (!holds) continue;
    }
    out.push_back(&rule);
  }
  return out;
}

std::vector<const Rule*> Layout::MatchAll(std::string_view name,
                                          const Variables& vars) const {
  return MatchAllResolved(name, Resolve(vars));
}

namespace {

std::string RuleList(const std::vector<const Rule*>& rules) {
  std::string out;
  for (const Rule* r : rules) out += (out.empty() ? "" : ", ") + r->Describe();
  return out;
}

}  // namespace

std::string Layout::NoRuleMessage(std::string_view name,
                                  const Variables& resolved) const {
  std::string msg =
      StrCat("no rule of layout '", name_, "' matches '", name, "'");
  std::vector<const Rule*> off;
  for (const Rule& rule : rules_) {
    if (rule.MatchesPattern(name)) off.push_back(&rule);
  }
  for (const Rule* r : off) {
    std::string value;
    try {
      value = r->when->IsTrue(resolved) ? "true" : "false";
    } catch (const Error&) {
      value = "not evaluable";
    }
    msg += StrCat("; ", r->Describe(), " matches the name but its condition '",
                  r->when->text(), "' is ", value);
  }
  if (!off.empty()) return msg;
  // The closest patterns, comparing with the layer index replaced by '*'.
  std::string probe(name);
  if (auto split = SplitLayer(name))
    probe = split->prefix + "*" + split->suffix;
  // The three closest (the first seen among equals); patterns 64 edits away
  // are no hint, and a distance is only computed up to the third best's.
  struct Scored {
    size_t distance;
    const std::string* alt;
    const Rule* rule;
  };
  std::vector<Scored> best;
  for (const Rule& rule : rules_) {
    for (const Glob& g : rule.match) {
      for (const std::string& alt : g.alternatives()) {
        const size_t limit = best.size() == 3 ? best.back().distance : 64;
        const size_t d = EditDistance(probe, alt, limit);
        if (best.size() == 3 && d >= limit) continue;
        auto at = std::upper_bound(
            best.begin(), best.end(), d,
            [](size_t x, const Scored& s) { return x < s.distance; });
        best.insert(at, Scored{d, &alt, &rule});
        if (best.size() > 3) best.pop_back();
      }
    }
  }
  msg += "; closest patterns:";
  for (size_t i = 0; i < best.size(); ++i) {
    msg += StrCat(i ? "," : "", " '", *best[i].alt, "' (",
                  best[i].rule->Describe(), ")");
  }
  return msg;
}

const Rule* Layout::Find(std::string_view name, const Variables& vars) const {
  const std::vector<const Rule*> rules = MatchAll(name, vars);
  if (rules.empty()) return nullptr;
  if (rules.size() > 1) {
    throw LayoutError("'", name, "' is matched by ", rules.size(),
                      " rules of layout '", name_, "': ", RuleList(rules));
  }
  return rules.front();
}

const Rule& Layout::Match(std::string_view name, const Variables& vars) const {
  const Variables resolved = Resolve(vars);
  const std::vector<const Rule*> rules = MatchAllResolved(name, resolved);
  if (rules.empty()) throw LayoutError(NoRuleMessage(name, resolved));
  if (rules.size() > 1) {
    throw LayoutError("'", name, "' is matched by ", rules.size(),
                      " rules of layout '", name_, "': ", RuleList(rules));
  }
  return *rules.front();
}

const Rule* Layout::RuleNamed(std::string_view rule_name) const {
  for (const Rule& r : rules_) {
    if (r.name == rule_name) return &r;
  }
  return nullptr;
}

std::vector<Diagnostic> Layout::Check(std::span<const std::string> names,
                                      const Variables& vars) const {
  const Variables resolved = Resolve(vars);
  // The expert count, when the variables give it (ValidateTopology reports
  // a missing one).
  std::optional<int64_t> num_experts;
  if (experts_) {
    try {
      num_experts = NumExperts(resolved);
    } catch (const LayoutError&) {
    }
  }
  std::vector<Diagnostic> out;
  out.reserve(names.size());
  for (const std::string& name : names) {
    Diagnostic d;
    d.name = name;
    std::vector<const Rule*> rules;
    try {
      rules = MatchAllResolved(name, resolved);
    } catch (const Error& e) {
      d.problem = e.what();
      out.push_back(std::move(d));
      continue;
    }
    if (rules.empty()) {
      d.problem = NoRuleMessage(name, resolved);
    } else if (rules.size() > 1) {
      d.problem =
          StrCat("matched by ", rules.size(), " rules: ", RuleList(rules));
    } else {
      const Rule& rule = *rules.front();
      const bool layered = SplitLayer(name).has_value();
      if (rule.stage == Stage::kLayer && !layered) {
        d.problem = StrCat(rule.Describe(), " is for layer params but '", name,
                           "' has no layer index");
      } else if (rule.stage != Stage::kLayer && layered) {
        d.problem =
            StrCat(rule.Describe(), " puts it on the ", StageName(rule.stage),
                   " stage but '", name, "' has a layer index");
      } else if (rule.expert && !SplitExpert(name)) {
        d.problem = StrCat(rule.Describe(), " is for expert params but '", name,
                           "' has no expert index");
      } else if (!rule.expert && SplitExpert(name)) {
        d.problem = StrCat(rule.Describe(), " is not for expert params but '",
                           name, "' has an expert index");
      } else if (rule.expert && num_experts &&
                 SplitExpert(name)->index >= *num_experts) {
        d.problem =
            StrCat("expert ", SplitExpert(name)->index, " but the model has ",
                   *num_experts, " experts (", experts_->count.text(), ")");
      } else {
        d.rule = rule.name;
      }
    }
    out.push_back(std::move(d));
  }
  return out;
}

}  // namespace ucp::layouts
