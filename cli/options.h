#pragma once
// Shared command-line helpers. Boost.Program_options is used only in cli/.

#include <boost/program_options.hpp>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/formats/driver.h"
#include "engine/reshape/executor.h"

namespace ucp::json {
class Value;
}

namespace ucp::cli {

namespace po = boost::program_options;

/// Applies --quiet / --progress to the process-wide progress default.
void SetProgressMode(bool quiet, bool force_progress);

/// Options every long-running command takes.
struct RunOptions {
  int threads = 0;
  std::string memory = "2G";
  bool quiet = false;
  bool progress = false;
  bool json = false;
  bool no_sync = false;
  /// Executor settings from --threads / --memory; applies --no-sync
  /// (SetDurableWrites). Throws UsageError.
  reshape::ExecutorOptions Executor() const;
};
void AddRunOptions(po::options_description& desc, RunOptions& options);

/// Parses `args` with named options `desc` and positional names `positional`
/// (each taking one value; the last may repeat if `last_repeats`). Prints
/// `desc` and returns false on --help. Throws boost::program_options errors
/// (main maps them to usage errors).
bool Parse(const std::vector<std::string>& args, po::options_description& desc,
           const std::vector<std::string>& positional, po::variables_map& vm,
           bool last_repeats = false);

/// The options the registered drivers declare (formats/options.h), added to
/// a command's options and read back generically. An option several drivers
/// declare appears once, with each driver's help.
class DriverOptionArgs {
 public:
  /// Adds every readable (`target` false) or writable driver's options.
  /// Names in `rename` are added as "<prefix><name>" (convert's source and
  /// target both take a --tag: the target's is --target-tag).
  void Add(po::options_description& desc, bool target,
           const std::vector<std::string>& rename = {},
           const std::string& prefix = "");
  /// The values given on the command line, by option name.
  formats::OptionValues Values(const po::variables_map& vm) const;
  /// The option names added (before renaming).
  std::vector<std::string> Names() const;

 private:
  struct Entry {
    std::string name;  // the driver's
    std::string flag;  // on the command line
    formats::OptionSpec::Type type;
  };
  std::vector<Entry> entries_;
};

/// Options that choose and read a source checkpoint (any format).
struct SourceArgs {
  std::string from;
  std::string layout;
  int64_t vocab_size = 0;
  DriverOptionArgs driver_options;
  formats::OptionValues values;  // set by Read

  void Add(po::options_description& desc);
  /// Takes the driver options' values from `vm` (after parsing).
  void Read(const po::variables_map& vm);
  formats::SourceOptions Options() const;
  /// Detects the format (or takes --from) and opens the checkpoint. Throws
  /// what formats::DetectDriver and Driver::Open throw.
  std::unique_ptr<formats::Source> Open(
      const std::filesystem::path& path) const;
};

/// The target options of reshape / convert / resume: the format, the
/// topology sizes it takes, and its driver's own options.
struct TargetArgs {
  std::string format;
  int64_t tp = 0, pp = 0, vpp = 0, dp = 0;  // 0: not given
  int64_t ep = 0, etp = 0;                  // 0: not given (etp: tp)
  bool no_optimizer = false;
  int64_t vocab_size = 0;
  std::string names;  // a name map (--names), "" for the source's names
  /// The layout a layout-placed target gives content without one (convert:
  /// the source's --layout; reshape: its own); "" detects it.
  std::string layout;
  std::vector<std::string> model_var_args;  // --model-var NAME=N, as given
  layouts::Variables model_vars;            // set by Read
  DriverOptionArgs driver_options;
  formats::OptionValues values;  // set by Read

  /// `rename`/`prefix`: as DriverOptionArgs::Add (convert and resume name
  /// the target's options that clash with a source option target-<name>).
  void Add(po::options_description& d, bool with_vocab,
           const std::vector<std::string>& rename = {},
           const std::string& prefix = "");
  void Read(const po::variables_map& vm);
  /// The options for `driver`: the topology sizes it takes (--dp required
  /// when it takes one; none given when it takes none) and its own options.
  /// Throws UsageError naming the option and what the format takes, or the
  /// numbers when the expert grid (etp x ep x pp) does not divide the world
  /// (tp x pp x dp).
  formats::TargetOptions Options(const formats::Driver& driver) const;
  /// "tp 2, pp 2, vpp 1, dp 4, distributed optimizer" for `driver` (", ep 4,
  /// etp 1" when --ep or --etp is given); "any topology" for a format
  /// without one.
  std::string Describe(const formats::Driver& driver) const;
  /// {"tp", "pp", "vpp", "dp", "ep", "etp", <layout options>} for `driver`
  /// ("ep" and "etp" for a format that takes them).
  json::Value TopologyJson(const formats::Driver& driver) const;
};

/// Adds --model-var NAME=N (repeatable) into `args`; `what` says what for.
void AddModelVarOption(po::options_description& d,
                       std::vector<std::string>& args, const char* what);
/// The --model-var NAME=N values. Throws UsageError naming a malformed one.
layouts::Variables ParseModelVars(const std::vector<std::string>& args);

/// `format`, else `native`: a writable driver. Throws UsageError naming the
/// writable formats.
const formats::Driver& TargetDriver(const std::string& format,
                                    const std::string& native);
/// Seconds since `t`.
double Since(std::chrono::steady_clock::time_point t);

/// The atom bytes a universal file written from `plan` holds (pad rows
/// included).
uint64_t UniversalBytes(const universal::SourcePlan& plan);
/// Staging left by crashed runs in folder `path` and beside it
/// (core/staging.h): one "ucp: note: ..." line each on stderr; returned as a
/// JSON array of {path, pid, running, bytes}.
json::Value ReportLeftovers(const std::filesystem::path& path);

/// Prints a JSON document on stdout (and remembers that one was printed), or
/// hands it to the sink SetJsonSink installed.
void PrintJson(const json::Value& doc);
/// While set, PrintJson hands documents to `sink` instead of printing them
/// (the Python module runs the commands in-process and returns their --json
/// document); an empty function restores stdout. Not thread-safe: the caller
/// runs one command at a time.
void SetJsonSink(std::function<void(const json::Value&)> sink);
/// True once PrintJson has printed a document in this process.
bool JsonPrinted();

/// `text` on one line and harmless for a terminal: control characters
/// (newlines from a pickled string or a file name, escape sequences) are
/// written as \n, \r, \t, \xNN, or \u00NN for the C1 controls.
std::string OneLine(std::string_view text);
/// Prints "ucp: <kind>: <what>" as one line on stderr.
void PrintError(std::string_view kind, std::string_view what);

}  // namespace ucp::cli
