#!/usr/bin/python3
"""`ucp diff` against reading both checkpoints once (issue 41: at most 1.25x).

  bench/diff_bench.py BUILD_DIR [--rounds 3] [--scale hidden=...] [--memory 1G] [--json FILE]

A Megatron-LM checkpoint (TP2 x PP2 x DP2, distributed optimizer, bf16, GQA + SwiGLU;
tests/tools/make_megatron_ckpts.py, about 2 GiB by default) compared with
  copy  a copy of itself (cp -r: every byte of both read and compared), and
  dcp   its DCP conversion by `ucp convert --format dcp --dp 2` (another format and layout; the
        bf16 weights, which DCP does not keep, are derived and not read),
each against `find A B -type f | xargs cat > /dev/null` of the same two folders in the same run
(the page cache is not dropped: both fit in memory, so this compares the software with reading
the bytes once). Rounds alternate cat and diff, `sync` before each; reported: median [min-max]
seconds, the ratio of the medians, ucp's peak RSS against --memory, and its bytes read
(/proc/<pid>/io rchar) over the two folders' size.
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
sys.path.insert(0, str(HERE))
from vs_cp import PY, TOOLS, timed, tree_bytes  # noqa: E402

SCALE = "hidden=2048,ffn=5632,layers=2,vocab=16000,heads=16,groups=8,kv=128"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("build_dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", default=SCALE)
    ap.add_argument("--memory", default="1G")
    ap.add_argument("--json", help="write the results here too")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    out = {}
    with tempfile.TemporaryDirectory(prefix="ucp-diff-bench-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        subprocess.run([PY, TOOLS / "make_megatron_ckpts.py", "--out", w / "gen", "--variant",
                        "gqa_swiglu_bias_untied", "--scale", a.scale, "--topologies",
                        "tp2_pp2_vpp1_dp2_do", "--no-truth"], check=True,
                       stdout=subprocess.DEVNULL)
        src = w / "gen" / "gqa_swiglu_bias_untied" / "tp2_pp2_vpp1_dp2_do"
        shutil.copytree(src, w / "copy")
        subprocess.run([ucp, "convert", src, "-o", w / "dcp", "--format", "dcp", "--dp", "2",
                        "-q"], check=True, stdout=subprocess.DEVNULL)
        print(f"megatron checkpoint {tree_bytes(src) / 2**30:.2f} GiB, "
              f"its dcp conversion {tree_bytes(w / 'dcp') / 2**30:.2f} GiB; "
              f"--memory {a.memory}", flush=True)
        print("| pair | both folders | diff s | cat s | ratio | peak RSS | read |")
        print("|---|---|---|---|---|---|---|")
        for name, other in (("copy", w / "copy"), ("dcp", w / "dcp")):
            size = tree_bytes(src) + tree_bytes(other)
            cat = f"find '{src}' '{other}' -type f -print0 | xargs -0 cat > /dev/null"
            diff = [ucp, "diff", src, other, "-q", "--memory", a.memory]
            cats, diffs, rss, read = [], [], 0, 0
            for _ in range(a.rounds):
                cats.append(timed(cat, shell=True)[0])
                s, r, c = timed(diff)
                diffs.append(s)
                rss, read = max(rss, r), c
            dm, cm = statistics.median(diffs), statistics.median(cats)
            row = {"bytes": size, "diff_s": diffs, "cat_s": cats, "ratio": dm / cm,
                   "peak_rss_mib": rss, "read": read / size}
            out[name] = row
            print(f"| {name} | {size / 2**30:.2f} GiB | {dm:.2f} [{min(diffs):.2f}-{max(diffs):.2f}]"
                  f" | {cm:.2f} [{min(cats):.2f}-{max(cats):.2f}] | **{dm / cm:.2f}** | "
                  f"{rss:.0f} MiB | {read / size:.3f} |", flush=True)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
