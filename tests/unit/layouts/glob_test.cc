#include "layouts/glob.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>
#include <regex>

#include "engine/core/error.h"
#include "tests/testutil/testutil.h"

namespace ucp::layouts {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(GlobTest, StarMatchesAnyRunIncludingDots) {
  const Glob g = Glob::Compile("decoder.layers.*.mlp.linear_fc1.weight");
  EXPECT_TRUE(g.Matches("decoder.layers.0.mlp.linear_fc1.weight"));
  EXPECT_TRUE(g.Matches("decoder.layers.123.mlp.linear_fc1.weight"));
  EXPECT_TRUE(g.Matches("decoder.layers.1.x.y.mlp.linear_fc1.weight"));
  EXPECT_FALSE(g.Matches("decoder.layers.0.mlp.linear_fc1.bias"));
  EXPECT_FALSE(g.Matches("decoder.layers.0.mlp.linear_fc1.weightx"));
  EXPECT_FALSE(g.Matches("xdecoder.layers.0.mlp.linear_fc1.weight"));
  EXPECT_TRUE(
      Glob::Compile("*._extra_state").Matches("output_layer._extra_state"));
  EXPECT_FALSE(Glob::Compile("*._extra_state").Matches("_extra_state"));
  EXPECT_TRUE(Glob::Compile("*").Matches(""));
  EXPECT_TRUE(Glob::Compile("a**b").Matches("ab"));
  EXPECT_FALSE(Glob::Compile("a").Matches("ab"));
}

TEST(GlobTest, BracesExpandToAlternatives) {
  const Glob g = Glob::Compile("x.{input_norm,input_layernorm}.{weight,bias}");
  EXPECT_EQ(g.alternatives(),
            (std::vector<std::string>{
                "x.input_norm.weight", "x.input_norm.bias",
                "x.input_layernorm.weight", "x.input_layernorm.bias"}));
  EXPECT_TRUE(g.Matches("x.input_layernorm.bias"));
  EXPECT_FALSE(g.Matches("x.input_norm.scale"));
  EXPECT_EQ(Glob::Compile("norm{,_1}").alternatives(),
            (std::vector<std::string>{"norm", "norm_1"}));
  EXPECT_EQ(g.pattern(), "x.{input_norm,input_layernorm}.{weight,bias}");
}

TEST(GlobTest, RejectsBadBraces) {
  EXPECT_THAT(
      [] { Glob::Compile("a.{b,c"); },
      ThrowsMessage<LayoutError>(HasSubstr("column 3: '{' without '}'")));
  EXPECT_THAT(
      [] { Glob::Compile("a.b}"); },
      ThrowsMessage<LayoutError>(HasSubstr("column 4: '}' without '{'")));
  EXPECT_THAT([] { Glob::Compile("{a,{b}}"); },
              ThrowsMessage<LayoutError>(HasSubstr("nested '{'")));
  EXPECT_THAT(
      [] {
        Glob::Compile(
            "{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}{a,b}");
      },
      ThrowsMessage<LayoutError>(HasSubstr("more than 1024")));
}

// Oracle: std::regex with each '*' as ".*" and '.' escaped.
TEST(GlobProperty, StarMatchAgreesWithRegex) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const std::string alphabet = "ab.*";
  for (int i = 0; i < 20000; ++i) {
    std::string pattern, name;
    for (size_t n = rng() % 8; n > 0; --n) pattern += alphabet[rng() % 4];
    for (size_t n = rng() % 10; n > 0; --n) name += alphabet[rng() % 3];
    std::string re;
    for (char c : pattern)
      re += c == '*' ? ".*" : c == '.' ? "\\." : std::string(1, c);
    const bool want = std::regex_match(name, std::regex(re));
    ASSERT_EQ(StarMatch(pattern, name), want)
        << "pattern '" << pattern << "' name '" << name << "'";
  }
}

TEST(GlobTest, EditDistance) {
  EXPECT_EQ(EditDistance("", ""), 0u);
  EXPECT_EQ(EditDistance("abc", ""), 3u);
  EXPECT_EQ(EditDistance("kitten", "sitting"), 3u);
  EXPECT_EQ(EditDistance("flaw", "lawn"), 2u);
  // Capped: the distance, or the limit when it is that far or farther.
  EXPECT_EQ(EditDistance("kitten", "sitting", 4), 3u);
  EXPECT_EQ(EditDistance("kitten", "sitting", 3), 3u);
  EXPECT_EQ(EditDistance("kitten", "sitting", 2), 2u);
  EXPECT_EQ(EditDistance("abc", std::string(100000, 'x'), 64), 64u);
  EXPECT_EQ(EditDistance(std::string(300, 'a'), std::string(300, 'b'), 10),
            10u);
}

TEST(GlobTest, HashMatchesADecimalNumber) {
  const Glob norm = Glob::Compile("#.{weight,bias}");
  EXPECT_TRUE(norm.Matches("9.weight"));
  EXPECT_TRUE(norm.Matches("105.bias"));
  EXPECT_FALSE(norm.Matches("9.input_layernorm.weight"));
  EXPECT_FALSE(norm.Matches(".weight"));
  EXPECT_FALSE(norm.Matches("x9.weight"));
  const Glob layer = Glob::Compile("#.self_attention.*.weight");
  EXPECT_TRUE(layer.Matches("12.self_attention.dense.weight"));
  EXPECT_FALSE(layer.Matches("tied_modules.self_attention.dense.weight"));
}

// Oracle: std::regex with '*' as ".*", '#' as "[0-9]+" and '.' escaped.
TEST(GlobProperty, HashAndStarAgreeWithRegex) {
  const uint64_t seed = testutil::Seed();
  SCOPED_TRACE(testing::Message() << "UCP_TEST_SEED=" << seed);
  std::mt19937_64 rng(seed);
  const std::string alphabet = "a1.*#";
  for (int i = 0; i < 20000; ++i) {
    std::string pattern, name;
    for (size_t n = rng() % 8; n > 0; --n) pattern += alphabet[rng() % 5];
    for (size_t n = rng() % 10; n > 0; --n) name += alphabet[rng() % 3];
    std::string re;
    for (char c : pattern)
      re += c == '*'   ? ".*"
            : c == '#' ? "[0-9]+"
            : c == '.' ? "\\."
                       : std::string(1, c);
    const bool want = std::regex_match(name, std::regex(re));
    ASSERT_EQ(StarMatch(pattern, name), want)
        << "pattern '" << pattern << "' name '" << name << "'";
  }
}

}  // namespace
}  // namespace ucp::layouts
