#!/usr/bin/env bash
# The elastic-resume scenario, end to end, with the LibTorch trainer of this
# folder (train.cc) and ucp's checkpointer:
#   1. an uninterrupted 2-process run of 24 steps (the reference);
#   2. the same run, one process SIGKILLed in the middle of the save of step
#      16: the job dies, step 12 stays the newest visible checkpoint;
#   3. resumed on 2 processes: the loss curve equals the reference bit for bit;
#   4. resumed instead on 3 processes (resharded 2 -> 3): it continues
#      smoothly; then on 1 process (3 -> 1), whose checkpoint Python's
#      torch.load and torch.optim.Adam.load_state_dict take;
#   5. a rank that never arrives: a clear error within the timeout, no hang.
# usage: examples/elastic-resume/run.sh BUILD_DIR [WORK_DIR]
# Prints "N passed, M failed" last; leaves the save folder in WORK_DIR/ckpt
# when WORK_DIR is given (else works in a temporary folder it removes).
set -uo pipefail

build=${1:?usage: run.sh BUILD_DIR [WORK_DIR]}
train="$build/examples/elastic-resume/elastic_train"
[ -x "$train" ] || { echo "run.sh: $train not built (cmake --build $build --target elastic_train)" >&2; exit 2; }
if [ -n "${2:-}" ]; then
  work=$2
  mkdir -p "$work"
  rm -rf "$work/ref" "$work/ckpt" "$work/same" "$work/dead" "$work"/*.log
else
  work=$(mktemp -d -t ucp-elastic-XXXXXX)
  trap 'rm -rf "$work"' EXIT
fi
# Python checks: the newest torch of the tests' PyPI environment (its default
# torch.load is weights-only) and Debian's torch 1.13.
venv_python=${UCP_VENV_PYTHON:-${UCP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ucp/venv}/bin/python}
old_python=${UCP_PYTHON:-/usr/bin/python3}
passed=0 failed=0
check() {  # check DESCRIPTION COMMAND...
  local what=$1; shift
  if "$@"; then passed=$((passed + 1)); echo "ok    $what"
  else failed=$((failed + 1)); echo "FAIL  $what"; fi
}
# A free local port, chosen by binding one (the kernel picks it).
free_port() {
  "$old_python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# launch N ARGS...: N local processes (RANK/WORLD_SIZE/MASTER_* as torchrun
# sets them); fails if any process fails.
launch() {
  local n=$1; shift
  local port pids=() rc=0
  port=$(free_port)
  for ((r = 0; r < n; r++)); do
    RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
      "$train" "$@" 2>>"$work/stderr.log" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
lines() { sed -n "$2,$3p" "$1"; }
decimal() { printf '%.9g\n' "$1"; }

echo "== 1. reference: 2 processes, 24 steps, a checkpoint every 4"
check "reference run" launch 2 --dir "$work/ref" --steps 24 --save-every 4 --log "$work/ref.log"

echo "== 2. the same run, rank 1 SIGKILLed in the middle of the save of step 16"
(launch 2 --dir "$work/ckpt" --steps 24 --save-every 4 --log "$work/crash.log" \
  --kill-in-save 16 --timeout-ms 10000) 2>/dev/null
check "the job failed" test $? -ne 0
check "step 12 is the newest checkpoint" test -f "$work/ckpt/step_000000012/meta.pt"
check "step 16 is invisible (only its partial folder)" \
  bash -c "! test -e '$work/ckpt/step_000000016' && test -d '$work/ckpt/.step_000000016.partial'"
cp -a "$work/ckpt" "$work/same"

echo "== 3. resumed on 2 processes"
check "resume on 2" launch 2 --dir "$work/same" --steps 24 --save-every 4 --log "$work/same.log"
check "steps 13-24 equal the reference bit for bit" \
  diff <(lines "$work/ref.log" 13 24) <(lines "$work/same.log" 1 12)
check "the partial folder was removed" test ! -e "$work/same/.step_000000016.partial"

echo "== 4. resumed on 3 processes (2 -> 3), then on 1 (3 -> 1)"
check "resume on 3" launch 3 --dir "$work/ckpt" --steps 24 --save-every 4 --log "$work/three.log"
ref13=$(decimal "$(lines "$work/ref.log" 13 13 | cut -d' ' -f2)")
got13=$(decimal "$(lines "$work/three.log" 1 1 | cut -d' ' -f2)")
echo "      step 13 loss: $got13 on 3 processes, $ref13 on 2"
check "the first step after the reshard continues the curve (within 1e-4)" \
  awk -v a="$ref13" -v b="$got13" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * a) }'
check "the checkpoints of steps 20 and 24 have 3 shards" \
  test -f "$work/ckpt/step_000000024/shard_00002-of-00003.pt" -a -f "$work/ckpt/step_000000020/shard_00002-of-00003.pt"
check "resume on 1" launch 1 --dir "$work/ckpt" --steps 28 --save-every 4 --log "$work/one.log"
last=$(decimal "$(tail -1 "$work/one.log" | cut -d' ' -f2)")
first=$(decimal "$(head -1 "$work/ref.log" | cut -d' ' -f2)")
echo "      loss: $first at step 1, $last at step 28"
check "the loss went down" awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'
pycheck='
import sys, torch
d = torch.load(sys.argv[1])  # the defaults: weights_only=True since torch 2.6
assert sorted(d) == ["extra", "model", "optimizer", "scaler", "shard", "step"], sorted(d)
assert d["step"] == 28 and d["extra"]["tokens_seen"] == 28 * 12 * 16, (d["step"], d["extra"])
params = [torch.nn.Parameter(v.clone()) for k, v in d["model"].items() if k != "causal_mask"]
opt = torch.optim.Adam(params, lr=1.0)
opt.load_state_dict(d["optimizer"])
assert opt.param_groups[0]["lr"] == 3e-3 and len(opt.state) == len(params)
assert all(float(s["step"]) == 28 for s in opt.state.values())
for f in sys.argv[2:]:
    torch.load(f)
print("      torch", torch.__version__, "loaded", len(sys.argv) - 1, "files")
'
one="$work/ckpt/step_000000028"
# One interpreter start per torch (importing the venv's torch costs seconds):
# the check itself prints the version; a python or torch that is missing
# fails the check, never skips it.
for py in "$venv_python" "$old_python"; do
  check "torch.load (defaults) and Adam.load_state_dict of $py's torch take the 1-process checkpoint" \
    "$py" -c "$pycheck" "$one/shard_00000-of-00001.pt" "$one/meta.pt"
done

echo "== 5. a rank that never arrives"
start=$(date +%s)
RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$(free_port) \
  "$train" --dir "$work/dead" --steps 4 --timeout-ms 1500 2>"$work/dead.log"
rc=$?
took=$(( $(date +%s) - start ))
echo "      $(tail -1 "$work/dead.log")"
check "fails with a clear error within the timeout ($took s)" \
  bash -c "[ $rc -ne 0 ] && [ $took -le 30 ] && grep -q 'rendezvous\|did not arrive' '$work/dead.log'"

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
