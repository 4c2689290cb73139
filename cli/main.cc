// ucp: universal checkpoint reshaping engine — command-line entry point.
// Every failure ends as one line on stderr, "ucp: <kind>: <context > message>",
// and an exit code per error class (see kExitCodes below and `ucp --help`).

#include <sys/resource.h>

#include <algorithm>
#include <boost/program_options/errors.hpp>
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "cli/command.h"
#include "cli/dist.h"
#include "cli/options.h"
#include "engine/core/error.h"
#include "engine/json/json.h"

namespace ucp::cli {

const std::vector<Command>& Commands() {
  static const std::vector<Command> kCommands = {
      {"to-universal", "checkpoint (any format) -> one universal HDF5 file",
       RunToUniversal},
      {"reshape", "universal file -> checkpoint for any TP/PP/VPP/DP/ZeRO",
       RunReshape},
      {"convert", "checkpoint -> checkpoint for another layout, one step",
       RunConvert},
      {"export", "consolidated model: safetensors / pytorch_model.bin shards",
       RunExport},
      {"verify", "check a universal file or a checkpoint folder", RunVerify},
      {"manifest", "write ucp.manifest.json (sizes, xxh3) for a checkpoint",
       RunManifest},
      {"resume",
       "elastic restart: newest intact checkpoint, reshaped for the new job",
       RunResume},
      {"diff", "compare two checkpoints (any formats) param by param", RunDiff},
      {"layout", "list / show / check layout descriptors", RunLayout},
      {"inspect", "show the tensors, objects and totals of torch.save files",
       RunInspect},
      {"formats", "the checkpoint formats ucp reads and writes", RunFormats},
  };
  return kCommands;
}

namespace {

void PrintUsage(std::FILE* out) {
  std::fprintf(
      out,
      "ucp - universal checkpoint reshaping for large-model training\n"
      "\n"
      "usage: ucp <command> [options]   (ucp <command> --help for details)\n"
      "\n"
      "commands:\n");
  for (const Command& c : Commands()) {
    std::fprintf(out, "  %-14s %s\n", c.name, c.summary);
  }
  std::fprintf(
      out,
      "\n"
      "examples:\n"
      "  ucp to-universal /ckpt/gpt -o gpt.ucp.h5\n"
      "  ucp reshape gpt.ucp.h5 -o /ckpt/gpt-tp4 --tp 4 --pp 1 --dp 2\n"
      "  ucp convert /ckpt/gpt -o /ckpt/gpt-pp4 --tp 1 --pp 4 --dp 8 \\\n"
      "      --distributed-optimizer\n"
      "  ucp convert /ckpt/ds -o /ckpt/ds-8 --format deepspeed --dp 8 "
      "--zero-stage 2\n"
      "  ucp export /ckpt/ds -o hf/ --max-shard-size 2GB\n"
      "  ucp verify gpt.ucp.h5\n"
      "  ucp layout check /ckpt/gpt\n"
      "  ucp inspect --json checkpoints/iter_0000100 > tree.json\n"
      "\n"
      "exit codes: 0 ok, 1 other error (ucp diff: different), 2 usage error, "
      "3\n"
      "format error (input corrupt or unsupported), 4 layout error, 5 i/o "
      "error,\n"
      "70 internal error\n");
}

// The one error line on stderr; with --json also a JSON document on stdout
// (unless the command already printed its own), so that --json output is
// always one valid JSON document.
int Fail(const char* kind, const std::string& what, int code, bool json) {
  PrintError(kind, what);
  if (json && !JsonPrinted()) {
    json::Value doc;
    doc["ok"] = false;
    doc["error"]["kind"] = kind;
    doc["error"]["message"] = what;
    doc["error"]["exit_code"] = code;
    PrintJson(doc);
  }
  return code;
}

// A reshape keeps every source rank file open (TP8 x PP64 with the
// distributed optimizer is 1024 files); Debian's default soft limit is 1024.
void RaiseOpenFileLimit() {
  rlimit lim{};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur >= lim.rlim_max) {
    return;
  }
  lim.rlim_cur = lim.rlim_max;
  ::setrlimit(RLIMIT_NOFILE, &lim);  // best effort
}

}  // namespace
}  // namespace ucp::cli

int main(int argc, char** argv) {
  ucp::cli::RaiseOpenFileLimit();
  using namespace ucp::cli;
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.empty()) {
    PrintUsage(stderr);
    return 2;
  }
  const std::string name = args.front();
  if (name == "-h" || name == "--help" || name == "help") {
    if (args.size() >= 2 && name == "help") {
      args = {args[1], "--help"};
    } else {
      PrintUsage(stdout);
      return 0;
    }
  }
  if (name == "--version") {
    std::printf("ucp 0.1.0\n");
    return 0;
  }
  const bool json = std::find(args.begin(), args.end(), "--json") != args.end();
  for (const Command& c : Commands()) {
    if (args.front() != c.name) continue;
    std::vector<std::string> rest(args.begin() + 1, args.end());
    int code = 0;
    try {
      code = c.run(rest);
    } catch (const ucp::Error& e) {
      // A job's other processes stop with this error (one that came from
      // one of them is not reported again).
      ReportJobFailure(e);
      code = Fail(e.kind(), e.what(), e.ExitCode(), json);
    } catch (const boost::program_options::error& e) {
      std::string msg =
          std::string(e.what()) + " (see: ucp " + c.name + " --help)";
      ReportJobFailure(ucp::UsageError(msg));
      code = Fail("usage error", msg, 2, json);
    } catch (const std::bad_alloc&) {
      const char* msg = "out of memory (lower --memory or --threads)";
      ReportJobFailure(ucp::Error(msg));
      code = Fail("error", msg, 1, json);
    } catch (const std::exception& e) {
      ReportJobFailure(ucp::InternalError(e.what()));
      code = Fail("internal error", e.what(), 70, json);
    }
    EndJob();
    return code;
  }
  return Fail("usage error",
              "unknown command '" + args.front() + "' (see: ucp --help)", 2,
              json);
}
