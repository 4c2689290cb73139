#include "engine/atoms/names.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/core/error.h"

namespace ucp::atoms {
namespace {

// Expected encodings follow the rules documented in names.h.
TEST(EscapeLinkNameTest, EncodesSlashPercentAndDotNames) {
  EXPECT_EQ(EscapeLinkName("layers.0.weight"), "layers.0.weight");
  EXPECT_EQ(EscapeLinkName("a/b"), "a%2Fb");
  EXPECT_EQ(EscapeLinkName("100%"), "100%25");
  EXPECT_EQ(EscapeLinkName("a%2Fb"), "a%252Fb");
  EXPECT_EQ(EscapeLinkName("."), "%2E");
  EXPECT_EQ(EscapeLinkName(".."), "%2E.");
  EXPECT_EQ(EscapeLinkName("..."), "...");
  EXPECT_EQ(EscapeLinkName("/"), "%2F");
  EXPECT_EQ(EscapeLinkName("层.权重"), "层.权重");
}

TEST(EscapeLinkNameTest, EncodesReservedWord) {
  EXPECT_EQ(EscapeLinkName("pad", "pad"), "%70ad");
  EXPECT_EQ(EscapeLinkName("pad"), "pad");
  EXPECT_EQ(EscapeLinkName("pads", "pad"), "pads");
}

TEST(EscapeLinkNameTest, RejectsEmptyName) {
  EXPECT_THROW(EscapeLinkName(""), InternalError);
}

TEST(UnescapeLinkNameTest, InvertsEscape) {
  for (const char* name : {"a", "a/b", "%", "%%", "%2F", ".", "..", "pad",
                           "a/./b", "/x/", "ключ/值", "\x01\x7f"}) {
    for (const char* reserved : {"", "pad"}) {
      std::string link = EscapeLinkName(name, reserved);
      EXPECT_EQ(link.find('/'), std::string::npos) << link;
      EXPECT_NE(link, ".");
      EXPECT_NE(link, "..");
      EXPECT_EQ(UnescapeLinkName(link), std::string(name)) << link;
    }
  }
}

TEST(UnescapeLinkNameTest, AcceptsLowerCaseHex) {
  EXPECT_EQ(UnescapeLinkName("a%2fb"), "a/b");
}

TEST(UnescapeLinkNameTest, RejectsMalformedEscapes) {
  EXPECT_EQ(UnescapeLinkName("%"), std::nullopt);
  EXPECT_EQ(UnescapeLinkName("a%2"), std::nullopt);
  EXPECT_EQ(UnescapeLinkName("%G0"), std::nullopt);
  EXPECT_EQ(UnescapeLinkName(""), std::nullopt);
}

}  // namespace
}  // namespace ucp::atoms
