#pragma once
// The `ucp` sub-commands. Each lives in its own cmd_<name>.cc and is listed
// in Commands() (main.cc). Boost.Program_options is used only in cli/.

#include <string>
#include <vector>

namespace ucp::cli {

struct Command {
  const char* name;     // "inspect", "layout"
  const char* summary;  // one line for `ucp --help`
  /// Runs with the arguments after the command name; returns the exit code.
  /// Throws ucp::Error (mapped to exit codes by main).
  int (*run)(const std::vector<std::string>& args);
};

const std::vector<Command>& Commands();

int RunInspect(const std::vector<std::string>& args);
int RunToUniversal(const std::vector<std::string>& args);
int RunReshape(const std::vector<std::string>& args);
int RunConvert(const std::vector<std::string>& args);
int RunVerify(const std::vector<std::string>& args);
int RunLayout(const std::vector<std::string>& args);
int RunExport(const std::vector<std::string>& args);
int RunFormats(const std::vector<std::string>& args);
int RunResume(const std::vector<std::string>& args);
int RunManifest(const std::vector<std::string>& args);
int RunDiff(const std::vector<std::string>& args);

}  // namespace ucp::cli
