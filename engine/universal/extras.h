#pragma once
// Reading a driver's extras record (Model::extras, one JSON object per
// driver) with error context, in the manner of llama.cpp's
// llama_model_loader::get_key: the driver names each key once, a typed
// getter says whether absence is allowed, and every error names the
// universal file, the record and the key:
//   universal file <file> > attribute <record> > member <key>: <problem>
// The members no getter took are the record's unknown members (Rest()): a
// driver keeps them opaque, so that its Read / Write pair loses nothing.
//
//   std::optional<RecordReader> r = RecordReader::ForExtras(model, "x", file);
//   if (!r) return std::nullopt;                // no record
//   r->Get("stage", x.stage);                   // required
//   r->Get("tag", x.tag, /*required=*/false);   // absence allowed
//   r->Get("world", x.world);                   // std::optional: optional
//   x.other = r->Rest();

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/error.h"
#include "engine/json/json.h"
#include "engine/universal/model.h"

namespace ucp::universal {

/// Reads the members of one JSON object. The object must outlive the reader.
class RecordReader {
 public:
  /// `context` names the object in errors ("universal file F > attribute
  /// x"); empty for an object inside a member (the member's getter adds the
  /// context). Throws FormatError "<context>: not a JSON object".
  explicit RecordReader(const json::Value& object, std::string context = {});

  /// The extras record `name` of `model`; absent if the model has none.
  /// Throws FormatError "universal file <file> > attribute <name>: not a
  /// JSON object".
  static std::optional<RecordReader> ForExtras(
      const Model& model, std::string_view name,
      const std::filesystem::path& file);

  /// Member `key` into `out`; returns whether the object has it (`out`
  /// untouched if not). Throws FormatError "missing key" if it is absent
  /// and `required`, FormatError if it has another type.
  bool Get(std::string_view key, std::string& out, bool required = true);
  bool Get(std::string_view key, int64_t& out, bool required = true);
  bool Get(std::string_view key, double& out, bool required = true);
  bool Get(std::string_view key, bool& out, bool required = true);
  bool Get(std::string_view key, std::vector<std::string>& out,
           bool required = true);
  /// An optional member: set if present, left empty if absent.
  template <typename T>
  bool Get(std::string_view key, std::optional<T>& out) {
    T v{};
    if (!Get(key, v, /*required=*/false)) return false;
    out = std::move(v);
    return true;
  }

  /// Member `key` through `decode(const json::Value&)`; returns whether the
  /// object has it. An Error that `decode` throws gets the key and this
  /// reader's context. Throws FormatError "missing key" if absent and
  /// `required`.
  template <typename Decode>
  bool Member(std::string_view key, bool required, Decode&& decode) {
    const json::Value* v = Take(key, required);
    if (v == nullptr) return false;
    try {
      std::forward<Decode>(decode)(*v);
    } catch (Error& e) {
      AddContext(e, key);
      throw;
    }
    return true;
  }

  /// Member `key`, a JSON object, read by `read(RecordReader&)`; errors as
  /// for Member (a nested member's error names both keys).
  template <typename Read>
  bool Object(std::string_view key, bool required, Read&& read) {
    return Member(key, required, [&](const json::Value& v) {
      RecordReader nested(v);
      std::forward<Read>(read)(nested);
    });
  }

  /// The members no getter asked for, in the object's order (an object).
  OpaqueMembers Rest() const;

 private:
  // Marks `key` as read; the member, nullptr if absent (FormatError
  // "missing key" with context if `required`).
  const json::Value* Take(std::string_view key, bool required);
  void AddContext(Error& e, std::string_view key) const;

  const json::Value* object_;
  std::string context_;
  std::vector<std::string> taken_;
};

/// Appends `other` (the members a reader kept opaque) to the object `out`.
/// Throws InternalError if `out` already has one of them (a typed member
/// also kept opaque: a bug).
void PutOpaque(json::Value& out, const OpaqueMembers& other);

}  // namespace ucp::universal
