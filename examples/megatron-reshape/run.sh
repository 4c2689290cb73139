#!/usr/bin/env bash
# Walkthrough: a Megatron-LM checkpoint trained with TP 2 x PP 2 (distributed
# optimizer, DP 2) is reshaped to TP 1 x PP 4 and back, with its optimizer
# state, and the round trip is checked bit for bit.
#
#   examples/megatron-reshape/run.sh [BUILD_DIR]        (default: <repo>/build)
#
# The starting checkpoint is written by tests/tools/make_megatron_ckpts.py,
# the project's Python model of the files Megatron-core v0.13 saves (tiny GPT:
# GQA, SwiGLU, biases, RoPE, untied output layer, bf16 with fp32 master weights
# and Adam moments), and the TP1 x PP4 result is compared with that model's
# files: a check against the project's reading of the format, not against
# Megatron. That the real megatron-core loads ucp's files (strict model load,
# its optimizers' loaders, state equal to the source's) is checked by
# tests/cli/test_megatron_legacy_real.py.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
build=${1:-$root/build}
ucp="$build/cli/ucp"
py=/usr/bin/python3
work=$(mktemp -d "${TMPDIR:-/tmp}/ucp-example-XXXXXX")
trap 'rm -rf "$work"' EXIT
step() { printf '\n\033[1m$ %s\033[0m\n' "$*"; }

echo "== a TP2 x PP2 checkpoint (as Megatron-LM saves it with --use-distributed-optimizer, DP 2)"
$py "$root/tests/tools/make_megatron_ckpts.py" --out "$work/gen" \
  --variant gqa_swiglu_bias_untied --topologies tp2_pp2_vpp1_dp2_do,tp1_pp4_vpp1_dp4_do >/dev/null
src="$work/gen/gqa_swiglu_bias_untied/tp2_pp2_vpp1_dp2_do"
find "$src" -type f | sed "s|$work/gen/||" | sort

step ucp layout check "$src"
"$ucp" layout check "$src" | tail -n 3

step ucp to-universal "$src" -o gpt.ucp.h5
"$ucp" to-universal "$src" -o "$work/gpt.ucp.h5" --quiet

step ucp verify gpt.ucp.h5
"$ucp" verify "$work/gpt.ucp.h5" --quiet

step ucp reshape gpt.ucp.h5 -o gpt-tp1pp4 --tp 1 --pp 4 --dp 4 --distributed-optimizer
"$ucp" reshape "$work/gpt.ucp.h5" -o "$work/gpt-tp1pp4" --tp 1 --pp 4 --dp 4 \
  --distributed-optimizer --quiet

echo
echo "== the TP1 x PP4 files equal the Python model's files for TP1 x PP4 (make_megatron_ckpts.py):"
$py "$root/tests/tools/compare_megatron_ckpt.py" \
  "$work/gen/gqa_swiglu_bias_untied/tp1_pp4_vpp1_dp4_do" "$work/gpt-tp1pp4" --ignore-rng \
  && echo "identical (tensors, optimizer state, distrib_optim.pt, args that matter)"

step ucp convert gpt-tp1pp4 -o back-tp2pp2 --tp 2 --pp 2 --dp 2 --distributed-optimizer
"$ucp" convert "$work/gpt-tp1pp4" -o "$work/back-tp2pp2" --tp 2 --pp 2 --dp 2 \
  --distributed-optimizer --quiet

"$ucp" to-universal "$work/back-tp2pp2" -o "$work/back.ucp.h5" --quiet >/dev/null

echo
echo "== back at TP2 x PP2: every parameter and optimizer state is identical, bit for bit"
$py - "$work/gpt.ucp.h5" "$work/back.ucp.h5" <<'PY'
import sys, h5py
def datasets(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda n, o: out.__setitem__(n, (o.shape, int(o.attrs["xxh3"])))
                     if isinstance(o, h5py.Dataset) and n.startswith("params/") else None)
    return out
a, b = datasets(sys.argv[1]), datasets(sys.argv[2])
main = [k for k in a if "/pad/" not in k]
same = [k for k in main if a[k] == b.get(k)]
print(f"{len(same)} of {len(main)} tensors (params x state kinds) identical")
assert len(same) == len(main), [k for k in main if a[k] != b.get(k)][:5]
print("vocab padding rows (not part of the model) come back verbatim where TP1 x PP4 had room\n"
      "for them (its padded vocabulary is smaller) and as zeros elsewhere")
PY
