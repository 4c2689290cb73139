#pragma once
// universal::Model: the content between every format driver's reader and
// writer, typed. Readers fill it, writers and the CLI read its fields; one
// place (ModelFromRoot / RootFromModel, model.cc) turns it into the universal
// file's root attributes (atoms::RootInfo, schema in atom_store.h) and back.
//
// Attribute  <-> field
//   source     SourceInfo: framework identity and topology
//   model      ModelInfo: the layout's model variables (int / bool)
//   layout     layout_yaml: the descriptor's YAML text, kept as text
//   optimizer  OptimizerInfo: type, param groups (typed lr / betas / eps /
//              weight_decay and member params), state kinds, step
//   scheduler  scheduler (the framework's scheduler object, by member)
//   args       args (the framework's args object, by member)
//   training   TrainingInfo: dtype, step, iteration, samples, frozen set,
//              shared (tied copies: alias -> fqn), param order
//   any other  extras: a driver's own attribute, name -> JSON document, kept
//              as read; each driver decodes its own with one serializer
//              declared beside its format spec (no driver reads another's)
//
// Members of a JSON attribute that no typed field holds are kept in the
// section's `other` (a JSON object, file order), as tensorstore's
// ZarrMetadata keeps unknown attributes: a round trip loses nothing. Typed
// members are written first in a fixed order, then `other`. A typed member
// absent from the file is an empty optional.

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/json/json.h"  // light: std types only

namespace ucp::atoms {
struct RootInfo;
}  // namespace ucp::atoms

namespace ucp::universal {

/// Members of a JSON object that no typed field holds, in file order (a JSON
/// object; null reads as empty).
using OpaqueMembers = json::Value;

/// Member `name`; nullptr if absent.
inline const json::Value* FindMember(const OpaqueMembers& members,
                                     std::string_view name) noexcept {
  return members.Find(name);
}

/// The `source` attribute: which checkpoint the content came from.
struct SourceInfo {
  std::optional<std::string> framework;          // "megatron-lm", ...
  std::optional<std::string> framework_version;  // as detected
  std::optional<std::string> format;             // "legacy", "torch_dist"
  std::optional<std::string> driver;             // reading driver's name
  std::optional<std::string> layout;             // descriptor name (builtin)
  std::optional<std::string> names;  // name map applied (ucp --names)
  std::optional<std::string> dtype;  // the model's dtype
  std::optional<std::vector<std::string>> dtypes;
  std::optional<int64_t> tp, pp, vpp, dp, cp, ep, zero_stage, world;
  std::optional<int64_t> first_stage_layers, last_stage_layers;
  std::optional<int64_t> padded_vocab_size;
  std::optional<bool> distributed_optimizer;
  OpaqueMembers other;

  /// A topology size, 1 if absent or below 1.
  static int64_t SizeOr1(const std::optional<int64_t>& size) noexcept {
    return size && *size > 1 ? *size : 1;
  }
};

/// One model variable of the `model` attribute.
struct ModelVariable {
  std::string name;
  int64_t value = 0;
  bool is_bool = false;  // written as true / false
};

/// The `model` attribute: the layout's variables (num_layers, hidden_size,
/// vocab_size, ...).
struct ModelInfo {
  std::vector<ModelVariable> variables;
  OpaqueMembers other;  // members that are neither ints nor bools

  /// The variable's value (a bool as 0 / 1); absent if there is none.
  std::optional<int64_t> Get(std::string_view name) const noexcept;
  /// Sets (or adds, at the end) an int variable.
  void Set(std::string_view name, int64_t value);
};

/// One optimizer param group with its typed hyper-parameters.
struct ParamGroup {
  std::optional<double> lr, eps, weight_decay;
  std::optional<std::array<double, 2>> betas;
  /// Member params by canonical name; absent if the source keeps the
  /// membership elsewhere (ParamInfo::group).
  std::optional<std::vector<std::string>> params;
  OpaqueMembers other;  // further hyper-parameters, a Megatron group key

  /// Sets member `key` to `value`: lr / eps / weight_decay typed if a number,
  /// betas if a pair of numbers, otherwise into `other`.
  void Set(std::string_view key, json::Value value);

  /// Which typed numbers the file wrote as JSON integers (bits: lr 1, eps 2,
  /// weight_decay 4, betas[0] 8, betas[1] 16), so that they are written
  /// back the same way. Serializer bookkeeping; 0 for new groups.
  uint8_t int_mask = 0;
};

/// The `optimizer` attribute.
struct OptimizerInfo {
  std::optional<std::string> type;  // "adam", "torch.optim", ...
  std::optional<std::vector<ParamGroup>> groups;
  std::optional<std::vector<std::string>> state_kinds;
  std::optional<int64_t> step;  // the optimizer step
  OpaqueMembers other;
};

/// The `training` attribute (version 2): framework-neutral run state.
struct TrainingInfo {
  std::optional<std::string> dtype;  // training dtype, or "mixed"
  std::optional<int64_t> step, iteration, global_samples;
  std::optional<std::vector<std::string>> frozen;
  /// Tied / shared copies: alias -> the fqn it is a copy of.
  std::optional<std::map<std::string, std::string>> shared;
  std::optional<std::vector<std::string>> param_order;
  OpaqueMembers other;
};

struct Model {
  /// ucp_version as read (RootFromModel writes it back as is).
  int64_t version = 2;
  int64_t iteration = 0;
  int64_t consumed_samples = -1;  // -1 if unknown
  SourceInfo source;
  ModelInfo variables;
  std::string layout_yaml;  // empty: no layout descriptor
  OptimizerInfo optimizer;
  OpaqueMembers scheduler;
  OpaqueMembers args;
  std::optional<TrainingInfo> training;  // absent in version-1 files
  /// Each driver's own attribute (name -> its JSON document), kept as read;
  /// the driver decodes it with its own serializer.
  std::map<std::string, json::Value> extras;
  /// Further str root attributes that are not JSON, untouched.
  std::map<std::string, std::string> extra_texts;
  /// Further int64 root attributes.
  std::map<std::string, int64_t> extra_ints;

  /// The extra's document; nullptr if absent.
  const json::Value* FindExtra(std::string_view name) const noexcept;
};

/// The model of a universal file's root attributes. Empty text reads as an
/// empty object (an absent `training` as no training record). Throws
/// FormatError "universal file <file> > attribute <name>: ..." if an
/// attribute is not a JSON object or a typed member has the wrong type.
Model ModelFromRoot(const atoms::RootInfo& root,
                    const std::filesystem::path& file);

/// The `source` / `model` attribute of a model as JSON (what RootFromModel
/// writes for them), for display.
json::Value SourceJson(const SourceInfo& source);
json::Value VariablesJson(const ModelInfo& variables);

/// The root attributes of `model` (JSON text per attribute). Throws
/// InternalError if an `other` holds a typed member's name (a bug).
atoms::RootInfo RootFromModel(const Model& model);

/// A reader's training record, replacing any: `dtype`, the step of the
/// model's iteration, and empty frozen / shared / param-order lists for the
/// reader to fill. Never throws (but std::bad_alloc).
TrainingInfo& NewTraining(Model& model, std::string dtype);

}  // namespace ucp::universal
