// The one serializer between universal::Model and the universal file's root
// attributes. Expected values are written by hand from the schema
// (engine/atoms/atom_store.h, engine/universal/model.h), never from ucp's
// output.
#include "engine/universal/model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/json/json.h"

namespace ucp::universal {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;
using ::testing::ThrowsMessage;

// Root attributes as a Megatron reader writes them (JSON written by hand).
atoms::RootInfo SampleRoot() {
  atoms::RootInfo r;
  r.version = 2;
  r.iteration = 30;
  r.consumed_samples = 960;
  r.source = R"({"framework":"megatron-lm","format":"legacy","tp":2,"pp":4,
    "vpp":1,"dp":2,"cp":1,"ep":1,"distributed_optimizer":true,
    "padded_vocab_size":1024,"vocab_size_from":"args",
    "dtypes":["bfloat16"],"layout":"gpt","iteration_dir":"iter_0000030"})";
  r.model = R"({"num_layers":4,"hidden_size":64,"swiglu":true,
    "note":"kept","true_vocab_size":1000})";
  r.layout = "name: gpt\nrules: []\n";
  r.optimizer = R"({"type":"adam","groups":[
    {"key":{"wd_mult":1.0},"lr":0.0003,"betas":[0.9,0.95],"eps":1e-08,
     "weight_decay":0,"params":["a.weight","b.bias"],"max_lr":0.001},
    {"lr":1e-4,"betas":[0.9,0.999,0.5]}],
    "state_kinds":["fp32","exp_avg","exp_avg_sq"],"step":30,
    "future":{"x":[1,2]}})";
  r.scheduler = R"({"num_steps":960,"max_lr":0.001})";
  r.args = R"({"num_layers":4,"tokenizer_type":"GPT2BPETokenizer"})";
  r.training = R"({"dtype":"bfloat16","step":30,"global_samples":960,
    "frozen":["b.bias"],"shared":{"out.weight":"emb.weight"},
    "param_order":["a.weight","b.bias"],"extra_fact":7})";
  r.extra_strings["megatron"] = R"({"entries":["model"],"release":false})";
  r.extra_strings["some_future_driver"] = R"([1,{"y":null}])";
  r.extra_strings["plain_note"] = "not json: kept as text";
  r.extra_ints["answer"] = 42;
  return r;
}

// Parsed by nlohmann (an independent parser; objects compare as maps, so
// member order is free).
nlohmann::json J(const std::string& text) {
  return nlohmann::json::parse(text);
}

TEST(ModelTest, ReadsTypedFieldsFromTheAttributes) {
  const Model m = ModelFromRoot(SampleRoot(), "u.h5");
  EXPECT_EQ(m.iteration, 30);
  EXPECT_EQ(m.consumed_samples, 960);
  EXPECT_EQ(m.source.framework, "megatron-lm");
  EXPECT_EQ(m.source.format, "legacy");
  EXPECT_EQ(m.source.tp, 2);
  EXPECT_EQ(m.source.pp, 4);
  EXPECT_EQ(m.source.dp, 2);
  EXPECT_EQ(m.source.distributed_optimizer, true);
  EXPECT_EQ(m.source.padded_vocab_size, 1024);
  EXPECT_EQ(m.source.layout, "gpt");
  EXPECT_EQ(m.source.dtypes, std::vector<std::string>{"bfloat16"});
  EXPECT_FALSE(m.source.world.has_value());
  EXPECT_FALSE(m.source.zero_stage.has_value());
  ASSERT_NE(FindMember(m.source.other, "iteration_dir"), nullptr);
  EXPECT_EQ(FindMember(m.source.other, "iteration_dir")->AsString(),
            "iter_0000030");

  EXPECT_EQ(m.variables.Get("num_layers"), 4);
  EXPECT_EQ(m.variables.Get("swiglu"), 1);
  EXPECT_EQ(m.variables.Get("true_vocab_size"), 1000);
  EXPECT_FALSE(m.variables.Get("note").has_value());
  EXPECT_EQ(m.layout_yaml, "name: gpt\nrules: []\n");

  EXPECT_EQ(m.optimizer.type, "adam");
  EXPECT_EQ(m.optimizer.step, 30);
  ASSERT_TRUE(m.optimizer.groups.has_value());
  ASSERT_EQ(m.optimizer.groups->size(), 2u);
  const ParamGroup& g0 = (*m.optimizer.groups)[0];
  EXPECT_EQ(g0.lr, 0.0003);
  EXPECT_EQ(g0.eps, 1e-08);
  EXPECT_EQ(g0.weight_decay, 0.0);
  ASSERT_TRUE(g0.betas.has_value());
  EXPECT_EQ((*g0.betas)[0], 0.9);
  EXPECT_EQ((*g0.betas)[1], 0.95);
  EXPECT_EQ(g0.params, (std::vector<std::string>{"a.weight", "b.bias"}));
  EXPECT_EQ(FindMember(g0.other, "max_lr")->AsDouble(), 0.001);
  EXPECT_NE(FindMember(g0.other, "key"), nullptr);
  const ParamGroup& g1 = (*m.optimizer.groups)[1];
  EXPECT_EQ(g1.lr, 1e-4);
  EXPECT_FALSE(g1.betas.has_value());  // three values: kept opaque
  EXPECT_NE(FindMember(g1.other, "betas"), nullptr);
  EXPECT_FALSE(g1.params.has_value());
  EXPECT_EQ(m.optimizer.state_kinds,
            (std::vector<std::string>{"fp32", "exp_avg", "exp_avg_sq"}));

  ASSERT_TRUE(m.training.has_value());
  EXPECT_EQ(m.training->dtype, "bfloat16");
  EXPECT_EQ(m.training->step, 30);
  EXPECT_EQ(m.training->global_samples, 960);
  EXPECT_FALSE(m.training->iteration.has_value());
  EXPECT_EQ(m.training->frozen, std::vector<std::string>{"b.bias"});
  ASSERT_TRUE(m.training->shared.has_value());
  EXPECT_THAT(*m.training->shared,
              ElementsAre(Pair("out.weight", "emb.weight")));
  EXPECT_EQ(FindMember(m.training->other, "extra_fact")->AsInt(), 7);

  EXPECT_EQ(FindMember(m.scheduler, "num_steps")->AsInt(), 960);
  EXPECT_EQ(FindMember(m.args, "tokenizer_type")->AsString(),
            "GPT2BPETokenizer");
  ASSERT_NE(m.FindExtra("megatron"), nullptr);
  EXPECT_EQ(m.FindExtra("megatron")->At("release").AsBool(), false);
  EXPECT_EQ(m.FindExtra("plain_note"), nullptr);
  EXPECT_EQ(m.extra_texts.at("plain_note"), "not json: kept as text");
  EXPECT_EQ(m.FindExtra("deepspeed"), nullptr);
  EXPECT_EQ(m.extra_ints.at("answer"), 42);
}

// Every attribute comes back as the same JSON document (members compared as
// parsed JSON, so key order is free), the extras byte for byte.
TEST(ModelTest, RoundTripKeepsEveryAttribute) {
  const atoms::RootInfo in = SampleRoot();
  const atoms::RootInfo out = RootFromModel(ModelFromRoot(in, "u.h5"));
  int compared = 0;
  for (const auto& [a, b] : {std::pair{&in.source, &out.source},
                             {&in.model, &out.model},
                             {&in.optimizer, &out.optimizer},
                             {&in.scheduler, &out.scheduler},
                             {&in.args, &out.args},
                             {&in.training, &out.training}}) {
    EXPECT_EQ(J(*a), J(*b)) << *b;
    ++compared;
  }
  EXPECT_EQ(compared, 6);
  EXPECT_EQ(out.layout, in.layout);
  EXPECT_EQ(out.extra_strings, in.extra_strings);  // the same text
  EXPECT_EQ(out.extra_ints, in.extra_ints);
  EXPECT_EQ(out.iteration, 30);
  EXPECT_EQ(out.consumed_samples, 960);
  // Integers stay integers (weight_decay 0 above), doubles stay doubles.
  const nlohmann::json g = J(out.optimizer)["groups"][0];
  EXPECT_TRUE(g["weight_decay"].is_number_integer());
  EXPECT_TRUE(g["lr"].is_number_float());
}

// Negative control: the comparison above sees a changed value.
TEST(ModelTest, RoundTripSeesAChangedTypedValue) {
  const atoms::RootInfo in = SampleRoot();
  Model m = ModelFromRoot(in, "u.h5");
  (*m.optimizer.groups)[0].lr = 0.0004;
  m.training->shared->emplace("head.weight", "emb.weight");
  const atoms::RootInfo out = RootFromModel(m);
  EXPECT_NE(J(in.optimizer), J(out.optimizer));
  EXPECT_NE(J(in.training), J(out.training));
  EXPECT_EQ(J(out.optimizer)["groups"][0]["lr"].get<double>(), 0.0004);
}

TEST(ModelTest, MissingOptionalFieldsAreAbsentValues) {
  atoms::RootInfo r;  // a version-1 style root: empty attributes
  r.version = 1;
  r.source = "{}";
  const Model m = ModelFromRoot(r, "old.h5");
  EXPECT_FALSE(m.source.framework.has_value());
  EXPECT_EQ(SourceInfo::SizeOr1(m.source.tp), 1);
  EXPECT_TRUE(m.variables.variables.empty());
  EXPECT_FALSE(m.optimizer.groups.has_value());
  EXPECT_FALSE(m.optimizer.step.has_value());
  EXPECT_FALSE(m.training.has_value());
  EXPECT_TRUE(m.layout_yaml.empty());
  EXPECT_TRUE(m.extras.empty());
  const atoms::RootInfo out = RootFromModel(m);
  EXPECT_EQ(out.version, 1);
  EXPECT_EQ(out.training, "");  // still no training record
  EXPECT_EQ(J(out.optimizer), nlohmann::json::object());
}

TEST(ModelTest, MalformedAttributeIsAFormatErrorNamingIt) {
  struct Case {
    std::string atoms::RootInfo::*field;
    std::string text;
    std::string expect;
  };
  const Case cases[] = {
      {&atoms::RootInfo::source, "{\"tp\": \"two\"}", "attribute source"},
      {&atoms::RootInfo::source, "[1]", "attribute source"},
      {&atoms::RootInfo::model, "{not json", "attribute model"},
      {&atoms::RootInfo::optimizer, "{\"groups\":[{\"lr\":\"x\"}]}",
       "member lr"},
      {&atoms::RootInfo::optimizer, "{\"groups\":[3]}", "attribute optimizer"},
      {&atoms::RootInfo::training, "{\"shared\":{\"a\":1}}", "member shared"},
      {&atoms::RootInfo::training, "{\"frozen\":\"a\"}", "member frozen"},
      {&atoms::RootInfo::scheduler, "7", "attribute scheduler"},
  };
  {
    atoms::RootInfo r = SampleRoot();
    r.extra_strings["megatron"] = "{\"entries\": [";
    EXPECT_THAT([&] { ModelFromRoot(r, "bad.h5"); },
                ThrowsMessage<FormatError>(HasSubstr("attribute megatron")));
  }
  int checked = 0;
  for (const Case& c : cases) {
    atoms::RootInfo r = SampleRoot();
    r.*c.field = c.text;
    EXPECT_THAT([&] { ModelFromRoot(r, "bad.h5"); },
                ThrowsMessage<FormatError>(
                    AllOf(HasSubstr("bad.h5"), HasSubstr(c.expect))))
        << c.text;
    ++checked;
  }
  EXPECT_EQ(checked, 8);
}

TEST(ModelTest, SetAddsOrReplacesAVariable) {
  ModelInfo m;
  m.Set("vocab_size", 10);
  m.Set("vocab_size", 12);
  m.Set("hidden", 4);
  EXPECT_EQ(m.Get("vocab_size"), 12);
  EXPECT_EQ(m.variables.size(), 2u);
  EXPECT_FALSE(m.Get("absent").has_value());
}

}  // namespace
}  // namespace ucp::universal
