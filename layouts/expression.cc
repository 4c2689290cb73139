#include "layouts/expression.h"

#include <algorithm>
#include <cctype>
#include <limits>
#include <set>

#include "engine/core/error.h"

namespace ucp::layouts {

struct Expression::Node {
  enum class Op {
    kConst,
    kVar,
    kNot,
    kNeg,
    kOr,
    kAnd,
    kEq,
    kNe,
    kLt,
    kLe,
    kGt,
    kGe,
    kAdd,
    kSub,
    kMul,
    kDiv,
    kMod
  };
  Op op = Op::kConst;
  int64_t value = 0;
  std::string name;
  std::unique_ptr<Node> lhs;
  std::unique_ptr<Node> rhs;
};

namespace {

using Node = Expression::Node;
using Op = Node::Op;

// Bounds the depth of the trees (and so the recursion that walks them).
constexpr size_t kMaxLength = 4096;

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  std::unique_ptr<Node> ParseAll() {
    auto node = ParseOr();
    SkipSpace();
    if (pos_ < text_.size()) Fail("unexpected '", text_.substr(pos_, 1), "'");
    return node;
  }

 private:
  template <typename... Args>
  [[noreturn]] void Fail(Args&&... args) const {
    throw LayoutError("expression '", text_, "': column ", pos_ + 1, ": ",
                      std::forward<Args>(args)...);
  }

  void SkipSpace() {
    while (pos_ < text_.size() &&
           std::isspace(static_cast<unsigned char>(text_[pos_]))) {
      ++pos_;
    }
  }

  // Consumes `token` if it comes next (and, for "<"/">"/"!", is not the
  // first character of a longer operator).
  bool Accept(std::string_view token) {
    SkipSpace();
    if (text_.substr(pos_, token.size()) != token) return false;
    if (token.size() == 1 &&
        (token == "<" || token == ">" || token == "!" || token == "=")) {
      if (pos_ + 1 < text_.size() && text_[pos_ + 1] == '=') return false;
    }
    pos_ += token.size();
    return true;
  }

  static std::unique_ptr<Node> Binary(Op op, std::unique_ptr<Node> lhs,
                                      std::unique_ptr<Node> rhs) {
    auto node = std::make_unique<Node>();
    node->op = op;
    node->lhs = std::move(lhs);
    node->rhs = std::move(rhs);
    return node;
  }

  std::unique_ptr<Node> ParseOr() {
    auto node = ParseAnd();
    while (Accept("||")) node = Binary(Op::kOr, std::move(node), ParseAnd());
    return node;
  }

  std::unique_ptr<Node> ParseAnd() {
    auto node = ParseCmp();
    while (Accept("&&")) node = Binary(Op::kAnd, std::move(node), ParseCmp());
    return node;
  }

  std::unique_ptr<Node> ParseCmp() {
    auto node = ParseSum();
    while (true) {
      Op op;
      if (Accept("==")) {
        op = Op::kEq;
      } else if (Accept("!=")) {
        op = Op::kNe;
      } else if (Accept("<=")) {
        op = Op::kLe;
      } else if (Accept(">=")) {
        op = Op::kGe;
      } else if (Accept("<")) {
        op = Op::kLt;
      } else if (Accept(">")) {
        op = Op::kGt;
      } else {
        SkipSpace();
        if (pos_ < text_.size() && text_[pos_] == '=') {
          Fail("'=' is not an operator (did you mean '=='?)");
        }
        return node;
      }
      node = Binary(op, std::move(node), ParseSum());
    }
  }

  std::unique_ptr<Node> ParseSum() {
    auto node = ParseProduct();
    while (true) {
      if (Accept("+")) {
        node = Binary(Op::kAdd, std::move(node), ParseProduct());
      } else if (Accept("-")) {
        node = Binary(Op::kSub, std::move(node), ParseProduct());
      } else {
        return node;
      }
    }
  }

  std::unique_ptr<Node> ParseProduct() {
    auto node = ParseUnary();
    while (true) {
      if (Accept("*")) {
        node = Binary(Op::kMul, std::move(node), ParseUnary());
      } else if (Accept("/")) {
        node = Binary(Op::kDiv, std::move(node), ParseUnary());
      } else if (Accept("%")) {
        node = Binary(Op::kMod, std::move(node), ParseUnary());
      } else {
        return node;
      }
    }
  }

  std::unique_ptr<Node> ParseUnary() {
    if (++depth_ > 200) Fail("nested too deeply");
    std::unique_ptr<Node> node;
    if (Accept("!")) {
      node = std::make_unique<Node>();
      node->op = Op::kNot;
      node->lhs = ParseUnary();
    } else if (Accept("-")) {
      node = std::make_unique<Node>();
      node->op = Op::kNeg;
      node->lhs = ParseUnary();
    } else {
      node = ParsePrimary();
    }
    --depth_;
    return node;
  }

  std::unique_ptr<Node> ParsePrimary() {
    SkipSpace();
    if (pos_ >= text_.size()) Fail("expected a number, a name or '('");
    const char c = text_[pos_];
    auto node = std::make_unique<Node>();
    if (c == '(') {
      ++pos_;
      node = ParseOr();
      if (!Accept(")")) Fail("expected ')'");
      return node;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      int64_t value = 0;
      while (pos_ < text_.size() &&
             std::isdigit(static_cast<unsigned char>(text_[pos_]))) {
        const int digit = text_[pos_] - '0';
        if (value > (std::numeric_limits<int64_t>::max() - digit) / 10) {
          Fail("integer too large");
        }
        value = value * 10 + digit;
        ++pos_;
      }
      if (pos_ < text_.size() && IsNameChar(text_[pos_])) {
        Fail("unexpected '", text_.substr(pos_, 1), "' after a number");
      }
      node->op = Op::kConst;
      node->value = value;
      return node;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      const size_t start = pos_;
      while (pos_ < text_.size() && IsNameChar(text_[pos_])) ++pos_;
      std::string name(text_.substr(start, pos_ - start));
      if (name == "true" || name == "false") {
        node->op = Op::kConst;
        node->value = name == "true" ? 1 : 0;
      } else {
        node->op = Op::kVar;
        node->name = std::move(name);
      }
      return node;
    }
    Fail("expected a number, a name or '(' but found '", text_.substr(pos_, 1),
         "'");
  }

  static bool IsNameChar(char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
  }

  std::string_view text_;
  size_t pos_ = 0;
  int depth_ = 0;
};

struct Evaluator {
  const Variables& vars;
  const std::string& text;

  template <typename... Args>
  [[noreturn]] void Fail(Args&&... args) const {
    throw LayoutError("expression '", text, "': ", std::forward<Args>(args)...);
  }

  // Applies a __builtin_*_overflow operation.
  template <typename Op>
  int64_t Checked(Op op, int64_t a, int64_t b) const {
    int64_t out = 0;
    if (op(a, b, &out)) Fail("int64 overflow");
    return out;
  }
  static bool Add(int64_t a, int64_t b, int64_t* out) {
    return __builtin_add_overflow(a, b, out);
  }
  static bool Sub(int64_t a, int64_t b, int64_t* out) {
    return __builtin_sub_overflow(a, b, out);
  }
  static bool Mul(int64_t a, int64_t b, int64_t* out) {
    return __builtin_mul_overflow(a, b, out);
  }

  int64_t Eval(const Node& n) const {
    switch (n.op) {
      case Op::kConst:
        return n.value;
      case Op::kVar: {
        if (auto v = vars.Find(n.name)) return *v;
        Fail("variable '", n.name, "' is not set (set: ",
             vars.values().empty() ? std::string("none") : vars.ToString(),
             ")");
      }
      case Op::kNot:
        return Eval(*n.lhs) == 0 ? 1 : 0;
      case Op::kNeg:
        return Checked(Sub, 0, Eval(*n.lhs));
      case Op::kOr:
        return (Eval(*n.lhs) != 0 || Eval(*n.rhs) != 0) ? 1 : 0;
      case Op::kAnd:
        return (Eval(*n.lhs) != 0 && Eval(*n.rhs) != 0) ? 1 : 0;
      default:
        break;
    }
    const int64_t a = Eval(*n.lhs);
    const int64_t b = Eval(*n.rhs);
    switch (n.op) {
      case Op::kEq:
        return a == b;
      case Op::kNe:
        return a != b;
      case Op::kLt:
        return a < b;
      case Op::kLe:
        return a <= b;
      case Op::kGt:
        return a > b;
      case Op::kGe:
        return a >= b;
      case Op::kAdd:
        return Checked(Add, a, b);
      case Op::kSub:
        return Checked(Sub, a, b);
      case Op::kMul:
        return Checked(Mul, a, b);
      case Op::kDiv:
      case Op::kMod:
        if (b == 0) Fail("division by zero");
        if (a == std::numeric_limits<int64_t>::min() && b == -1) {
          Fail("int64 overflow");
        }
        return n.op == Op::kDiv ? a / b : a % b;
      default:
        UCP_CHECK(false, "unhandled expression operator");
    }
  }
};

void CollectNames(const Node* n, std::set<std::string>& out) {
  if (n == nullptr) return;
  if (n->op == Op::kVar) out.insert(n->name);
  CollectNames(n->lhs.get(), out);
  CollectNames(n->rhs.get(), out);
}

}  // namespace

Expression::Expression() : Expression(Constant(1)) {}

Expression::Expression(std::string text, std::shared_ptr<const Node> root)
    : text_(std::move(text)), root_(std::move(root)) {}

Expression Expression::Parse(std::string_view text) {
  if (text.size() > kMaxLength) {
    throw LayoutError("expression of ", text.size(),
                      " characters is too long (at most ", kMaxLength, ")");
  }
  Parser parser(text);
  std::shared_ptr<const Node> root = parser.ParseAll();
  return Expression(std::string(text), std::move(root));
}

Expression Expression::Constant(int64_t value) {
  auto node = std::make_shared<Node>();
  node->op = Op::kConst;
  node->value = value;
  return Expression(std::to_string(value), std::move(node));
}

int64_t Expression::Evaluate(const Variables& vars) const {
  return Evaluator{vars, text_}.Eval(*root_);
}

std::vector<std::string> Expression::VariableNames() const {
  std::set<std::string> names;
  CollectNames(root_.get(), names);
  return {names.begin(), names.end()};
}

}  // namespace ucp::layouts
