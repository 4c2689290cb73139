#include "engine/json/json.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

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
  EXPECT_EQ(text,
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

}  // namespace
}  // namespace ucp::json
