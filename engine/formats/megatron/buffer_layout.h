#pragma once
// The distributed optimizer's flat buffer layout (Megatron-core
// DistributedDataParallel / _ParamAndGradBuffer, core_v0.13.0
// megatron/core/distributed/param_and_grad_buffer.py) and how distrib_optim.pt
// stores it.
//
// One buffer per (model chunk, param dtype, grad dtype) holds the chunk's
// trainable params in named_parameters() order. The layout walks them in
// REVERSE (backprop) order:
//   start = 0, bucket_start = 0
//   for p in reversed(params):
//     start = ceil(start / A) * A                A = 64 with the distributed
//                                                optimizer (1 in v0.7, and
//                                                without it)
//     if p.shared_embedding and distopt and the bucket holds params:
//       close the bucket at `start`              (v0.13: p starts at the
//       start = the closed bucket's padded end    padded end; v0.7-v0.12 keep
//                                                their unpadded start: the
//                                                "shared-embedding quirk")
//     p occupies [start, start + numel) in the current bucket
//     if (bucket_size and end - bucket_start >= bucket_size) or
//        (p.shared_embedding and distopt): close the bucket at end,
//                                          start = its padded end
//     else start = end
//   close the last bucket (if it holds params)
// Closing a bucket at `end`: numel_unpadded = end - bucket_start; the padded
// end is ceil(end / D) * D with D = lcm(dp, 128) (lcm(dp, 128, 65536) with
// --ddp-pad-buckets-for-high-nccl-busbw) under the distributed optimizer, else
// end; the next bucket starts there. `dp` is the data-parallel size of the
// optimizer (times the context-parallel size, over the number of distributed
// optimizer instances).
//
// bucket_size is None (one bucket) unless --overlap-grad-reduce; then
// --ddp-bucket-size, or (local param count) / --ddp-num-buckets, or
// max(40e6, 1e6 * dp * cp); it is None again for pipeline ranks > 0, model
// chunks > 0 and with --overlap-param-gather-with-optimizer-step
// (training.py:get_model, distributed_data_parallel.py;
// RunConfig::DistributedBufferOptions).
//
// DP sharding: DP rank r owns [bucket.start + r*n/dp, bucket.start +
// (r+1)*n/dp) of each bucket (n = its padded size).
//
// distrib_optim.pt (get_parameter_state_dp_zero) keeps, per buffer, the
// concatenation of every bucket's first numel_unpadded elements (alignment
// gaps inside a bucket stay, zero-filled; bucket-end padding is dropped), so
// a param's state starts at its buffer start minus the end padding of the
// buckets before it.

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace ucp::megatron {

/// Which Megatron-core generation's rules to apply.
enum class LayoutRules {
  kCore013,  // v0.13+: shared param starts at the padded bucket start
  kCore08,   // v0.8-v0.12: 64-aligned start kept (the quirk)
  kCore07,   // v0.7: no 64-element param alignment, quirk as v0.8
};

/// "v0.13", "v0.8-v0.12", "v0.7".
const char* LayoutRulesName(LayoutRules rules);

struct BufferParam {
  std::string name;  // for messages
  int64_t numel = 0;
  bool shared_embedding = false;  // tied embedding / output copy, PP > 1
};

struct BufferOptions {
  bool distributed_optimizer = true;
  int64_t dp = 1;  // data-parallel size used for the bucket padding
  std::optional<int64_t> bucket_size;
  bool pad_for_high_nccl_busbw = false;
  LayoutRules rules = LayoutRules::kCore013;
};

struct ParamRange {
  int64_t start = 0;
  int64_t end = 0;
  int64_t bucket = 0;
  friend bool operator==(const ParamRange&, const ParamRange&) = default;
};

struct Bucket {
  int64_t start = 0;
  int64_t end = 0;  // padded
  int64_t numel_unpadded = 0;
  friend bool operator==(const Bucket&, const Bucket&) = default;
};

struct BufferLayout {
  std::vector<ParamRange> ranges;  // indexed like the input params
  std::vector<Bucket> buckets;
  /// Indices of the input params in buffer order (reversed).
  std::vector<size_t> order;

  /// Padded size of the buffer.
  int64_t numel() const;
  /// Sum of the buckets' unpadded sizes: the length of the distrib_optim.pt
  /// world tensors.
  int64_t numel_unpadded() const;
  /// Where param `index` starts in the distrib_optim.pt world tensors.
  int64_t WorldOffset(size_t index) const;
  /// The buffer range DP rank `dp_rank` of `dp` owns in bucket `bucket`.
  std::pair<int64_t, int64_t> DpRange(size_t bucket, int64_t dp,
                                      int64_t dp_rank) const;
  /// Whether DP rank `dp_rank` owns an element of param `index`.
  bool DpRankHolds(size_t index, int64_t dp, int64_t dp_rank) const;
  /// The first param (buffer order) that does not lie inside the unpadded
  /// part of its bucket: with LayoutRules::kCore08/07 a shared-embedding param
  /// that opens a bucket at an unpadded start (Megatron v0.8-v0.12 then lose
  /// its first elements in distrib_optim.pt or assert). Absent if none.
  std::optional<size_t> FirstStraddling() const;
};

/// The layout of one buffer. Throws InternalError for a negative numel or
/// dp < 1.
BufferLayout ComputeBufferLayout(std::span<const BufferParam> params,
                                 const BufferOptions& options);

}  // namespace ucp::megatron
