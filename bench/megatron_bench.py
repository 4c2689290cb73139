#!/usr/bin/python3
"""Benchmark of ucp on a ~4 GiB Megatron-LM checkpoint (issue 3).

  bench/megatron_bench.py BUILD_DIR [--scale bench4g] [--memory 2G] [--threads 0]

Generates (untimed) a TP2 x PP2 x DP2 checkpoint with the distributed optimizer
(tests/tools/make_megatron_ckpts.py, Megatron-core v0.13 layout, bf16 weights +
fp32 master + Adam moments), then times in the same run:
  plain copy    every file copied with pread/pwrite + fsync (bench/torchfile_bench)
  to-universal  ucp to-universal SRC -o u.h5
  reshape       ucp reshape u.h5 --tp 4 --pp 1 --dp 2 --distributed-optimizer
  convert       ucp convert SRC (same target, streaming)
  python        the same reshape with torch.load / torch.save: every rank file
                loaded, full tensors reassembled, the target rank files built and
                saved (the generator's own reassembly and writer)
Throughput = checkpoint bytes / seconds, reported as a ratio to the plain copy.
Every step runs twice (the plain copy three times, first and last) after a
sync; the best time counts. Peak RSS is measured per command (getrusage of a
fresh child). Peak disk use is about twice the checkpoint size (outputs are
removed as soon as measured).
"""
import argparse
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tests" / "tools"
PY = "/usr/bin/python3"
VARIANT = "gqa_swiglu_bias_untied"
SRC_TOPO = "tp2_pp2_vpp1_dp2_do"
TGT_TOPO = "tp4_pp1_vpp1_dp2_do"


def measured(cmd, env=None):
    """Runs cmd in a fresh child after flushing dirty pages (so an earlier
    step's write-back does not land in this one's fsync); returns (seconds,
    peak RSS MiB of that child, stdout)."""
    os.sync()
    wrapper = ("import resource, subprocess, sys, time, json\n"
               "t = time.perf_counter()\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "s = time.perf_counter() - t\n"
               "if p.returncode: sys.stderr.write(p.stdout + p.stderr); sys.exit(p.returncode)\n"
               "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
               "print(json.dumps({'seconds': s, 'rss_mib': r, 'stdout': p.stdout}))\n")
    out = subprocess.run([PY, "-c", wrapper, *map(str, cmd)], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{out.stderr}")
    d = json.loads(out.stdout)
    return d["seconds"], d["rss_mib"], d["stdout"]


def tree_bytes(path):
    return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())




def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--scale", default="bench4g")
    ap.add_argument("--memory", default="2G")
    ap.add_argument("--threads", default="0")
    ap.add_argument("--skip-python", action="store_true")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build) / "cli" / "ucp"
    tfb = pathlib.Path(a.build) / "bench" / "torchfile_bench"
    work = pathlib.Path(tempfile.mkdtemp(prefix="ucp-mbench-", dir=os.environ.get("TMPDIR")))
    try:
        print(f"generating the {a.scale} checkpoint in {work} ...", file=sys.stderr)
        subprocess.run([PY, TOOLS / "make_megatron_ckpts.py", "--out", work / "gen", "--variant", VARIANT,
                        "--scale", a.scale, "--topologies", SRC_TOPO, "--no-truth"], check=True,
                       stdout=subprocess.DEVNULL)
        vdir = next((work / "gen").iterdir())
        src = vdir / SRC_TOPO
        size = tree_bytes(src)
        run = ["--memory", a.memory, "--threads", a.threads, "-q"]
        tgt = ["--tp", "4", "--pp", "1", "--dp", "2", "--distributed-optimizer"]
        rows = {}

        def best(name, cmd, out, repeat=2):
            for _ in range(repeat):
                s, r, _ = measured(cmd)
                if name not in rows or s < rows[name][0]:
                    rows[name] = (s, r)
                if os.path.isdir(out):
                    shutil.rmtree(out)
                elif os.path.exists(out):
                    os.unlink(out)

        best("plain copy", [tfb, "plain-copy-tree", src, work / "copy"], work / "copy")
        best("convert", [ucp, "convert", src, "-o", work / "conv", *tgt, *run], work / "conv")

        if not a.skip_python:
            s, r, _ = measured([PY, HERE / "py_reshape.py", vdir, SRC_TOPO, TGT_TOPO, work / "py"])
            rows["python"] = (s, r)
            shutil.rmtree(work / "py", ignore_errors=True)

        best("to-universal", [ucp, "to-universal", src, "-o", work / "u.h5", *run], work / "u.h5")
        s, r, _ = measured([ucp, "to-universal", src, "-o", work / "u.h5", *run])
        best("plain copy", [tfb, "plain-copy-tree", src, work / "copy"], work / "copy", repeat=1)
        shutil.rmtree(vdir)  # keep the disk footprint at ~2x the checkpoint
        best("reshape", [ucp, "reshape", work / "u.h5", "-o", work / "resh", *tgt, *run], work / "resh")

        copy_s = rows["plain copy"][0]
        print(f"checkpoint: {size / 2**30:.2f} GiB, TP2 PP2 DP2 distributed optimizer -> TP4 PP1 DP2;"
              f" --memory {a.memory}, --threads {a.threads}")
        print("| step | seconds | GB/s | ratio to plain copy | vs Python | peak RSS |")
        print("|---|---|---|---|---|---|")
        for name in ("plain copy", "to-universal", "reshape", "convert", "python"):
            if name not in rows:
                continue
            s, r = rows[name]
            vs = ""
            if "python" in rows and name in ("reshape", "convert"):
                vs = f"{rows['python'][0] / s:.1f}x"
            print(f"| {name} | {s:.2f} | {size / s / 1e9:.2f} | {copy_s / s:.2f} | {vs} | {r:.0f} MiB |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
