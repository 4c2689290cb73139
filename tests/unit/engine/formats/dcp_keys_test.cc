// DCP keys (engine/formats/dcp/keys.h): what a key holds, from its
// planner_data path or its dotted name, and the path ucp writes for a key it
// names. The oracle is torch itself: torch.distributed.checkpoint's
// flatten_state_dict names a key by joining its path with dots and records
// that path as planner_data, and state_dict.get_state_dict nests the state
// as {"model": {fqn: t}, "optimizer": {"state": {fqn: {kind: t}},
// "param_groups": [{key: v, "params": [fqn]}]}}; the real saves' paths are
// the expected values (the torch 2.6 fixture, data/dcp_torch2.15_nopg).

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/formats/dcp/keys.h"
#include "engine/formats/dcp/metadata.h"
#include "tests/testutil/testutil.h"

namespace ucp::dcp {
namespace {

namespace fs = std::filesystem;
using Path = std::vector<PathComponent>;

std::string JoinPath(const Path& p) {  // torch's flatten: ".".join(map(str))
  std::string s;
  for (size_t i = 0; i < p.size(); ++i) {
    s += i ? "." : "";
    s += std::holds_alternative<std::string>(p[i])
             ? std::get<std::string>(p[i])
             : std::to_string(std::get<int64_t>(p[i]));
  }
  return s;
}

Metadata ReadReal(const fs::path& file) {
  return ParseMetadata(testutil::ReadFile(file), file);
}

// For every key of a real save whose path says what it holds, the class
// ucp gives it (with planner_data, and again from the name alone) has
// torch's path; every other key is kept as what it is.
void CheckRealSave(const Metadata& m, int min_checked) {
  std::map<std::string, bool> tensor;
  for (const Entry& e : m.entries) tensor[e.fqn] = e.tensor;
  Metadata names_only = m;
  names_only.planner_data.clear();
  const KeyNames with_paths = KeyNames::From(m);
  const KeyNames from_names = KeyNames::From(names_only);
  int checked = 0;
  for (const auto& [fqn, path] : m.planner_data) {
    SCOPED_TRACE(fqn);
    ASSERT_EQ(JoinPath(path), fqn);  // the oracle's own rule
    const std::string* p0 = std::get_if<std::string>(&path[0]);
    const bool known = p0 != nullptr && (*p0 == "model" || *p0 == "optimizer");
    for (const KeyNames* names : {&with_paths, &from_names}) {
      const KeyClass k = names->Classify(fqn, tensor.at(fqn));
      if (known) {
        EXPECT_EQ(PathOf(k, fqn), path) << KeyClassName(k.kind);
      } else {
        EXPECT_EQ(k.kind,
                  tensor.at(fqn) ? KeyClass::kTensor : KeyClass::kBytes);
        EXPECT_EQ(PathOf(k, fqn), Path{fqn});
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, min_checked);
}

TEST(DcpKeysTest, RealSavesClassifyToTorchsPaths) {
  CheckRealSave(ReadReal(testutil::FixturesDir() /
                         "dcp-torch-2.6/dtensor_shard0_w2/ckpt/.metadata"),
                2 * 81);
  CheckRealSave(
      ReadReal(testutil::SourceDir() / "tests/unit/engine/formats/data/"
                                       "dcp_torch2.15_nopg.metadata"),
      2 * 8);
}

TEST(DcpKeysTest, RealSaveClasses) {
  const Metadata m = ReadReal(testutil::FixturesDir() /
                              "dcp-torch-2.6/dtensor_shard0_w2/ckpt/.metadata");
  const KeyNames n = KeyNames::From(m);
  const KeyClass a =
      n.Classify("optimizer.state.blocks.0.attn.qkv.bias.exp_avg_sq", true);
  EXPECT_EQ(a.kind, KeyClass::kState);
  EXPECT_EQ(a.param, "blocks.0.attn.qkv.bias");
  EXPECT_EQ(a.state, "exp_avg_sq");
  const KeyClass g = n.Classify("optimizer.param_groups.0.weight_decay", false);
  EXPECT_EQ(g.kind, KeyClass::kParamGroup);
  EXPECT_EQ(g.group, 0);
  EXPECT_EQ(g.group_key, "weight_decay");
  const KeyClass w = n.Classify("model.wpe.weight", true);
  EXPECT_EQ(w.kind, KeyClass::kModel);
  EXPECT_EQ(w.param, "wpe.weight");
}

struct KeyCase {
  const char* fqn;
  bool tensor;
  Path path;  // planner_data; empty: none
  KeyClass::Kind kind;
  const char* param;
  const char* state;
  int64_t group;
  const char* group_key;
};

Metadata MetadataOf(const std::vector<KeyCase>& cases,
                    const std::vector<std::string>& model_params) {
  Metadata m;
  for (const std::string& p : model_params) {
    Entry e;
    e.fqn = "model." + p;
    e.tensor = true;
    m.entries.push_back(e);
  }
  for (const KeyCase& c : cases)
    if (!c.path.empty()) m.planner_data.emplace_back(c.fqn, c.path);
  return m;
}

void CheckCases(const std::vector<KeyCase>& cases,
                const std::vector<std::string>& model_params) {
  const KeyNames n = KeyNames::From(MetadataOf(cases, model_params));
  for (const KeyCase& c : cases) {
    SCOPED_TRACE(c.fqn);
    const KeyClass k = n.Classify(c.fqn, c.tensor);
    EXPECT_EQ(KeyClassName(k.kind), KeyClassName(c.kind));
    EXPECT_EQ(k.param, c.param);
    EXPECT_EQ(k.state, c.state);
    EXPECT_EQ(k.group, c.group);
    EXPECT_EQ(k.group_key, c.group_key);
  }
}

using S = std::string;
using K = KeyClass;

TEST(DcpKeysTest, FromThePlannerDataPathNeverTheDots) {
  CheckCases(
      {
          {"model.a.b",
           true,
           {S("model"), S("a.b")},
           K::kModel,
           "a.b",
           "",
           -1,
           ""},
          // A state kind with a dot: the path says where the param ends.
          {"optimizer.state.a.b.exp.avg",
           true,
           {S("optimizer"), S("state"), S("a.b"), S("exp.avg")},
           K::kState,
           "a.b",
           "exp.avg",
           -1,
           ""},
          {"optimizer.param_groups.1.betas",
           false,
           {S("optimizer"), S("param_groups"), int64_t{1}, S("betas")},
           K::kParamGroup,
           "",
           "",
           1,
           "betas"},
          // Older torch: the whole list as one item.
          {"optimizer.param_groups",
           false,
           {S("optimizer"), S("param_groups")},
           K::kParamGroups,
           "",
           "",
           -1,
           ""},
          // Nested deeper than a state dict's model: a tensor named by its key.
          {"model.layers.0.w",
           true,
           {S("model"), S("layers"), int64_t{0}, S("w")},
           K::kTensor,
           "model.layers.0.w",
           "",
           -1,
           ""},
          // Another root: kept as it is.
          {"extra.epoch",
           false,
           {S("extra"), S("epoch")},
           K::kBytes,
           "",
           "",
           -1,
           ""},
          {"lr_scheduler.w",
           true,
           {S("lr_scheduler"), S("w")},
           K::kTensor,
           "lr_scheduler.w",
           "",
           -1,
           ""},
          // An object under "model" or "optimizer.state": not a param's.
          {"model.x", false, {S("model"), S("x")}, K::kBytes, "", "", -1, ""},
          {"optimizer.state.a.step",
           false,
           {S("optimizer"), S("state"), S("a"), S("step")},
           K::kBytes,
           "",
           "",
           -1,
           ""},
          // A group index that is a str, not a list index: not a group.
          {"optimizer.param_groups.x.lr",
           false,
           {S("optimizer"), S("param_groups"), S("x"), S("lr")},
           K::kBytes,
           "",
           "",
           -1,
           ""},
      },
      {});
}

TEST(DcpKeysTest, FromTheDottedNameWithoutPlannerData) {
  CheckCases(
      {
          {"model.layer.weight",
           true,
           {},
           K::kModel,
           "layer.weight",
           "",
           -1,
           ""},
          // The longest model param the name starts with.
          {"optimizer.state.layer.weight.exp_avg",
           true,
           {},
           K::kState,
           "layer.weight",
           "exp_avg",
           -1,
           ""},
          {"optimizer.state.w.a.b", true, {}, K::kState, "w", "a.b", -1, ""},
          // No model param matches: the last dot.
          {"optimizer.state.other.p.exp_avg_sq",
           true,
           {},
           K::kState,
           "other.p",
           "exp_avg_sq",
           -1,
           ""},
          {"optimizer.param_groups",
           false,
           {},
           K::kParamGroups,
           "",
           "",
           -1,
           ""},
          {"optimizer.param_groups.12.weight_decay",
           false,
           {},
           K::kParamGroup,
           "",
           "",
           12,
           "weight_decay"},
          // Refused as a group: not a number, no key, a tensor.
          {"optimizer.param_groups.x.lr", false, {}, K::kBytes, "", "", -1, ""},
          {"optimizer.param_groups.1", false, {}, K::kBytes, "", "", -1, ""},
          {"optimizer.param_groups.1x.lr",
           false,
           {},
           K::kBytes,
           "",
           "",
           -1,
           ""},
          {"optimizer.param_groups.0.lr",
           true,
           {},
           K::kTensor,
           "optimizer.param_groups.0.lr",
           "",
           -1,
           ""},
          // Refused as a state: no kind after the param.
          {"optimizer.state.nodot",
           true,
           {},
           K::kTensor,
           "optimizer.state.nodot",
           "",
           -1,
           ""},
          {"optimizer.state.w.",
           true,
           {},
           K::kTensor,
           "optimizer.state.w.",
           "",
           -1,
           ""},
          {"model.", true, {}, K::kTensor, "model.", "", -1, ""},
          {"model.w", false, {}, K::kBytes, "", "", -1, ""},
          {"wte.weight", true, {}, K::kTensor, "wte.weight", "", -1, ""},
          {"step", false, {}, K::kBytes, "", "", -1, ""},
      },
      {"layer.weight", "layer", "w"});
}

TEST(DcpKeysTest, PathOfAKeyUcpNames) {
  int checked = 0;
  auto check = [&](const KeyClass& k, const std::string& fqn,
                   const Path& want) {
    EXPECT_EQ(PathOf(k, fqn), want) << fqn;
    // torch's flatten_state_dict gives the key back from the path.
    EXPECT_EQ(JoinPath(want), fqn);
    ++checked;
  };
  KeyClass m;
  m.kind = K::kModel;
  m.param = "decoder.layers.0.mlp.linear_fc1.weight";
  check(m, "model.decoder.layers.0.mlp.linear_fc1.weight",
        {S("model"), m.param});
  KeyClass s;
  s.kind = K::kState;
  s.param = "wte.weight";
  s.state = "exp_avg_sq";
  check(s, "optimizer.state.wte.weight.exp_avg_sq",
        {S("optimizer"), S("state"), S("wte.weight"), S("exp_avg_sq")});
  KeyClass g;
  g.kind = K::kParamGroup;
  g.group = 3;
  g.group_key = "params";
  check(g, "optimizer.param_groups.3.params",
        {S("optimizer"), S("param_groups"), int64_t{3}, S("params")});
  KeyClass gs;
  gs.kind = K::kParamGroups;
  check(gs, "optimizer.param_groups", {S("optimizer"), S("param_groups")});
  KeyClass t;
  t.kind = K::kTensor;
  check(t, "buffers.rope", {S("buffers.rope")});
  EXPECT_EQ(checked, 5);
  EXPECT_EQ(KeyClassName(K::kModel), "model");
  EXPECT_EQ(KeyClassName(K::kParamGroups), "param_groups");
  EXPECT_EQ(KeyClassName(K::kBytes), "bytes");
}

}  // namespace
}  // namespace ucp::dcp
