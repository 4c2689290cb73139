// The drivers' typed extras (megatron_format.h MegatronExtras, dcp.h
// DcpExtras, deepspeed_format.h DeepSpeedExtras, torch_dist.h
// TorchDistExtras): each attribute as its reader writes it, spelled by hand
// from the format spec at the top of those headers, read into the struct and
// written back; a struct written and read back is the same; malformed
// records are FormatErrors naming the record and the key.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/deepspeed/deepspeed_format.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"
#include "engine/universal/model.h"

namespace ucp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

universal::Model WithExtra(const char* name, const std::string& text) {
  universal::Model m;
  m.extras[name] = json::Value::Parse(text);
  return m;
}

nlohmann::json Nl(const json::Value& v) {
  return nlohmann::json::parse(v.Dump());
}

constexpr char kMegatron[] =
    R"({"top_level_keys":["args","model","optimizer"],)"
    R"("entries":[["embedding.word_embeddings.weight","param"],)"
    R"(["decoder.layers.0._extra_state","opaque"]],"release":false,)"
    R"("gpus_per_node":4,"optimizer_format":"distributed",)"
    R"("state_keys":["exp_avg","exp_avg_sq"],"grad_dtype":"bfloat16",)"
    R"("vocab_size_known":false,"future":1})";

TEST(DriverExtrasTest, MegatronRecordReadAndWrittenBack) {
  const universal::Model m = WithExtra("megatron", kMegatron);
  const std::optional<megatron::MegatronExtras> x =
      megatron::ReadMegatronExtras(m, "u.h5");
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->top_level_keys,
            (std::vector<std::string>{"args", "model", "optimizer"}));
  ASSERT_TRUE(x->entries.has_value());
  ASSERT_EQ(x->entries->size(), 2u);
  EXPECT_EQ((*x->entries)[1].first, "decoder.layers.0._extra_state");
  EXPECT_EQ((*x->entries)[1].second, "opaque");
  EXPECT_EQ(x->release, false);
  EXPECT_EQ(x->gpus_per_node, 4);
  EXPECT_EQ(x->optimizer_format, "distributed");
  EXPECT_EQ(x->grad_dtype, "bfloat16");
  EXPECT_FALSE(x->VocabSizeKnown());
  universal::Model out;
  megatron::WriteMegatronExtras(*x, out);
  EXPECT_EQ(Nl(*out.FindExtra("megatron")), nlohmann::json::parse(kMegatron));
  // Absent: no record; an empty record: every member absent.
  EXPECT_FALSE(megatron::ReadMegatronExtras(universal::Model{}, "u.h5"));
  const auto empty =
      megatron::ReadMegatronExtras(WithExtra("megatron", "{}"), "u.h5");
  ASSERT_TRUE(empty.has_value());
  EXPECT_FALSE(empty->entries.has_value());
  EXPECT_TRUE(empty->VocabSizeKnown());
}

TEST(DriverExtrasTest, MalformedMegatronRecordNamesTheMember) {
  EXPECT_THAT(
      [] {
        megatron::ReadMegatronExtras(
            WithExtra("megatron", R"({"entries":[["a"]]})"), "bad.h5");
      },
      ThrowsMessage<FormatError>(AllOf(HasSubstr("bad.h5"),
                                       HasSubstr("attribute megatron"),
                                       HasSubstr("member entries"))));
  EXPECT_THAT(
      [] {
        megatron::ReadMegatronExtras(
            WithExtra("megatron", R"({"gpus_per_node":"8"})"), "bad.h5");
      },
      ThrowsMessage<FormatError>(HasSubstr("member gpus_per_node")));
}

constexpr char kDcp[] =
    R"({"keys":[{"key":"model.w","class":"model","param":"w"},)"
    R"({"key":"optimizer.state.w.exp_avg","class":"state","param":"w",)"
    R"("state":"exp_avg"},{"key":"step","class":"bytes"}],)"
    R"("planner_data":{"model.w":["model","w"],"step":["step"],)"
    R"("optimizer.param_groups.0.lr":["optimizer","param_groups",0,"lr"]},)"
    R"("version":"2.6.0","world":2})";

TEST(DriverExtrasTest, DcpRecordReadAndWrittenBack) {
  const std::optional<dcp::DcpExtras> x =
      dcp::ReadDcpExtras(WithExtra("dcp", kDcp), "u.h5");
  ASSERT_TRUE(x.has_value());
  ASSERT_EQ(x->keys.size(), 3u);
  EXPECT_EQ(x->keys[1].state, "exp_avg");
  EXPECT_EQ(x->keys[2].param, "");
  ASSERT_TRUE(x->planner_data.has_value());
  ASSERT_EQ(x->planner_data->size(), 3u);
  // State-dict order kept; an int component stays an int.
  EXPECT_EQ((*x->planner_data)[2].first, "optimizer.param_groups.0.lr");
  EXPECT_EQ(std::get<int64_t>((*x->planner_data)[2].second[2]), 0);
  EXPECT_EQ(x->version, "2.6.0");
  EXPECT_EQ(x->world, 2);
  universal::Model out;
  dcp::WriteDcpExtras(*x, out);
  EXPECT_EQ(Nl(*out.FindExtra("dcp")), nlohmann::json::parse(kDcp));
  EXPECT_EQ(out.FindExtra("dcp")->Dump(),
            json::Value::Parse(kDcp).Dump());  // member order too
  EXPECT_THAT(
      [] { dcp::ReadDcpExtras(WithExtra("dcp", R"({"world":2})"), "bad.h5"); },
      ThrowsMessage<FormatError>(
          AllOf(HasSubstr("attribute dcp"), HasSubstr("keys"))));
}

// A Megatron-DeepSpeed record (deepspeed_format.h), members in the reader's
// order, with an unknown member at both levels.
constexpr char kDeepSpeed[] =
    R"({"tag":"global_step7","stage":1,"wrapper":"bf16","bf16_prefix":true,)"
    R"("groups":[["1.weight","tied_modules.embed.word_embeddings.weight"],)"
    R"(["2.bias"]],"module_keys":["1.weight","2.bias"],)"
    R"("model_keys":["module","optimizer","args"],"step_kind":"float",)"
    R"("step_value":7.5,"zero3_sub_groups":3,"lp_dtype":"bfloat16",)"
    R"("model_parallel":{"tp":2,"pp":2,"pipeline":true,)"
    R"("layout":"megatron-deepspeed-gpt-pipe","layout_yaml":"name: x\n",)"
    R"("tied_layers":{"tied_modules.embed":1},)"
    R"("variables":{"num_layers":2,"vocab_size":30},"vocab_size":30,)"
    R"("vocab_size_from":"args","mp_future":[1]},"future":{"a":null}})";

TEST(DriverExtrasTest, DeepSpeedRecordReadAndWrittenBack) {
  const std::optional<deepspeed::DeepSpeedExtras> x =
      deepspeed::ReadDeepSpeedExtras(WithExtra("deepspeed", kDeepSpeed),
                                     "u.h5");
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->tag, "global_step7");
  EXPECT_EQ(x->stage, 1);
  EXPECT_EQ(x->wrapper, "bf16");
  EXPECT_EQ(x->bf16_prefix, true);
  ASSERT_TRUE(x->groups.has_value());
  ASSERT_EQ(x->groups->size(), 2u);
  EXPECT_EQ((*x->groups)[0][1], "tied_modules.embed.word_embeddings.weight");
  EXPECT_EQ((*x->groups)[1], std::vector<std::string>{"2.bias"});
  EXPECT_EQ(x->module_keys, (std::vector<std::string>{"1.weight", "2.bias"}));
  EXPECT_EQ(x->model_keys,
            (std::vector<std::string>{"module", "optimizer", "args"}));
  EXPECT_EQ(x->step_kind, "float");
  EXPECT_EQ(x->step_value, 7.5);
  EXPECT_EQ(x->zero3_sub_groups, 3);
  EXPECT_EQ(x->lp_dtype, "bfloat16");
  ASSERT_TRUE(x->model_parallel.has_value());
  const deepspeed::DeepSpeedModelParallel& mp = *x->model_parallel;
  EXPECT_EQ(mp.tp, 2);
  EXPECT_EQ(mp.pp, 2);
  EXPECT_TRUE(mp.pipeline);
  EXPECT_EQ(mp.layout, "megatron-deepspeed-gpt-pipe");
  EXPECT_EQ(mp.layout_yaml, "name: x\n");
  EXPECT_EQ(mp.tied_layers,
            (std::map<std::string, int64_t>{{"tied_modules.embed", 1}}));
  EXPECT_EQ(mp.variables, (std::map<std::string, int64_t>{{"num_layers", 2},
                                                          {"vocab_size", 30}}));
  EXPECT_EQ(mp.vocab_size, 30);
  EXPECT_EQ(mp.vocab_size_from, "args");
  // Unknown members kept, at both levels.
  EXPECT_EQ(mp.other.Dump(), R"({"mp_future":[1]})");
  EXPECT_EQ(x->other.Dump(), R"({"future":{"a":null}})");
  universal::Model out;
  deepspeed::WriteDeepSpeedExtras(*x, out);
  EXPECT_EQ(Nl(*out.FindExtra("deepspeed")), nlohmann::json::parse(kDeepSpeed));
  EXPECT_EQ(out.FindExtra("deepspeed")->Dump(),
            json::Value::Parse(kDeepSpeed).Dump());  // member order too
  // Negative control: one changed member is seen.
  deepspeed::DeepSpeedExtras changed = *x;
  changed.model_parallel->tied_layers->at("tied_modules.embed") = 2;
  universal::Model out2;
  deepspeed::WriteDeepSpeedExtras(changed, out2);
  EXPECT_NE(Nl(*out2.FindExtra("deepspeed")),
            nlohmann::json::parse(kDeepSpeed));
  EXPECT_FALSE(deepspeed::ReadDeepSpeedExtras(universal::Model{}, "u.h5"));
}

TEST(DriverExtrasTest, DeepSpeedStructWrittenAndReadBackIsEqual) {
  // The required members only (a plain DeepSpeed source), then everything.
  deepspeed::DeepSpeedExtras x;
  x.tag = "t";
  x.stage = 3;
  x.wrapper = "zero";
  x.lp_dtype = "float16";
  for (int full = 0; full < 2; ++full) {
    if (full) {
      x.groups = {{"a", "b"}, {}};
      x.step_kind = "tensor";
      x.model_parallel.emplace();
      x.model_parallel->variables = {{"hidden_size", 8}};
      x.model_parallel->other["k"] = "v";
      x.other["z"] = 1;
    }
    universal::Model m;
    deepspeed::WriteDeepSpeedExtras(x, m);
    const auto back = deepspeed::ReadDeepSpeedExtras(m, "u.h5");
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, x) << m.FindExtra("deepspeed")->Dump();
    EXPECT_FALSE(full == 0 && back->groups.has_value());
  }
}

// A mixture-of-experts record (deepspeed_format.h "moe"), written from the
// spec, members in the reader's order, an unknown one kept.
constexpr char kDeepSpeedMoe[] =
    R"({"tag":"global_step2","stage":1,"wrapper":"zero","lp_dtype":"float32",)"
    R"("moe":{"num_experts":[4,8],"layers":["moe","layers.3.mlp"],"ep":2,)"
    R"("expert_groups":[1],"legacy_names":true,"moe_future":"x"}})";

TEST(DriverExtrasTest, DeepSpeedMoeRecordReadAndWrittenBack) {
  const std::optional<deepspeed::DeepSpeedExtras> x =
      deepspeed::ReadDeepSpeedExtras(WithExtra("deepspeed", kDeepSpeedMoe),
                                     "u.h5");
  ASSERT_TRUE(x.has_value() && x->moe.has_value());
  const deepspeed::DeepSpeedMoe& m = *x->moe;
  EXPECT_EQ(m.num_experts, (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(m.layers, (std::vector<std::string>{"moe", "layers.3.mlp"}));
  EXPECT_EQ(m.ep, 2);
  EXPECT_EQ(m.expert_groups, std::vector<int64_t>{1});
  EXPECT_TRUE(m.legacy_names);
  EXPECT_EQ(m.other.Dump(), R"({"moe_future":"x"})");
  universal::Model out;
  deepspeed::WriteDeepSpeedExtras(*x, out);
  EXPECT_EQ(out.FindExtra("deepspeed")->Dump(),
            json::Value::Parse(kDeepSpeedMoe).Dump());
  deepspeed::DeepSpeedExtras changed = *x;  // negative control
  changed.moe->num_experts[1] = 6;
  universal::Model out2;
  deepspeed::WriteDeepSpeedExtras(changed, out2);
  EXPECT_NE(out2.FindExtra("deepspeed")->Dump(),
            json::Value::Parse(kDeepSpeedMoe).Dump());
  // Malformed: a member of the wrong type, layers and counts that disagree.
  auto read = [](const std::string& moe) {
    deepspeed::ReadDeepSpeedExtras(
        WithExtra("deepspeed",
                  R"({"tag":"t","stage":1,"wrapper":"zero","lp_dtype":"f",)"
                  R"("moe":)" +
                      moe + "}"),
        "bad.h5");
  };
  EXPECT_NO_THROW(read(R"({"num_experts":[4],"layers":["m"],"ep":1,)"
                       R"("expert_groups":[]})"));
  EXPECT_THAT(
      [&] {
        read(R"({"num_experts":["4"],"layers":["m"],"ep":1,)"
             R"("expert_groups":[]})");
      },
      ThrowsMessage<FormatError>(
          HasSubstr("attribute deepspeed > member moe > member num_experts")));
  EXPECT_THAT(
      [&] {
        read(R"({"num_experts":[4,4],"layers":["m"],"ep":1,)"
             R"("expert_groups":[]})");
      },
      ThrowsMessage<FormatError>(
          AllOf(HasSubstr("member moe"), HasSubstr("1 layers but 2"))));
}

TEST(DriverExtrasTest, DeepSpeedExpertNames) {
  const auto x = deepspeed::SplitExpertName(
      "layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.12.fc1.weight");
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(x->layer, "layers.3.mlp");
  EXPECT_EQ(x->expert, 12);
  EXPECT_EQ(x->rest, "fc1.weight");
  EXPECT_EQ(
      deepspeed::ExpertParamName(x->layer, 5, x->rest),
      "layers.3.mlp.deepspeed_moe.experts.deepspeed_experts.5.fc1.weight");
  const auto top =
      deepspeed::SplitExpertName("deepspeed_moe.experts.deepspeed_experts.0.w");
  ASSERT_TRUE(top.has_value());
  EXPECT_EQ(top->layer, "");
  EXPECT_EQ(deepspeed::ExpertParamName("", 0, "w"),
            "deepspeed_moe.experts.deepspeed_experts.0.w");
  for (const char* no : {"moe.deepspeed_moe.gate.wg.weight", "fc1.weight",
                         "moe.deepspeed_moe.experts.deepspeed_experts.x.w",
                         "moe.deepspeed_moe.experts.deepspeed_experts.3",
                         "moexdeepspeed_moe.experts.deepspeed_experts.3.w"})
    EXPECT_FALSE(deepspeed::SplitExpertName(no).has_value()) << no;
}

TEST(DriverExtrasTest, MalformedDeepSpeedRecordNamesTheMember) {
  auto read = [](const std::string& text) {
    deepspeed::ReadDeepSpeedExtras(WithExtra("deepspeed", text), "bad.h5");
  };
  const std::string ok = R"("tag":"t","wrapper":"zero","lp_dtype":"bf16")";
  EXPECT_NO_THROW(read("{" + ok + R"(,"stage":2})"));
  EXPECT_THAT([&] { read("{" + ok + R"(,"stage":"2"})"); },
              ThrowsMessage<FormatError>(
                  AllOf(HasSubstr("universal file bad.h5"),
                        HasSubstr("attribute deepspeed > member stage"))));
  EXPECT_THAT(
      [&] { read("{" + ok + "}"); },
      ThrowsMessage<FormatError>(AllOf(HasSubstr("attribute deepspeed"),
                                       HasSubstr("missing key \"stage\""))));
  EXPECT_THAT(
      [&] {
        read("{" + ok +
             R"(,"stage":1,"model_parallel":{"tp":"2","pp":1,)"
             R"("pipeline":false}})");
      },
      ThrowsMessage<FormatError>(HasSubstr(
          "attribute deepspeed > member model_parallel > member tp")));
  EXPECT_THAT(
      [&] {
        read("{" + ok +
             R"(,"stage":1,"model_parallel":{"tp":2,"pp":1,)"
             R"("pipeline":false,"tied_layers":{"x":"1"}}})");
      },
      ThrowsMessage<FormatError>(
          HasSubstr("member model_parallel > member tied_layers > member x")));
  EXPECT_THAT([&] { read("{" + ok + R"(,"stage":1,"groups":[["a",2]]})"); },
              ThrowsMessage<FormatError>(HasSubstr("member groups")));
  EXPECT_THAT([&] { read("[]"); },
              ThrowsMessage<FormatError>(
                  HasSubstr("attribute deepspeed > not a JSON object")));
}

constexpr char kTorchDist[] =
    R"({"content_metadata":{"distrib_optim_sharding_type":"dp_reshardable",)"
    R"("singleton_local_shards":false},"common_in":"common_state",)"
    R"("optimizer":"dp_reshardable","future":2})";

TEST(DriverExtrasTest, TorchDistRecordReadAndWrittenBack) {
  const std::optional<torch_dist::TorchDistExtras> x =
      torch_dist::ReadTorchDistExtras(
          WithExtra("megatron_torch_dist", kTorchDist), "u.h5");
  ASSERT_TRUE(x.has_value());
  EXPECT_EQ(Nl(x->content_metadata),
            nlohmann::json::parse(R"({"distrib_optim_sharding_type":)"
                                  R"("dp_reshardable",)"
                                  R"("singleton_local_shards":false})"));
  EXPECT_EQ(x->common_in, "common_state");
  EXPECT_EQ(x->optimizer, "dp_reshardable");
  EXPECT_EQ(x->other.Dump(), R"({"future":2})");
  universal::Model out;
  torch_dist::WriteTorchDistExtras(*x, out);
  EXPECT_EQ(out.FindExtra("megatron_torch_dist")->Dump(),
            json::Value::Parse(kTorchDist).Dump());
  // Struct -> record -> struct; a changed member is seen.
  const auto back = torch_dist::ReadTorchDistExtras(out, "u.h5");
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(*back, *x);
  torch_dist::TorchDistExtras changed = *x;
  changed.common_in = "common.pt";
  EXPECT_FALSE(changed == *back);
  EXPECT_FALSE(torch_dist::ReadTorchDistExtras(universal::Model{}, "u.h5"));
}

TEST(DriverExtrasTest, MalformedTorchDistRecordNamesTheMember) {
  auto read = [](const char* text) {
    torch_dist::ReadTorchDistExtras(WithExtra("megatron_torch_dist", text),
                                    "bad.h5");
  };
  EXPECT_THAT(
      [&] { read(R"({"content_metadata":{},"common_in":"common.pt"})"); },
      ThrowsMessage<FormatError>(
          AllOf(HasSubstr("universal file bad.h5 > attribute "
                          "megatron_torch_dist"),
                HasSubstr("missing key \"optimizer\""))));
  EXPECT_THAT(
      [&] {
        read(R"({"content_metadata":[],"common_in":"","optimizer":"none"})");
      },
      ThrowsMessage<FormatError>(HasSubstr(
          "attribute megatron_torch_dist > member content_metadata > not a "
          "JSON object")));
  EXPECT_THAT(
      [&] {
        read(R"({"content_metadata":{},"common_in":1,"optimizer":"none"})");
      },
      ThrowsMessage<FormatError>(
          HasSubstr("attribute megatron_torch_dist > member common_in")));
}

}  // namespace
}  // namespace ucp
