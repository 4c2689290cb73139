#include "cli/options.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <thread>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/core/staging.h"
#include "engine/json/json.h"
#include "engine/torchfile/zip.h"
#include "engine/universal/input.h"

namespace ucp::cli {

void SetProgressMode(bool quiet, bool force_progress) {
  if (quiet) {
    Progress::SetDefaultMode(Progress::Mode::kNever);
  } else if (force_progress) {
    Progress::SetDefaultMode(Progress::Mode::kAlways);
  }
}

reshape::ExecutorOptions RunOptions::Executor() const {
  reshape::ExecutorOptions o;
  if (threads < 0) throw UsageError("--threads must be >= 0 (0: all cores)");
  o.threads = threads;
  SetDurableWrites(!no_sync);
  o.memory_budget = reshape::ParseByteSize(memory);
  if (o.memory_budget < (16u << 20)) {
    throw UsageError("--memory ", memory, " is too small (at least 16M)");
  }
  // For benchmarks: the executor's chunk size (default: from --memory).
  if (const char* c = std::getenv("UCP_CHUNK_BYTES"); c != nullptr && *c) {
    o.chunk_bytes = reshape::ParseByteSize(c);
  }
  return o;
}

void AddRunOptions(po::options_description& desc, RunOptions& options) {
  desc.add_options()("threads",
                     po::value<int>(&options.threads)->default_value(0),
                     "worker threads (0: all cores)")(
      "memory", po::value<std::string>(&options.memory)->default_value("2G"),
      "buffer memory budget, at least 16M, e.g. 512M, 4G (peak RSS stays "
      "near it)")("json", po::bool_switch(&options.json),
                  "print a JSON summary on stdout")(
      "quiet,q", po::bool_switch(&options.quiet), "no progress bar")(
      "progress", po::bool_switch(&options.progress),
      "progress bar even when stderr is not a terminal")(
      "no-sync", po::bool_switch(&options.no_sync),
      "do not fsync the outputs (like cp: faster, but a power loss can "
      "leave files with missing data; unsafe for checkpoints you keep); "
      "UCP_NO_SYNC=1 in the environment does the same for every command");
}

bool Parse(const std::vector<std::string>& args, po::options_description& desc,
           const std::vector<std::string>& positional, po::variables_map& vm,
           bool last_repeats) {
  desc.add_options()("help,h", "show this help");
  po::options_description hidden;
  po::positional_options_description pos;
  for (size_t i = 0; i < positional.size(); ++i) {
    const bool repeat = last_repeats && i + 1 == positional.size();
    if (repeat) {
      hidden.add_options()(positional[i].c_str(),
                           po::value<std::vector<std::string>>(), "");
    } else {
      hidden.add_options()(positional[i].c_str(), po::value<std::string>(), "");
    }
    pos.add(positional[i].c_str(), repeat ? -1 : 1);
  }
  po::options_description all;
  all.add(desc).add(hidden);
  // An option with an optional value (`--dequantize [bf16|fp32]`, an implicit
  // value) takes the next word as its value unless it looks like a path: one
  // that exists, or a word with a '/' (the source then: `--dequantize SRC`,
  // and a mistyped `--dequantize /no/such` is named as the missing source);
  // such an option is moved to the end of the words, where it takes none.
  std::vector<std::string> words, implicit;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    const po::option_description* o =
        a.starts_with("--") && a.find('=') == std::string::npos
            ? all.find_nothrow(a.substr(2), false)
            : nullptr;
    std::error_code ec;
    if (o != nullptr && o->semantic()->min_tokens() == 0 &&
        o->semantic()->max_tokens() == 1 &&
        (i + 1 == args.size() || args[i + 1].starts_with("-") ||
         args[i + 1].find('/') != std::string::npos ||
         std::filesystem::exists(args[i + 1], ec))) {
      implicit.push_back(a);
    } else {
      words.push_back(a);
    }
  }
  words.insert(words.end(), implicit.begin(), implicit.end());
  po::store(po::command_line_parser(words).options(all).positional(pos).run(),
            vm);
  if (vm.count("help")) {
    std::cout << desc << "\n";
    return false;
  }
  po::notify(vm);
  return true;
}

uint64_t UniversalBytes(const universal::SourcePlan& plan) {
  uint64_t bytes = 0;
  for (const universal::AtomPlan& a : plan.atoms) {
    const int64_t n = NumElements(a.shape) +
                      (a.pad_shape.empty() ? 0 : NumElements(a.pad_shape));
    bytes += static_cast<uint64_t>(n) * ElementSize(a.dtype);
  }
  return bytes;
}

json::Value ReportLeftovers(const std::filesystem::path& path) {
  std::vector<Leftover> all = FindLeftovers(path);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    for (Leftover& l : FindLeftoversIn(path)) all.push_back(std::move(l));
  }
  json::Value out = json::Value::Array();
  for (const Leftover& l : all) {
    std::string name = l.path.filename().string();
    const size_t marker = name.find(".ucp-", 1);
    const std::string output = name.substr(1, marker - 1);
    std::fprintf(
        stderr,
        "ucp: note: %s: staging left by ucp process %lld (%s), %s; %s\n",
        OneLine(l.path.string()).c_str(), static_cast<long long>(l.pid),
        l.running ? "still running" : "no longer running",
        HumanBytes(static_cast<double>(l.bytes)).c_str(),
        l.running ? "it is in use"
                  : StrCat("the next ucp run writing ", OneLine(output),
                           " here removes it (or delete it)")
                        .c_str());
    json::Value j;
    j["path"] = l.path.string();
    j["pid"] = l.pid;
    j["running"] = l.running;
    j["bytes"] = static_cast<int64_t>(l.bytes);
    out.Append(std::move(j));
  }
  return out;
}

namespace {
bool g_json_printed = false;
std::function<void(const json::Value&)>& JsonSink() {
  static std::function<void(const json::Value&)> sink;
  return sink;
}
}  // namespace

void PrintJson(const json::Value& doc) {
  if (JsonSink()) {
    JsonSink()(doc);
  } else {
    std::printf("%s\n", doc.Dump(2).c_str());
    std::fflush(stdout);
  }
  g_json_printed = true;
}

void SetJsonSink(std::function<void(const json::Value&)> sink) {
  JsonSink() = std::move(sink);
}

bool JsonPrinted() { return g_json_printed; }

std::string OneLine(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    const auto u = static_cast<unsigned char>(c);
    if (u == 0xc2 && i + 1 < text.size() &&
        (static_cast<unsigned char>(text[i + 1]) & 0xe0) == 0x80) {
      // U+0080..U+009F, the C1 controls (CSI is U+009B), UTF-8 encoded.
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x",
                    static_cast<unsigned char>(text[++i]));
      out += buf;
    } else if (u >= 0x20 && u != 0x7f) {
      out += c;
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", u);
      out += buf;
    }
  }
  return out;
}

void PrintError(std::string_view kind, std::string_view what) {
  std::fprintf(stderr, "ucp: %s: %s\n", OneLine(kind).c_str(),
               OneLine(what).c_str());
}

}  // namespace ucp::cli
