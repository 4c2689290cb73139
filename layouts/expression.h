#pragma once
// The descriptor's tiny expression language, used by `when`, `exists_when`,
// `defaults`, `layers.count` and the numbers of vocab/QKV placements.
//
//   expr    := or
//   or      := and ("||" and)*
//   and     := cmp ("&&" cmp)*
//   cmp     := sum (("==" | "!=" | "<" | "<=" | ">" | ">=") sum)*
//   sum     := product (("+" | "-") product)*
//   product := unary (("*" | "/" | "%") unary)*
//   unary   := ("!" | "-") unary | primary
//   primary := integer | "true" | "false" | identifier | "(" expr ")"
//
// Values are int64; comparisons and logic yield 0/1, and any non-zero value is
// true. "&&" and "||" short-circuit as in C. "/" and "%" truncate toward zero.
// Identifiers ([A-Za-z_][A-Za-z0-9_]*) name model variables (or tp, pp, vpp,
// dp where the descriptor allows them).

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "layouts/variables.h"

namespace ucp::layouts {

class Expression {
 public:
  /// The constant 1 ("true").
  Expression();

  /// Throws LayoutError "expression '<text>': column N: <problem>" on a
  /// syntax error (column 1-based).
  static Expression Parse(std::string_view text);
  static Expression Constant(int64_t value);

  /// Throws LayoutError if a variable it reaches is not set in `vars`
  /// (naming the variable and the expression), on division by zero or on
  /// int64 overflow.
  int64_t Evaluate(const Variables& vars) const;
  bool IsTrue(const Variables& vars) const { return Evaluate(vars) != 0; }

  /// The source text ("1" for a default-constructed expression).
  const std::string& text() const { return text_; }
  /// The variable names the expression mentions, sorted, without repeats.
  std::vector<std::string> VariableNames() const;

  struct Node;

 private:
  Expression(std::string text, std::shared_ptr<const Node> root);
  std::string text_;
  std::shared_ptr<const Node> root_;
};

}  // namespace ucp::layouts
