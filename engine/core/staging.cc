#include "engine/core/staging.h"

#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include "engine/core/error.h"
#include "engine/core/progress.h"

namespace ucp {
namespace fs = std::filesystem;
namespace {

constexpr std::string_view kMarkers[] = {".ucp-partial-", ".ucp-tmp-"};

// Field 22 of /proc/<pid>/stat (start time); absent if no such process.
std::optional<uint64_t> StartTime(int64_t pid) {
  std::ifstream in(StrCat("/proc/", pid, "/stat"));
  if (!in) return std::nullopt;
  std::string line;
  std::getline(in, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return std::nullopt;
  std::istringstream rest(line.substr(close + 1));
  std::string field;
  // Fields after the command: 3 (state) ... 22 (starttime).
  for (int i = 3; i <= 22; ++i) {
    if (!(rest >> field)) return std::nullopt;
  }
  return std::strtoull(field.c_str(), nullptr, 10);
}

bool Digits(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s)
    if (c < '0' || c > '9') return false;
  return true;
}

// "<pid>-<start>-..." after a marker; absent for other names (staging of an
// older ucp without the token is left alone).
std::optional<std::pair<int64_t, uint64_t>> ParseToken(std::string_view s) {
  const size_t a = s.find('-');
  if (a == std::string_view::npos) return std::nullopt;
  const size_t b = s.find('-', a + 1);
  if (b == std::string_view::npos) return std::nullopt;
  const std::string_view pid = s.substr(0, a), start = s.substr(a + 1, b - a - 1);
  if (!Digits(pid) || !Digits(start) || pid.size() > 9 || start.size() > 19)
    return std::nullopt;
  return std::make_pair(std::stoll(std::string(pid)),
                        std::strtoull(std::string(start).c_str(), nullptr, 10));
}

uint64_t DiskBytes(const fs::path& p) {
  std::error_code ec;
  if (fs::is_regular_file(fs::symlink_status(p, ec))) {
    const auto n = fs::file_size(p, ec);
    return ec ? 0 : n;
  }
  uint64_t total = 0;
  for (fs::recursive_directory_iterator it(p, ec), end; !ec && it != end;
       it.increment(ec)) {
    if (it->is_regular_file(ec)) {
      const auto n = it->file_size(ec);
      if (!ec) total += n;
    }
  }
  return total;
}

// A staging entry named `name`: for `prefix` (".<final>") only.
std::optional<Leftover> Classify(const fs::path& dir, const std::string& name,
                                 std::string_view prefix) {
  if (name.empty() || name[0] != '.') return std::nullopt;
  for (std::string_view marker : kMarkers) {
    const size_t at = name.find(marker);
    if (at == std::string::npos || at == 0) continue;
    if (!prefix.empty() && std::string_view(name).substr(0, at) != prefix)
      continue;
    auto token = ParseToken(std::string_view(name).substr(at + marker.size()));
    if (!token) return std::nullopt;
    Leftover l;
    l.path = dir / name;
    l.pid = token->first;
    const std::optional<uint64_t> start = StartTime(token->first);
    l.running = start && *start == token->second;
    l.bytes = DiskBytes(l.path);
    return l;
  }
  return std::nullopt;
}

std::vector<Leftover> Scan(const fs::path& dir, std::string_view prefix) {
  std::vector<Leftover> out;
  std::error_code ec;
  for (fs::directory_iterator it(dir.empty() ? fs::path(".") : dir, ec), end;
       !ec && it != end; it.increment(ec)) {
    if (auto l = Classify(dir, it->path().filename().string(), prefix))
      out.push_back(std::move(*l));
  }
  return out;
}

}  // namespace

const std::string& StagingToken() {
  static const std::string token = [] {
    const int64_t pid = ::getpid();
    return StrCat(pid, "-", StartTime(pid).value_or(0));
  }();
  return token;
}

fs::path OutputName(fs::path path) {
  while (!path.empty() && !path.has_filename() && path != path.root_path())
    path = path.parent_path();
  return path;
}

std::vector<Leftover> FindLeftovers(const fs::path& final_path) {
  const fs::path f = OutputName(final_path);
  return Scan(f.parent_path(), StrCat(".", f.filename().string()));
}

std::vector<Leftover> FindLeftoversIn(const fs::path& dir) {
  return Scan(dir, "");
}

std::vector<Leftover> ReclaimLeftovers(const fs::path& final_path) {
  std::vector<Leftover> removed;
  for (Leftover& l : FindLeftovers(final_path)) {
    if (l.running) continue;
    std::error_code ec;
    fs::remove_all(l.path, ec);
    if (!ec) removed.push_back(std::move(l));
  }
  return removed;
}

uint64_t FreeBytes(const fs::path& dir) {
  if (const char* v = std::getenv("UCP_TESTING_FREE_BYTES"); v && *v)
    return std::strtoull(v, nullptr, 10);
  struct statvfs st {};
  const fs::path d = dir.empty() ? fs::path(".") : dir;
  if (::statvfs(d.c_str(), &st) != 0) {
    throw IoError("cannot query the free space of ", d.string(), ": ",
                  std::strerror(errno));
  }
  return static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
}

void RequireFreeSpace(const fs::path& dir, uint64_t needed,
                      std::string_view what) {
  const uint64_t free = FreeBytes(dir);
  if (free < needed) {
    throw IoError("not enough free space for ", what, ": needs at least ",
                  needed, " bytes (", HumanBytes(static_cast<double>(needed)), "), ", free,
                  " bytes (", HumanBytes(static_cast<double>(free)), ") free on the filesystem of ",
                  dir.empty() ? std::string(".") : dir.string());
  }
}

}  // namespace ucp
