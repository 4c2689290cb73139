#pragma once
// A fuzz input as a temporary file (the readers take paths), removed after
// the run.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ucp::fuzz {

class ScratchFile {
 public:
  ScratchFile(const uint8_t* data, size_t size, const char* tag) {
    const char* dir = std::getenv("TMPDIR");
    path_ = std::string(dir != nullptr && *dir ? dir : "/tmp") + "/ucp-fuzz-" +
            tag + "-" + std::to_string(::getpid());
    if (FILE* f = std::fopen(path_.c_str(), "wb")) {
      if (size > 0) std::fwrite(data, 1, size, f);
      std::fclose(f);
    }
  }
  ~ScratchFile() { std::remove(path_.c_str()); }
  ScratchFile(const ScratchFile&) = delete;
  ScratchFile& operator=(const ScratchFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace ucp::fuzz
