#pragma once
// Shared command-line helpers (Boost.Program_options stays in options.cc and
// the cmd_*.cc files).

#include <cstdint>
#include <string>

namespace ucp::cli {

/// "1.5 MiB"
std::string HumanBytes(uint64_t bytes);

/// Applies --quiet / --progress to the process-wide progress default.
void SetProgressMode(bool quiet, bool force_progress);

}  // namespace ucp::cli
