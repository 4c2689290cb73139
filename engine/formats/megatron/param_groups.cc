#include "engine/formats/megatron/param_groups.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <utility>

#include "engine/core/error.h"

namespace ucp::megatron {

using pickle::Kind;

std::string GroupKey::ToString() const {
  return StrCat("(wd_mult=", wd_mult, ", lr_mult=", lr_mult,
                ", is_expert_parallel=", is_expert_parallel ? "True" : "False",
                ", is_decoupled_lr=", is_decoupled_lr ? "True" : "False", ")");
}

json::Value GroupKey::ToJson() const {
  json::Value a = json::Value::Array();
  a.Append(wd_mult);
  a.Append(lr_mult);
  a.Append(is_expert_parallel);
  a.Append(is_decoupled_lr);
  return a;
}

GroupKey GroupKey::FromJson(const json::Value& v) {
  if (!v.is_array() || v.size() != 4) {
    throw FormatError("optimizer group key ", v.Dump(),
                      " is not [wd_mult, lr_mult, is_expert_parallel, "
                      "is_decoupled_lr]");
  }
  GroupKey k;
  k.wd_mult = v.items()[0].AsDouble();
  k.lr_mult = v.items()[1].AsDouble();
  k.is_expert_parallel = v.items()[2].AsBool();
  k.is_decoupled_lr = v.items()[3].AsBool();
  return k;
}

GroupKey DefaultGroupKey(std::string_view name, size_t ndim) {
  GroupKey k;
  const bool bias = name.size() >= 5 && name.substr(name.size() - 5) == ".bias";
  k.wd_mult = bias || ndim == 1 ? 0.0 : 1.0;
  return k;
}

GroupKey StoredGroupKey(const pickle::Value* group) {
  if (group == nullptr || !group->IsDictLike()) {
    throw FormatError("optimizer param group is not a dict (",
                      pickle::Repr(group, 60), ")");
  }
  GroupKey k;
  auto num = [&](const char* f, double& out) {
    const pickle::Value* v = group->Get(f);
    if (v == nullptr) return;
    std::optional<double> d = v->AsFloat();
    if (!d || v->kind == Kind::kBool)
      throw FormatError("optimizer param group field '", f, "' is ",
                        pickle::Repr(v, 40), ", expected a number");
    out = *d;
  };
  auto flag = [&](const char* f, bool& out) {
    const pickle::Value* v = group->Get(f);
    if (v == nullptr) return;
    if (v->kind != Kind::kBool)
      throw FormatError("optimizer param group field '", f, "' is ",
                        pickle::Repr(v, 40), ", expected a bool");
    out = v->b;
  };
  num("wd_mult", k.wd_mult);
  num("lr_mult", k.lr_mult);
  flag("is_expert_parallel", k.is_expert_parallel);
  flag("is_decoupled_lr", k.is_decoupled_lr);
  return k;
}

Grouping GroupParams(std::span<const GroupKey> keys, GroupOrder order) {
  Grouping g;
  g.group_of.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    size_t gi = 0;
    while (gi < g.keys.size() && !(g.keys[gi] == keys[i])) ++gi;
    if (gi == g.keys.size()) {
      g.keys.push_back(keys[i]);
      g.members.emplace_back();
    }
    g.members[gi].push_back(i);
    g.group_of.push_back(gi);
  }
  if (order != GroupOrder::kFirstAppearance) {
    // kLegacyFixed: weight decay first, then lr_mult 1 first, then dense
    // first. kOverridesSorted: no override first, then the overrides'
    // (name, value) pairs in name order, compared as Python compares tuples.
    using Pairs = std::vector<std::pair<std::string, double>>;
    auto overrides = [](const GroupKey& k) {
      Pairs p;
      if (k.lr_mult != 1.0) p.emplace_back("lr_mult", k.lr_mult);
      if (k.wd_mult != 1.0) p.emplace_back("wd_mult", k.wd_mult);
      return p;
    };
    auto before = [&](const GroupKey& a, const GroupKey& b) {
      if (order == GroupOrder::kLegacyFixed) {
        auto rank = [](const GroupKey& k) {
          return std::make_tuple(k.wd_mult == 0.0, k.lr_mult != 1.0,
                                 k.is_expert_parallel, k.is_decoupled_lr);
        };
        return rank(a) < rank(b);
      }
      const Pairs pa = overrides(a), pb = overrides(b);
      return std::make_pair(!pa.empty(), pa) < std::make_pair(!pb.empty(), pb);
    };
    std::vector<size_t> perm(g.keys.size());
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = i;
    std::stable_sort(perm.begin(), perm.end(), [&](size_t a, size_t b) {
      return before(g.keys[a], g.keys[b]);
    });
    Grouping sorted;
    std::vector<size_t> new_index(perm.size());
    for (size_t n = 0; n < perm.size(); ++n) {
      sorted.keys.push_back(g.keys[perm[n]]);
      sorted.members.push_back(std::move(g.members[perm[n]]));
      new_index[perm[n]] = n;
    }
    for (size_t gi : g.group_of) sorted.group_of.push_back(new_index[gi]);
    g = std::move(sorted);
  }
  return g;
}

std::optional<GroupKey> SingleStoredGroup(
    std::span<const pickle::Value* const> stored, size_t default_groups) {
  if (default_groups <= 1 || stored.empty()) return std::nullopt;
  std::optional<GroupKey> one;
  for (const pickle::Value* groups : stored) {
    if (groups == nullptr || groups->kind != pickle::Kind::kList ||
        groups->items.size() != 1 || !groups->items[0]->IsDictLike())
      return std::nullopt;
    const GroupKey k = StoredGroupKey(groups->items[0]);
    if (one && !(*one == k)) return std::nullopt;
    one = k;
  }
  return one;
}

}  // namespace ucp::megatron
