#!/usr/bin/env bash
# Runs the benchmarks and prints a table of throughputs as ratios against plain
# file I/O of the same bytes measured in the same run, plus peak RSS.
#   bench/run.sh BUILD_DIR [SIZE_MIB]      (default 2048 MiB; needs ~3x that in $TMPDIR)
# Each measurement is the best of 3 runs (hot page cache: the first run warms it).
# Writes end with fsync; with TMPDIR on tmpfs (/dev/shm) the disk drops out and
# the figures compare software throughput only.
set -euo pipefail
build=${1:?usage: bench/run.sh BUILD_DIR [SIZE_MIB]}
size=${2:-2048}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bin="$build/bench/torchfile_bench"
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/ucp-bench-XXXXXX")
trap 'rm -rf "$work"' EXIT

best() {  # best (max gbps) JSON line of 3 runs of a command
  local out="" line
  for _ in 1 2 3; do
    line=$("$@")
    out+="$line"$'\n'
    rm -f "$work/out.pt"
  done
  printf '%s' "$out" | $py -c 'import sys,json; r=[json.loads(l) for l in sys.stdin if l.strip()]; print(json.dumps(max(r,key=lambda x:x["gbps"])))'
}

echo "generating a ${size} MiB torch.save file in $work ..." >&2
"$bin" gen "$work/src.pt" "$size"
results=$work/results.jsonl
{
  best "$bin" plain-read "$work/src.pt"
  best "$bin" read "$work/src.pt"
  best "$bin" read-whole "$work/src.pt"
  best "$py" "$here/py_bench.py" load "$work/src.pt"
  best "$bin" plain-write "$work/out.pt" "$size"
  best "$bin" write "$work/src.pt" "$work/out.pt"
  best "$bin" write "$work/src.pt" "$work/out.pt" "$(nproc)"
  best "$py" "$here/py_bench.py" save "$work/src.pt" "$work/out.pt"
  best "$bin" plain-copy "$work/src.pt" "$work/out.pt"
  best "$bin" copy "$work/src.pt" "$work/out.pt"
} > "$results"
$py - "$results" <<'PY'
import json, sys
r = {d["op"]: d for d in map(json.loads, open(sys.argv[1]))}
def row(op, base, py=None):
    d = r[op]; b = r[base]
    ratio = d["gbps"] / b["gbps"]
    pyx = f'{d["gbps"] / r[py]["gbps"]:.1f}x' if py else "-"
    print(f'| {op:<14} | {d["bytes"]/2**30:6.2f} GiB | {d["gbps"]:6.2f} GB/s | {base:<11} {b["gbps"]:6.2f} GB/s | {ratio:5.2f} | {pyx:>6} | {d["max_rss_mib"]:8.0f} MiB |')
print("| op             | bytes      | throughput  | baseline (same run)     | ratio | vs Python | peak RSS   |")
print("|----------------|------------|-------------|-------------------------|-------|-----------|------------|")
row("read", "plain-read", "py-load")
row("read-whole", "plain-read", "py-load")
row("write", "plain-write", "py-save")
row("write-parallel", "plain-write", "py-save")
row("copy", "plain-copy")
for op in ("py-load", "py-save"):
    d = r[op]
    print(f'| {op:<14} | {d["bytes"]/2**30:6.2f} GiB | {d["gbps"]:6.2f} GB/s | -                       |   -   |     -     | {d["max_rss_mib"]:8.0f} MiB |')
PY
