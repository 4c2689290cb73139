"""ucp against the real DeepSpeed (the tests' PyPI environment, CPU, gloo):
the newest, and 0.14.5 (its entries put it first on PYTHONPATH); the source
cases named, in turn, `test_deepspeed_real.py STAGE,DTYPE,WORLD[,MODEL] ...`
(MODEL mlp, or rich: two param groups, a frozen weight, tied weights), the
DeepSpeed version that must run in UCP_DEEPSPEED_VERSION. Per case:

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
import time

import torch

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
TOOLS = pathlib.Path(os.environ["UCP_SOURCE_DIR"]) / "tests" / "tools"
sys.path.insert(0, str(TOOLS))
import deepspeed_real  # noqa: E402 (imports DeepSpeed only when a command runs)

# (stage, dtype, world, model) of the source -> the (world, stage) of its
# native targets, of the universal folder's load, and of the native files ucp
# writes from DeepSpeed's own ds_to_universal folder (None: ds_to_universal
# converts no ZeRO 0 checkpoint). DeepSpeed's load_universal finds the model
# states by the stage's file names (as in its own ds_to_universal folders,
# which keep the source's): a folder from ZeRO 0-2 loads at stage 1 or 2, from
# ZeRO 3 at stage 3; stage 0 has no universal load. model "rich": two param
# groups, a frozen weight, an embedding tied to the output head
# (tests/tools/deepspeed_real.py).
TARGETS = {
    (0, "bf16", 1, "mlp"): ([(2, 1)], (2, 1), None),
    (1, "fp32", 2, "mlp"): ([(3, 2), (1, 0)], (3, 1), (1, 2)),
    (2, "bf16", 3, "mlp"): ([(2, 3)], (2, 2), (2, 1)),
    (3, "bf16", 2, "mlp"): ([(3, 1)], (1, 3), (2, 2)),
    (3, "fp32", 1, "mlp"): ([(2, 3)], (3, 3), (2, 1)),
    (1, "fp16", 2, "mlp"): ([(1, 2)], (2, 2), (1, 0)),
    (3, "fp16", 1, "mlp"): ([(2, 3)], (2, 3), (2, 2)),
    (1, "bf16", 2, "rich"): ([(3, 2), (1, 0)], (2, 1), (1, 2)),
    (0, "fp16", 1, "rich"): ([(2, 2)], (2, 1), None),
    (2, "fp16", 2, "rich"): ([(1, 0)], (1, 2), (1, 1)),
}


def run(*args, **kw):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-4000:])
    return r.stdout


def ds(*args, expect_ok=True):
    """tests/tools/deepspeed_real.py's command in this process (torch and DeepSpeed imported
    once per test, the ranks forked from here). A load compares at least 8 values (tensors,
    hyper-parameters, counters). Returns rank 0's verdict for a load."""
    out, ok = deepspeed_real.command(args)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    print(last, flush=True)
    assert ok == expect_ok, (args, out[-2000:])
    if args[0] == "load":
        verdict = json.loads(last)
        assert verdict["checked"] >= 8, verdict
        return verdict
    return out


def change_one_master_byte(folder):
    """Negative control of the load oracle: one byte of one fp32 master in the ZeRO 1/2
    rank 0 optimizer file of FOLDER (its latest tag) changed."""
    tag = folder / (folder / "latest").read_text().strip()
    f = next(tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    o = torch.load(f, weights_only=False)
    t = o["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    t.view(-1).view(torch.uint8)[0] ^= 1
    torch.save(o, f)


def unfused(dtype, stage):
    """DeepSpeed on CPU trains fp16 at stage 0 with FP16_UnfusedOptimizer (FP16_Optimizer
    needs FusedAdam): ucp's option for that target."""
    return ["--fp16-optimizer", "unfused"] if dtype == "fp16" and stage == 0 else []


def check_universal(h5, src):
    """tests/tools/check_deepspeed.py's universal check, in this process (torch imported once),
    on ucp's universal file H5 (at least 300 values compared), and its negative control: H5 with
    one byte of one fp32 master changed fails it."""
    import check_deepspeed as ck
    import h5py
    ck.cmd_universal(str(h5), str(src), 300)
    bad = h5.with_name(h5.stem + "-changed.h5")
    bad.write_bytes(h5.read_bytes())
    with h5py.File(bad, "r+") as f:
        d = f["params"][sorted(f["params"])[0]]["fp32"]
        v = d[()]
        v.reshape(-1).view("uint8")[0] ^= 1
        d[...] = v
    try:
        ck.cmd_universal(str(bad), str(src))
    except ck.Bad as e:
        assert "fp32: values differ" in str(e), e
    else:
        raise AssertionError(f"check_deepspeed universal passed {bad} (one master byte changed)")
    bad.unlink()


def same_tensor(a, b, what):
    assert a.dtype == b.dtype and a.numel() == b.numel(), (what, a.dtype, a.shape, b.dtype, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def run_case(stage, dtype, world, model):
    natives, (universal_world, universal_stage), from_theirs = \
        TARGETS[(stage, dtype, world, model)]
    m = ["--model", model]
    with tempfile.TemporaryDirectory(prefix="ucp-dsreal-") as t:
        t = pathlib.Path(t)
        src = t / "src"
        ds("make", "--world", world, "--stage", stage, "--dtype", dtype, "--out", src, *m)
        # The DeepSpeed the entry names ran (not another one found first).
        version = json.loads((src / "meta.json").read_text())["deepspeed_version"]
        assert version == os.environ["UCP_DEEPSPEED_VERSION"], \
            (version, os.environ["UCP_DEEPSPEED_VERSION"], os.environ.get("PYTHONPATH"))
        print(f"DeepSpeed {version} saved ZeRO {stage} {dtype} at world {world}", flush=True)

        run(UCP, "to-universal", src, "-o", t / "u.h5", "-q")
        check_universal(t / "u.h5", src)
        print("ok ucp to-universal holds DeepSpeed's in-memory state", flush=True)

        for n, s in natives:
            out = t / f"w{n}z{s}"
            run(UCP, "convert", src, "-o", out, "--format", "deepspeed", "--dp", n,
                "--zero-stage", s, *unfused(dtype, s), "-q", "--no-sync")
            (t / f"scratch-{n}-{s}").mkdir()
            ds("load", "--world", n, "--stage", s, "--dtype", dtype, "--dir", out, "--truth", src,
               "--scratch", t / f"scratch-{n}-{s}", *m)
            print(f"ok DeepSpeed loads ucp's ZeRO {s} files at world {n}", flush=True)
            if model == "rich" and dtype == "bf16" and (n, s) == natives[0]:
                change_one_master_byte(out)
                (t / f"scratch-{n}-{s}-changed").mkdir()
                verdict = ds("load", "--world", n, "--stage", s, "--dtype", dtype, "--dir", out,
                             "--truth", src, "--scratch", t / f"scratch-{n}-{s}-changed", *m,
                             expect_ok=False)
                assert any("values differ" in f for f in verdict["failures"]), verdict
                print("ok the load oracle fails on one changed byte", flush=True)

        uni = t / "universal"
        run(UCP, "convert", src, "-o", uni, "--format", "deepspeed-universal", "-q", "--no-sync")
        (t / "scratch-u").mkdir()
        ds("load", "--world", universal_world, "--stage", universal_stage, "--dtype", dtype,
           "--dir", uni,
           "--truth", src, "--scratch", t / "scratch-u", "--universal", *m)
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
        names = sorted(p.name for p in (ours / "zero").iterdir() if p.is_dir())
        compared = 0
        # DeepSpeed 0.19 also writes fp32.pt (the module's value, {'param': t}) for the
        # params without optimizer fragments: frozen ones and tied aliases; ucp's folder has
        # none for them (DeepSpeed's load_universal reads them from the model states).
        meta = json.loads((src / "meta.json").read_text())
        module = torch.load(src / "reference_module_params.pt")
        extra = sorted(p.name for p in (theirs / "zero").iterdir() if p.is_dir()
                       and p.name not in names)
        assert set(names) <= {p.name for p in (theirs / "zero").iterdir()}, names
        assert set(extra) <= set(meta.get("frozen", [])) | set(meta.get("tied", {})), extra
        for name in extra:
            b = torch.load(theirs / "zero" / name / "fp32.pt", weights_only=False)["param"]
            same_tensor(b, module[meta.get("tied", {}).get(name, name)], (name, "fp32"))
            compared += b.numel()
        for name in names:
            for kind in ("fp32", "exp_avg", "exp_avg_sq"):
                if not (theirs / "zero" / name / f"{kind}.pt").exists() and kind != "fp32":
                    # DeepSpeed 0.19 writes a frozen param's fp32.pt alone (from the module)
                    assert not (ours / "zero" / name / f"{kind}.pt").exists(), (name, kind)
                    continue
                a = torch.load(ours / "zero" / name / f"{kind}.pt", weights_only=False)
                b = torch.load(theirs / "zero" / name / f"{kind}.pt", weights_only=False)
                a = a["param"] if isinstance(a, dict) else a
                b = b["param"] if isinstance(b, dict) else b
                same_tensor(a, b, (name, kind))
                compared += a.numel()
        assert len(names) >= 4 and compared >= 300, (names, compared)
        # Negative control of the comparison: one changed byte is seen.
        changed = a.clone()
        changed.reshape(-1).view(torch.uint8)[0] ^= 1
        try:
            same_tensor(changed, b, "changed")
        except AssertionError:
            pass
        else:
            raise AssertionError("a changed byte compared equal")
        print(f"ok ucp's universal folder equals ds_to_universal's ({len(names)} params, "
              f"{compared} values)", flush=True)

        # ucp reads DeepSpeed's own folder: to-universal holds the engine's in-memory state,
        # and native files written from it at another world size and stage load in a fresh
        # engine with the source's numbers.
        run(UCP, "to-universal", theirs, "--from", "deepspeed-universal", "-o", t / "theirs.h5",
            "-q")
        check_universal(t / "theirs.h5", src)
        n, s = from_theirs
        out = t / f"theirs-w{n}z{s}"
        run(UCP, "convert", theirs, "--from", "deepspeed-universal", "-o", out, "--format",
            "deepspeed", "--dp", n, "--zero-stage", s, *unfused(dtype, s), "-q", "--no-sync")
        (t / "scratch-theirs").mkdir()
        ds("load", "--world", n, "--stage", s, "--dtype", dtype, "--dir", out, "--truth", src,
           "--scratch", t / "scratch-theirs", *m)
        print(f"ok ucp reads ds_to_universal's folder: DeepSpeed loads the ZeRO {s} files ucp "
              f"writes from it at world {n}", flush=True)


def main():
    """Runs each case of the command line (STAGE,DTYPE,WORLD[,MODEL]) in turn, in this one
    process (torch and DeepSpeed imported once), printing each case's time."""
    cases = []
    for arg in sys.argv[1:]:
        f = arg.split(",")
        assert len(f) in (3, 4), f"a case is STAGE,DTYPE,WORLD[,MODEL], not {arg!r}"
        case = (int(f[0]), f[1], int(f[2]), f[3] if len(f) == 4 else "mlp")
        assert case in TARGETS, f"no such case: {case} (TARGETS lists them)"
        cases.append(case)
    assert cases, "no case named"
    for case in cases:
        start = time.monotonic()
        print(f"case ZeRO {case[0]} {case[1]} world {case[2]} {case[3]}", flush=True)
        run_case(*case)
        print(f"ok case ZeRO {case[0]} {case[1]} world {case[2]} {case[3]} "
              f"({time.monotonic() - start:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
