#include "engine/formats/deepspeed/pickled.h"

#include "engine/core/error.h"

namespace ucp::deepspeed::internal {

using pickle::Kind;
using pickle::Value;

const Value* Get(const Value* d, std::string_view key) {
  return pickle::DictGet(d, key);
}

const Value* Require(const Value* d, std::string_view key) {
  const Value* v = Get(d, key);
  if (v == nullptr) throw FormatError("no '", key, "' entry");
  return v;
}

const Value* RequireDict(const Value* d, std::string_view key) {
  const Value* v = Require(d, key);
  if (!v->IsDictLike()) {
    throw FormatError("'", key, "' is ", pickle::KindName(v->kind),
                      ", expected a dict");
  }
  return v;
}

int64_t Int(const Value* v, std::string_view what) {
  std::optional<int64_t> i = v != nullptr ? v->AsInt() : std::nullopt;
  if (!i) {
    throw FormatError(what, " is ",
                      v == nullptr ? "missing" : pickle::Repr(v, 60),
                      ", expected an int");
  }
  return *i;
}

std::string Str(const Value* v, std::string_view what) {
  if (v == nullptr || v->kind != Kind::kStr)
    throw FormatError(what, " is not a str");
  return v->s;
}

bool IsNone(const Value* v) { return v == nullptr || v->kind == Kind::kNone; }

std::vector<std::string> Keys(const Value* d, std::string_view what) {
  if (d == nullptr || !d->IsDictLike())
    throw FormatError(what, " is not a dict");
  std::vector<std::string> out;
  for (const auto& [k, v] : d->entries) {
    if (k == nullptr || k->kind != Kind::kStr)
      throw FormatError(what, " has a key that is not a str");
    out.push_back(k->s);
  }
  return out;
}

const std::vector<Value*>& Items(const Value* v, std::string_view what) {
  if (v == nullptr || (v->kind != Kind::kList && v->kind != Kind::kTuple))
    throw FormatError(what, " is not a list");
  return v->items;
}

Shape SizeOf(const Value* v, std::string_view what) {
  const Value* t = v;
  if (v != nullptr && v->kind == Kind::kObject && v->args != nullptr &&
      v->args->kind == Kind::kTuple && v->args->items.size() == 1)
    t = v->args->items[0];  // torch.Size((13, 7))
  Shape out;
  for (const Value* d : Items(t, what)) {
    const int64_t n = Int(d, what);
    if (n < 0) throw FormatError(what, " has a negative dimension");
    out.push_back(n);
  }
  return out;
}

std::optional<int64_t> ZeroStageOf(const Value* v) {
  if (v == nullptr) return std::nullopt;
  if (std::optional<int64_t> i = v->AsInt()) return i;
  if (v->kind != Kind::kObject || v->args == nullptr) return std::nullopt;
  const auto& args = v->args->items;
  if (args.size() == 1 && args[0] != nullptr) return args[0]->AsInt();
  if (args.size() == 2 && args[1] != nullptr && args[1]->kind == Kind::kStr) {
    const std::string& s = args[1]->s;
    if (s == "disabled") return 0;
    if (s == "optimizer_states") return 1;
    if (s == "gradients") return 2;
    if (s == "weights" || s == "max_stage") return 3;
  }
  return std::nullopt;
}

const Value* GetIndex(const Value* d, int64_t key) {
  if (d == nullptr || !d->IsDictLike()) return nullptr;
  for (const auto& [k, v] : d->entries) {
    if (k != nullptr && k->kind == Kind::kInt && k->big.empty() && k->i == key)
      return v;
  }
  return nullptr;
}

}  // namespace ucp::deepspeed::internal
