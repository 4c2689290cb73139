#!/usr/bin/python3
"""Oracle for buffer_layout_test.cc: the distributed-optimizer buffer layouts that tests/tools/megatron_spec.py
(the generator's independent re-statement of Megatron-core's _ParamAndGradBuffer rules) computes.

Usage: dump_buffer_layouts.py --seed N --random K
Prints one JSON object per line:
  {"case": "grid", "variant", "topology", "pp_rank", "vp", "dp", "distopt", "version": "0.13",
   "params": [[key, numel, shared, ndim], ...], "index": {key: [start, end, bucket]}, "buckets": [[s, e, unpadded]],
   "world": {key: offset}, "steps": [group has step on DP rank 0, ...] (distopt only), "groups": [[key...], ...]}
     for every chunk of every topology of the full grid of every variant;
  {"case": "random", "version", "dp", "distopt", "bucket_size", "params", then "index"/"buckets"/"world" or
   "straddle": true (v0.8 raised MegatronVersionError)}  for K seeded random buffers.
"""

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))
import megatron_spec as S  # noqa: E402


def dump(lay):
    return {"index": {k: list(v) for k, v in lay.index.items()}, "buckets": [list(b) for b in lay.buckets],
            "world": {k: lay.world_offset(k) for k in lay.index}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--random", type=int, default=0)
    a = ap.parse_args()
    for vname, cfg in S.VARIANTS.items():
        for t in S.all_topologies(cfg, "full"):
            for p in range(t.pp):
                lays = [S.chunk_buffer_layout(cfg, t, p, vp) for vp in range(t.vpp)]
                steps = S.groups_with_step_on_dp0(cfg, t, p, lays) if t.distopt else None
                groups = [[e.key for _vp, e in members] for _k, members in S.param_groups(cfg, t, p)]
                for vp in range(t.vpp):
                    params = [[e.key, S.math.prod(S.local_shape(e.param, cfg, t.tp)), e.shared_embedding,
                               len(e.param.shape)] for e in S.chunk_params(cfg, t, p, vp)]
                    out = {"case": "grid", "variant": vname, "topology": t.name, "pp_rank": p, "vp": vp,
                           "dp": t.dp, "distopt": t.distopt, "version": "0.13", "params": params,
                           "steps": steps, "groups": groups}
                    out.update(dump(lays[vp]))
                    print(json.dumps(out))
    rng = random.Random(a.seed)
    for _ in range(a.random):
        n = rng.randint(1, 10)
        params = []
        for i in range(n):
            shared = rng.random() < 0.2
            params.append([f"p{i}", rng.choice([rng.randint(1, 200), rng.randint(1, 5000), 64, 128]), shared])
        version = rng.choice(["0.13", "0.8"])
        dp = rng.choice([1, 2, 4, 8, 16, 64] + ([3, 5, 6, 12, 256] if version == "0.13" else []))
        distopt = rng.random() < 0.8
        bucket_size = rng.choice([None, None, rng.randint(1, 3000)])
        out = {"case": "random", "version": version, "dp": dp, "distopt": distopt, "bucket_size": bucket_size,
               "params": params}
        try:
            lay = S.buffer_layout([tuple(x[:3]) for x in params], dp, distopt, bucket_size, version)
            out.update(dump(lay))
        except S.MegatronVersionError:
            out["straddle"] = True
        print(json.dumps(out))


if __name__ == "__main__":
    main()
