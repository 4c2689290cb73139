#include "engine/json/json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <limits>
#include <string>

#include "engine/core/error.h"

namespace ucp::json {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(JsonTest, BuildDumpParseKeepsOrderAndTypes) {
  Value v;
  v["zeta"] = 1;
  v["alpha"] = "x";
  v["list"].Append(2.5);
  v["list"].Append(nullptr);
  v["list"].Append(true);
  v["big"] = int64_t{1} << 62;
  std::string text = v.Dump();
  EXPECT_EQ(
      text,
      R"({"zeta":1,"alpha":"x","list":[2.5,null,true],"big":4611686018427387904})");
  Value back = Value::Parse(text);
  EXPECT_EQ(back, v);
  EXPECT_EQ(back.At("big").AsInt(), int64_t{1} << 62);
  EXPECT_EQ(back.members().front().first, "zeta");
  EXPECT_EQ(back.Find("missing"), nullptr);
}

TEST(JsonTest, ErrorsAreFormatErrors) {
  EXPECT_THAT([] { Value::Parse("{\"a\": [1, 2"); },
              ThrowsMessage<FormatError>(HasSubstr("JSON")));
  EXPECT_THAT([] { Value("s").AsInt(); },
              ThrowsMessage<FormatError>(HasSubstr("expected integer")));
  EXPECT_THAT([] { Value::Object().At("k"); },
              ThrowsMessage<FormatError>(HasSubstr("missing key \"k\"")));
}

TEST(JsonTest, IntegralDoublesReadAsInt) {
  EXPECT_EQ(Value::Parse("3.0").AsInt(), 3);
  EXPECT_THROW(Value::Parse("3.5").AsInt(), FormatError);
  EXPECT_DOUBLE_EQ(Value::Parse("7").AsDouble(), 7.0);
}

TEST(JsonTest, NonFiniteDoublesDumpAsNull) {
  Value v = Value::Array();
  v.Append(std::numeric_limits<double>::quiet_NaN());
  v.Append(std::numeric_limits<double>::infinity());
  v.Append(-std::numeric_limits<double>::infinity());
  v.Append(0.1);
  EXPECT_EQ(v.Dump(), "[null,null,null,0.1]");
  EXPECT_EQ(Value::Parse(v.Dump()).items()[3].AsDouble(), 0.1);
}

TEST(JsonTest, Uint64BeyondInt64StaysPositive) {
  const uint64_t big = (uint64_t{1} << 63) + 4096;
  Value v(big);
  EXPECT_EQ(v.type(), Value::Type::kDouble);
  EXPECT_EQ(v.AsDouble(), static_cast<double>(big));
  EXPECT_EQ(Value(uint64_t{7}).AsInt(), 7);
  Value parsed = Value::Parse("18446744073709551615");
  EXPECT_EQ(parsed.type(), Value::Type::kDouble);
  EXPECT_GT(parsed.AsDouble(), 1.8e19);
  EXPECT_EQ(Value::Parse("-9223372036854775808").AsInt(), INT64_MIN);
}

TEST(JsonTest, AsIntRejectsDoublesOutsideInt64) {
  EXPECT_THROW(Value::Parse("1e300").AsInt(), FormatError);
  EXPECT_THROW(Value::Parse("9223372036854775808.0").AsInt(), FormatError);
  EXPECT_THROW(Value(std::numeric_limits<double>::quiet_NaN()).AsInt(),
               FormatError);
  EXPECT_EQ(Value::Parse("-9223372036854775808.0").AsInt(), INT64_MIN);
}

TEST(JsonTest, RepeatedKeyKeepsFirstPositionAndLastValue) {
  Value v = Value::Parse(R"({"a": 1, "b": 2, "a": {"x": [3]}})");
  ASSERT_EQ(v.members().size(), 2u);
  EXPECT_EQ(v.members()[0].first, "a");
  EXPECT_EQ(v.At("a").At("x").items()[0].AsInt(), 3);
  EXPECT_EQ(v.Dump(), R"({"a":{"x":[3]},"b":2})");
}

TEST(JsonTest, FromMembersKeepsOrderAndMergesRepeatedKeys) {
  std::vector<std::pair<std::string, Value>> members;
  members.emplace_back("b", Value(int64_t{1}));
  members.emplace_back("a", Value(int64_t{2}));
  members.emplace_back("b", Value(std::string("x")));
  Value v = Value::FromMembers(std::move(members));
  EXPECT_EQ(v.Dump(), R"({"b":"x","a":2})");
  EXPECT_EQ(Value::FromMembers({}).Dump(), "{}");
}

TEST(JsonTest, NestedDocumentsRoundTrip) {
  const std::string text =
      R"({"k":[1,{"a":[],"b":{}},[[null]],"s\u00e9\n"],"e":{}})";
  Value v = Value::Parse(text);
  EXPECT_EQ(Value::Parse(v.Dump()), v);
  EXPECT_EQ(v.At("k").items()[3].AsString(), "s\xc3\xa9\n");
  EXPECT_EQ(v.At("e").size(), 0u);
  EXPECT_TRUE(v.At("e").is_object());
}

// Objects with many keys (one per parameter of a large model) parse and dump
// in linear time; ordered_json's own member lookup is linear per key.
TEST(JsonTest, LargeObjectsAreLinear) {
  std::string text = "{";
  constexpr int kKeys = 200000;
  for (int i = 0; i < kKeys; ++i) {
    if (i) text += ',';
    text += "\"decoder.layers." + std::to_string(i) +
            ".weight\":" + std::to_string(i);
  }
  text += "}";
  const auto start = std::chrono::steady_clock::now();
  Value v = Value::Parse(text);
  const std::string dumped = v.Dump();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  EXPECT_EQ(v.size(), static_cast<size_t>(kKeys));
  EXPECT_EQ(dumped.size(), text.size());
  EXPECT_LT(seconds, 10.0);
}

}  // namespace
}  // namespace ucp::json
