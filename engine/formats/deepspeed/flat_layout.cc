#include "engine/formats/deepspeed/flat_layout.h"

#include <algorithm>

namespace ucp::deepspeed::internal {

int64_t ZeroGroup::Real(int64_t rank) const {
  return std::clamp<int64_t>(numel - rank * partition, 0, partition);
}

int64_t ZeroGroup::Padding(int64_t rank, int64_t world, bool bf16) const {
  if (bf16) return rank == world - 1 ? padded - numel : 0;
  return partition - Real(rank);
}

ZeroGroup ZeroLayout(std::span<const int64_t> numels, int64_t world) {
  ZeroGroup g;
  for (int64_t n : numels) g.numel += n;
  const int64_t align = 2 * world;
  g.padded = (g.numel + align - 1) / align * align;
  g.partition = g.padded / world;
  return g;
}

std::vector<Window> ZeroWindows(std::span<const int64_t> numels,
                                const ZeroGroup& group, int64_t rank) {
  std::vector<Window> out;
  const int64_t lo = rank * group.partition, hi = lo + group.partition;
  int64_t o = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t b = std::max(o, lo), e = std::min(o + numels[i], hi);
    if (b < e) out.push_back({i, b - o, e - o, b - lo});
    o += numels[i];
  }
  return out;
}

int64_t Zero3Piece(int64_t numel, int64_t world) {
  return (numel + world - 1) / world;
}

std::vector<Window> Zero3Windows(std::span<const int64_t> numels, int64_t world,
                                 int64_t rank, int64_t* length) {
  std::vector<Window> out;
  int64_t at = 0;
  for (size_t i = 0; i < numels.size(); ++i) {
    const int64_t p = Zero3Piece(numels[i], world);
    const int64_t b = std::min(numels[i], rank * p);
    const int64_t e = std::min(numels[i], (rank + 1) * p);
    if (b < e) out.push_back({i, b, e, at});
    at += p;
  }
  *length = at;
  return out;
}

std::vector<Window> ConcatWindows(std::span<const int64_t> numels,
                                  int64_t* length) {
  std::vector<Window> out;
  int64_t at = 0;
  for (size_t m = 0; m < numels.size(); ++m) {
    if (numels[m] > 0) out.push_back({m, 0, numels[m], at});
    at += numels[m];
  }
  *length = at;
  return out;
}

}  // namespace ucp::deepspeed::internal
