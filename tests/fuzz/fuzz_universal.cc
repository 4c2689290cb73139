// Fuzz harness: the universal-file reader (engine/atoms: HDF5 metadata, read
// in a forked child before HDF5 touches it in-process). The input is written
// to a temporary file and opened; params and datasets are listed, looked up
// by name and every dataset is read back and rehashed (Verify), so fuzzed
// offsets, sizes and checksums reach the readers.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "tests/fuzz/fuzz_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const ucp::fuzz::ScratchFile file(data, size, "h5");
  try {
    const ucp::atoms::AtomStoreReader r =
        ucp::atoms::AtomStoreReader::Open(file.path());
    size_t n = 0;
    for (const auto& p : r.params()) {
      n += p.atoms.size();
      n += r.FindParam(p.info.fqn) != nullptr;
    }
    for (const auto& d : r.datasets()) n += d.nbytes > 0;
    n += r.Verify().size();
    (void)n;
  } catch (const ucp::Error& e) {
    // UCP_FUZZ_TRAP=<text>: treat an error containing <text> as a crash, so
    // that libFuzzer saves the input (e.g. "of CPU" for metadata loops).
    const char* trap = std::getenv("UCP_FUZZ_TRAP");
    if (trap != nullptr && *trap && std::strstr(e.what(), trap) != nullptr)
      std::abort();
  }
  return 0;
}
