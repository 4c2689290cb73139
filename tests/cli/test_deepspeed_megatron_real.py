"""Megatron-DeepSpeed checkpoints that ucp writes at another TP / PP / DP size
and ZeRO stage, judged by the real DeepSpeed (the tests' PyPI environment), not
by ucp's reader: DeepSpeed's own ds_to_universal (DeepSpeedCheckpoint and its
TP merge by the checkpoint's universal_checkpoint_info patterns) merges the
source and ucp's output to whole tensors, and the two must hold the same params
with the same fp32 masters, Adam moments and steps, bit for bit (the
vocabulary padding cut by DeepSpeed to the true size). The sources are the
independent generator's (tests/tools/make_megatron_deepspeed_ckpts.py); its
truth.pt (whole tensors at the true vocabulary size) must equal DeepSpeed's
merge of the source too. Negative control: ucp's output with one byte of one
fp32 master changed merges to something else.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tools"
UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
sys.path.insert(0, str(TOOLS))
import deepspeed_real  # noqa: E402 (no stubs on this path: the real DeepSpeed loads the files)

KINDS = ("fp32", "exp_avg", "exp_avg_sq")


def run(*args):
    r = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    assert r.returncode == 0, (args, r.stdout[-2000:], r.stderr[-4000:])
    return r.stdout


def merged(folder, scratch):
    """DeepSpeed's ds_to_universal of FOLDER's latest tag (on a copy: it writes into its
    input): {param: {kind: tensor}}."""
    tag = (folder / "latest").read_text().strip()
    copy = scratch / "in"
    shutil.copytree(folder / tag, copy)
    out = scratch / "out"
    error = deepspeed_real.ds_to_universal(copy, out)
    assert error is None, (folder, error)
    got = {}
    for d in sorted(p for p in (out / "zero").iterdir() if p.is_dir()):
        got[d.name] = {}
        for f in d.glob("*.pt"):
            x = torch.load(f, weights_only=False)
            got[d.name][f.stem] = x["param"] if isinstance(x, dict) else x
    shutil.rmtree(scratch)
    return got


def same(a, b, what):
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, a.shape, b.dtype, b.shape)
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what
        return a.numel()
    assert float(a) == float(b), (what, a, b)
    return 1


def compare(theirs, ours, what):
    """Every param and state DeepSpeed merged from the source equals its merge of ucp's
    files; returns the number of values compared."""
    assert sorted(theirs) == sorted(ours), (what, sorted(set(theirs) ^ set(ours)))
    n = 0
    for name, kinds in theirs.items():
        assert sorted(kinds) == sorted(ours[name]), (what, name, sorted(kinds), sorted(ours[name]))
        assert set(KINDS) <= set(kinds), (what, name, sorted(kinds))
        for k, t in kinds.items():
            n += same(ours[name][k], t, f"{what} {name}/{k}")
    return n


def flags(tp, pp, dp, stage):
    return ["--tp", tp, "--pp", pp, "--dp", dp, "--zero-stage", stage]


def check_cases(cases):
    with tempfile.TemporaryDirectory(prefix="ucp-mds-") as t:
        t = pathlib.Path(t)
        gen = t / "gen"
        # The generator with its class stubs, in its own process (this one has the real
        # DeepSpeed).
        run(sys.executable, TOOLS / "make_megatron_deepspeed_ckpts.py", "--out", gen,
            "--only", *sorted({c[0] for c in cases}))
        for name, targets in cases:
            src = gen / name
            theirs = merged(src, t / "s")
            # The generator's whole tensors are what DeepSpeed merges from its files.
            truth = torch.load(src / "truth.pt")["atoms"]
            n = 0
            for p, kinds in truth.items():
                for k, ref in kinds.items():
                    if k in KINDS:
                        n += same(theirs[p][k].reshape(ref.shape), ref, f"{name} truth {p}/{k}")
            assert n >= 1000, (name, n)
            for target in targets:
                out = t / "out"
                run(UCP, "convert", src, "-o", out, "--format", "deepspeed", *flags(*target),
                    "-q", "--no-sync")
                n = compare(theirs, merged(out, t / "o"), f"{name} -> {target}")
                assert n >= 1000, (name, target, n)
                print(f"ok {name} -> tp {target[0]} pp {target[1]} dp {target[2]} "
                      f"ZeRO {target[3]}: DeepSpeed merges ucp's files to the source's "
                      f"({n} values)", flush=True)
                if target == targets[0]:
                    # Negative control: one changed byte of one fp32 master is seen.
                    tag = out / (out / "latest").read_text().strip()
                    f = sorted(tag.glob("*zero_pp_rank_0_mp_rank_00_optim_states.pt"))[0]
                    o = torch.load(f, weights_only=False)
                    o["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].view(
                        torch.uint8)[0] ^= 1
                    torch.save(o, f)
                    try:
                        compare(theirs, merged(out, t / "o"), "changed")
                    except AssertionError as e:
                        assert "fp32" in str(e), e
                    else:
                        raise AssertionError(f"{name}: a changed fp32 byte was not seen")
                shutil.rmtree(out)


def test_pipeline_other_tp_pp():
    """GPTModelPipe layer files: BF16_Optimizer at TP 2 PP 2 to TP 1 PP 2 (BF16_Optimizer)
    and TP 2 PP 1 at ZeRO 1; ZeRO 1 at TP 1 PP 2 to TP 2 PP 1 at ZeRO 2."""
    check_cases([("pipe_bf16opt_tp2_pp2_dp2", [(1, 2, 1, 0), (2, 1, 3, 1)]),
                 ("pipe_z1_tp1_pp2_dp2", [(2, 1, 1, 2)])])


def test_no_pipeline_other_tp():
    """GPTModel without pipeline: ZeRO 2 at TP 2 to TP 1 at ZeRO 1 (DP 3); SwiGLU ZeRO 1 at
    TP 2 DP 3 to TP 1 DP 2 at ZeRO 2."""
    check_cases([("nopipe_z2_tp2_dp2", [(1, 1, 3, 1)]),
                 ("nopipe_z1_tp2_dp3_swiglu", [(1, 1, 2, 2)])])


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
