"""`import ucp`: ckpt.read of a whole checkpoint against `ucp export` of the same bytes (issue 41).

  PYTHONPATH=BUILD/python <venv python> bench/python_read_bench.py BUILD_DIR [--mib 1024]
                                                                [--rounds 5] [--threads 0]

A single-process DCP save (torch, fp32: 60 % in 16 MiB tensors, the rest in 256 KiB ones) is read
whole, every tensor once, three ways in the same run, rounds alternated, page cache warm for all
(each reads the same bytes from it):

  ucp export SRC -o OUT --no-sync       the consolidated fp32 model written to the page cache
  ckpt.read(name) for every param        a new numpy array each (page faults included)
  ckpt.read_into(name, tensor)           into preallocated torch tensors (reused across rounds)

Seconds as median [min-max]; ratio = export's median / the read's median (the read's throughput as
a fraction of export's: the issue asks >= 0.8).
"""
import argparse
import os
import pathlib
import statistics
import subprocess
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp

import ucp


def make(path, mib):
    g = torch.Generator().manual_seed(0)
    sd, total, i = {}, 0, 0
    big = int(mib * 0.6) // 16
    for i in range(big):
        sd[f"layers.{i}.big.weight"] = torch.randn(1024, 4096, generator=g)
        total += 16
    i = 0
    while total < mib:
        sd[f"small.{i}.weight"] = torch.randn(256, 256, generator=g)
        total += 0.25
        i += 1
    dcp.save(sd, checkpoint_id=str(path))
    return sum(t.numel() * t.element_size() for t in sd.values())


def timed(fn):
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir", type=pathlib.Path)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    exe = a.build_dir / "cli" / "ucp"
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "step-1"
        nbytes = make(src, a.mib)
        ckpt = ucp.open(src, threads=a.threads)
        params = ckpt.params()
        tensors = {p.name: torch.empty(p.shape) for p in params}
        runs = {"export": [], "read": [], "read_into": []}

        def export():
            out = pathlib.Path(tmp) / "out"
            subprocess.run([str(exe), "export", str(src), "-o", str(out), "--no-sync", "-q",
                            "--threads", str(a.threads)], check=True,
                           stdout=subprocess.DEVNULL)
            subprocess.run(["rm", "-rf", str(out)], check=True)

        def read():
            for p in params:
                ckpt.read(p.name)

        def read_into():
            for p in params:
                ckpt.read_into(p.name, tensors[p.name])

        read_into()  # fault the preallocated tensors in once
        for _ in range(a.rounds):
            for name, fn in (("export", export), ("read", read), ("read_into", read_into)):
                runs[name].append(timed(fn))
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"{nbytes / 2**20:.0f} MiB in {len(params)} tensors, {a.rounds} rounds, "
              f"threads {a.threads or os.cpu_count()}")
        print("| way | s | GiB/s | ratio (export s / s) |")
        print("|---|---|---|---|")
        for k, v in runs.items():
            print(f"| {k} | {med[k]:.2f} [{min(v):.2f}-{max(v):.2f}] | "
                  f"{nbytes / med[k] / 2**30:.2f} | **{med['export'] / med[k]:.2f}** |")


if __name__ == "__main__":
    main()
