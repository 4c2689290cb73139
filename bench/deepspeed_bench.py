#!/usr/bin/python3
"""Benchmark of ucp on a ~3 GiB DeepSpeed ZeRO-2 bf16 world-2 checkpoint
(issue 7).

  bench/deepspeed_bench.py BUILD_DIR [--gib 3] [--rounds 3] [--memory 2G]

Generates (untimed) the checkpoint with tests/tools/make_deepspeed_ckpts.py
--bench-gib, then times in alternating rounds, on the same input in the same
run:
  cp -r && sync   `cp -r SRC DST && sync` (ucp fsyncs its outputs, so the
                  copy is made durable too)
  to-universal    ucp to-universal SRC -o u.h5
  export          ucp export SRC -o DIR (safetensors, fp32 masters)
  convert --dp 1  ucp convert SRC -o DIR --dp 1 (ZeRO-2, one rank)
Each row: median seconds (min-max) and the ratio median / median of the copy;
peak RSS (getrusage of the command's process).
"""
import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tests" / "tools"
PY = "/usr/bin/python3"


def measured(cmd):
    os.sync()
    wrapper = ("import resource, subprocess, sys, time, json\n"
               "t = time.perf_counter()\n"
               "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
               "s = time.perf_counter() - t\n"
               "if p.returncode: sys.stderr.write(p.stdout + p.stderr); sys.exit(p.returncode)\n"
               "r = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
               "print(json.dumps({'seconds': s, 'rss_mib': r}))\n")
    out = subprocess.run([PY, "-c", wrapper, *map(str, cmd)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{out.stderr}")
    d = json.loads(out.stdout)
    return d["seconds"], d["rss_mib"]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", default="2G")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build) / "cli" / "ucp"
    work = pathlib.Path(tempfile.mkdtemp(prefix="ucp-dsbench-", dir=os.environ.get("TMPDIR")))
    try:
        print(f"generating a {a.gib} GiB checkpoint in {work} ...", file=sys.stderr)
        subprocess.run([PY, TOOLS / "make_deepspeed_ckpts.py", "--out", work / "gen",
                        "--bench-gib", str(a.gib)], check=True, stdout=subprocess.DEVNULL)
        src = work / "gen" / "z2_bf16_w2"
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        run = ["--memory", a.memory, "-q"]
        out = work / "out"
        steps = [
            ("cp -r && sync", ["sh", "-c", f"cp -r '{src}' '{out}' && sync"]),
            ("to-universal", [ucp, "to-universal", src, "-o", out, *run]),
            ("export", [ucp, "export", src, "-o", out, *run]),
            ("convert --dp 1", [ucp, "convert", src, "-o", out, "--dp", "1", *run]),
        ]
        rows = {name: [] for name, _ in steps}
        for _ in range(a.rounds):
            for name, cmd in steps:
                # A copy between every two commands: pairs alternate.
                for n2, c2 in ([steps[0]] if name != steps[0][0] else []) + [(name, cmd)]:
                    s, r = measured(c2)
                    rows[n2].append((s, r))
                    if out.is_dir():
                        shutil.rmtree(out)
                    elif out.exists():
                        out.unlink()
        copy = statistics.median(s for s, _ in rows["cp -r && sync"])
        print(f"checkpoint: {size / 2**30:.2f} GiB (DeepSpeed ZeRO-2 bf16, world 2), "
              f"{a.rounds} rounds, --memory {a.memory}")
        print("| command | median s (min-max) | ratio to cp -r && sync | peak RSS |")
        print("|---|---|---|---|")
        for name, _ in steps:
            ss = [s for s, _ in rows[name]]
            rss = max(r for _, r in rows[name])
            med = statistics.median(ss)
            print(f"| {name} | {med:.2f} ({min(ss):.2f}-{max(ss):.2f}) | {med / copy:.2f} | {rss:.0f} MiB |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
