#include "engine/atoms/signature.h"

#include <string_view>

#include "engine/core/error.h"
#include "engine/core/file.h"

namespace ucp::atoms {

bool IsHdf5File(const std::filesystem::path& path) {
  try {
    File f = File::OpenRead(path);
    char sig[8] = {};
    return f.ReadSome(sig, 8, 0) == 8 &&
           std::string_view(sig, 8) == std::string_view("\x89HDF\r\n\x1a\n", 8);
  } catch (const Error&) {
    return false;
  }
}

}  // namespace ucp::atoms
