#pragma once
// Template implementation of ForEachRunPair (included by box.h).

#include "engine/core/error.h"

namespace ucp {

template <typename Fn>
void ForEachRunPair(const Box& src_box, std::span<const int64_t> src_shape,
                    const Box& dst_box, std::span<const int64_t> dst_shape,
                    Fn&& fn, std::span<const int64_t> src_stride) {
  const size_t rank = src_box.rank();
  UCP_CHECK(dst_box.rank() == rank && src_shape.size() == rank &&
            dst_shape.size() == rank &&
            (src_stride.empty() || src_stride.size() == rank));
  const bool strided = !src_stride.empty();
  UCP_CHECK(src_box.size == dst_box.size, src_box.ToString(), " vs ",
            dst_box.ToString());
  if (src_box.empty()) return;
  if (rank == 0) {
    fn(int64_t{0}, int64_t{0}, int64_t{1});
    return;
  }
  // Strides of both tensors.
  std::vector<int64_t> ss(rank), ds(rank);
  int64_t s = 1, t = 1;
  for (size_t d = rank; d-- > 0;) {
    ss[d] = strided ? src_stride[d] : s;
    ds[d] = t;
    s *= src_shape[d];
    t *= dst_shape[d];
  }
  // Merge trailing dims while both boxes span their tensors fully there (and
  // a strided source's elements stay consecutive: dim d steps by the number
  // of elements the dims after it span; a dim the box takes one index of
  // adds nothing to the run).
  size_t inner = rank;  // dims [inner, rank) merged into the run
  int64_t run = 1;
  while (inner > 0) {
    size_t d = inner - 1;
    if (strided && src_box.size[d] > 1 && ss[d] != run) break;
    run *= src_box.size[d];
    inner = d;
    bool full_src = src_box.offset[d] == 0 && src_box.size[d] == src_shape[d];
    bool full_dst = dst_box.offset[d] == 0 && dst_box.size[d] == dst_shape[d];
    if (!(full_src && full_dst)) break;
  }
  // Iterate the outer dims [0, inner).
  std::vector<int64_t> idx(inner, 0);
  while (true) {
    int64_t so = 0, dof = 0;
    for (size_t d = 0; d < rank; ++d) {
      int64_t i = d < inner ? idx[d] : 0;
      so += (src_box.offset[d] + i) * ss[d];
      dof += (dst_box.offset[d] + i) * ds[d];
    }
    fn(so, dof, run);
    size_t d = inner;
    while (d > 0) {
      --d;
      if (++idx[d] < src_box.size[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (inner == 0) return;
  }
}

}  // namespace ucp
