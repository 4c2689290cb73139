// MindSpore's typed extras (mindspore.h MindSporeExtras): the "mindspore"
// attribute as the reader of a MindSpore checkpoint writes it, spelled by
// hand from the format spec in mindspore.h, read into the struct and
// written back; unknown members kept; malformed records refused.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/formats/mindspore/mindspore.h"
#include "engine/universal/model.h"

namespace ucp {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

universal::Model WithRecord(const std::string& text) {
  universal::Model m;
  m.extras["mindspore"] = json::Value::Parse(text);
  return m;
}

// global_step = 7 as an Int32 (little-endian), learning_rate = 0.001f
// (0x3a83126f), then a member ucp does not know.
constexpr char kRecord[] =
    R"({"records":[{"tag":"global_step","type":"Int32","dims":[1],)"
    R"("hex":"07000000"},{"tag":"learning_rate","type":"Float32",)"
    R"("dims":[],"hex":"6f12833a"}],)"
    R"("order":["w","moment1.w","moment2.w","global_step","learning_rate"],)"
    R"("exp_avg_prefix":"adam_m.","exp_avg_sq_prefix":"adam_v.",)"
    R"("file":"llama_rank_0-1_2.ckpt","rank_folder":true,"crc":false,)"
    R"("files":["llama_rank_0-1_2.ckpt","llama_rank_1-1_2.ckpt"],)"
    R"("future":{"x":[1,2]}})";

TEST(MindSporeExtrasTest, RecordReadAndWrittenBack) {
  const std::optional<mindspore::MindSporeExtras> x =
      mindspore::ReadMindSporeExtras(WithRecord(kRecord), "u.h5");
  ASSERT_TRUE(x.has_value());
  ASSERT_TRUE(x->records.has_value());
  ASSERT_EQ(x->records->size(), 2u);
  const mindspore::OtherRecord& step = (*x->records)[0];
  EXPECT_EQ(step.tag, "global_step");
  EXPECT_EQ(step.type, "Int32");
  EXPECT_EQ(step.dims, (std::vector<int64_t>{1}));
  EXPECT_EQ(step.bytes, std::string("\x07\x00\x00\x00", 4));
  const mindspore::OtherRecord& lr = (*x->records)[1];
  EXPECT_TRUE(lr.dims.empty());
  float f = 0;
  ASSERT_EQ(lr.bytes.size(), sizeof f);
  std::memcpy(&f, lr.bytes.data(), sizeof f);
  EXPECT_EQ(f, 0.001f);
  ASSERT_TRUE(x->order.has_value());
  EXPECT_EQ(x->order->size(), 5u);
  EXPECT_EQ(x->order->at(1), "moment1.w");
  EXPECT_EQ(x->exp_avg_prefix, "adam_m.");
  EXPECT_EQ(x->exp_avg_sq_prefix, "adam_v.");
  EXPECT_EQ(x->file, "llama_rank_0-1_2.ckpt");
  EXPECT_EQ(x->rank_folder, true);
  EXPECT_EQ(x->crc, false);
  EXPECT_EQ(x->files, (std::vector<std::string>{"llama_rank_0-1_2.ckpt",
                                                "llama_rank_1-1_2.ckpt"}));
  // Written back: the same document, member order included; the unknown
  // member untouched.
  universal::Model out;
  mindspore::WriteMindSporeExtras(*x, out);
  ASSERT_NE(out.FindExtra("mindspore"), nullptr);
  EXPECT_EQ(nlohmann::json::parse(out.FindExtra("mindspore")->Dump()),
            nlohmann::json::parse(kRecord));
  EXPECT_EQ(out.FindExtra("mindspore")->Dump(),
            json::Value::Parse(kRecord).Dump());
}

TEST(MindSporeExtrasTest, AbsentAndEmptyRecords) {
  EXPECT_FALSE(mindspore::ReadMindSporeExtras(universal::Model{}, "u.h5"));
  const auto empty = mindspore::ReadMindSporeExtras(WithRecord("{}"), "u.h5");
  ASSERT_TRUE(empty.has_value());
  EXPECT_FALSE(empty->records || empty->order || empty->exp_avg_prefix ||
               empty->exp_avg_sq_prefix || empty->file || empty->rank_folder ||
               empty->crc || empty->files);
  universal::Model out;
  mindspore::WriteMindSporeExtras(*empty, out);
  EXPECT_EQ(out.FindExtra("mindspore")->Dump(), "{}");
  // Only unknown members: kept as they are.
  const char* only = R"({"a":1,"b":"x"})";
  universal::Model out2;
  mindspore::WriteMindSporeExtras(
      *mindspore::ReadMindSporeExtras(WithRecord(only), "u.h5"), out2);
  EXPECT_EQ(out2.FindExtra("mindspore")->Dump(),
            json::Value::Parse(only).Dump());
}

// A changed byte of the hex changes the record's bytes (the decoding is
// not blind to the text).
TEST(MindSporeExtrasTest, HexDecodedByte) {
  const auto x = mindspore::ReadMindSporeExtras(
      WithRecord(R"({"records":[{"tag":"s","type":"Int32","dims":[1],)"
                 R"("hex":"08000000"}]})"),
      "u.h5");
  EXPECT_EQ((*x->records)[0].bytes, std::string("\x08\x00\x00\x00", 4));
  EXPECT_NE((*x->records)[0].bytes, std::string("\x07\x00\x00\x00", 4));
}

void ExpectRefused(const std::string& text, const std::string& member,
                   const std::string& what) {
  EXPECT_THAT(
      [&] { mindspore::ReadMindSporeExtras(WithRecord(text), "bad.h5"); },
      ThrowsMessage<FormatError>(AllOf(
          HasSubstr("universal file bad.h5"), HasSubstr("attribute mindspore"),
          HasSubstr("member " + member), HasSubstr(what))))
      << text;
}

TEST(MindSporeExtrasTest, MalformedRecordNamesRecordAndKey) {
  ExpectRefused(R"({"records":[{"type":"Int32","dims":[1],"hex":"00"}]})",
                "records", "\"tag\"");
  ExpectRefused(
      R"({"records":[{"tag":"s","type":"Int32","dims":[1],"hex":"0z"}]})",
      "records", "record s");
  ExpectRefused(
      R"({"records":[{"tag":"s","type":"Int32","dims":[1],"hex":"000"}]})",
      "records", "odd length");
  ExpectRefused(R"({"records":[{"tag":"s","type":"Int32","hex":"00"}]})",
                "records", "\"dims\"");
  ExpectRefused(R"({"records":[7]})", "records", "no object");
  ExpectRefused(R"({"rank_folder":"yes"})", "rank_folder", "expected");
  ExpectRefused(R"({"files":[1]})", "files", "expected");
  ExpectRefused(R"({"exp_avg_prefix":3})", "exp_avg_prefix", "expected");
  EXPECT_THAT(
      [] { mindspore::ReadMindSporeExtras(WithRecord("[1]"), "bad.h5"); },
      ThrowsMessage<FormatError>(AllOf(HasSubstr("attribute mindspore"),
                                       HasSubstr("not a JSON object"))));
}

}  // namespace
}  // namespace ucp
