// --rng-state: numpy's module path in Megatron's RNG states (rng_state.h).

#include "engine/formats/megatron/rng_state.h"

#include <optional>
#include <unordered_set>
#include <vector>

#include "engine/core/error.h"

namespace ucp::megatron {
namespace {

using pickle::Kind;
using pickle::Value;

constexpr std::string_view kNumpy1Core = "numpy.core";
constexpr std::string_view kNumpy2Core = "numpy._core";

// `module` is `package` or one of its submodules.
bool Under(std::string_view module, std::string_view package) {
  return module.starts_with(package) &&
         (module.size() == package.size() || module[package.size()] == '.');
}

}  // namespace

formats::OptionSpec RngStateOptionSpec(std::string_view what) {
  formats::OptionSpec o;
  o.name = kRngStateOption;
  o.type = formats::OptionSpec::Type::kString;
  o.help = StrCat(
      what,
      ": numpy's RNG state as keep (as the source holds it), numpy2 / numpy1 "
      "(pickled under the module path of the numpy the run has: torch >= 2.6 "
      "refuses the other) or drop (left out: load with --no-load-rng)");
  o.default_text = "keep";
  // What the target is written for: in summaries and `ucp resume`'s load
  // folder names (-rngnumpy2), so a folder made for one numpy is not
  // handed to a run asking for another.
  o.layout = true;
  o.abbrev = "rng";
  return o;
}

RngStateMode ParseRngStateMode(const formats::OptionValues& values) {
  const std::optional<std::string> v = values.String(kRngStateOption);
  if (!v || *v == "keep") return RngStateMode::kKeep;
  if (*v == "numpy2") return RngStateMode::kNumpy2;
  if (*v == "numpy1") return RngStateMode::kNumpy1;
  if (*v == "drop") return RngStateMode::kDrop;
  throw UsageError("--", kRngStateOption, " '", *v,
                   "': use keep, numpy2, numpy1 or drop");
}

NumpyPaths ApplyRngStateMode(Value* root, RngStateMode mode) {
  NumpyPaths found;
  if (root == nullptr) return found;
  std::unordered_set<const Value*> seen;
  std::vector<Value*> todo = {root};
  auto push = [&](Value* v) {
    if (v != nullptr && seen.insert(v).second) todo.push_back(v);
  };
  seen.insert(root);
  while (!todo.empty()) {
    Value* v = todo.back();
    todo.pop_back();
    if (v->kind == Kind::kGlobal) {
      if (Under(v->module, kNumpy1Core)) {
        found.numpy1 = true;
        if (mode == RngStateMode::kNumpy2)
          v->module = StrCat(kNumpy2Core, v->module.substr(kNumpy1Core.size()));
      } else if (Under(v->module, kNumpy2Core)) {
        found.numpy2 = true;
        if (mode == RngStateMode::kNumpy1)
          v->module = StrCat(kNumpy1Core, v->module.substr(kNumpy2Core.size()));
      }
      continue;
    }
    for (Value* c : v->items) push(c);
    for (auto& [k, x] : v->entries) {
      push(k);
      push(x);
    }
    push(v->callable);
    push(v->args);
    push(v->kwargs);
    push(v->state);
    push(v->pid);
  }
  return found;
}

std::string RngStateNote(RngStateMode mode, NumpyPaths found, bool any_state) {
  if (!any_state) return "";
  switch (mode) {
    case RngStateMode::kKeep:
      if (found.numpy1 && !found.numpy2) {
        return "rng states: numpy's state is pickled under numpy 1's module "
               "path (numpy.core.multiarray), which Megatron under numpy 2 "
               "with torch >= 2.6 refuses (\"could not load the checkpoint\", "
               "exit status 0): for such a run write --rng-state numpy2 (or "
               "drop, and load with --no-load-rng)";
      }
      // (A state under numpy 2's path is what today's Megatron saves and
      // loads; a run under numpy 1 needs --rng-state numpy1: README.)
      return "";
    case RngStateMode::kNumpy2:
      if (!found.numpy1) return "";
      return "rng states: numpy's state respelled under numpy 2's module path "
             "(numpy.core -> numpy._core; --rng-state numpy2): a run under "
             "numpy 1 refuses it";
    case RngStateMode::kNumpy1:
      if (!found.numpy2) return "";
      return "rng states: numpy's state respelled under numpy 1's module path "
             "(numpy._core -> numpy.core; --rng-state numpy1): a run under "
             "numpy 2 with torch >= 2.6 refuses it";
    case RngStateMode::kDrop:
      return "rng states left out (--rng-state drop): load with --no-load-rng "
             "(or --finetune), else Megatron stops at \"Unable to load rng "
             "state\"; the run draws from the state its --seed gives";
  }
  return "";
}

}  // namespace ucp::megatron
