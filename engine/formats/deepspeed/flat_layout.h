#pragma once
// DeepSpeed's flat optimizer layouts (deepspeed_format.h), in one place for
// the reader and the writers. Pure arithmetic over parameter sizes.
//
// ZeRO 1/2 and BF16_Optimizer, per param group of N elements over W ranks:
//   A = 2W, Np = ceil(N/A)*A, ps = Np/W; rank r owns flat[r*ps, (r+1)*ps).
// ZeRO 3, per sub-group: each param of n elements is cut into W pieces of
//   p = ceil(n/W) (padded at the end); rank r's flat group is the
//   concatenation of every param's piece r.
// FP16_Optimizer (ZeRO 0 with fp16), per param group: one flat fp32 master
//   holding the params back to back, no padding.

#include <cstdint>
#include <span>
#include <vector>

namespace ucp::deepspeed::internal {

/// Elements [begin, end) of member `member` (an index into the sizes given)
/// at element `dst` of a rank's flat tensor.
struct Window {
  size_t member = 0;
  int64_t begin = 0, end = 0;
  int64_t dst = 0;
};

struct ZeroGroup {
  int64_t numel = 0;      // N
  int64_t padded = 0;     // Np
  int64_t partition = 0;  // ps

  /// Elements of rank r's partition that belong to params (the rest is
  /// padding at the tail).
  int64_t Real(int64_t rank) const;
  /// group_paddings[r] as saved: ZeRO strips the padding from the fp32
  /// partition (padded - its real elements); BF16_Optimizer records the
  /// whole padding on the last rank only.
  int64_t Padding(int64_t rank, int64_t world, bool bf16) const;
};

/// The ZeRO 1/2 layout of a group whose params have `numels`.
ZeroGroup ZeroLayout(std::span<const int64_t> numels, int64_t world);

/// The params' windows in rank r's ZeRO 1/2 partition.
std::vector<Window> ZeroWindows(std::span<const int64_t> numels,
                                const ZeroGroup& group, int64_t rank);

/// ZeRO 3: a param's piece size ceil(n / world).
int64_t Zero3Piece(int64_t numel, int64_t world);

/// The params' windows in rank r's ZeRO 3 flat group (its length in
/// `*length`, padding included).
std::vector<Window> Zero3Windows(std::span<const int64_t> numels, int64_t world,
                                 int64_t rank, int64_t* length);

/// FP16_Optimizer: the params' windows in a group's flat master (its length
/// in `*length`).
std::vector<Window> ConcatWindows(std::span<const int64_t> numels,
                                  int64_t* length);

}  // namespace ucp::deepspeed::internal
