// The drivers' typed extras (megatron_format.h MegatronExtras, dcp.h
// DcpExtras): each attribute as its reader writes it, spelled by hand from
// the format spec at the top of those headers, read into the struct and
// written back.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "engine/core/error.h"
#include "engine/formats/dcp/dcp.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/universal/model.h"

namespace ucp {
namespace {

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

}  // namespace
}  // namespace ucp
