// Fuzz harness: the torch.save container (engine/torchfile: zip records,
// CRC-32, data.pkl, storages; legacy format). The input is written to a
// temporary file and opened as a torch file; every tensor's bytes are read.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/torchfile/torch_file.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFile file(data, size, "zip");
  try {
    const ucp::torchfile::TorchFile f = ucp::torchfile::TorchFile::Open(file.path());
    std::vector<std::byte> buf;
    for (const ucp::torchfile::TensorInfo& t : f.tensors()) {
      if (t.nbytes > (1u << 20)) continue;
      buf.resize(t.nbytes);
      f.ReadTensor(t, buf);
    }
  } catch (const ucp::Error&) {
  }
  return 0;
}
