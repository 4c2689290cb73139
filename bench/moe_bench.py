"""Mixture of experts: ucp on a large Megatron-core torch_dist MoE checkpoint against what users
compare it with (issue 37).

  <venv python> bench/moe_bench.py BUILD_DIR [--size 3,512,64,512] [--rounds 5] [--json FILE]
                                   [--ckpt DIR] [--few-experts-size 3,512,8,4096]

The checkpoint is saved by the real megatron-core 0.16 (tests/tools/make_moe_torch_dist.py --size,
the tests' PyPI environment: run this with its python) on CPU with gloo: a Mixtral-like GPTModel
(every layer MoE, SwiGLU experts, top-2 router, bf16) at TP1 PP1 DP2 EP2 with the chained
distributed optimizer's fully_reshardable state (fp32 masters and both Adam moments of the dense
and the expert half), ~2.1 GiB at the default size (3 layers, hidden 512, 64 experts of ffn 512).
In the same run, rounds alternated, `sync` before each timed command, medians [min-max], peak RSS
and bytes read:

  ucp to-universal                       vs  cp -r SRC DST && sync
  ucp convert -> EP 4 (DP 4)             vs  cp -r SRC DST && sync
  ucp convert -> EP 4 (DP 4) --no-sync   vs  cp -r SRC DST
  ucp convert -> EP 1 TP 2 (DP 1)        vs  cp -r SRC DST && sync

Then peak RSS against the number of experts: the same conversions of a checkpoint of about the
same size with 8 experts (--few-experts-size) — RSS stays within --memory and flat in experts.
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

TOOL = HERE.parent / "tests" / "tools" / "make_moe_torch_dist.py"


def save(src, size):
    if (src / "latest_checkpointed_iteration.txt").is_file():
        return
    subprocess.run([sys.executable, str(TOOL), "--out", str(src), "--dp", "2", "--ep", "2",
                    "--size", size, "--no-truth"], check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--size", default="3,512,64,512", help="layers,hidden,experts,moe_ffn")
    ap.add_argument("--few-experts-size", default="3,512,8,4096",
                    help="the comparison checkpoint of about the same size, fewer experts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--memory", default="2G")
    ap.add_argument("--json")
    ap.add_argument("--ckpt", help="keep the generated checkpoints under this folder; reuse them")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    results = {}
    with tempfile.TemporaryDirectory(prefix="ucp-moe-bench-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        base = pathlib.Path(a.ckpt).resolve() if a.ckpt else w
        for label, size, rounds in (("many", a.size, a.rounds), ("few", a.few_experts_size, 3)):
            src = base / f"moe_{size.replace(',', '_')}"
            save(src, size)
            nbytes = pairs_mod.tree_bytes(src)
            experts = size.split(",")[2]
            print(f"MoE torch_dist checkpoint: {nbytes / 2**30:.2f} GiB, {experts} experts, "
                  f"TP1 PP1 DP2 EP2", flush=True)
            out = w / "out"
            common = ["--memory", a.memory, "-q"]
            ep4 = [ucp, "convert", src, "-o", out, "--tp", 1, "--pp", 1, "--dp", 4, "--ep", 4,
                   "--distributed-optimizer"] + common
            pairs = {
                "to-universal (durable)": ([ucp, "to-universal", src, "-o", out] + common,
                                           f"cp -r '{src}' '{out}' && sync", True),
                "convert EP 4 (durable)": (ep4, f"cp -r '{src}' '{out}' && sync", True),
                "convert EP 4 (--no-sync)": (ep4 + ["--no-sync"], f"cp -r '{src}' '{out}'", True),
                "convert EP 1 TP 2 (durable)": ([ucp, "convert", src, "-o", out, "--tp", 2, "--pp", 1,
                                                 "--dp", 1, "--ep", 1, "--distributed-optimizer"]
                                                + common, f"cp -r '{src}' '{out}' && sync", True),
            }
            if label == "few":  # RSS against the number of experts: the durable pairs only
                pairs = {k: v for k, v in pairs.items() if "no-sync" not in k}

            results[label] = {"experts": int(experts), "bytes": nbytes,
                              "pairs": pairs_mod.run_pairs(pairs, rounds, nbytes, out)}
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
