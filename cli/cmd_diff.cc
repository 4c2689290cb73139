// ucp diff: two checkpoints (any formats and layouts, or universal files)
// compared through their universal content; the comparison is the engine's
// (engine/diff/diff.h), this file parses options and prints.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <new>

#include "cli/command.h"
#include "cli/options.h"
#include "engine/core/error.h"
#include "engine/diff/diff.h"
#include "engine/formats/name_map.h"
#include "engine/json/json.h"

namespace ucp::cli {
namespace {

constexpr const char* kDiffHelp =
    "usage: ucp diff A B [--atol X] [--rtol X] [--names MAP] [--json]\n"
    "                [--memory SIZE] [--threads N] [--progress]\n"
    "\n"
    "Compares two checkpoints param by param and state by state (param, "
    "fp32\n"
    "master, exp_avg, exp_avg_sq, step, ...) through their universal "
    "content: A and\n"
    "B may be universal files or checkpoints of any readable formats and "
    "layouts\n"
    "(a Megatron TP2 save against its DCP conversion, say). Reports params "
    "and\n"
    "states only one side has, shape and dtype differences, and for values "
    "the\n"
    "number of differing elements, the first one's index and the largest "
    "absolute\n"
    "and relative difference (|a - b| / |b|). Exact by default: elements "
    "equal when\n"
    "their bytes are (a NaN equals a NaN of the same bits; -0.0 differs from "
    "0.0).\n"
    "With --atol / --rtol: numpy.isclose(a, b, rtol, atol, equal_nan=True) "
    "on the\n"
    "values as doubles, |a - b| <= atol + rtol * |b|. Differing dtypes are "
    "compared\n"
    "as values (and reported). A state one side lacks that the other "
    "implies (the\n"
    "bf16 copy of an fp32 master both hold, a per-param step equal to the "
    "other's\n"
    "optimizer step) is listed as derived, not as a difference. Vocabulary "
    "padding\n"
    "rows, opaque objects and the model's attributes are not compared. "
    "Streaming:\n"
    "both sides are read once, in windows, within --memory.\n"
    "\n"
    "Output: one line per difference and a summary line (--json: a document "
    "with the\n"
    "summary and every param). Exit code (as cmp): 0 equal, 1 different; "
    "errors keep\n"
    "their classes: 2 usage, 3 format, 4 layout, 5 i/o, 70 internal.\n"
    "\n"
    "examples:\n"
    "  ucp diff /ckpt/gpt /ckpt/gpt-dcp                  # Megatron vs its "
    "DCP conversion\n"
    "  ucp diff gpt.ucp.h5 /ckpt/gpt --json > diff.json\n"
    "  ucp diff /ckpt/a /ckpt/b --atol 1e-6 --rtol 1e-3  # numeric, like "
    "numpy.isclose\n"
    "  ucp diff /ckpt/mcore ms/ --names mindformers-llama  # under "
    "MindFormers' names\n"
    "\n"
    "options";

}  // namespace

int RunDiff(const std::vector<std::string>& args) {
  po::options_description desc(kDiffHelp);
  diff::Options o;
  RunOptions run;
  std::string maps;
  for (const std::string& n : formats::NameMapNames())
    maps += (maps.empty() ? "" : ", ") + n;
  desc.add_options()(
      "atol", po::value<double>(&o.tolerance.atol)->default_value(0, "0"),
      "absolute tolerance (>= 0; with --rtol, 0 and 0 compare bits)")(
      "rtol", po::value<double>(&o.tolerance.rtol)->default_value(0, "0"),
      "relative tolerance, of B's value (>= 0)")(
      "names", po::value<std::string>(&o.names)->value_name("MAP"),
      StrCat("compare under a name map's names: each side whose names it "
             "knows is viewed under them (",
             maps, ")")
          .c_str());
  std::vector<std::string> model_var_args;
  AddModelVarOption(desc, model_var_args, "for --names");
  AddRunOptions(desc, run);
  po::variables_map vm;
  if (!Parse(args, desc, {"a", "b"}, vm)) return 0;
  if (!vm.count("a") || !vm.count("b"))
    throw UsageError("diff needs two checkpoints, A and B");
  o.model_vars = ParseModelVars(model_var_args);
  o.executor = run.Executor();
  // For benchmarks: A's bytes per batch (default: engine/diff/diff.h).
  if (const char* c = std::getenv("UCP_DIFF_BATCH_BYTES"); c != nullptr && *c)
    o.batch_bytes = reshape::ParseByteSize(c);
  o.progress = true;  // drawn when stderr is a terminal, or --progress
  SetProgressMode(run.quiet, run.progress);
  const auto start = std::chrono::steady_clock::now();
  diff::Report r;
  try {
    r = diff::DiffPaths(vm["a"].as<std::string>(), vm["b"].as<std::string>(),
                        o);
  } catch (const std::bad_alloc&) {
    // Exit code 1 means "different" here.
    throw IoError("out of memory (lower --memory or --threads)");
  }
  const bool equal = r.equal();
  if (run.json) {
    json::Value j = diff::ToJson(r);
    j["command"] = "diff";
    j["seconds"] = Since(start);
    PrintJson(j);
  } else {
    for (const std::string& line : diff::DifferenceLines(r))
      std::printf("%s\n", OneLine(line).c_str());
    int64_t only = 0, differ = 0;
    for (const diff::ParamDiff& p : r.params) {
      only += !(p.in_a && p.in_b);
      differ += p.in_a && p.in_b && !p.equal();
    }
    const std::string mode =
        r.tolerance.exact()
            ? std::string("exact")
            : StrCat("atol ", r.tolerance.atol, ", rtol ", r.tolerance.rtol);
    std::printf(
        "%s: %lld params compared (%lld states, %lld elements, %s), %lld "
        "differ, %lld in one side only; %lld elements differ; %lld derived "
        "states; %.1f s\n",
        equal ? "equal" : "different",
        static_cast<long long>(r.params_compared),
        static_cast<long long>(r.states_compared),
        static_cast<long long>(r.elements_compared), mode.c_str(),
        static_cast<long long>(differ), static_cast<long long>(only),
        static_cast<long long>(r.differing_elements),
        static_cast<long long>(r.derived_states), Since(start));
  }
  std::fflush(stdout);
  return equal ? 0 : 1;
}

}  // namespace ucp::cli
