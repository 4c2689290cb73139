#include "engine/json/json.h"

#include <nlohmann/json.hpp>

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

Ordered ToNlohmann(const Value& v) {
  switch (v.type()) {
    case Value::Type::kNull:
      return nullptr;
    case Value::Type::kBool:
      return v.AsBool();
    case Value::Type::kInt:
      return v.AsInt();
    case Value::Type::kDouble:
      return v.AsDouble();
    case Value::Type::kString:
      return v.AsString();
    case Value::Type::kArray: {
      Ordered a = Ordered::array();
      for (const Value& item : v.items()) a.push_back(ToNlohmann(item));
      return a;
    }
    case Value::Type::kObject: {
      Ordered o = Ordered::object();
      for (const auto& [k, item] : v.members()) o[k] = ToNlohmann(item);
      return o;
    }
  }
  return nullptr;
}

Value FromNlohmann(const Ordered& j) {
  switch (j.type()) {
    case Ordered::value_t::null:
    case Ordered::value_t::discarded:
      return Value();
    case Ordered::value_t::boolean:
      return Value(j.get<bool>());
    case Ordered::value_t::number_integer:
      return Value(j.get<int64_t>());
    case Ordered::value_t::number_unsigned:
      return Value(j.get<uint64_t>());
    case Ordered::value_t::number_float:
      return Value(j.get<double>());
    case Ordered::value_t::string:
      return Value(j.get<std::string>());
    case Ordered::value_t::binary:
      throw FormatError("JSON: binary values are not supported");
    case Ordered::value_t::array: {
      Value a = Value::Array();
      for (const Ordered& item : j) a.Append(FromNlohmann(item));
      return a;
    }
    case Ordered::value_t::object: {
      Value o = Value::Object();
      for (auto it = j.begin(); it != j.end(); ++it) {
        o[it.key()] = FromNlohmann(it.value());
      }
      return o;
    }
  }
  return Value();
}

}  // namespace

bool Value::AsBool() const {
  if (type_ != Type::kBool) TypeMismatch(Type::kBool, type_);
  return b_;
}

int64_t Value::AsInt() const {
  if (type_ == Type::kInt) return i_;
  if (type_ == Type::kDouble && d_ == static_cast<double>(
                                          static_cast<int64_t>(d_))) {
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
  return ToNlohmann(*this).dump(indent, ' ', false,
                                Ordered::error_handler_t::replace);
}

Value Value::Parse(std::string_view text) {
  try {
    return FromNlohmann(Ordered::parse(text));
  } catch (const nlohmann::json::exception& e) {
    throw FormatError("JSON: ", e.what());
  }
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
