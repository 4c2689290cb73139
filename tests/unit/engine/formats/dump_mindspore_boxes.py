#!/usr/bin/env python3
"""Oracle for mindspore_strategy_test.cc: the slice of a parameter each rank holds, as MindSpore
computes it (the tests' venv: mindspore.parallel._tensor, the code transform_checkpoints runs).

Usage: dump_mindspore_boxes.py
For each case (dev_matrix, tensor_map, opt_weight_shard_step, opt_weight_shard_size, shape) the
layout goes through _construct_tensor_layout_for_opt_shard (the optimizer shard folded in, as
transform_checkpoints does) and _load_tensor cuts np.arange(numel) for every rank of the stage;
the slice is checked to be one box of the original shape, and printed as a C++ table row:
  {"name", {dev}, {{axes}...}, step, size, {shape}, {{offset..., size...} per rank}},
"""

import itertools
import sys

import numpy as np
from mindspore.parallel._tensor import _construct_tensor_layout_for_opt_shard, _load_tensor

CASES = [
    # name, dev_matrix, tensor_map (int per dim, or a list of axes per dim: the extend form), step, size, shape
    ("tp_dim0", [2, 4], [0, -1], 0, 0, [8, 6]),
    ("tp_dim1", [2, 4], [-1, 0], 0, 0, [6, 8]),
    ("dp_and_tp", [2, 2], [1, 0], 0, 0, [4, 6]),
    ("three_axes", [2, 3, 2], [2, -1, 0], 0, 0, [4, 5, 6]),
    ("replicated", [4, 2], [-1, -1], 0, 0, [3, 5]),
    ("vector", [2, 4], [0], 0, 0, [8]),
    ("opt_dp", [4, 2], [-1, 0], 2, 4, [8, 6]),
    ("opt_dp_part", [4, 2], [-1, 0], 2, 2, [8, 6]),
    ("opt_all_free", [2, 2, 2], [1, -1], 2, -1, [8, 4]),
    ("opt_middle_axis", [2, 2, 2], [2, -1], 4, 2, [8, 4]),
    ("extend_dim0", [2, 2, 2], [[2, 1], -1], 0, 0, [8, 3]),
    ("extend_two_dims", [2, 3, 2], [[2], [1, 0]], 0, 0, [4, 12]),
    ("extend_opt", [2, 2, 2, 2], [[1, 0], -1], 4, 2, [8, 2]),
    ("extend_opt_all", [2, 2, 2], [[0], -1], 2, -1, [8, 3]),
    ("opt_size_splits_an_axis", [4, 2], [-1, 0], 2, 2, [16, 2]),
    ("opt_right_of_tp", [2, 2, 2], [2, -1], 4, 4, [16, 2]),
]


class Arr:
    def __init__(self, a):
        self.a = a

    def asnumpy(self):
        return self.a


def main():
    for name, dev, tmap, step, size, shape in CASES:
        numel = int(np.prod(shape))
        full = np.arange(numel).reshape(shape)
        dev2, map2, shape2 = _construct_tensor_layout_for_opt_shard(list(dev), list(tmap), step, size, list(shape))
        rows = []
        for rank in range(int(np.prod(dev))):
            sl = _load_tensor(Arr(full), list(dev2), list(map2), list(shape2), rank)
            coords = np.array(np.unravel_index(sl.reshape(-1), shape)).T
            lo, hi = coords.min(axis=0), coords.max(axis=0) + 1
            box_size = hi - lo
            assert int(np.prod(box_size)) == sl.size, (name, rank)
            box = full[tuple(slice(int(a), int(b)) for a, b in zip(lo, hi))]
            assert np.array_equal(np.sort(box.reshape(-1)), np.sort(sl.reshape(-1))), (name, rank)
            rows.append("{" + ", ".join(str(int(x)) for x in itertools.chain(lo, box_size)) + "}")
        axes = []
        for t in tmap:
            ts = t if isinstance(t, list) else [t]
            axes.append("{" + ", ".join(str(a) for a in ts if a >= 0) + "}")
        print(f'    {{"{name}", {{{", ".join(map(str, dev))}}}, {{{", ".join(axes)}}}, '
              f'{str(any(isinstance(t, list) for t in tmap)).lower()}, {step}, {size}, '
              f'{{{", ".join(map(str, shape))}}},\n     {{{", ".join(rows)}}}}},')
    return 0


if __name__ == "__main__":
    sys.exit(main())
