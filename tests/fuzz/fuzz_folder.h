#pragma once
// A fuzz input as one file of a real checkpoint folder: each placement is a
// writable copy of a fixture folder (made once per process, removed at
// exit) in which the input replaces one file for the run and the original
// bytes are put back after it.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

namespace ucp::fuzz {

namespace fs = std::filesystem;

struct Placement {
  fs::path folder;  // the copy of the fixture folder
  fs::path file;    // the file the input replaces (inside `folder`)
  std::string original;
};

class ScratchFolders {
 public:
  /// `placements`: (fixture folder, file relative to it). `tag` names the
  /// scratch folder ($TMPDIR/ucp-fuzz-<tag>-<pid>). Exits with a message if
  /// a fixture is missing (the harness would otherwise test nothing).
  ScratchFolders(const std::vector<std::pair<fs::path, fs::path>>& placements,
                 const char* tag) {
    const char* tmp = std::getenv("TMPDIR");
    root_ = fs::path(tmp != nullptr && *tmp ? tmp : "/tmp") /
            (std::string("ucp-fuzz-") + tag + "-" + std::to_string(::getpid()));
    std::error_code ec;
    fs::remove_all(root_, ec);
    for (size_t i = 0; i < placements.size(); ++i) {
      const auto& [fixture, file] = placements[i];
      Placement p;
      p.folder = root_ / std::to_string(i);
      p.file = p.folder / file;
      fs::create_directories(p.folder, ec);
      fs::copy(fixture, p.folder, fs::copy_options::recursive, ec);
      if (ec || !fs::is_regular_file(p.file)) {
        std::fprintf(stderr, "fuzz harness: cannot copy %s (for %s): %s\n",
                     fixture.c_str(), file.c_str(), ec.message().c_str());
        std::exit(2);
      }
      // The fixtures are read-only; their copies must not be.
      for (fs::recursive_directory_iterator it(p.folder, ec), end;
           !ec && it != end; it.increment(ec)) {
        fs::permissions(it->path(), fs::perms::owner_write,
                        fs::perm_options::add, ec);
      }
      std::ifstream in(p.file, std::ios::binary);
      p.original.assign(std::istreambuf_iterator<char>(in),
                        std::istreambuf_iterator<char>());
      placements_.push_back(std::move(p));
    }
  }
  ~ScratchFolders() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  ScratchFolders(const ScratchFolders&) = delete;
  ScratchFolders& operator=(const ScratchFolders&) = delete;

  const std::vector<Placement>& placements() const { return placements_; }

  /// Writes `data` as placement `i`'s file, runs `fn(folder)`, puts the
  /// original file back.
  template <typename Fn>
  void Run(size_t i, const uint8_t* data, size_t size, Fn&& fn) const {
    const Placement& p = placements_[i];
    Write(p.file, data, size);
    fn(p.folder);
    Write(p.file, p.original.data(), p.original.size());
  }

 private:
  static void Write(const fs::path& path, const void* data, size_t size) {
    if (FILE* f = std::fopen(path.c_str(), "wb")) {
      if (size > 0) std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
  }

  fs::path root_;
  std::vector<Placement> placements_;
};

/// The folder of the real checkpoints: $UCP_FIXTURES, else the one the
/// build was configured with (UCP_FUZZ_FIXTURES_DIR).
inline fs::path FixturesDir() {
  if (const char* env = std::getenv("UCP_FIXTURES"); env != nullptr && *env)
    return env;
#ifdef UCP_FUZZ_FIXTURES_DIR
  return UCP_FUZZ_FIXTURES_DIR;
#else
  return "../shared/fixtures";
#endif
}

}  // namespace ucp::fuzz
