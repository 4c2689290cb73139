#include "layouts/expression.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/core/error.h"
#include "tests/unit/layouts/topology_testutil.h"

namespace ucp::layouts {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

int64_t Eval(std::string_view text, const Variables& vars = {}) {
  return Expression::Parse(text).Evaluate(vars);
}

TEST(ExpressionTest, EvaluatesWithCPrecedence) {
  const Variables vars = {{"a", 3}, {"b", 4}, {"swiglu", 1}, {"pp", 2}};
  struct Case {
    const char* text;
    int64_t want;
  } cases[] = {
      {"1", 1},
      {"true", 1},
      {"false", 0},
      {"a", 3},
      {"!a", 0},
      {"!!a", 1},
      {"-a", -3},
      {"a + b * 2", 11},
      {"(a + b) * 2", 14},
      {"b / a", 1},
      {"-7 / 2", -3},  // truncation toward zero, as C
      {"-7 % 2", -1},
      {"a - b - 1", -2},  // left associative
      {"a < b", 1},
      {"a <= 3", 1},
      {"a > b", 0},
      {"a >= 4", 0},
      {"a == 3", 1},
      {"a != 3", 0},
      {"a == 3 && b == 4", 1},
      {"a == 3 && b == 5", 0},
      {"a == 0 || b == 4", 1},
      {"1 || 0 && 0", 1},  // && binds tighter than ||
      {"!swiglu || pp > 1", 1},
      {"!(swiglu && pp > 1)", 0},
      {"1 + 2 == 3", 1},  // arithmetic binds tighter than comparison
      {"1 < 2 == 1", 1},  // comparisons chain left to right
      {"  a\t+\nb ", 7},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(Eval(c.text, vars), c.want) << c.text;
  }
}

TEST(ExpressionTest, ShortCircuits) {
  EXPECT_EQ(Eval("0 && unset_variable"), 0);
  EXPECT_EQ(Eval("1 || unset_variable"), 1);
  EXPECT_EQ(Eval("0 && 1 / 0"), 0);
}

TEST(ExpressionTest, SyntaxErrorsNameTheColumn) {
  struct Case {
    const char* text;
    const char* want;
  } cases[] = {
      {"", "column 1: expected a number, a name or '('"},
      {"a &&", "column 5: expected a number"},
      {"(a", "column 3: expected ')'"},
      {"a b", "column 3: unexpected 'b'"},
      {"a = 1", "column 3: '=' is not an operator (did you mean '=='?)"},
      {"a & b", "column 3: unexpected '&'"},
      {"3x", "column 2: unexpected 'x' after a number"},
      {"a + $", "column 5: expected a number, a name or '(' but found '$'"},
      {"99999999999999999999", "integer too large"},
  };
  for (const Case& c : cases) {
    EXPECT_THAT([&] { Expression::Parse(c.text); },
                ThrowsMessage<LayoutError>(HasSubstr(c.want)))
        << c.text;
  }
  EXPECT_THAT([] { Expression::Parse("a &&"); },
              ThrowsMessage<LayoutError>(HasSubstr("expression 'a &&'")));
}

TEST(ExpressionTest, RejectsDeepNestingAndLongText) {
  EXPECT_THAT(
      [] {
        Expression::Parse(std::string(300, '(') + "1" + std::string(300, ')'));
      },
      ThrowsMessage<LayoutError>(HasSubstr("nested too deeply")));
  EXPECT_THAT([] { Expression::Parse(std::string(5000, '1')); },
              ThrowsMessage<LayoutError>(HasSubstr("too long")));
}

TEST(ExpressionTest, EvaluationErrors) {
  const Variables vars = {{"a", 1}};
  EXPECT_THAT([&] { Eval("a && missing", vars); },
              ThrowsMessage<LayoutError>(AllOf(
                  HasSubstr("variable 'missing' is not set"), HasSubstr("a=1"),
                  HasSubstr("expression 'a && missing'"))));
  EXPECT_THAT([] { Eval("1 / 0"); },
              ThrowsMessage<LayoutError>(HasSubstr("division by zero")));
  EXPECT_THAT([] { Eval("5 % (2 - 2)"); },
              ThrowsMessage<LayoutError>(HasSubstr("division by zero")));
  EXPECT_THAT([] { Eval("9223372036854775807 + 1"); },
              ThrowsMessage<LayoutError>(HasSubstr("overflow")));
  EXPECT_THAT([] { Eval("4611686018427387904 * 2"); },
              ThrowsMessage<LayoutError>(HasSubstr("overflow")));
  EXPECT_EQ(Eval("-9223372036854775807 - 1"), INT64_MIN);
  EXPECT_THAT([] { Eval("(-9223372036854775807 - 1) / -1"); },
              ThrowsMessage<LayoutError>(HasSubstr("overflow")));
}

TEST(ExpressionTest, VariableNamesAndText) {
  const Expression e = Expression::Parse("tied && pp > 1 || tied");
  EXPECT_EQ(e.text(), "tied && pp > 1 || tied");
  EXPECT_EQ(e.VariableNames(), (std::vector<std::string>{"pp", "tied"}));
  EXPECT_EQ(Expression().text(), "1");
  EXPECT_TRUE(Expression().IsTrue({}));
  EXPECT_EQ(Expression::Constant(-4).Evaluate({}), -4);
  EXPECT_TRUE(Expression::Parse("true").VariableNames().empty());
}

TEST(VariablesTest, SetFindGetMerge) {
  Variables v = {{"a", 1}};
  v.Set("b", 2);
  v.Set("a", 5);
  EXPECT_EQ(v.Find("a"), 5);
  EXPECT_EQ(v.Find("c"), std::nullopt);
  EXPECT_EQ(v.Get("b"), 2);
  EXPECT_THAT(
      [&] { v.Get("c"); },
      ThrowsMessage<LayoutError>(HasSubstr("model variable 'c' is not set")));
  const Variables m = v.Merged({{"b", 7}, {"c", 8}});
  EXPECT_EQ(m.ToString(), "a=5, b=7, c=8");
  const Variables t = WithTopology(v, Topo(2, 3, 4, 5));
  EXPECT_EQ(t.ToString(), "a=5, b=2, dp=5, pp=3, tp=2, vpp=4");
  EXPECT_TRUE(IsTopologyVariable("vpp"));
  EXPECT_FALSE(IsTopologyVariable("num_layers"));
  EXPECT_EQ((Topo(2, 4, 1, 1, 3)).ToString(),
            "tp=2 pp=4 vpp=1 dp=1 first_stage_layers=3");
}

}  // namespace
}  // namespace ucp::layouts
