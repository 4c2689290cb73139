#!/usr/bin/python3
"""ucp against what users compare it with: copying the same checkpoint.

  bench/vs_cp.py BUILD_DIR [--rounds 3] [--megatron-scale hidden=...|bench4g]
                 [--deepspeed-gib 1.0] [--only megatron|deepspeed] [--json FILE]

For a Megatron-LM checkpoint (TP2 x PP2 x DP2, distributed optimizer, bf16,
GQA + SwiGLU; tests/tools/make_megatron_ckpts.py) and a DeepSpeed one (ZeRO-2
bf16, world 2; tests/tools/make_deepspeed_ckpts.py), in the same run:

  durable    ucp CMD            vs  cp -r SRC DST && sync
  --no-sync  ucp CMD --no-sync  vs  cp -r SRC DST          (page cache only)

for CMD in to-universal, reshape (from that universal file), convert and
export. Each round runs every pair back to back, copy first, alternating;
reported per command: median / min / max seconds of ucp and of the copy,
the ratio of the medians, peak RSS of ucp, and ucp's bytes read
(/proc/<pid>/io rchar) over the checkpoint size. Before each timed command
dirty pages are flushed (sync), so one step's write-back does not land in the
next. Outputs are removed right after each measurement (peak disk: about
three times the checkpoint).
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
import time

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tests" / "tools"
PY = "/usr/bin/python3"


def tree_bytes(path):
    path = pathlib.Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(cmd, shell=False):
    """Runs cmd after a sync; returns seconds, peak RSS MiB and bytes read
    (rchar, read from /proc before the child is reaped)."""
    os.sync()
    t = time.perf_counter()
    p = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    seconds = time.perf_counter() - t
    rchar = 0
    try:
        for line in pathlib.Path(f"/proc/{p.pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                rchar = int(line.split()[1])
    except OSError:
        pass
    _, status, ru = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode:
        sys.exit(f"failed ({p.returncode}): {cmd}\n{p.stderr.read().decode()[-2000:]}")
    return seconds, ru.ru_maxrss / 1024, rchar


def bench(name, src, ucp, work, rounds, size):
    uni = work / "u.h5"
    subprocess.run([ucp, "to-universal", src, "-o", uni, "-q"], check=True, stdout=subprocess.DEVNULL)
    target = {"megatron": ["--tp", "4", "--pp", "1", "--dp", "2", "--distributed-optimizer"],
              "deepspeed": ["--dp", "3", "--zero-stage", "1"]}[name]
    commands = {
        "to-universal": (lambda out: [ucp, "to-universal", src, "-o", out], False),
        "reshape": (lambda out: [ucp, "reshape", uni, "-o", out, *target], True),
        "convert": (lambda out: [ucp, "convert", src, "-o", out, *target], True),
        "export": (lambda out: [ucp, "export", src, "-o", out], True),
    }
    results = {}
    for cmd, (make, _) in commands.items():
        for mode in ("durable", "no-sync"):
            r = {"ucp": [], "copy": [], "rss": [], "read": []}
            for k in range(rounds):
                out = work / "out"
                copy = f"cp -r '{src}' '{out}'" + (" && sync" if mode == "durable" else "")
                pair = [("copy", copy), ("ucp", None)]
                if k % 2:
                    pair.reverse()  # alternate which runs first
                for who, c in pair:
                    if who == "copy":
                        s, _, _ = timed(c, shell=True)
                        r["copy"].append(s)
                    else:
                        args = make(out) + ["-q"] + (["--no-sync"] if mode == "no-sync" else [])
                        s, rss, rchar = timed(list(map(str, args)))
                        r["ucp"].append(s)
                        r["rss"].append(rss)
                        r["read"].append(rchar)
                    shutil.rmtree(out) if out.is_dir() else out.unlink()
            med_u, med_c = statistics.median(r["ucp"]), statistics.median(r["copy"])
            base = tree_bytes(uni) if cmd == "reshape" else size
            results[f"{cmd} ({mode})"] = {
                "ucp_s": [round(med_u, 2), round(min(r["ucp"]), 2), round(max(r["ucp"]), 2)],
                "copy_s": [round(med_c, 2), round(min(r["copy"]), 2), round(max(r["copy"]), 2)],
                "ratio": round(med_u / med_c, 2),
                "peak_rss_mib": round(max(r["rss"])),
                "read_amplification": round(max(r["read"]) / base, 3),
            }
            print(f"{name:9s} {cmd:12s} {mode:8s} ucp {med_u:6.2f}s [{min(r['ucp']):.2f}-{max(r['ucp']):.2f}]"
                  f"  copy {med_c:6.2f}s [{min(r['copy']):.2f}-{max(r['copy']):.2f}]"
                  f"  ratio {med_u / med_c:5.2f}  rss {max(r['rss']):5.0f} MiB"
                  f"  read x{max(r['read']) / base:.3f}", flush=True)
    uni.unlink()
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--megatron-scale", default="bench4g")
    ap.add_argument("--deepspeed-gib", type=float, default=3.0)
    ap.add_argument("--only", choices=["megatron", "deepspeed"])
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    out = {}
    with tempfile.TemporaryDirectory(prefix="ucp-vs-cp-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        if a.only in (None, "megatron"):
            subprocess.run([PY, TOOLS / "make_megatron_ckpts.py", "--out", w / "gen", "--variant",
                            "gqa_swiglu_bias_untied", "--scale", a.megatron_scale, "--topologies",
                            "tp2_pp2_vpp1_dp2_do", "--no-truth"], check=True, stdout=subprocess.DEVNULL)
            src = w / "gen" / "gqa_swiglu_bias_untied" / "tp2_pp2_vpp1_dp2_do"
            size = tree_bytes(src)
            print(f"megatron checkpoint: {size / 2**30:.2f} GiB", flush=True)
            out["megatron"] = {"bytes": size, "results": bench("megatron", src, ucp, w, a.rounds, size)}
            shutil.rmtree(w / "gen")
        if a.only in (None, "deepspeed"):
            subprocess.run([PY, TOOLS / "make_deepspeed_ckpts.py", "--out", w / "gen",
                            "--bench-gib", str(a.deepspeed_gib)], check=True, stdout=subprocess.DEVNULL)
            src = w / "gen" / "z2_bf16_w2"
            size = tree_bytes(src)
            print(f"deepspeed checkpoint: {size / 2**30:.2f} GiB", flush=True)
            out["deepspeed"] = {"bytes": size, "results": bench("deepspeed", src, ucp, w, a.rounds, size)}
            shutil.rmtree(w / "gen")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
