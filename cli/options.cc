#include "cli/options.h"

#include <cstdio>

#include "engine/core/progress.h"

namespace ucp::cli {

std::string HumanBytes(uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  if (u == 0) {
    std::snprintf(buf, sizeof buf, "%llu B",
                  static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  }
  return buf;
}

void SetProgressMode(bool quiet, bool force_progress) {
  if (quiet) {
    Progress::SetDefaultMode(Progress::Mode::kNever);
  } else if (force_progress) {
    Progress::SetDefaultMode(Progress::Mode::kAlways);
  }
}

}  // namespace ucp::cli
