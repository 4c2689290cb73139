#include "engine/formats/megatron/buffer_layout.h"

#include <algorithm>
#include <numeric>

#include "engine/core/error.h"

namespace ucp::megatron {
namespace {

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

const char* LayoutRulesName(LayoutRules rules) {
  switch (rules) {
    case LayoutRules::kCore013:
      return "v0.13";
    case LayoutRules::kCore08:
      return "v0.8-v0.12";
    case LayoutRules::kCore07:
      return "v0.7";
  }
  return "?";
}

int64_t BufferLayout::numel() const {
  return buckets.empty() ? 0 : buckets.back().end;
}

int64_t BufferLayout::numel_unpadded() const {
  int64_t n = 0;
  for (const Bucket& b : buckets) n += b.numel_unpadded;
  return n;
}

int64_t BufferLayout::WorldOffset(size_t index) const {
  UCP_CHECK(index < ranges.size(), "param index out of range");
  const ParamRange& r = ranges[index];
  int64_t dropped = 0;
  for (int64_t b = 0; b < r.bucket; ++b) {
    const Bucket& bk = buckets[static_cast<size_t>(b)];
    dropped += bk.end - bk.start - bk.numel_unpadded;
  }
  return r.start - dropped;
}

std::pair<int64_t, int64_t> BufferLayout::DpRange(size_t bucket, int64_t dp,
                                                  int64_t dp_rank) const {
  UCP_CHECK(bucket < buckets.size() && dp >= 1 && dp_rank >= 0 && dp_rank < dp,
            "bad bucket / dp rank");
  const Bucket& b = buckets[bucket];
  const int64_t n = (b.end - b.start) / dp;
  return {b.start + dp_rank * n, b.start + (dp_rank + 1) * n};
}

bool BufferLayout::DpRankHolds(size_t index, int64_t dp,
                               int64_t dp_rank) const {
  UCP_CHECK(index < ranges.size(), "param index out of range");
  const ParamRange& r = ranges[index];
  for (size_t b = 0; b < buckets.size(); ++b) {
    auto [lo, hi] = DpRange(b, dp, dp_rank);
    if (std::min(hi, r.end) > std::max(lo, r.start)) return true;
  }
  return false;
}

std::optional<size_t> BufferLayout::FirstStraddling() const {
  for (size_t i : order) {
    const ParamRange& r = ranges[i];
    const Bucket& b = buckets[static_cast<size_t>(r.bucket)];
    if (r.start < b.start || r.end > b.start + b.numel_unpadded) return i;
  }
  return std::nullopt;
}

BufferLayout ComputeBufferLayout(std::span<const BufferParam> params,
                                 const BufferOptions& options) {
  UCP_CHECK(options.dp >= 1, "dp ", options.dp);
  const bool distopt = options.distributed_optimizer;
  const int64_t align =
      distopt && options.rules != LayoutRules::kCore07 ? 64 : 1;
  int64_t divisor = 1;
  if (distopt) {
    divisor = std::lcm(options.dp, int64_t{128});
    if (options.pad_for_high_nccl_busbw) {
      divisor = std::lcm(divisor, int64_t{1} << 16);
    }
  }

  BufferLayout layout;
  layout.ranges.resize(params.size());
  int64_t start = 0;
  int64_t end = 0;
  int64_t bucket_start = 0;
  int64_t in_bucket = 0;  // params in the open bucket
  auto close_bucket = [&](int64_t unpadded_end) {
    const int64_t padded = RoundUp(unpadded_end, divisor);
    layout.buckets.push_back(
        {bucket_start, padded, unpadded_end - bucket_start});
    bucket_start = padded;
    in_bucket = 0;
    return padded;
  };

  for (size_t k = params.size(); k-- > 0;) {
    const BufferParam& p = params[k];
    UCP_CHECK(p.numel >= 0, "param ", p.name, " numel ", p.numel);
    const bool own_bucket = p.shared_embedding && distopt;
    start = RoundUp(start, align);
    if (own_bucket && in_bucket > 0) {
      const int64_t padded = close_bucket(start);
      if (options.rules == LayoutRules::kCore013) start = padded;
    }
    end = start + p.numel;
    layout.ranges[k] = {start, end,
                        static_cast<int64_t>(layout.buckets.size())};
    layout.order.push_back(k);
    ++in_bucket;
    if ((options.bucket_size && end - bucket_start >= *options.bucket_size) ||
        own_bucket) {
      start = close_bucket(end);
    } else {
      start = end;
    }
  }
  if (in_bucket > 0) close_bucket(end);
  return layout;
}

}  // namespace ucp::megatron
