// ucp layout list | show NAME | check CKPT: the layout descriptors.

#include <cstdio>
#include <iostream>

#include "cli/command.h"
#include "cli/options.h"
#include "engine/core/error.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "layouts/layout.h"

namespace ucp::cli {
namespace {

constexpr const char* kLayoutHelp =
    "usage: ucp layout list\n"
    "       ucp layout show NAME|FILE [--json]\n"
    "       ucp layout check CKPT [--layout NAME|FILE] [--json]\n"
    "\n"
    "A layout descriptor (YAML, see layouts/README.md) says how each parameter "
    "of a\n"
    "model family is partitioned: split along a numbered dim over TP, "
    "replicated,\n"
    "vocab-padded, fused QKV with query groups, two-segment (SwiGLU) split, "
    "tied\n"
    "copies, layer placement over PP/VPP, and which entries are opaque.\n"
    "  list    the builtin descriptors\n"
    "  show    print a descriptor's YAML (builtin name or file); with --json\n"
    "          {name, description, yaml}\n"
    "  check   list every parameter of a Megatron-LM or Megatron-DeepSpeed\n"
    "          (TP/PP) checkpoint with the rule it matches; fails (exit 4)\n"
    "          if a parameter is matched by no rule or by two\n"
    "\n"
    "examples:\n"
    "  ucp layout check /ckpt/gpt\n"
    "  ucp layout check /ckpt/gpt --layout my-model.yaml --json\n"
    "\n"
    "options";

}  // namespace

int RunLayout(const std::vector<std::string>& args) {
  po::options_description desc(kLayoutHelp);
  std::string layout;
  std::string from;
  bool json_out = false;
  desc.add_options()("layout", po::value<std::string>(&layout),
                     "descriptor for check (default: detected)")(
      "from", po::value<std::string>(&from),
      "checkpoint format for check (default: detected)")(
      "json", po::bool_switch(&json_out), "JSON output");
  po::variables_map vm;
  if (!Parse(args, desc, {"action", "target"}, vm)) return 0;
  if (!vm.count("action"))
    throw UsageError("layout needs an action: list, show or check");
  const std::string action = vm["action"].as<std::string>();
  const std::string target =
      vm.count("target") ? vm["target"].as<std::string>() : "";
  if (action == "list") {
    json::Value j = json::Value::Array();
    for (const std::string& name : layouts::Layout::BuiltinNames()) {
      layouts::Layout l = layouts::Layout::Builtin(name);
      if (json_out) {
        json::Value e;
        e["name"] = name;
        e["description"] = l.description();
        j.Append(std::move(e));
      } else {
        std::printf("%-22s %s\n", name.c_str(), l.description().c_str());
      }
    }
    if (json_out) PrintJson(j);
    return 0;
  }
  if (action == "show") {
    if (target.empty()) throw UsageError("layout show needs a NAME or FILE");
    layouts::Layout l = layouts::Layout::FromSpec(target);
    if (json_out) {
      json::Value j;
      j["name"] = l.name();
      j["description"] = l.description();
      j["yaml"] = l.yaml();
      PrintJson(j);
    } else {
      std::printf("%s", l.yaml().c_str());
    }
    return 0;
  }
  if (action != "check") {
    throw UsageError("unknown layout action '", action,
                     "' (list, show or check)");
  }
  if (target.empty())
    throw UsageError("layout check needs a checkpoint folder");
  SourceArgs src;
  src.layout = layout;
  src.from = from;
  std::unique_ptr<formats::Source> source = src.Open(target);
  formats::Source::NameListing names = source->ListNames();
  layouts::Layout l = layout.empty() ? layouts::Layout::Parse(names.layout_yaml,
                                                              names.layout_name)
                                     : layouts::Layout::FromSpec(layout);
  std::vector<layouts::Diagnostic> diags =
      l.Check(names.names, names.variables);
  size_t problems = 0;
  json::Value list = json::Value::Array();
  for (const layouts::Diagnostic& d : diags) {
    if (!d.ok()) ++problems;
    if (json_out) {
      json::Value e;
      e["param"] = d.name;
      e["rule"] = d.rule;
      e["ok"] = d.ok();
      if (!d.ok()) e["problem"] = d.problem;
      list.Append(std::move(e));
    } else if (d.ok()) {
      std::printf("%-70s %s\n", d.name.c_str(), d.rule.c_str());
    } else {
      std::printf("%-70s PROBLEM: %s\n", d.name.c_str(), d.problem.c_str());
    }
  }
  if (json_out) {
    json::Value j;
    j["checkpoint"] = source->info().path.string();
    j["layout"] = l.name();
    j["params"] = std::move(list);
    j["problems"] = static_cast<int64_t>(problems);
    PrintJson(j);
  } else {
    std::printf("layout '%s': %zu entries, %zu problem(s)\n", l.name().c_str(),
                diags.size(), problems);
  }
  if (problems > 0) {
    for (const layouts::Diagnostic& d : diags) {
      if (!d.ok()) {
        throw LayoutError(
            source->info().path.string(), ": param ", d.name, ": ", d.problem,
            problems > 1 ? StrCat(" (and ", problems - 1, " more)") : "");
      }
    }
  }
  return 0;
}

}  // namespace ucp::cli
