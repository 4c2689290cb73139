#pragma once
// A small JSON document type for ucp's summaries, universal-file metadata and
// test truth files. nlohmann::json is used only inside json.cc, so this header
// stays cheap to include.

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ucp::json {

namespace internal {
struct Access;  // json.cc: builds values without per-member lookups
}  // namespace internal

/// Deepest nesting of arrays/objects that Parse accepts.
inline constexpr int kMaxParseDepth = 1000;

class Value {
 public:
  enum class Type : uint8_t {
    kNull,
    kBool,
    kInt,
    kDouble,
    kString,
    kArray,
    kObject
  };

  Value() noexcept = default;  // null
  Value(std::nullptr_t) noexcept {}
  Value(bool b) noexcept : type_(Type::kBool), b_(b) {}
  Value(int i) noexcept : type_(Type::kInt), i_(i) {}
  Value(int64_t i) noexcept : type_(Type::kInt), i_(i) {}
  /// Above INT64_MAX the value is kept as a double (rounded), never wrapped.
  Value(uint64_t i) noexcept
      : type_(i > static_cast<uint64_t>(INT64_MAX) ? Type::kDouble
                                                   : Type::kInt),
        i_(i > static_cast<uint64_t>(INT64_MAX) ? 0 : static_cast<int64_t>(i)),
        d_(static_cast<double>(i)) {}
  Value(double d) noexcept : type_(Type::kDouble), d_(d) {}
  Value(std::string s) noexcept : type_(Type::kString), s_(std::move(s)) {}
  Value(std::string_view s) : type_(Type::kString), s_(s) {}
  Value(const char* s) : type_(Type::kString), s_(s) {}

  static Value Array() {
    Value v;
    v.type_ = Type::kArray;
    return v;
  }
  static Value Object() {
    Value v;
    v.type_ = Type::kObject;
    return v;
  }

  Type type() const noexcept { return type_; }
  bool is_null() const noexcept { return type_ == Type::kNull; }
  bool is_bool() const noexcept { return type_ == Type::kBool; }
  bool is_int() const noexcept { return type_ == Type::kInt; }
  bool is_number() const noexcept {
    return type_ == Type::kInt || type_ == Type::kDouble;
  }
  bool is_string() const noexcept { return type_ == Type::kString; }
  bool is_array() const noexcept { return type_ == Type::kArray; }
  bool is_object() const noexcept { return type_ == Type::kObject; }

  /// Typed accessors. Throw FormatError naming the expected and actual type.
  bool AsBool() const;
  /// Also accepts a double with an integral value in int64's range.
  int64_t AsInt() const;
  double AsDouble() const;
  const std::string& AsString() const;
  const std::vector<Value>& items() const;  // array
  std::vector<Value>& items();
  const std::vector<std::pair<std::string, Value>>& members() const;  // object

  /// Object member or nullptr if absent (or not an object).
  const Value* Find(std::string_view key) const noexcept;
  /// Object member, inserted as null if absent (turns a null into an object).
  /// Linear in the number of members: build large objects with FromMembers.
  Value& operator[](std::string_view key);
  /// An object of these members in order; a repeated key keeps its first
  /// position and its last value. Linear time.
  static Value FromMembers(std::vector<std::pair<std::string, Value>> members);
  /// Object member. Throws FormatError "missing key" if absent.
  const Value& At(std::string_view key) const;
  /// Appends to an array (turns a null into an array).
  void Append(Value v);
  size_t size() const noexcept;

  /// Serialises; indent < 0 gives one line. Always valid JSON: NaN and
  /// infinities (which JSON cannot spell) are written as null, invalid UTF-8
  /// in strings as U+FFFD. Linear in the size of the document.
  std::string Dump(int indent = -1) const;
  /// Parses a JSON text (linear time; a repeated object key keeps its first
  /// position and its last value; integers beyond int64 become doubles).
  /// Throws FormatError with the position on bad input, and for nesting
  /// deeper than kMaxParseDepth.
  static Value Parse(std::string_view text);

  friend bool operator==(const Value& a, const Value& b) noexcept;

 private:
  friend struct internal::Access;
  Type type_ = Type::kNull;
  bool b_ = false;
  int64_t i_ = 0;
  double d_ = 0;
  std::string s_;
  std::vector<Value> items_;
  std::vector<std::pair<std::string, Value>> members_;
};

}  // namespace ucp::json
