#include "engine/formats/megatron_torch_dist/keys.h"

#include <cctype>
#include <charconv>
#include <cstdint>

#include "engine/core/error.h"

namespace ucp::torch_dist {
namespace {

constexpr std::string_view kLayers = "decoder.layers.";
constexpr std::string_view kState = "optimizer.state.";
constexpr std::string_view kBuckets = "optimizer.distributed.";

// The local layer spec's module names and the keys Megatron stores them
// under (gpt_layer_specs.py: sharded_state_dict_keys_map).
struct SpecName {
  std::string_view local;
  std::string_view key;
};
constexpr SpecName kLocalSpec[] = {
    {"input_layernorm.", "self_attention.linear_qkv.layer_norm_"},
    {"pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"},
};

// "1.2" -> {1, 2}; nullopt unless digits separated by dots (Megatron's
// offsets and grid sizes are never negative).
std::optional<std::vector<int64_t>> Numbers(std::string_view s) {
  std::vector<int64_t> out;
  while (!s.empty()) {
    const size_t dot = s.find('.');
    const std::string_view part = s.substr(0, dot);
    int64_t v = 0;
    auto [p, ec] = std::from_chars(part.data(), part.data() + part.size(), v);
    if (part.empty() || part[0] == '-' || ec != std::errc() ||
        p != part.data() + part.size())
      return std::nullopt;
    out.push_back(v);
    if (dot == std::string_view::npos) break;
    s.remove_prefix(dot + 1);
    if (s.empty()) return std::nullopt;
  }
  if (out.empty()) return std::nullopt;
  return out;
}

void FlatBoxesRec(const Shape& shape, size_t dim, Shape& offset, int64_t base,
                  int64_t a, int64_t b, std::vector<FlatBox>& out) {
  if (a >= b) return;
  if (shape.empty()) {
    out.push_back({Box{{}, {}}, 0});
    return;
  }
  int64_t inner = 1;
  for (size_t d = dim + 1; d < shape.size(); ++d) inner *= shape[d];
  auto whole = [&](int64_t i0, int64_t i1) {
    Box box{offset, shape};
    box.offset[dim] = i0;
    box.size[dim] = i1 - i0;
    for (size_t d = 0; d < dim; ++d) box.size[d] = 1;
    out.push_back({std::move(box), base + i0 * inner});
  };
  auto part = [&](int64_t i, int64_t lo, int64_t hi) {
    offset[dim] = i;
    FlatBoxesRec(shape, dim + 1, offset, base + i * inner, lo, hi, out);
    offset[dim] = 0;
  };
  if (dim + 1 == shape.size()) {
    whole(a, b);
    return;
  }
  int64_t i0 = a / inner;
  const int64_t i1 = b / inner;
  if (i0 == i1) {
    part(i0, a - i0 * inner, b - i0 * inner);
    return;
  }
  if (a % inner != 0) {
    part(i0, a - i0 * inner, inner);
    ++i0;
  }
  if (i1 > i0) whole(i0, i1);
  if (b % inner != 0) part(i1, 0, b - i1 * inner);
}

}  // namespace

KeyInfo ClassifyKey(std::string_view fqn, bool tensor) {
  KeyInfo k;
  if (fqn.starts_with("common_state/") || fqn == "common_state") {
    k.kind = KeyInfo::kCommonState;
    return k;
  }
  if (!tensor) {
    // <key>/shard_<offsets>_<grid>
    k.kind = KeyInfo::kObject;
    k.model_key = std::string(fqn);
    const size_t slash = fqn.rfind("/shard_");
    if (slash != std::string_view::npos) {
      const std::string_view rest = fqn.substr(slash + 7);
      const size_t us = rest.find('_');
      if (us != std::string_view::npos) {
        auto off = Numbers(rest.substr(0, us));
        auto grid = Numbers(rest.substr(us + 1));
        if (off && grid && off->size() == grid->size()) {
          k.model_key = std::string(fqn.substr(0, slash));
          k.offsets = std::move(*off);
          k.grid = std::move(*grid);
        }
      }
    }
    return k;
  }
  // A ChainedOptimizer's dp_reshardable buckets (mixture of experts):
  // chained_<i>.optimizer.distributed....
  if (fqn.starts_with(kBuckets) ||
      (fqn.starts_with("chained_") &&
       fqn.find(StrCat(".", kBuckets)) != std::string_view::npos)) {
    k.kind = KeyInfo::kBucket;
    return k;
  }
  if (fqn.starts_with(kState)) {
    const std::string_view rest = fqn.substr(kState.size());
    const size_t dot = rest.find('.');
    if (dot != std::string_view::npos && dot > 0) {
      k.kind = KeyInfo::kOptimizerState;
      k.state = std::string(rest.substr(0, dot));
      k.model_key = std::string(rest.substr(dot + 1));
      return k;
    }
  }
  k.kind = KeyInfo::kModel;
  k.model_key = std::string(fqn);
  return k;
}

bool IsStacked(std::string_view model_key) {
  if (!model_key.starts_with(kLayers)) return false;
  const std::string_view rest = model_key.substr(kLayers.size());
  return !rest.empty() && !std::isdigit(static_cast<unsigned char>(rest[0]));
}

std::string CanonicalName(std::string_view model_key, int64_t layer,
                          bool local_spec) {
  if (layer < 0 || !model_key.starts_with(kLayers))
    return std::string(model_key);
  std::string_view rest = model_key.substr(kLayers.size());
  std::string out = StrCat(kLayers, layer, ".");
  if (local_spec) {
    for (const SpecName& s : kLocalSpec) {
      if (rest.starts_with(s.key)) {
        return out + std::string(s.local) +
               std::string(rest.substr(s.key.size()));
      }
    }
  }
  return out + std::string(rest);
}

KeyAxes AxesOf(std::string_view model_key) {
  KeyAxes a;
  a.experts = model_key.find(kExpertsInfix) != std::string_view::npos;
  a.stacked = IsStacked(model_key);
  if (!a.stacked && model_key.starts_with(kLayers)) {
    const std::string_view rest = model_key.substr(kLayers.size());
    const size_t dot = rest.find('.');
    int64_t layer = 0;
    auto [p, ec] =
        std::from_chars(rest.data(), rest.data() + rest.size(), layer);
    if (dot != std::string_view::npos && ec == std::errc() &&
        p == rest.data() + dot)
      a.layer = layer;
  }
  return a;
}

std::string CanonicalName(std::string_view model_key, int64_t layer,
                          int64_t expert, bool local_spec) {
  const KeyAxes a = AxesOf(model_key);
  std::string generic(model_key);
  if (a.layer >= 0) {  // decoder.layers.<g>.rest -> decoder.layers.rest
    const std::string_view rest = model_key.substr(kLayers.size());
    generic = StrCat(kLayers, rest.substr(rest.find('.') + 1));
    layer = a.layer;
  }
  std::string out = CanonicalName(generic, layer, local_spec);
  if (expert >= 0) {
    const size_t at = out.find(kExpertsInfix);
    if (at != std::string::npos) {
      out.replace(at, kExpertsInfix.size(),
                  StrCat(".mlp.experts.", expert, "."));
    }
  }
  return out;
}

KeyOfName ModelKeyOf(std::string_view canonical) {
  KeyOfName k;
  if (!canonical.starts_with(kLayers)) {
    k.key = std::string(canonical);
    return k;
  }
  std::string_view rest = canonical.substr(kLayers.size());
  const size_t dot = rest.find('.');
  int64_t layer = 0;
  auto [p, ec] = std::from_chars(rest.data(), rest.data() + dot, layer);
  if (dot == std::string_view::npos || dot == 0 || ec != std::errc() ||
      p != rest.data() + dot) {
    k.key = std::string(canonical);
    return k;
  }
  rest.remove_prefix(dot + 1);
  k.layer = layer;
  // mlp.experts.<e>.<rest> -> mlp.experts.experts.<rest>
  constexpr std::string_view kExpert = "mlp.experts.";
  std::string expert_rest;
  if (rest.starts_with(kExpert)) {
    const std::string_view tail = rest.substr(kExpert.size());
    const size_t edot = tail.find('.');
    int64_t e = 0;
    auto [q, ec2] = std::from_chars(tail.data(), tail.data() + tail.size(), e);
    if (edot != std::string_view::npos && edot > 0 && ec2 == std::errc() &&
        q == tail.data() + edot) {
      k.expert = e;
      expert_rest = StrCat("mlp.experts.experts.", tail.substr(edot + 1));
      rest = expert_rest;
    }
  }
  for (const SpecName& s : kLocalSpec) {
    if (rest.starts_with(s.local)) {
      k.key = StrCat(kLayers, s.key, rest.substr(s.local.size()));
      return k;
    }
  }
  k.key = StrCat(kLayers, rest);
  return k;
}

std::optional<BucketKey> ParseBucketKey(std::string_view fqn) {
  constexpr std::string_view kPrefix = "optimizer.distributed.dp_group_idx_";
  int64_t chain = -1;
  if (fqn.starts_with("chained_")) {
    const size_t dot = fqn.find('.');
    const std::string_view n = fqn.substr(
        8, dot == std::string_view::npos ? std::string_view::npos : dot - 8);
    auto [p, ec] = std::from_chars(n.data(), n.data() + n.size(), chain);
    if (n.empty() || n[0] == '-' || ec != std::errc() ||
        p != n.data() + n.size())
      return std::nullopt;
    fqn.remove_prefix(dot + 1);
  }
  if (!fqn.starts_with(kPrefix)) return std::nullopt;
  fqn.remove_prefix(kPrefix.size());
  auto number = [&](std::string_view stop, int64_t& v) {
    const size_t at = fqn.find(stop);
    if (at == std::string_view::npos || at == 0) return false;
    v = 0;
    for (char ch : fqn.substr(0, at)) {
      if (ch < '0' || ch > '9' || v > (INT64_MAX - 9) / 10) return false;
      v = v * 10 + (ch - '0');
    }
    fqn.remove_prefix(at + stop.size());
    return true;
  };
  BucketKey k;
  k.chain = chain;
  if (!number(".gbuf_idx_", k.group)) return std::nullopt;
  if (!number(".dtype_", k.gbuf)) return std::nullopt;
  const size_t b = fqn.find(".bucket_idx_");
  if (b == std::string_view::npos) return std::nullopt;
  k.dtype = std::string(fqn.substr(0, b));
  fqn.remove_prefix(b + 12);
  if (!number(".", k.bucket) || fqn.empty()) return std::nullopt;
  k.state = std::string(fqn);
  return k;
}

std::string ObjectKey(std::string_view key, std::span<const int64_t> offsets,
                      std::span<const int64_t> grid) {
  std::string out = StrCat(key, "/shard_");
  for (size_t i = 0; i < offsets.size(); ++i)
    out += StrCat(i ? "." : "", offsets[i]);
  out += "_";
  for (size_t i = 0; i < grid.size(); ++i) out += StrCat(i ? "." : "", grid[i]);
  return out;
}

std::vector<FlatBox> FlatBoxes(const Shape& shape, int64_t a, int64_t b) {
  std::vector<FlatBox> out;
  Shape offset(shape.size(), 0);
  FlatBoxesRec(shape, 0, offset, 0, a, b, out);
  return out;
}

}  // namespace ucp::torch_dist
