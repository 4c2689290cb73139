// Fuzz harness: a safetensors file as MindFormers' Checkpoint 2.0 holds them
// (engine/formats/mindspore/checkpoint2.h), through the header reader and a
// read of every tensor's bytes. Any input either reads or throws a
// ucp::Error.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/mindspore/checkpoint2.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFile file(data, size, "safetensors");
  try {
    const ucp::mindspore::CkptIndex index =
        ucp::mindspore::ReadSafetensorsIndex(file.path());
    const ucp::File f = ucp::File::OpenRead(file.path());
    std::vector<char> buf;
    for (const ucp::mindspore::CkptEntry& e : index.entries) {
      for (const ucp::mindspore::CkptSlice& s : e.slices) {
        buf.resize(s.length);
        if (s.length > 0) f.ReadExact(buf.data(), s.length, s.offset);
      }
    }
  } catch (const ucp::Error&) {
  }
  return 0;
}
