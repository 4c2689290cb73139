#include "engine/json/json.h"

#include <cmath>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "engine/core/error.h"

namespace ucp::json {
namespace {

using Ordered = nlohmann::ordered_json;

const char* TypeName(Value::Type t) {
  switch (t) {
    case Value::Type::kNull:
      return "null";
    case Value::Type::kBool:
      return "bool";
    case Value::Type::kInt:
      return "integer";
    case Value::Type::kDouble:
      return "number";
    case Value::Type::kString:
      return "string";
    case Value::Type::kArray:
      return "array";
    case Value::Type::kObject:
      return "object";
  }
  return "?";
}

[[noreturn]] void TypeMismatch(Value::Type want, Value::Type got) {
  throw FormatError("JSON: expected ", TypeName(want), ", found ",
                    TypeName(got));
}

}  // namespace

// Builds nlohmann documents from Values and Values from a SAX parse, both in
// linear time: ordered_json's own operator[] searches its members linearly,
// which makes building an object of n keys O(n^2).
struct internal::Access {
  static Ordered ToNlohmann(const Value& v) {
    switch (v.type_) {
      case Value::Type::kNull:
        return nullptr;
      case Value::Type::kBool:
        return v.b_;
      case Value::Type::kInt:
        return v.i_;
      case Value::Type::kDouble:
        return v.d_;
      case Value::Type::kString:
        return v.s_;
      case Value::Type::kArray: {
        Ordered a = Ordered::array();
        a.get_ref<Ordered::array_t&>().reserve(v.items_.size());
        for (const Value& item : v.items_) a.push_back(ToNlohmann(item));
        return a;
      }
      case Value::Type::kObject: {
        Ordered o = Ordered::object();
        // Keys are unique (operator[] and Parse keep them so): append to
        // the underlying vector without ordered_map's linear key search.
        auto& members = static_cast<Ordered::object_t::Container&>(
            o.get_ref<Ordered::object_t&>());
        members.reserve(v.members_.size());
        for (const auto& [k, item] : v.members_) {
          members.emplace_back(k, ToNlohmann(item));
        }
        return o;
      }
    }
    return nullptr;
  }

  // nlohmann's SAX interface (json_sax): every event lands directly in the
  // Value tree. Only the innermost open container grows, so the pointers to
  // the open containers on `stack_` stay valid.
  class Builder {
   public:
    using number_integer_t = Ordered::number_integer_t;
    using number_unsigned_t = Ordered::number_unsigned_t;
    using number_float_t = Ordered::number_float_t;
    using string_t = Ordered::string_t;
    using binary_t = Ordered::binary_t;

    Value Take() { return std::move(root_); }

    bool null() { return Put(Value()); }
    bool boolean(bool b) { return Put(Value(b)); }
    bool number_integer(number_integer_t i) { return Put(Value(int64_t{i})); }
    bool number_unsigned(number_unsigned_t u) {
      return Put(Value(uint64_t{u}));
    }
    bool number_float(number_float_t d, const string_t&) {
      return Put(Value(double{d}));
    }
    bool string(string_t& s) { return Put(Value(std::move(s))); }
    bool binary(binary_t&) {
      throw FormatError("JSON: binary values are not supported");
    }
    bool start_object(std::size_t) { return Open(Value::Object()); }
    bool key(string_t& k) {
      Frame& f = stack_.back();
      auto [it, inserted] = f.keys.emplace(k, f.container->members_.size());
      if (inserted) {
        f.container->members_.emplace_back(std::move(k), Value());
        f.slot = &f.container->members_.back().second;
      } else {  // a repeated key: its last value wins, at its first position
        f.slot = &f.container->members_[it->second].second;
        *f.slot = Value();
      }
      return true;
    }
    bool end_object() { return Close(); }
    bool start_array(std::size_t) { return Open(Value::Array()); }
    bool end_array() { return Close(); }
    bool parse_error(std::size_t, const std::string&,
                     const nlohmann::detail::exception& e) {
      throw FormatError("JSON: ", e.what());
    }

   private:
    struct Frame {
      Value* container;
      Value* slot = nullptr;  // objects: where the next value goes
      std::unordered_map<std::string, size_t> keys;
    };

    Value* Place(Value v) {
      if (stack_.empty()) {
        root_ = std::move(v);
        return &root_;
      }
      Frame& f = stack_.back();
      if (f.container->type_ == Value::Type::kArray) {
        f.container->items_.push_back(std::move(v));
        return &f.container->items_.back();
      }
      *f.slot = std::move(v);
      return f.slot;
    }
    bool Put(Value v) {
      Place(std::move(v));
      return true;
    }
    bool Open(Value container) {
      if (stack_.size() >= static_cast<size_t>(kMaxParseDepth)) {
        throw FormatError("JSON: nested deeper than ", kMaxParseDepth,
                          " levels");
      }
      stack_.push_back(Frame{Place(std::move(container))});
      return true;
    }
    bool Close() {
      stack_.pop_back();
      return true;
    }

    Value root_;
    std::vector<Frame> stack_;
  };
};

namespace {}  // namespace

bool Value::AsBool() const {
  if (type_ != Type::kBool) TypeMismatch(Type::kBool, type_);
  return b_;
}

int64_t Value::AsInt() const {
  if (type_ == Type::kInt) return i_;
  // [-2^63, 2^63) is exactly int64's range; outside it (and for NaN) the
  // conversion would be undefined.
  if (type_ == Type::kDouble && d_ >= -0x1p63 && d_ < 0x1p63 &&
      d_ == std::trunc(d_)) {
    return static_cast<int64_t>(d_);
  }
  TypeMismatch(Type::kInt, type_);
}

double Value::AsDouble() const {
  if (type_ == Type::kDouble) return d_;
  if (type_ == Type::kInt) return static_cast<double>(i_);
  TypeMismatch(Type::kDouble, type_);
}

const std::string& Value::AsString() const {
  if (type_ != Type::kString) TypeMismatch(Type::kString, type_);
  return s_;
}

const std::vector<Value>& Value::items() const {
  if (type_ != Type::kArray) TypeMismatch(Type::kArray, type_);
  return items_;
}

std::vector<Value>& Value::items() {
  if (type_ != Type::kArray) TypeMismatch(Type::kArray, type_);
  return items_;
}

const std::vector<std::pair<std::string, Value>>& Value::members() const {
  if (type_ != Type::kObject) TypeMismatch(Type::kObject, type_);
  return members_;
}

const Value* Value::Find(std::string_view key) const noexcept {
  if (type_ != Type::kObject) return nullptr;
  for (const auto& [k, v] : members_) {
    if (k == key) return &v;
  }
  return nullptr;
}

Value& Value::operator[](std::string_view key) {
  if (type_ == Type::kNull) type_ = Type::kObject;
  if (type_ != Type::kObject) TypeMismatch(Type::kObject, type_);
  for (auto& [k, v] : members_) {
    if (k == key) return v;
  }
  members_.emplace_back(std::string(key), Value());
  return members_.back().second;
}

Value Value::FromMembers(std::vector<std::pair<std::string, Value>> members) {
  Value o = Object();
  std::unordered_map<std::string_view, size_t> index;
  o.members_.reserve(members.size());
  for (auto& [k, v] : members) {
    auto it = index.find(k);
    if (it != index.end()) {
      o.members_[it->second].second = std::move(v);
      continue;
    }
    o.members_.emplace_back(std::move(k), std::move(v));
    index.emplace(o.members_.back().first, o.members_.size() - 1);
  }
  return o;
}

const Value& Value::At(std::string_view key) const {
  const Value* v = Find(key);
  if (v == nullptr) throw FormatError("JSON: missing key \"", key, "\"");
  return *v;
}

void Value::Append(Value v) {
  if (type_ == Type::kNull) type_ = Type::kArray;
  if (type_ != Type::kArray) TypeMismatch(Type::kArray, type_);
  items_.push_back(std::move(v));
}

size_t Value::size() const noexcept {
  if (type_ == Type::kArray) return items_.size();
  if (type_ == Type::kObject) return members_.size();
  return 0;
}

std::string Value::Dump(int indent) const {
  return internal::Access::ToNlohmann(*this).dump(
      indent, ' ', false, Ordered::error_handler_t::replace);
}

Value Value::Parse(std::string_view text) {
  internal::Access::Builder builder;
  try {
    Ordered::sax_parse(text.begin(), text.end(), &builder);
  } catch (const nlohmann::json::exception& e) {
    throw FormatError("JSON: ", e.what());
  }
  return builder.Take();
}

bool operator==(const Value& a, const Value& b) noexcept {
  if (a.type_ != b.type_) return false;
  switch (a.type_) {
    case Value::Type::kNull:
      return true;
    case Value::Type::kBool:
      return a.b_ == b.b_;
    case Value::Type::kInt:
      return a.i_ == b.i_;
    case Value::Type::kDouble:
      return a.d_ == b.d_;
    case Value::Type::kString:
      return a.s_ == b.s_;
    case Value::Type::kArray:
      return a.items_ == b.items_;
    case Value::Type::kObject:
      return a.members_ == b.members_;
  }
  return false;
}

}  // namespace ucp::json
