#!/usr/bin/python3
"""ucp convert as a job of N processes (engine/dist, issue 40): 1 vs 2 vs 4 vs 8 processes.

  bench/dist_bench.py BUILD_DIR [--gib 1] [--rounds 3] [--procs 1,2,4,8] [--dp 16]

Generates (untimed) a DeepSpeed ZeRO-2 bf16 world-2 checkpoint (tests/tools/make_deepspeed_ckpts.py
--bench-gib) and converts it to ZeRO-1 on --dp ranks, as one process and as jobs of N processes
started with Slurm's variables (SLURM_PROCID, SLURM_NTASKS, MASTER_ADDR, MASTER_PORT: no launcher
needed), in alternating rounds after a `sync`. Per N: the median wall seconds and its ratio to one
process; from rank 0's --json `processes`: the largest process's share of the bytes written and
read (1/N is ideal), the store messages and bytes per process (flat in N: a fixed handful each);
and two models built from those figures, with fixed(N) = the job's own cost (wall time minus
the slowest process's emit: LibTorch loaded, the store, the second planning pass, the exchange):
  this host (N processes sharing its cores and disk): fixed(N) + seconds(1), checked against the
      measured N;
  N hosts (each reads and writes its share at its own disk's speed):
      fixed(N) + seconds(1) * largest share(N).
"""
import argparse
import json
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tests" / "tools"
PY = "/usr/bin/python3"


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "WORLD_SIZE", "SLURM_", "OMPI_", "PMI_", "MASTER_",
                                "TORCHELASTIC_", "UCP_STORE_PORT", "UCP_DIST"))}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def convert(ucp, src, out, n, dp):
    """One timed run with n processes; returns (seconds, rank 0's --json)."""
    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    args = [str(ucp), "convert", str(src), "-o", str(out), "--dp", str(dp), "--zero-stage", "1",
            "--json", "-q"]
    port = free_port()
    t = time.perf_counter()
    procs = []
    for r in range(n):
        env = clean_env() if n == 1 else clean_env(SLURM_PROCID=r, SLURM_NTASKS=n,
                                                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = [p.communicate() for p in procs]
    seconds = time.perf_counter() - t
    for p, (o, e) in zip(procs, outs):
        if p.returncode:
            sys.exit(f"failed ({n} processes): {e}")
    return seconds, json.loads(outs[0][0])


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("build")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--procs", default="1,2,4,8")
    ap.add_argument("--dp", type=int, default=16)
    a = ap.parse_args()
    ucp = pathlib.Path(a.build) / "cli" / "ucp"
    counts = [int(x) for x in a.procs.split(",")]
    work = pathlib.Path(tempfile.mkdtemp(prefix="ucp-distbench-", dir=os.environ.get("TMPDIR")))
    try:
        print(f"generating a {a.gib} GiB checkpoint in {work} ...", file=sys.stderr)
        subprocess.run([PY, TOOLS / "make_deepspeed_ckpts.py", "--out", work / "gen",
                        "--bench-gib", str(a.gib)], check=True, capture_output=True)
        src = work / "gen" / "z2_bf16_w2"
        runs = {n: [] for n in counts}
        for _ in range(a.rounds):
            for n in counts:
                runs[n].append(convert(ucp, src, work / "out", n, a.dp))
        one = statistics.median(s for s, _ in runs[counts[0]])
        j1 = runs[counts[0]][0][1]
        total = j1["bytes"]
        print(f"DeepSpeed ZeRO-2 bf16 w2, {total / 2**30:.2f} GiB written, ZeRO-1 dp {a.dp}; "
              f"median of {a.rounds} rounds\n")
        print("| processes | seconds | vs 1 | fixed | largest share written | largest share read "
              "| store messages / process | store bytes / process | model: this host | "
              "model: N hosts |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for n in counts:
            secs = [s for s, _ in runs[n]]
            med = statistics.median(secs)
            j = runs[n][0][1]
            procs = j.get("processes")
            if procs:
                written = sum(p["bytes_written"] for p in procs)
                read = sum(p["bytes_read"] for p in procs) or 1
                share_w = max(p["bytes_written"] for p in procs) / written
                share_r = max(p["bytes_read"] for p in procs) / read
                msgs = statistics.mean(p["store_messages"] for p in procs)
                mbytes = statistics.mean(p["store_bytes"] for p in procs)
                # the job's own cost: wall minus the slowest process's emit (LibTorch loaded,
                # the store, planning, the exchange)
                fixed = statistics.median(
                    s - max(p["seconds"] for p in jj["processes"]) for s, jj in runs[n])
                row = (f"{fixed:.2f} | {share_w:.3f} (1/N {1 / n:.3f}) | {share_r:.3f} | "
                       f"{msgs:.1f} | {mbytes:.0f} | {fixed + one:.2f} | "
                       f"{fixed + one * share_w:.2f}")
            else:
                row = "0 | 1 | 1 | 0 | 0 | (measured) | (measured)"
            print(f"| {n} | {med:.2f} [{min(secs):.2f}-{max(secs):.2f}] | {med / one:.2f} | "
                  f"{row} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
