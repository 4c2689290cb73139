// Hostile JSON (run under ASan + UBSan): every text either parses or is
// rejected with ucp::FormatError; never a crash, stack overflow or undefined
// behaviour.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

#include "engine/core/error.h"
#include "engine/json/json.h"

namespace ucp::json {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(JsonMalformedTest, DeepNestingIsRejectedNotAStackOverflow) {
  for (const char* open_close : {"[]", "{}"}) {
    std::string text;
    constexpr int kDepth = 1'000'000;
    for (int i = 0; i < kDepth; ++i) {
      text += open_close[0];
      if (open_close[0] == '{') text += "\"k\":";
    }
    text += "1";
    text.append(kDepth, open_close[1]);
    EXPECT_THAT([&] { Value::Parse(text); },
                ThrowsMessage<FormatError>(HasSubstr("nested deeper than")));
  }
}

TEST(JsonMalformedTest, NestingUpToTheLimitParsesAndDumps) {
  std::string text(kMaxParseDepth, '[');
  text.append(kMaxParseDepth, ']');
  Value v = Value::Parse(text);
  EXPECT_EQ(v.Dump(), text);
  std::string deeper = "[" + text + "]";
  EXPECT_THROW(Value::Parse(deeper), FormatError);
}

TEST(JsonMalformedTest, HugeNumbersAreNotUndefinedBehaviour) {
  for (const char* text : {"1e308", "-1e308", "1e999", "9.3e18", "-9.3e18",
                           "18446744073709551616"}) {
    SCOPED_TRACE(text);
    Value v;
    try {
      v = Value::Parse(text);
    } catch (const FormatError&) {
      continue;  // out of double's range: rejected by the parser
    }
    EXPECT_THROW(v.AsInt(), FormatError);
  }
}

TEST(JsonMalformedTest, GarbageIsAFormatError) {
  for (const char* text : {"", "{", "[1,", "{\"a\" 1}", "nul", "\"\\ud800\"x",
                           "[1]]", "\xff", "{\"a\":1,}", "01", "\"\x01\""}) {
    SCOPED_TRACE(text);
    EXPECT_THROW(Value::Parse(text), FormatError);
  }
}

}  // namespace
}  // namespace ucp::json
