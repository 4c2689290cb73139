"""MindSpore sharded saves: ucp against what MindSpore users compare it with, on one large
checkpoint.

  <venv python> bench/mindspore_bench.py BUILD_DIR [--params 44] [--rounds 5]
                                         [--transform-rounds 3] [--json FILE] [--ckpt DIR]

The checkpoint is made by the real MindSpore (the tests' PyPI environment: run this with its
python): `--params` float32 weights of 2048 x 2048 with both Adam moments (~2.1 GB at 44) saved
by save_checkpoint, cut by MindSpore's own transform_checkpoints into 4 ranks (dev_matrix [2, 2],
weights split on dim 0 or dim 1). Target: 8 ranks (dev_matrix [2, 2, 2], both dims split,
optimizer-parallel shards of dim 0). In the same run, rounds alternated, `sync` before each timed
command, medians [min-max], peak RSS and bytes read:

  ucp convert -> 8 ranks            vs  cp -r SRC DST && sync
  ucp convert -> 8 ranks --no-sync  vs  cp -r SRC DST
  ucp convert -> 8 ranks --no-sync  vs  transform_checkpoints(SRC, DST, ..., A, B)

The last pair starts each command with an empty page cache (run as root): MindSpore's loader
refuses a file larger than the free memory, which a page cache full of the checkpoint leaves.
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pairs as pairs_mod  # noqa: E402

N = 2048


def strategy(path, names, dev, layout):
    from mindspore.train import node_strategy_pb2 as pb
    m = pb.ParallelStrategyMap()
    m.current_stage = 0
    for i, n in enumerate(names):
        tmap, size, step = layout(i)
        for full in (n, "adam_m." + n, "adam_v." + n):
            item = m.parallel_layout_item.add()
            item.param_name = full
            lay = item.parallel_layouts
            lay.dev_matrix.add().dim.extend(dev)
            lay.tensor_map.add().dim.extend(tmap)
            lay.param_split_shape.add()
            lay.indices_offset.add()
            lay.field = 0
            lay.opt_weight_shard_size = size
            lay.opt_weight_shard_step = step
    pathlib.Path(path).write_bytes(m.SerializeToString())


def make(src, w, params):
    """The sharded source (4 ranks) and the two strategy files."""
    import numpy as np
    import mindspore as ms
    from mindspore.parallel import transform_checkpoints
    names = [f"layers.{i}.weight" for i in range(params)]
    strategy(w / "a.ckpt", names, [2, 2], lambda i: ([0, -1] if i % 2 else [-1, 1], 0, 0))
    strategy(w / "b.ckpt", names, [2, 2, 2], lambda i: ([1, 0], 2, 4))
    if (src / "rank_3").is_dir():
        return
    rng = np.random.default_rng(0)
    items = []
    for n in names:
        for p in ("", "adam_m.", "adam_v."):
            items.append({"name": p + n, "data": ms.Tensor(
                rng.standard_normal((N, N), dtype=np.float32))})
    items.append({"name": "global_step", "data": ms.Tensor(np.array([100], np.int32))})
    (w / "one" / "rank_0").mkdir(parents=True)
    ms.save_checkpoint(items, str(w / "one" / "rank_0" / "net.ckpt"))
    del items
    transform_checkpoints(str(w / "one"), str(src), "net_rank_", None, str(w / "a.ckpt"))
    for f in (w / "one" / "rank_0").iterdir():
        f.unlink()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--params", type=int, default=44)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transform-rounds", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--ckpt", help="keep the generated checkpoint in this folder; reuse it")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    with tempfile.TemporaryDirectory(prefix="ucp-ms-bench-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        src = pathlib.Path(a.ckpt).resolve() if a.ckpt else w / "ckpt"
        make(src, w, a.params)
        size = pairs_mod.tree_bytes(src)
        print(f"MindSpore checkpoint: {size / 2**30:.2f} GiB, 4 ranks -> 8 ranks", flush=True)
        out = w / "out"
        to = [ucp, "convert", src, "--strategy", w / "a.ckpt", "-o", out,
              "--target-strategy", w / "b.ckpt", "-q"]
        err = w / "transform.err"
        transform = (f"GLOG_v=3 '{sys.executable}' -c \"from mindspore.parallel import "
                     f"transform_checkpoints as t; t('{src}', '{out}', 'net_rank_', "
                     f"'{w / 'a.ckpt'}', '{w / 'b.ckpt'}')\" 2>'{err}' || "
                     f"(tail -c 2000 '{err}' >&2; exit 1)")
        results = pairs_mod.run_pairs({
            "convert (durable)": (to, f"cp -r '{src}' '{out}' && sync", True),
            "convert (--no-sync)": (to + ["--no-sync"], f"cp -r '{src}' '{out}'", True),
        }, a.rounds, size, out)
        results.update(pairs_mod.run_pairs({
            "convert (--no-sync) vs transform_checkpoints": (to + ["--no-sync"], transform, True),
        }, a.transform_rounds, size, out, before=pairs_mod.drop_caches))
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
