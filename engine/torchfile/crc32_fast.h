#pragma once
// Internal: CRC-32 (the zip/gzip polynomial) folded with carry-less multiplies
// (PCLMULQDQ), after Intel's "Fast CRC Computation for Generic Polynomials
// Using PCLMULQDQ Instruction" (2009), reflected variant: 128-bit registers
// (about 5x zlib's table-driven crc32 on one core, 14 GB/s here), or with
// AVX-512 VPCLMULQDQ four 512-bit ones (28 GB/s), which keeps writing torch
// files from being CRC-bound.

#include <cstddef>
#include <cstdint>

namespace ucp::torchfile::internal {

/// True if this CPU has PCLMULQDQ and SSE4.1.
bool HaveFastCrc32() noexcept;

/// zlib-convention CRC update (crc32(crc, data, len)) over `len` bytes,
/// where len >= 64 and len % 16 == 0. Requires HaveFastCrc32().
uint32_t Crc32Folded(uint32_t crc, const unsigned char* data,
                     size_t len) noexcept;

/// True if this CPU also has AVX-512F and VPCLMULQDQ.
bool HaveWideCrc32() noexcept;
/// The same folding on four 512-bit registers (256 bytes per step, about 4x
/// Crc32Folded), where len >= 256 and len % 16 == 0. Requires
/// HaveWideCrc32().
uint32_t Crc32Wide(uint32_t crc, const unsigned char* data,
                   size_t len) noexcept;

}  // namespace ucp::torchfile::internal
