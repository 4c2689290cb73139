"""Megatron-FSDP fsdp_dtensor -> Megatron-core torch_dist: ucp against `cp -r`, on one large
checkpoint.

  <venv python> bench/megatron_fsdp_bench.py BUILD_DIR [--size 1024,14,2816,16,4] [--rounds 5]
                                             [--json FILE] [--ckpt DIR]

The checkpoint is saved by the real megatron-core's Megatron-FSDP (tests/tools/megatron_fsdp.py,
the tests' PyPI environment: run this with its python) on CPU with gloo at DP 2: fp32 main weights
and both Adam moments (12 bytes per param) as unevenly sharded DTensors, every param's group meta
as objects, ~2 GB at the default size. Megatron-FSDP has no converter of its own to compare with
(Megatron-LM's checkpoint_inspector converts only the other way, on GPUs). In the same run,
rounds alternated, `sync` before each timed command, medians [min-max], peak RSS and bytes read:

  ucp convert -> torch_dist TP2 PP2 DP1            vs  cp -r SRC DST && sync
  ucp convert -> torch_dist TP2 PP2 DP1 --no-sync  vs  cp -r SRC DST
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

TOOL = HERE.parent / "tests" / "tools" / "megatron_fsdp.py"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--size", default="1024,14,2816,16,4",
                    help="hidden,layers,ffn,heads,groups of the model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--ckpt", help="keep the generated checkpoint in this folder; reuse it")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    with tempfile.TemporaryDirectory(prefix="ucp-fsdp-bench-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        src = pathlib.Path(a.ckpt).resolve() if a.ckpt else w / "ckpt"
        if not (src / "latest_checkpointed_iteration.txt").is_file():
            subprocess.run([sys.executable, str(TOOL), "save", "--out", str(src), "--dp", "2",
                            "--size", a.size], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"))
        size = pairs_mod.tree_bytes(src)
        print(f"fsdp_dtensor checkpoint: {size / 2**30:.2f} GiB, DP2 -> torch_dist TP2 PP2",
              flush=True)
        out = w / "out"
        to = [ucp, "convert", src, "-o", out, "--format", "megatron-torch-dist", "--tp", 2,
              "--pp", 2, "--dp", 1, "--distributed-optimizer", "-q"]
        pairs = {
            "convert (durable)": (to, f"cp -r '{src}' '{out}' && sync", True),
            "convert (--no-sync)": (to + ["--no-sync"], f"cp -r '{src}' '{out}'", True),
        }
        results = pairs_mod.run_pairs(pairs, a.rounds, size, out)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
