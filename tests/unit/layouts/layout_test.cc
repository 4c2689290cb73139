#include "layouts/layout.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::ThrowsMessage;

constexpr char kTestLayout[] = R"(name: t
description: a test layout
detect: {all: ["m.layers.*.w"], none: ["legacy.*"], priority: 3}
defaults:
  heads: 8
  groups: heads
  div: 4
nesting: [top.inner, other]
layers: {prefix: ["m.layers.", "m.old."], count: n}
rules:
  - name: emb
    match: "m.emb.weight"
    stage: first
    tp: {split: {dim: 0}, vocab: {true_size: vocab, divisible_by: div}}
  - name: qkv
    match: "m.layers.*.qkv.{weight,bias}"
    tp: {split: {dim: 0}, groups: groups, heads: heads}
  - name: fc1
    match: "m.layers.*.fc1.weight"
    when: "!swiglu"
    tp: {split: {dim: 0}}
  - name: fc1_swiglu
    match: "m.layers.*.fc1.weight"
    when: swiglu
    tp: {split: {dim: 0, segments: 2}}
  - name: proj
    match: ["m.layers.*.proj.weight", "m.old.*.proj.weight"]
    tp: {split: {dim: 1}}
  - name: norm
    match: "m.layers.*.norm.*"
    tp: replicated
  - name: norm_weight_too
    match: "m.layers.*.norm.weight"
    when: overlap
  - name: extra
    match: "m.layers.*._extra_state"
    entry: opaque
  - name: buf
    match: "m.layers.*.mask"
    entry: buffer
  - name: final
    match: "m.final.weight"
    stage: last
  - name: head
    note: the tied copy
    match: "m.head.weight"
    when: tied
    stage: last
    tied_to: "m.emb.weight"
    exists_when: "pp > 1"
  - name: nested
    match: "top.inner.x.*"
    stage: first
)";

Layout TestLayout() { return Layout::Parse(kTestLayout, "t.yaml"); }

TEST(LayoutParseTest, ReadsEverySection) {
  const Layout l = TestLayout();
  EXPECT_EQ(l.name(), "t");
  EXPECT_EQ(l.description(), "a test layout");
  EXPECT_EQ(l.source(), "t.yaml");
  EXPECT_EQ(l.yaml(), kTestLayout);
  EXPECT_EQ(l.nesting(),
            (std::vector<std::string>{"other", "top", "top.inner"}));
  EXPECT_EQ(l.layer_prefixes(),
            (std::vector<std::string>{"m.layers.", "m.old."}));
  EXPECT_EQ(l.layer_count().text(), "n");
  EXPECT_EQ(l.detection().priority, 3);
  ASSERT_EQ(l.defaults().size(), 3u);
  EXPECT_EQ(l.defaults()[1].first, "groups");
  ASSERT_EQ(l.rules().size(), 12u);
  const Rule& emb = l.rules()[0];
  EXPECT_EQ(emb.name, "emb");
  EXPECT_EQ(emb.line, 11);
  EXPECT_EQ(emb.stage, Stage::kFirst);
  EXPECT_EQ(emb.entry, EntryKind::kParam);
  EXPECT_EQ(emb.tp.ToString(),
            "split{dim: 0, vocab: {true_size: vocab, divisible_by: div}}");
  EXPECT_EQ(l.RuleNamed("qkv")->tp.ToString(),
            "split{dim: 0, groups: groups, heads: heads}");
  EXPECT_EQ(l.RuleNamed("qkv")->stage,
            Stage::kLayer);  // default under a layer prefix
  EXPECT_EQ(l.RuleNamed("fc1_swiglu")->tp.ToString(),
            "split{dim: 0, segments: 2}");
  EXPECT_EQ(l.RuleNamed("proj")->tp.ToString(), "split{dim: 1}");
  EXPECT_EQ(l.RuleNamed("norm")->tp.ToString(), "replicated");
  EXPECT_EQ(l.RuleNamed("final")->tp.ToString(), "replicated");  // default
  EXPECT_EQ(l.RuleNamed("extra")->entry, EntryKind::kOpaque);
  EXPECT_EQ(l.RuleNamed("buf")->entry, EntryKind::kBuffer);
  EXPECT_EQ(l.RuleNamed("missing"), nullptr);
  const Rule& head = *l.RuleNamed("head");
  EXPECT_EQ(head.tied_to, "m.emb.weight");
  EXPECT_TRUE(head.tp.SameAs(emb.tp));  // inherited from the original
  EXPECT_EQ(head.Describe(), "rule 'head' (line 44)");
  EXPECT_FALSE(head.Exists({}, Topo(1)));
  EXPECT_TRUE(head.Exists({}, Topo(1, 2)));
  EXPECT_TRUE(emb.Exists({}, Topology{}));
  EXPECT_EQ(EntryKindName(EntryKind::kOpaque), "opaque");
  EXPECT_EQ(StageName(Stage::kLast), "last");
}

struct BadCase {
  const char* what;
  std::string yaml;
  std::string want;
};

// Every descriptor error names the line (and column) of the offending node.
TEST(LayoutParseTest, ErrorsNameTheLine) {
  const std::string head =
      "name: t\n"                                    // 1
      "layers: {prefix: \"m.layers.\", count: n}\n"  // 2
      "rules:\n"                                     // 3
      "  - name: ok\n"                               // 4
      "    match: \"m.layers.*.ok\"\n";              // 5
  const std::vector<BadCase> cases = {
      {"invalid yaml", "name: [\n", "t.yaml:2:1: invalid YAML"},
      {"not a mapping", "- a\n",
       "t.yaml:1:1: a layout descriptor must be a mapping"},
      {"unknown top key", "name: t\nnmae: x\n",
       "t.yaml:2:1: layout: unknown key 'nmae' (allowed:"},
      {"duplicate key", "name: t\nname: u\n",
       "t.yaml:2:1: layout: key 'name' given twice"},
      {"missing rules", "name: t\n", "layout: missing 'rules'"},
      {"missing name", "rules: []\n", "layout: missing 'name'"},
      {"empty rules", "name: t\nrules: []\n",
       "t.yaml:2:8: rules must be a non-empty list"},
      {"rule not a map", head + "  - x\n",
       "t.yaml:6:5: each rule must be a mapping"},
      {"rule without name", head + "  - match: a\n    stage: first\n",
       "t.yaml:6:5: rule at line 6: missing 'name'"},
      {"rule without match", head + "  - name: r\n    stage: first\n",
       "t.yaml:6:5: rule 'r': missing 'match'"},
      {"unknown rule key",
       head + "  - name: r\n    match: a\n    stage: first\n    spilt: 1\n",
       "t.yaml:9:5: rule at line 6: unknown key 'spilt'"},
      {"duplicate rule", head + "  - name: ok\n    match: \"m.layers.*.b\"\n",
       "t.yaml:6:11: rule 'ok': a rule of this name is already defined"},
      {"bad tp word",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: replicatd\n",
       "t.yaml:8:9: rule 'r': tp must be 'replicated' or a mapping with "
       "'split'"},
      {"tp without split",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {groups: g, "
              "heads: h}\n",
       "t.yaml:8:9: rule 'r': tp needs 'split: {dim: N}'"},
      {"unknown split key",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {split: "
              "{dimm: 0}}\n",
       "t.yaml:8:18: rule 'r': tp.split: unknown key 'dimm'"},
      {"dim not integer",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {split: {dim: "
              "x}}\n",
       "t.yaml:8:23: tp.split.dim must be an integer, not 'x'"},
      {"negative dim",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {split: {dim: "
              "-1}}\n",
       "t.yaml:8:23: rule 'r': tp.split.dim must be in [0, 64]"},
      {"zero segments",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {split: {dim: "
              "0, segments: 0}}\n",
       "t.yaml:8:36: rule 'r': tp.split.segments must be in [1, 1024]"},
      {"vocab with segments",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n"
              "    tp: {split: {dim: 0, segments: 2}, vocab: {true_size: v, "
              "divisible_by: d}}\n",
       "t.yaml:8:47: rule 'r': vocab padding cannot be combined with segments"},
      {"vocab incomplete",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {split: {dim: "
              "0}, vocab: {true_size: v}}\n",
       "t.yaml:8:34: rule 'r': tp.vocab needs 'true_size' and 'divisible_by'"},
      {"groups without heads",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    tp: {split: {dim: "
              "0}, groups: g}\n",
       "t.yaml:8:9: rule 'r': tp.groups and tp.heads go together"},
      {"bad when",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    when: \"swiglu "
              "&&\"\n",
       "t.yaml:8:11: rule 'r': when: expression 'swiglu &&': column 10: "
       "expected a number"},
      {"topology in when",
       head +
           "  - name: r\n    match: \"m.layers.*.r\"\n    when: \"pp > 1\"\n",
       "t.yaml:8:11: rule 'r': when: 'pp' is a topology variable; conditions "
       "on the topology go "
       "in exists_when"},
      {"bad exists_when",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    exists_when: \"pp "
              ">\"\n",
       "t.yaml:8:18: rule 'r': exists_when: expression 'pp >'"},
      {"bad entry",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    entry: tensor\n",
       "t.yaml:8:12: rule 'r': entry must be param, buffer or opaque, not "
       "'tensor'"},
      {"opaque split",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    entry: opaque\n   "
              " tp: {split: {dim: 0}}\n",
       "t.yaml:9:9: rule 'r': opaque entries cannot be split"},
      {"no stage for non-layer",
       head + "  - name: r\n    match: \"m.emb.weight\"\n",
       "t.yaml:6:5: rule 'r': its patterns are not under a layer prefix, so it "
       "needs 'stage: "
       "first' or 'stage: last'"},
      {"star pattern needs stage",
       head + "  - name: r\n    match: \"*._extra_state\"\n",
       "t.yaml:6:5: rule 'r': its patterns are not under a layer prefix"},
      {"stage first under layer prefix",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    stage: first\n",
       "t.yaml:8:12: rule 'r': stage first for patterns under a layer prefix"},
      {"bad stage",
       head + "  - name: r\n    match: \"m.layers.*.r\"\n    stage: middle\n",
       "t.yaml:8:12: rule 'r': stage must be layer, first or last, not "
       "'middle'"},
      {"mixed patterns",
       head + "  - name: r\n    match: [\"m.layers.*.r\", \"m.r\"]\n",
       "t.yaml:7:12: rule 'r': mixes patterns under a layer prefix with "
       "others"},
      {"mixed via braces",
       head + "  - name: r\n    match: \"m.{layers.*.r,r}\"\n",
       "t.yaml:7:12: rule 'r': mixes patterns"},
      {"bad pattern", head + "  - name: r\n    match: \"m.layers.{a\"\n",
       "t.yaml:7:12: rule 'r': match: pattern 'm.layers.{a': column 10: '{' "
       "without '}'"},
      {"empty pattern", head + "  - name: r\n    match: \"\"\n",
       "t.yaml:7:12: rule 'r': match: empty pattern"},
      {"tied to nothing",
       head + "  - name: r\n    match: \"head\"\n    stage: last\n    tied_to: "
              "\"emb\"\n",
       "t.yaml:9:14: rule 'r': tied_to 'emb' is matched by no rule"},
      {"tied placed differently",
       head + "  - name: emb\n    match: emb\n    stage: first\n    tp: "
              "{split: {dim: 0}}\n"
              "  - name: r\n    match: head\n    stage: last\n    tied_to: "
              "emb\n    tp: {split: {dim: 1}}\n",
       "t.yaml:14:9: rule 'r': a tied copy must be placed like its original "
       "(rule 'emb' (line 6): "
       "split{dim: 0})"},
      {"tied ambiguous",
       head +
           "  - name: e1\n    match: emb\n    when: a\n    stage: first\n    "
           "tp: {split: {dim: 0}}\n"
           "  - name: e2\n    match: emb\n    when: '!a'\n    stage: first\n"
           "  - name: r\n    match: head\n    stage: last\n    tied_to: emb\n",
       "t.yaml:15:5: rule 'r': the rules for 'emb' place it differently"},
      {"tied opaque",
       head + "  - name: r\n    match: \"m.layers.*.x\"\n    entry: opaque\n   "
              " tied_to: \"m.layers.0.ok\"\n",
       "t.yaml:9:14: rule 'r': only params can be tied copies"},
      {"layers prefix without dot",
       "name: t\nlayers: {prefix: \"m.layers\", count: n}\nrules: [{name: a, "
       "match: b, stage: first}]\n",
       "t.yaml:2:18: layers.prefix 'm.layers' must be a literal dotted prefix "
       "ending in '.'"},
      {"layers without count",
       "name: t\nlayers: {prefix: \"m.\"}\nrules: [{name: a, match: b, stage: "
       "first}]\n",
       "t.yaml:2:9: layers: missing 'count'"},
      {"bad count",
       "name: t\nlayers: {prefix: \"m.\", count: \"n +\"}\nrules: [{name: a, "
       "match: b, stage: first}]\n",
       "t.yaml:2:31: layers.count: expression 'n +'"},
      {"bad nesting",
       "name: t\nnesting: [\"a..b\"]\nrules: [{name: a, match: b, stage: "
       "first}]\n",
       "t.yaml:2:11: nesting entry 'a..b' must be a dotted prefix"},
      {"nesting not a list",
       "name: t\nnesting: a\nrules: [{name: a, match: b, stage: first}]\n",
       "t.yaml:2:10: nesting must be a list"},
      {"bad detect",
       "name: t\ndetect: {every: [a]}\nrules: [{name: a, match: b, stage: "
       "first}]\n",
       "t.yaml:2:10: detect: unknown key 'every'"},
      {"bad priority",
       "name: t\ndetect: {all: [a], priority: high}\nrules: [{name: a, match: "
       "b, stage: first}]\n",
       "t.yaml:2:30: detect.priority must be an integer"},
      {"default for topology",
       "name: t\ndefaults: {tp: 1}\nrules: [{name: a, match: b, stage: "
       "first}]\n",
       "t.yaml:2:12: defaults: 'tp' is a topology variable"},
      {"bad default",
       "name: t\ndefaults: {a: \"1 +\"}\nrules: [{name: a, match: b, stage: "
       "first}]\n",
       "t.yaml:2:15: defaults.a: expression '1 +'"},
      {"match is a map",
       head + "  - name: r\n    match: {a: b}\n    stage: first\n",
       "t.yaml:7:12: rule 'r': match must be a string or a list of strings"},
  };
  for (const BadCase& c : cases) {
    EXPECT_THAT([&] { Layout::Parse(c.yaml, "t.yaml"); },
                ThrowsMessage<LayoutError>(HasSubstr(c.want)))
        << c.what;
  }
  // The valid head parses (the errors come from the added lines).
  EXPECT_NO_THROW(Layout::Parse(head, "t.yaml"));
}

TEST(LayoutMatchTest, MatchesExactlyOneRule) {
  const Layout l = TestLayout();
  const Variables vars = {{"swiglu", 0}, {"overlap", 0}, {"tied", 1}};
  EXPECT_EQ(l.Match("m.layers.3.qkv.weight", vars).name, "qkv");
  EXPECT_EQ(l.Match("m.layers.3.qkv.bias", vars).name, "qkv");
  EXPECT_EQ(l.Match("m.layers.0.fc1.weight", vars).name, "fc1");
  EXPECT_EQ(l.Match("m.layers.0.fc1.weight", vars.Merged({{"swiglu", 1}})).name,
            "fc1_swiglu");
  EXPECT_EQ(l.Match("m.old.7.proj.weight", vars).name, "proj");
  EXPECT_EQ(l.Match("m.layers.0.norm.weight", vars).name, "norm");
  EXPECT_EQ(l.Match("m.head.weight", vars).name, "head");
  EXPECT_EQ(l.Find("m.layers.0.fc2.weight", vars), nullptr);
  EXPECT_EQ(l.Find("m.layers.0.fc1.weight", vars)->name, "fc1");
  EXPECT_THAT(
      l.MatchAll("m.layers.0.norm.weight", vars.Merged({{"overlap", 1}})),
      ElementsAre(l.RuleNamed("norm"), l.RuleNamed("norm_weight_too")));
}

TEST(LayoutMatchTest, NoRuleNamesTheClosestPatterns) {
  const Layout l = TestLayout();
  const Variables vars = {{"swiglu", 0}, {"overlap", 0}, {"tied", 0}};
  EXPECT_THAT(
      [&] { l.Match("m.layers.5.fc2.weight", vars); },
      ThrowsMessage<LayoutError>(AllOf(
          HasSubstr("no rule of layout 't' matches 'm.layers.5.fc2.weight'"),
          HasSubstr("closest patterns: 'm.layers.*.fc1.weight' (rule 'fc1' "
                    "(line 18))"))));
}

TEST(LayoutMatchTest, NoRuleNamesRulesWhoseConditionIsFalse) {
  const Layout l = TestLayout();
  const Variables vars = {{"swiglu", 0}, {"overlap", 0}, {"tied", 0}};
  EXPECT_THAT(
      [&] { l.Match("m.head.weight", vars); },
      ThrowsMessage<LayoutError>(AllOf(
          HasSubstr("no rule of layout 't' matches 'm.head.weight'"),
          HasSubstr("rule 'head' (line 44) matches the name but its condition "
                    "'tied' is false"))));
}

TEST(LayoutMatchTest, TwoRulesAreAnError) {
  const Layout l = TestLayout();
  const Variables vars = {{"swiglu", 0}, {"overlap", 1}, {"tied", 0}};
  const auto two = ThrowsMessage<LayoutError>(AllOf(
      HasSubstr("'m.layers.2.norm.weight' is matched by 2 rules of layout 't'"),
      HasSubstr("rule 'norm' (line 29)"),
      HasSubstr("rule 'norm_weight_too' (line 32)")));
  EXPECT_THAT([&] { l.Match("m.layers.2.norm.weight", vars); }, two);
  EXPECT_THAT([&] { l.Find("m.layers.2.norm.weight", vars); }, two);
  EXPECT_EQ(l.Match("m.layers.2.norm.bias", vars).name, "norm");
}

TEST(LayoutMatchTest, UnsetConditionVariableIsAnError) {
  const Layout l = TestLayout();
  EXPECT_THAT([&] { l.Match("m.layers.0.fc1.weight", {}); },
              ThrowsMessage<LayoutError>(
                  AllOf(HasSubstr("rule 'fc1' (line 18) when"),
                        HasSubstr("variable 'swiglu' is not set"))));
}

TEST(LayoutMatchTest, CheckReportsOneDiagnosticPerName) {
  const Layout l = TestLayout();
  const std::vector<std::string> names = {
      "m.emb.weight",           "m.layers.0.qkv.weight",
      "m.layers.0.norm.weight", "m.layers.0.fc3.weight",
      "m.layers.0.fc1.weight",  "m.final.weight",
      "m.layers.x.qkv.weight",  "top.inner.x.y"};
  const std::vector<Diagnostic> d =
      l.Check(names, {{"overlap", 1}, {"tied", 1}});
  ASSERT_EQ(d.size(), names.size());
  EXPECT_TRUE(d[0].ok());
  EXPECT_EQ(d[0].rule, "emb");
  EXPECT_EQ(d[1].rule, "qkv");
  EXPECT_THAT(d[2].problem,
              HasSubstr("matched by 2 rules: rule 'norm' (line 29), rule "
                        "'norm_weight_too' (line 32)"));
  EXPECT_EQ(d[2].rule, "");
  EXPECT_THAT(
      d[3].problem,
      HasSubstr("no rule of layout 't' matches 'm.layers.0.fc3.weight'"));
  EXPECT_THAT(d[4].problem,
              HasSubstr("variable 'swiglu' is not set"));  // when not evaluable
  EXPECT_EQ(d[5].rule, "final");
  EXPECT_THAT(d[6].problem,
              HasSubstr("rule 'qkv' (line 15) is for layer params but "
                        "'m.layers.x.qkv.weight' has no layer index"));
  EXPECT_EQ(d[7].rule, "nested");
  EXPECT_EQ(d[0].name, "m.emb.weight");
}

TEST(LayoutVariablesTest, DefaultsFillUnsetVariablesInOrder) {
  const Layout l = TestLayout();
  EXPECT_EQ(l.Resolve({}).ToString(), "div=4, groups=8, heads=8");
  EXPECT_EQ(l.Resolve({{"heads", 16}}).ToString(),
            "div=4, groups=16, heads=16");
  EXPECT_EQ(l.Resolve({{"groups", 2}}).ToString(), "div=4, groups=2, heads=8");
  EXPECT_EQ(l.NumLayers({{"n", 6}}), 6);
  EXPECT_THAT(
      [&] { l.NumLayers({}); },
      ThrowsMessage<LayoutError>(AllOf(HasSubstr("layers.count"),
                                       HasSubstr("variable 'n' is not set"))));
  EXPECT_THAT(
      [&] {
        l.NumLayers({{"n", -1}});
      },
      ThrowsMessage<LayoutError>(HasSubstr("negative")));
  const Layout chain = Layout::Parse(
      "name: b\ndefaults: {x: y + 1, z: x * 2}\nrules: [{name: a, match: b, "
      "stage: first}]\n",
      "b");
  EXPECT_EQ(chain.Resolve({}).ToString(), "");  // y unknown: x and z stay unset
  EXPECT_EQ(chain.Resolve({{"y", 1}}).ToString(), "x=2, y=1, z=4");
  const Layout bad = Layout::Parse(
      "name: b\ndefaults: {x: y / 0}\nrules: [{name: a, match: b, stage: "
      "first}]\n",
      "b");
  EXPECT_THAT(
      [&] {
        bad.Resolve({{"y", 1}});
      },
      ThrowsMessage<LayoutError>(
          AllOf(HasSubstr("layout 'b' > default for 'x'"),
                HasSubstr("division by zero"))));
}

TEST(LayoutNamesTest, SplitLayerAndWithLayer) {
  const Layout l = TestLayout();
  EXPECT_EQ(l.SplitLayer("m.layers.12.qkv.weight"),
            (LayerName{"m.layers.", 12, ".qkv.weight"}));
  EXPECT_EQ(l.SplitLayer("m.old.0.proj.weight"),
            (LayerName{"m.old.", 0, ".proj.weight"}));
  EXPECT_EQ(l.SplitLayer("m.layers.x.qkv"), std::nullopt);
  EXPECT_EQ(l.SplitLayer("m.layers.12"), std::nullopt);
  EXPECT_EQ(l.SplitLayer("m.layers..w"), std::nullopt);
  EXPECT_EQ(l.SplitLayer("m.emb.weight"), std::nullopt);
  EXPECT_EQ(l.SplitLayer("m.layers.1234567890123456789.w"),
            std::nullopt);  // > 18 digits
  EXPECT_EQ(l.WithLayer("m.layers.12.qkv.weight", 3), "m.layers.3.qkv.weight");
  EXPECT_EQ(l.WithLayer("m.old.2.x", 100), "m.old.100.x");
  EXPECT_THAT([&] { l.WithLayer("m.emb.weight", 1); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("'m.emb.weight' has no layer index (layer prefixes "
                            "of layout 't': 'm.layers.', "
                            "'m.old.')")));
  EXPECT_THAT([&] { l.WithLayer("m.layers.1.x", -1); },
              ThrowsMessage<LayoutError>(HasSubstr("negative layer index")));
}

TEST(LayoutNamesTest, KeyPathFollowsTheNesting) {
  const Layout l = TestLayout();  // levels: other, top, top.inner
  using V = std::vector<std::string>;
  EXPECT_EQ(l.KeyPath("top.inner.x.y"), (V{"top", "inner", "x.y"}));
  EXPECT_EQ(l.KeyPath("top.x.y"), (V{"top", "x.y"}));
  EXPECT_EQ(l.KeyPath("other.a"), (V{"other", "a"}));
  EXPECT_EQ(l.KeyPath("m.emb.weight"), (V{"m.emb.weight"}));
  EXPECT_EQ(l.KeyPath("topx.y"), (V{"topx.y"}));
  EXPECT_EQ(l.FromKeyPath(V{"top", "inner", "x.y"}), "top.inner.x.y");
  EXPECT_EQ(l.FromKeyPath(V{"m.emb.weight"}), "m.emb.weight");
  EXPECT_THAT([&] { l.KeyPath("top.inner"); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("'top.inner' is a nested dict level")));
  EXPECT_THAT([&] { l.KeyPath(""); },
              ThrowsMessage<LayoutError>(HasSubstr("empty param name")));
  EXPECT_THAT(
      [&] {
        l.FromKeyPath(V{"m", "emb"});
      },
      ThrowsMessage<LayoutError>(
          HasSubstr("'m' is a nested dict in the state dict but "
                    "not a nesting level of layout 't'")));
  EXPECT_THAT(
      [&] {
        l.FromKeyPath(V{"top", "inner.x"});
      },
      ThrowsMessage<LayoutError>(HasSubstr("cannot be a leaf")));
  EXPECT_THAT([&] { l.FromKeyPath(V{"top"}); },
              ThrowsMessage<LayoutError>(HasSubstr("is a nested dict level")));
  EXPECT_THAT([&] { l.FromKeyPath(V{}); },
              ThrowsMessage<LayoutError>(HasSubstr("empty key path")));
  EXPECT_THAT(
      [&] {
        l.FromKeyPath(V{"top", ""});
      },
      ThrowsMessage<LayoutError>(HasSubstr("empty key")));
}

// KeyPath and FromKeyPath are inverse on every name that is not a level.
TEST(LayoutNamesProperty, KeyPathRoundTrips) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const Layout l = TestLayout();
  const std::vector<std::string> parts = {"top", "inner",  "other",
                                          "x",   "layers", "0"};
  int checked = 0;
  for (int i = 0; i < 5000; ++i) {
    std::string name;
    for (size_t n = 1 + rng() % 5; n > 0; --n) {
      name += (name.empty() ? "" : ".") + parts[rng() % parts.size()];
    }
    if (std::binary_search(l.nesting().begin(), l.nesting().end(), name))
      continue;
    const std::vector<std::string> path = l.KeyPath(name);
    ASSERT_EQ(l.FromKeyPath(path), name);
    for (size_t k = 0; k + 1 < path.size(); ++k) {
      std::string level;
      for (size_t j = 0; j <= k; ++j) level += (j ? "." : "") + path[j];
      ASSERT_TRUE(
          std::binary_search(l.nesting().begin(), l.nesting().end(), level))
          << name;
    }
    ++checked;
  }
  EXPECT_GT(checked, 1000);
}

TEST(LayoutDetectTest, AllAnyNone) {
  const Layout l = TestLayout();
  EXPECT_TRUE(l.Detect(std::vector<std::string>{"a", "m.layers.0.w"}));
  EXPECT_FALSE(l.Detect(std::vector<std::string>{"a", "m.layers.0.v"}));
  EXPECT_FALSE(l.Detect(std::vector<std::string>{"m.layers.0.w", "legacy.x"}));
  const Layout any = Layout::Parse(
      "name: a\ndetect: {any: [x, y]}\nrules: [{name: a, match: b, stage: "
      "first}]\n",
      "a");
  EXPECT_TRUE(any.Detect(std::vector<std::string>{"y"}));
  EXPECT_FALSE(any.Detect(std::vector<std::string>{"z"}));
  const Layout none = Layout::Parse(
      "name: n\nrules: [{name: a, match: b, stage: first}]\n", "n");
  EXPECT_FALSE(
      none.Detect(std::vector<std::string>{"b"}));  // no detect section
  EXPECT_EQ(none.NumLayers({}), 0);                 // no layers section
}

TEST(LayoutLoadTest, LoadsFilesAndReportsMissingOnes) {
  testutil::TempDir dir;
  testutil::WriteFile(dir / "t.yaml", kTestLayout);
  const Layout l = Layout::Load(dir / "t.yaml");
  EXPECT_EQ(l.name(), "t");
  EXPECT_EQ(l.source(), (dir / "t.yaml").string());
  testutil::WriteFile(dir / "bad.yaml", "name: t\nrules: 3\n");
  EXPECT_THAT([&] { Layout::Load(dir / "bad.yaml"); },
              ThrowsMessage<LayoutError>(
                  HasSubstr("bad.yaml:2:8: rules must be a non-empty list")));
  EXPECT_THROW(Layout::Load(dir / "missing.yaml"), IoError);
}

}  // namespace
}  // namespace ucp::layouts
