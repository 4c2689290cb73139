#pragma once
// Shared command-line helpers. Boost.Program_options is used only in cli/.

#include <boost/program_options.hpp>
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "engine/reshape/executor.h"

namespace ucp::json {
class Value;
}

namespace ucp::cli {

namespace po = boost::program_options;

/// "1.5 MiB"
std::string HumanBytes(uint64_t bytes);

/// Applies --quiet / --progress to the process-wide progress default.
void SetProgressMode(bool quiet, bool force_progress);

/// Options every long-running command takes.
struct RunOptions {
  int threads = 0;
  std::string memory = "2G";
  bool quiet = false;
  bool progress = false;
  bool json = false;
  /// Executor settings from --threads / --memory. Throws UsageError.
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

/// True if the file starts with the HDF5 signature (a universal file).
bool IsHdf5File(const std::filesystem::path& path);

/// Prints a JSON document on stdout.
void PrintJson(const json::Value& doc);

}  // namespace ucp::cli
