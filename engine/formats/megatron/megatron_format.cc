// Megatron's folder and file names (megatron_format.h): iteration folders,
// the tracker, rank folders, rng-state keys; shared by the three Megatron
// drivers.

#include "engine/formats/megatron/megatron_format.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <system_error>

#include "engine/core/error.h"
#include "engine/core/file.h"

namespace ucp::megatron {
namespace fs = std::filesystem;
namespace {

std::optional<int64_t> ParseNumber(std::string_view s) {
  if (s.empty()) return std::nullopt;
  int64_t v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || v < 0)
    return std::nullopt;
  return v;
}

// "iter_0000050, iter_0000100": the iter_N folders of `dir`, sorted; "none".
std::string IterationsIn(const fs::path& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end;
       it.increment(ec)) {
    std::string name = it->path().filename().string();
    std::error_code e2;
    if (ParseIterDirName(name) && it->is_directory(e2))
      names.push_back(std::move(name));
  }
  std::sort(names.begin(), names.end());
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

}  // namespace

std::string IterDirName(int64_t iteration, bool release) {
  if (release) return std::string(kReleaseDir);
  char buf[32];
  std::snprintf(buf, sizeof buf, "iter_%07lld",
                static_cast<long long>(iteration));
  return buf;
}

std::string RngStateKey(int64_t tp_rank, int64_t pp_rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "rng_state/tp%02lld_pp%03lld",
                static_cast<long long>(tp_rank),
                static_cast<long long>(pp_rank));
  return buf;
}

std::string RngStateKey(int64_t tp_rank, int64_t pp_rank, int64_t ep_rank) {
  std::string key = RngStateKey(tp_rank, pp_rank);
  if (ep_rank == 0) return key;
  char buf[32];
  std::snprintf(buf, sizeof buf, "_ep%03lld", static_cast<long long>(ep_rank));
  return key + buf;
}

std::string RankDirName(int64_t tp_rank, int64_t pp_rank, int64_t pp,
                        int64_t ep_rank, int64_t ep) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "mp_rank_%02lld",
                static_cast<long long>(tp_rank));
  std::string name = buf;
  if (pp > 1) {
    std::snprintf(buf, sizeof buf, "_%03lld", static_cast<long long>(pp_rank));
    name += buf;
  }
  if (ep > 1) {
    std::snprintf(buf, sizeof buf, "_%03lld", static_cast<long long>(ep_rank));
    name += buf;
  }
  return name;
}

std::optional<int64_t> ParseIterDirName(std::string_view name) {
  if (!name.starts_with("iter_")) return std::nullopt;
  return ParseNumber(name.substr(5));
}

IterationFolder LocateIteration(const fs::path& path,
                                std::optional<int64_t> iteration,
                                ReleaseFolder release) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    throw IoError("checkpoint folder ", path.string(),
                  " does not exist or is not a folder");
  }
  const bool release_ok = release == ReleaseFolder::kAccepted;
  IterationFolder f;
  const fs::path tracker = path / kTrackerFile;
  const std::string leaf = path.filename().string();
  const auto own = ParseIterDirName(leaf);
  const bool own_release = release_ok && leaf == kReleaseDir;
  if (iteration) {
    const bool iter_folder = own || own_release;
    f.dir = iter_folder && !fs::exists(tracker, ec) ? path.parent_path() : path;
    f.iteration = *iteration;
    f.iter_dir = f.dir / IterDirName(*iteration, false);
    if (!fs::is_directory(f.iter_dir, ec)) {
      // The caller's choice: say which iterations the folder has.
      throw UsageError("--iteration ", *iteration, ": no ",
                       f.iter_dir.filename().string(), " in ", f.dir.string(),
                       " (iterations here: ", IterationsIn(f.dir), ")");
    }
  } else if (fs::exists(tracker, ec)) {
    f.dir = path;
    const std::string text = ReadSmallFile(tracker, 1024);
    const std::string_view held = TrimWhitespace(text);
    const auto n = ParseNumber(held);
    f.release = release_ok && held == kReleaseDir;
    if (!n && !f.release) {
      throw FormatError(tracker.string(), ": tracker holds '",
                        std::string(held).substr(0, 40),
                        "', expected an iteration number",
                        release_ok ? " or 'release'" : "");
    }
    f.iteration = n.value_or(0);
    f.iter_dir = path / IterDirName(f.iteration, f.release);
    if (!fs::is_directory(f.iter_dir, ec)) {
      throw FormatError(tracker.string(), " names ",
                        f.release ? std::string(kReleaseDir)
                                  : StrCat("iteration ", f.iteration),
                        " but ", f.iter_dir.string(), " does not exist");
    }
  } else {
    f.dir = path.parent_path();
    f.iter_dir = path;
    f.iteration = own.value_or(0);
    f.release = own_release;
    f.named = own.has_value() || own_release;
  }
  f.iter_dir = f.iter_dir.lexically_normal();
  return f;
}

std::optional<RankDirNumbers> ParseRankDirName(std::string_view name) {
  constexpr std::string_view kPrefix = "mp_rank_";
  if (name.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  name.remove_prefix(kPrefix.size());
  std::vector<int64_t> nums;
  while (true) {
    const size_t us = name.find('_');
    auto n = ParseNumber(name.substr(0, us));
    if (!n) return std::nullopt;
    nums.push_back(*n);
    if (us == std::string_view::npos) break;
    name.remove_prefix(us + 1);
  }
  if (nums.size() > 3) return std::nullopt;
  RankDirNumbers r;
  r.tp_rank = nums[0];
  if (nums.size() > 1) r.second = nums[1];
  if (nums.size() > 2) r.third = nums[2];
  return r;
}

}  // namespace ucp::megatron
