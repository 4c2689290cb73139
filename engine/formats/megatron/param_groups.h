#pragma once
// Optimizer param groups as Megatron-core builds them
// (megatron/core/optimizer/__init__.py:_get_param_groups, core_v0.13.0):
// every trainable param of every model chunk (chunk 0 first, then in
// named_parameters() order) gets the key
//   (wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr)
// with wd_mult = 0 for names ending in ".bias" and for 1-D params, else 1;
// lr_mult = 1 (no scale_lr_cond), is_expert_parallel = false (dense),
// is_decoupled_lr = false (no --decoupled-lr). Groups appear in the order
// their key first appears (v0.6+); members keep their order.
//
// Megatron-core <= v0.5 and Megatron-LM 23.x (megatron/optimizer/__init__.py:
// get_param_groups) used a fixed group order instead: weight-decayed groups
// first, then the others; within each, lr_mult 1 before a scaled lr_mult
// (and, v0.5, dense before expert-parallel). Empty groups are dropped in both.
//
// Megatron-core v0.16+ (config overrides; its group dicts carry
// 'default_config') sorts the groups instead: the group without overrides
// (wd_mult 1, lr_mult 1) first, then the overridden ones by their override
// pairs ((name, value) sorted by name: lr_mult before wd_mult); dense and
// expert-parallel groups of one override keep their first-appearance order.
// Readers accept any of the three orders; writers use v0.16's when the
// source's group dicts carry 'default_config', else the first-appearance
// order. (v0.16 also keeps a group that is empty on a rank when another rank
// has it; the writers drop empty groups, which none of the supported models
// has: every pipeline stage holds 1-D norms and 2-D weights.)

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/json/json.h"
#include "engine/pickle/value.h"

namespace ucp::megatron {

struct GroupKey {
  double wd_mult = 1.0;
  double lr_mult = 1.0;
  bool is_expert_parallel = false;
  bool is_decoupled_lr = false;
  friend bool operator==(const GroupKey&, const GroupKey&) = default;

  /// "(wd_mult=0, lr_mult=1, is_expert_parallel=False, ...)".
  std::string ToString() const;
  /// [wd_mult, lr_mult, is_expert_parallel, is_decoupled_lr].
  json::Value ToJson() const;
  /// Throws FormatError if `v` is not such an array.
  static GroupKey FromJson(const json::Value& v);
};

/// Megatron's default key of a param (name as in the state dict, any layer
/// numbering; `ndim` of its tensor).
GroupKey DefaultGroupKey(std::string_view name, size_t ndim);

/// The key fields of a stored param group dict; fields that are absent keep
/// their defaults. Throws FormatError if `group` is not a dict or a field has
/// the wrong type.
GroupKey StoredGroupKey(const pickle::Value* group);

struct Grouping {
  std::vector<GroupKey> keys;                // group order
  std::vector<std::vector<size_t>> members;  // indices into the input
  std::vector<size_t> group_of;              // per input: its group
};

enum class GroupOrder {
  kFirstAppearance,  // Megatron-core v0.6+
  kLegacyFixed,      // Megatron-core <= v0.5, Megatron-LM 23.x
  kOverridesSorted,  // Megatron-core v0.16+
};

/// Groups params (their keys in named_parameters() order) by key, groups in
/// `order`.
Grouping GroupParams(std::span<const GroupKey> keys,
                     GroupOrder order = GroupOrder::kFirstAppearance);

/// The one group every param is in when a run grouped otherwise than
/// Megatron's rule (one group for all): Megatron's rule makes
/// `default_groups` > 1 groups, but every stored param_groups list
/// (`stored`, one per file that has one) holds one group dict, all with one
/// key. Absent otherwise (Megatron's rule applies). Throws FormatError like
/// StoredGroupKey.
std::optional<GroupKey> SingleStoredGroup(
    std::span<const pickle::Value* const> stored, size_t default_groups);

}  // namespace ucp::megatron
