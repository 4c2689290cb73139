#include "engine/dist/split.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "engine/core/error.h"
#include "engine/dist/assign.h"

namespace ucp::dist {

namespace {

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// Test hooks (tests/cli/test_dist.py), once the files are assigned:
// UCP_TESTING_DIST_PAUSE="R:S" makes rank R sleep S seconds (to be killed),
// UCP_TESTING_DIST_FAIL=R makes rank R fail.
void TestingHooks(int rank) {
  if (const char* v = std::getenv("UCP_TESTING_DIST_PAUSE")) {
    const std::string text(v);
    const size_t colon = text.find(':');
    if (colon != std::string::npos &&
        std::atoi(text.substr(0, colon).c_str()) == rank) {
      std::this_thread::sleep_for(std::chrono::milliseconds(
          static_cast<int64_t>(std::atof(text.c_str() + colon + 1) * 1000)));
    }
  }
  if (const char* v = std::getenv("UCP_TESTING_DIST_FAIL");
      v && std::atoi(v) == rank) {
    throw IoError("testing: rank ", rank, " fails (UCP_TESTING_DIST_FAIL)");
  }
}

}  // namespace

std::vector<int> JobSplit::Assign(const std::vector<File>& files) {
  std::vector<FileLoad> loads;
  loads.reserve(files.size());
  for (const File& f : files) loads.push_back({f.bytes, f.slots});
  std::vector<int> owner = AssignFiles(loads, coordinator_.world());
  TestingHooks(coordinator_.rank());
  return owner;
}

std::optional<std::vector<json::Value>> JobSplit::Finished(json::Value report) {
  report["rank"] = coordinator_.rank();
  report["host"] = HostName();
  const StoreStats s = coordinator_.stats();
  report["store_messages"] = s.messages;
  report["store_bytes"] = s.bytes;
  const std::vector<std::string> all =
      coordinator_.Gather("emit", report.Dump());
  if (all.empty()) return std::nullopt;
  reports_.clear();
  for (const std::string& text : all)
    reports_.push_back(json::Value::Parse(text));
  return reports_;
}

json::Value JobSplit::Processes() const {
  json::Value out = json::Value::Array();
  for (const json::Value& r : reports_) {
    json::Value p;
    for (const char* k : {"rank", "host", "files"}) p[k] = r.At(k);
    p["bytes_written"] = r.At("bytes");
    for (const char* k :
         {"bytes_read", "seconds", "store_messages", "store_bytes"})
      p[k] = r.At(k);
    out.Append(std::move(p));
  }
  return out;
}

}  // namespace ucp::dist
