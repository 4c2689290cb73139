"""ucp against the real DeepSpeed (the tests' PyPI environment, CPU, gloo):
the newest, and 0.14.5 (its entries put it first on PYTHONPATH); one source
case per run, `test_deepspeed_real.py STAGE DTYPE WORLD`, the DeepSpeed
version that must run in UCP_DEEPSPEED_VERSION.

1. DeepSpeed trains and saves at ZeRO STAGE, DTYPE, WORLD ranks, and reports
   its masters, Adam moments and module params in memory
   (tests/tools/deepspeed_real.py make);
2. `ucp to-universal` of that checkpoint holds exactly those numbers
   (tests/tools/check_deepspeed.py universal);
3. `ucp convert` to DeepSpeed at other world sizes and stages, and to a
   universal folder: a fresh DeepSpeed engine at that size and stage loads each
   (engine.load_checkpoint; load_universal for the folder) and holds the
   source's numbers bit for bit (tests/tools/deepspeed_real.py load);
4. DeepSpeed's own ds_to_universal converts the source (ZeRO 1-3: it
   converts no other): ucp's universal folder (ucp's writer, step 3) holds the
   same tensors as DeepSpeed's folder, and ucp reads DeepSpeed's folder
   (--from deepspeed-universal): to-universal holds the engine's in-memory
   state, and converted to native files at another world size and stage it
   loads in a fresh engine with the source's numbers bit for bit.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

import torch

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
TOOLS = pathlib.Path(os.environ["UCP_SOURCE_DIR"]) / "tests" / "tools"
PY = sys.executable
sys.path.insert(0, str(TOOLS))
import deepspeed_real  # noqa: E402 (imports DeepSpeed only when a command runs)

# (stage, dtype, world) of the source -> the (world, stage) of its native
# targets, and of the universal folder's load. DeepSpeed's load_universal
# finds the model states by the stage's file names (as in its own
# ds_to_universal folders, which keep the source's): a folder from ZeRO 0-2
# loads at stage 1 or 2, from ZeRO 3 at stage 3; stage 0 has no universal load.
TARGETS = {
    (0, "bf16", 1): ([(2, 1)], (2, 1)),
    (1, "fp32", 2): ([(3, 2), (1, 0)], (3, 1)),
    (2, "bf16", 3): ([(2, 3)], (2, 2)),
    (3, "bf16", 2): ([(3, 1)], (1, 3)),
    (3, "fp32", 1): ([(2, 3)], (3, 3)),
    (1, "fp16", 2): ([(1, 2)], (2, 2)),
    (3, "fp16", 1): ([(2, 3)], (2, 3)),
}


def run(*args, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-4000:])
    return r.stdout


def ds(*args):
    """tests/tools/deepspeed_real.py's command in this process (torch and DeepSpeed imported
    once per test, the ranks forked from here)."""
    out, ok = deepspeed_real.command(args)
    assert ok, (args, out[-2000:])
    print(out.strip().splitlines()[-1] if out.strip() else "", flush=True)
    return out


def same_tensor(a, b, what):
    assert a.dtype == b.dtype and a.numel() == b.numel(), (what, a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def main():
    stage, dtype, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    natives, (universal_world, universal_stage) = TARGETS[(stage, dtype, world)]
    with tempfile.TemporaryDirectory(prefix="ucp-dsreal-") as t:
        t = pathlib.Path(t)
        src = t / "src"
        ds("make", "--world", world, "--stage", stage, "--dtype", dtype, "--out", src)
        # The DeepSpeed the entry names ran (not another one found first).
        version = json.loads((src / "meta.json").read_text())["deepspeed_version"]
        assert version == os.environ["UCP_DEEPSPEED_VERSION"], \
            (version, os.environ["UCP_DEEPSPEED_VERSION"], os.environ.get("PYTHONPATH"))
        print(f"DeepSpeed {version} saved ZeRO {stage} {dtype} at world {world}", flush=True)

        run(UCP, "to-universal", src, "-o", t / "u.h5", "-q")
        run(PY, TOOLS / "check_deepspeed.py", "universal", t / "u.h5", src)
        print("ok ucp to-universal holds DeepSpeed's in-memory state", flush=True)

        for n, s in natives:
            out = t / f"w{n}z{s}"
            run(UCP, "convert", src, "-o", out, "--format", "deepspeed", "--dp", n,
                "--zero-stage", s, "-q", "--no-sync")
            (t / f"scratch-{n}-{s}").mkdir()
            ds("load", "--world", n, "--stage", s, "--dtype", dtype, "--dir", out, "--truth", src,
               "--scratch", t / f"scratch-{n}-{s}")
            print(f"ok DeepSpeed loads ucp's ZeRO {s} files at world {n}", flush=True)

        uni = t / "universal"
        run(UCP, "convert", src, "-o", uni, "--format", "deepspeed-universal", "-q", "--no-sync")
        (t / "scratch-u").mkdir()
        ds("load", "--world", universal_world, "--stage", universal_stage, "--dtype", dtype,
           "--dir", uni,
           "--truth", src, "--scratch", t / "scratch-u", "--universal")
        print(f"ok DeepSpeed's load_universal takes ucp's folder at world {universal_world}, "
              f"ZeRO {universal_stage}", flush=True)

        if stage == 0:
            return  # ds_to_universal converts ZeRO 1-3 checkpoints only
        # DeepSpeed's own converter on a copy (--inject_missing_state writes into its input).
        copy = t / "copy"
        run("cp", "-r", src, copy)
        theirs = t / "theirs" / "global_step2_universal"
        error = deepspeed_real.ds_to_universal(copy / "global_step2", theirs)
        assert error is None, error
        ours = next(p for p in uni.glob("*_universal") if p.is_dir())
        names = sorted(p.name for p in (theirs / "zero").iterdir() if p.is_dir())
        assert names == sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir()), names
        for name in names:
            for kind in ("fp32", "exp_avg", "exp_avg_sq"):
                a = torch.load(ours / "zero" / name / f"{kind}.pt", weights_only=False)
                b = torch.load(theirs / "zero" / name / f"{kind}.pt", weights_only=False)
                a = a["param"] if isinstance(a, dict) else a
                b = b["param"] if isinstance(b, dict) else b
                same_tensor(a, b, (name, kind))
        print(f"ok the universal folder equals ds_to_universal's ({len(names)} params)", flush=True)


if __name__ == "__main__":
    main()
