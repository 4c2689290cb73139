// Fuzz harness: the pickle VM (engine/pickle). Any input either parses or
// throws ucp::FormatError; parsed graphs are walked (Repr) and re-pickled.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/value.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  try {
    ucp::pickle::Arena arena;
    size_t consumed = 0;
    const ucp::pickle::Value* root =
        ucp::pickle::Unpickle(bytes, arena, &consumed);
    (void)ucp::pickle::Repr(root, 200);
    (void)ucp::pickle::Pickle(root);
  } catch (const ucp::Error&) {
  }
  return 0;
}
