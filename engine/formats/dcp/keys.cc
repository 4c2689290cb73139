#include "engine/formats/dcp/keys.h"

#include <charconv>

namespace ucp::dcp {
namespace {

const std::string* Str(const std::vector<PathComponent>& p, size_t i) {
  return i < p.size() ? std::get_if<std::string>(&p[i]) : nullptr;
}

std::optional<int64_t> Number(std::string_view s) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || s.empty())
    return std::nullopt;
  return v;
}

}  // namespace

std::string_view KeyClassName(KeyClass::Kind kind) {
  switch (kind) {
    case KeyClass::kModel:
      return "model";
    case KeyClass::kState:
      return "state";
    case KeyClass::kParamGroup:
      return "param_group";
    case KeyClass::kParamGroups:
      return "param_groups";
    case KeyClass::kTensor:
      return "tensor";
    case KeyClass::kBytes:
      return "bytes";
  }
  return "bytes";
}

KeyNames KeyNames::From(const Metadata& m) {
  KeyNames n;
  for (const auto& [fqn, path] : m.planner_data) n.paths_[fqn] = path;
  for (const Entry& e : m.entries) {
    if (!e.tensor) continue;
    const KeyClass k = n.Classify(e.fqn, true);
    if (k.kind == KeyClass::kModel) n.model_params_.insert(k.param);
  }
  return n;
}

KeyClass KeyNames::Classify(const std::string& fqn, bool tensor) const {
  KeyClass k;
  auto it = paths_.find(fqn);
  if (it != paths_.end()) {
    const std::vector<PathComponent>& p = it->second;
    const std::string* p0 = Str(p, 0);
    const std::string* p1 = Str(p, 1);
    if (tensor && p.size() == 2 && p0 && *p0 == "model" && p1) {
      k.kind = KeyClass::kModel;
      k.param = *p1;
      return k;
    }
    if (p0 && *p0 == "optimizer" && p1 && *p1 == "state" && p.size() == 4 &&
        Str(p, 2) && Str(p, 3) && tensor) {
      k.kind = KeyClass::kState;
      k.param = *Str(p, 2);
      k.state = *Str(p, 3);
      return k;
    }
    if (!tensor && p0 && *p0 == "optimizer" && p1 && *p1 == "param_groups") {
      if (p.size() == 2) {
        k.kind = KeyClass::kParamGroups;
        return k;
      }
      const int64_t* g = p.size() == 4 ? std::get_if<int64_t>(&p[2]) : nullptr;
      if (g != nullptr && Str(p, 3)) {
        k.kind = KeyClass::kParamGroup;
        k.group = *g;
        k.group_key = *Str(p, 3);
        return k;
      }
    }
    k.kind = tensor ? KeyClass::kTensor : KeyClass::kBytes;
    if (tensor) k.param = fqn;
    return k;
  }
  // No planner_data: from the dotted name.
  std::string_view s = fqn;
  if (tensor && s.starts_with("model.") && s.size() > 6) {
    k.kind = KeyClass::kModel;
    k.param = std::string(s.substr(6));
    return k;
  }
  if (tensor && s.starts_with("optimizer.state.")) {
    const std::string_view rest = s.substr(16);
    size_t best = 0;
    for (const std::string& p : model_params_) {
      if (p.size() > best && rest.size() > p.size() + 1 &&
          rest.starts_with(p) && rest[p.size()] == '.')
        best = p.size();
    }
    if (best == 0) best = rest.rfind('.');
    if (best != std::string_view::npos && best > 0 && best + 1 < rest.size()) {
      k.kind = KeyClass::kState;
      k.param = std::string(rest.substr(0, best));
      k.state = std::string(rest.substr(best + 1));
      return k;
    }
  }
  if (!tensor && s == "optimizer.param_groups") {
    k.kind = KeyClass::kParamGroups;
    return k;
  }
  if (!tensor && s.starts_with("optimizer.param_groups.")) {
    const std::string_view rest = s.substr(23);
    const size_t dot = rest.find('.');
    if (dot != std::string_view::npos) {
      if (std::optional<int64_t> g = Number(rest.substr(0, dot))) {
        k.kind = KeyClass::kParamGroup;
        k.group = *g;
        k.group_key = std::string(rest.substr(dot + 1));
        return k;
      }
    }
  }
  k.kind = tensor ? KeyClass::kTensor : KeyClass::kBytes;
  if (tensor) k.param = fqn;
  return k;
}

std::vector<PathComponent> PathOf(const KeyClass& k, const std::string& fqn) {
  switch (k.kind) {
    case KeyClass::kModel:
      return {std::string("model"), k.param};
    case KeyClass::kState:
      return {std::string("optimizer"), std::string("state"), k.param, k.state};
    case KeyClass::kParamGroup:
      return {std::string("optimizer"), std::string("param_groups"), k.group,
              k.group_key};
    case KeyClass::kParamGroups:
      return {std::string("optimizer"), std::string("param_groups")};
    default:
      return {fqn};
  }
}

}  // namespace ucp::dcp
