// Replays fuzz inputs without libFuzzer (the ctest smoke, built by any
// compiler under ASan + UBSan): every file named on the command line, or
// found under a named folder, is passed to LLVMFuzzerTestOneInput once.
// Prints how many inputs ran; fails if none did, or if one took longer than
// UCP_REPLAY_MAX_SECONDS (when set: regressions of inputs that were slow; an
// input still running a second after that limit is stopped by an alarm, so
// one that would take hours fails at once).
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

char g_current[4096];  // the input running, for the alarm's message

void OnAlarm(int) {
  const char msg[] = "input still running past UCP_REPLAY_MAX_SECONDS: ";
  (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
  (void)!::write(STDERR_FILENO, g_current, std::strlen(g_current));
  (void)!::write(STDERR_FILENO, "\n", 1);
  ::_exit(1);
}

size_t RunFile(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)),
                    std::istreambuf_iterator<char>());
  if (bytes.size() > (64u << 20)) return 0;  // seeds stay small
  std::snprintf(g_current, sizeof g_current, "%s", p.c_str());
  if (const char* max = std::getenv("UCP_REPLAY_MAX_SECONDS")) {
    std::signal(SIGALRM, OnAlarm);
    ::alarm(static_cast<unsigned>(std::ceil(std::atof(max))) + 1);
  }
  const auto start = std::chrono::steady_clock::now();
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()),
                         bytes.size());
  ::alarm(0);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (const char* max = std::getenv("UCP_REPLAY_MAX_SECONDS")) {
    if (seconds > std::atof(max)) {
      std::fprintf(stderr, "%s took %.2f s (UCP_REPLAY_MAX_SECONDS=%s)\n",
                   p.c_str(), seconds, max);
      std::exit(1);
    }
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  size_t runs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path p = argv[i];
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec)) {
      for (std::filesystem::recursive_directory_iterator it(p, ec), end;
           !ec && it != end; it.increment(ec)) {
        if (it->is_regular_file(ec)) runs += RunFile(it->path());
      }
    } else if (std::filesystem::is_regular_file(p, ec)) {
      runs += RunFile(p);
    }
  }
  std::printf("%zu inputs replayed\n", runs);
  return runs > 0 ? 0 : 1;
}
