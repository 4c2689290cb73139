#pragma once
// Recognising a universal file by its first bytes, without opening it as HDF5.

#include <filesystem>

namespace ucp::atoms {

/// True if the file starts with the HDF5 signature (a universal file, or
/// another HDF5 file that AtomStoreReader::Open then refuses); false for a
/// folder, a shorter file or one that cannot be read. Never throws.
bool IsHdf5File(const std::filesystem::path& path);

}  // namespace ucp::atoms
