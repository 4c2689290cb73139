#include "engine/dist/split.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

#include "engine/core/error.h"
#include "engine/core/hash.h"
#include "engine/dist/assign.h"

namespace ucp::dist {

namespace {

std::string HostName() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "?";
  return name;
}

// Test hooks (tests/cli/test_dist.py), once the files are assigned:
// UCP_TESTING_DIST_PAUSE="R:S[,R:S...]" makes rank R sleep S seconds (to be
// killed, or busy while another fails), UCP_TESTING_DIST_FAIL=R makes rank R
// fail.
void TestingHooks(int rank) {
  if (const char* v = std::getenv("UCP_TESTING_DIST_PAUSE")) {
    const std::string text(v);
    size_t at = 0;
    while (at < text.size()) {
      size_t end = text.find(',', at);
      if (end == std::string::npos) end = text.size();
      const std::string item = text.substr(at, end - at);
      at = end + 1;
      const size_t colon = item.find(':');
      if (colon != std::string::npos &&
          std::atoi(item.substr(0, colon).c_str()) == rank) {
        std::this_thread::sleep_for(std::chrono::milliseconds(
            static_cast<int64_t>(std::atof(item.c_str() + colon + 1) * 1000)));
      }
    }
  }
  if (const char* v = std::getenv("UCP_TESTING_DIST_FAIL");
      v && std::atoi(v) == rank) {
    throw IoError("testing: rank ", rank, " fails (UCP_TESTING_DIST_FAIL)");
  }
}

// "<files>:<files with slots>:<xxh3 hex>" of the plan (each file's path,
// slot bytes and whether it has slots) and the world size: what every
// process must have computed alike for the assignment to be the same.
std::string PlanDigest(const std::vector<formats::EmitSplit::File>& files,
                       int world) {
  Xxh3Hasher h;
  const int64_t w = world;
  h.Update(&w, sizeof(w));
  int64_t with_slots = 0;
  for (const formats::EmitSplit::File& f : files) {
    const std::string path = f.path.generic_string();
    const uint64_t n = path.size();
    const uint8_t slots = f.slots ? 1 : 0;
    h.Update(&n, sizeof(n));
    h.Update(path.data(), path.size());
    h.Update(&f.bytes, sizeof(f.bytes));
    h.Update(&slots, 1);
    with_slots += slots;
  }
  return StrCat(files.size(), ":", with_slots, ":", HashHex(h.Digest()));
}

}  // namespace

std::vector<int> JobSplit::Assign(const std::vector<File>& files) {
  std::vector<File> mine = files;
  // Test hook: UCP_TESTING_DIST_PERTURB_PLAN=R makes rank R plan one byte
  // more in its first file (as a different build or source listing would).
  if (const char* v = std::getenv("UCP_TESTING_DIST_PERTURB_PLAN");
      v && std::atoi(v) == coordinator_.rank() && !mine.empty()) {
    mine[0].bytes += 1;
  }
  // Rank 0's plan is the job's: every other process must have planned the
  // same files, else files would be written twice or not at all.
  const std::string digest = PlanDigest(mine, coordinator_.world());
  if (coordinator_.leader()) {
    coordinator_.Publish("plan", digest);
  } else {
    const std::string want = coordinator_.Fetch("plan");
    if (want != digest) {
      throw UsageError(
          "process ", coordinator_.rank(),
          " planned another target than rank 0: files:files with slots:xxh3 ",
          digest, " against rank 0's ", want,
          " (the same ucp build and the same view of the source on every "
          "process?)");
    }
  }
  std::vector<FileLoad> loads;
  loads.reserve(mine.size());
  for (const File& f : mine) loads.push_back({f.bytes, f.slots});
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
  if (coordinator_.rank() != 0) {
    // This report is a message too: its text counted (as dumped with the
    // count before it; its key is not).
    report["store_messages"] = s.messages + 1;
    report["store_bytes"] = s.bytes + report.Dump().size();
  }
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
