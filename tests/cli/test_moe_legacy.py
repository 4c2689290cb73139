"""Megatron-LM legacy (--ckpt-format torch) mixture-of-experts checkpoints judged by the real
megatron-core (the tests' PyPI environment, run with its python). tests/tools/
megatron_legacy_real.py saves megatron-core 0.16's MoE GPTModel (local spec, SequentialMLP, 4
experts, top-2; Mixtral-like: every layer MoE; DeepSeek-like: a dense first layer, a shared
expert, the router's expert bias) after two real steps of its ChainedOptimizer (dense half over
DP, expert half over expert DP), as Megatron-LM's save_checkpoint writes it: mp_rank_TT[_PPP]_EEE
folders with each EP rank's local experts, distrib_optim.pt [dense state or None, expert state];
ucp converts it to another TP / PP / DP / EP (ETP = TP) and optimizer; each target rank loads it
as Megatron-LM's load_checkpoint does (GPTModel.load_state_dict(strict=True), the optimizers'
load_state_dict, load_parameter_state), and what the target ranks then hold (weights, fp32 main
params, Adam moments, steps, param groups, in megatron-core's own global coordinates: every
expert at its global index) must equal what the source ranks held, bit for bit. Negative
control: one byte of ucp's output changed, the same judgment fails. A torch_dist MoE save of the
real megatron-core (tests/tools/make_moe_torch_dist.py, fixture moe_torch_dist_ckpts) converted
to the legacy format is judged against its truth the same way; legacy saves sent to torch_dist
and back (the distributed and the non-distributed optimizer's halves) against their source.
Damaged legacy MoE saves (an EP folder missing, a rank file holding an expert twice or lacking
one, a cut rank file) are one clear error line, also through the sanitized ucp_san.
"""
import functools
import os
import pathlib
import shutil
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
sys.path.insert(0, str(HERE))
import megatron_legacy_real as mlr  # noqa: E402
import testmain  # noqa: E402
from testmain import Tmp, fails, one_error_line, run  # noqa: E402

WORK = pathlib.Path(tempfile.mkdtemp(prefix="ucp-moe-legacy-"))
ITER = f"iter_{mlr.STEPS:07d}"
# The MoE model: about 8 k elements of each kind (weights, main params, two moments).
MIN_VALUES = 30_000
TORCH_DIST = pathlib.Path(os.environ.get("UCP_TESTDATA", "/nonexistent")) / "moe_torch_dist"


@functools.lru_cache(maxsize=None)
def source(variant, tp, pp, dp, ep, optim):
    """A legacy save by the real megatron-core (once per process) and its view."""
    out = WORK / f"{variant}_tp{tp}_pp{pp}_dp{dp}_ep{ep}_{optim}"
    a = mlr.options("save", tp=tp, pp=pp, dp=dp, ep=ep, optim=optim, variant=variant,
                    out=out / "save", view=out / "view")
    ok, msg = mlr.run(a)
    assert ok, msg
    return out


def flags(tp, pp, dp, ep, optim):
    f = ["--tp", tp, "--pp", pp, "--dp", dp, "--ep", ep]
    return f + (["--distributed-optimizer"] if optim == "distributed" else [])


def load(ckpt, view, variant, tp, pp, dp, ep, optim, iteration=mlr.STEPS):
    """The target ranks load `ckpt` as Megatron-LM's load_checkpoint does; their VIEW."""
    shutil.rmtree(view, ignore_errors=True)
    ok, msg = mlr.run(mlr.options("load", tp=tp, pp=pp, dp=dp, ep=ep, optim=optim,
                                  variant=variant, ckpt=ckpt, view=view, iteration=iteration))
    assert ok, msg


def convert_and_judge(src_key, target, negative=None, via=None):
    """Converts source `src_key` (source()'s arguments) with ucp to `target` (tp, pp, dp, ep,
    optim), loads it with megatron-core and compares with the source's view; `negative`: (rank
    folder, model key) of ucp's output to damage (damage()), after which the same judgment must
    fail on values; `via`: (tp, pp, dp, ep, optim) of a torch_dist save the source is converted
    to first, the target then converted from it."""
    variant = src_key[0]
    src = source(*src_key)
    with Tmp("ucp-moe-legacy-") as t:
        origin = src / "save"
        if via is not None:
            run("convert", origin, "-o", t / "mid", "--format", "megatron-torch-dist",
                *flags(*via))
            check_torch_dist_optimizer(t / "mid" / ITER / "common.pt", via[-1])
            origin = t / "mid"
        p = run("convert", origin, "-o", t / "out", *flags(*target),
                *(["--format", "megatron"] if via is not None else []))
        assert "--expert-model-parallel-size" in p.stdout + p.stderr, p
        load(t / "out", t / "view", variant, *target)
        ok, report = mlr.compare(src / "view", t / "view", MIN_VALUES)
        print(report)
        assert ok, report
        assert set(report["kinds"]) == {"model", "param", "exp_avg", "exp_avg_sq"}, report
        if negative is None:
            return
        damage(t / "out" / ITER / negative[0] / "model_optim_rng.pt", negative[1])
        load(t / "out", t / "view", variant, *target)
        ok, bad = mlr.compare(src / "view", t / "view", MIN_VALUES)
        assert not ok and any("values differ" in x for x in bad["problems"]), bad
        print("negative control:", negative, bad["problems"][:2])


def check_torch_dist_optimizer(common, optim):
    """The torch_dist save's common state holds the ChainedOptimizer's two halves {0: dense, 1:
    expert}, each with its Adam step as the optimizer `optim` keeps it (the non-distributed
    one's optimizer.state.common_step, the distributed one's on its param groups)."""
    opt = torch.load(common, weights_only=False)["optimizer"]
    assert isinstance(opt, dict) and sorted(opt) == [0, 1], opt
    for half in opt.values():
        if optim == "distributed":
            assert all(g["step"] == mlr.STEPS for g in half["optimizer"]["param_groups"]), half
        else:
            assert float(half["optimizer"]["state"]["common_step"]) == mlr.STEPS, half


def rewrite(path, change):
    """Re-saves rank file `path` with torch after change(state dict)."""
    sd = torch.load(path, weights_only=False)
    change(sd)
    torch.save(sd, path)


def damage(path, key):
    """One byte of the first element of model tensor `key` of rank file `path` changed."""
    def flip(sd):
        t = sd["model"][key]
        t.view(torch.int16).view(-1)[0] ^= 0x5A
    rewrite(path, flip)


def test_mixtral_ep2_tp_change_with_ep_fixed():
    """Mixtral-like, the distributed optimizer at TP 1 DP 2 EP 2 -> TP 2 DP 2 EP 2 (each expert
    split over ETP = TP 2, experts and their Adam state in the expert half over expert DP 1)."""
    convert_and_judge(("moe_mixtral", 1, 1, 2, 2, "distributed"), (2, 1, 2, 2, "distributed"),
                      negative=("mp_rank_01_001",
                                "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"))


def test_mixtral_ep_change_alone():
    """EP 2 -> 1 alone (TP 1 DP 2, distributed optimizer): megatron-core makes the experts dense
    params at EP 1 (one optimizer, one buffer over DP), so the ChainedOptimizer's halves merge;
    and EP 1 -> 2 back from that output, judged against the same source."""
    src = source("moe_mixtral", 1, 1, 2, 2, "distributed")
    with Tmp("ucp-moe-legacy-") as t:
        run("convert", src / "save", "-o", t / "ep1", *flags(1, 1, 2, 1, "distributed"))
        assert not (t / "ep1" / ITER / "mp_rank_00_001").exists()
        load(t / "ep1", t / "view1", "moe_mixtral", 1, 1, 2, 1, "distributed")
        ok, report = mlr.compare(src / "view", t / "view1", MIN_VALUES)
        print(report)
        assert ok, report
        run("convert", t / "ep1", "-o", t / "ep2", *flags(1, 1, 2, 2, "float16"))
        assert sorted(x.name for x in (t / "ep2" / ITER).iterdir()) == \
            ["mp_rank_00_000", "mp_rank_00_001"]
        load(t / "ep2", t / "view2", "moe_mixtral", 1, 1, 2, 2, "float16")
        ok, report = mlr.compare(src / "view", t / "view2", MIN_VALUES)
        print(report)
        assert ok, report


def test_deepseek_pp_change_with_ep_fixed():
    """DeepSeek-like (dense first layer, shared expert, expert bias), Float16Optimizer at TP 1
    DP 2 EP 2 -> the distributed optimizer at PP 2 DP 2 EP 2: the first stage holds no expert
    (its expert half keeps megatron-core's empty group, its distrib_optim.pt an empty state)."""
    convert_and_judge(("moe_deepseek", 1, 1, 2, 2, "float16"), (1, 2, 2, 2, "distributed"),
                      negative=("mp_rank_00_001_001",
                                "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"))


def test_mixtral_legacy_torch_dist_legacy_distributed():
    """Legacy -> torch_dist -> legacy, Mixtral-like, the distributed optimizer at TP 1 DP 2 EP 2
    throughout (torch_dist's fully_reshardable form of both halves between): megatron-core
    loads the final folder with every value and step of the source."""
    convert_and_judge(("moe_mixtral", 1, 1, 2, 2, "distributed"), (1, 1, 2, 2, "distributed"),
                      via=(1, 1, 2, 2, "distributed"),
                      negative=("mp_rank_00_001",
                                "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"))


def test_deepseek_legacy_torch_dist_legacy_non_distributed():
    """Legacy -> torch_dist -> legacy, DeepSeek-like with the non-distributed optimizer
    (Float16OptimizerWithFloat16Params in each half) at TP 1 DP 2 EP 2: torch_dist keeps each
    half's Adam step as its optimizer[0|1].optimizer.state.common_step, which must come back as
    every param's step (megatron-core's load of a state without it: KeyError 'step')."""
    convert_and_judge(("moe_deepseek", 1, 1, 2, 2, "float16"), (1, 1, 2, 2, "float16"),
                      via=(1, 1, 2, 2, "float16"),
                      negative=("mp_rank_00_000",
                                "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"))


def test_torch_dist_to_legacy():
    """A torch_dist MoE save of the real megatron-core (Mixtral-like, TP 1 PP 2 DP 2 EP 2, the
    chained DistributedOptimizer's fully_reshardable state) -> legacy TP 2 PP 1 DP 2 EP 2 with
    the distributed optimizer: the loaded state equals the save's truth (gathered from the saving
    ranks' memory) bit for bit."""
    src = TORCH_DIST / "mixtral_tp1_pp2_dp2_ep2"
    with Tmp("ucp-moe-legacy-") as t:
        target = (2, 1, 2, 2, "distributed")
        run("convert", src, "-o", t / "out", "--format", "megatron", *flags(*target))
        load(t / "out", t / "view", "moe_mixtral", *target, iteration=10)
        ok, report = mlr.compare_truth(src / "truth.pt", t / "view", MIN_VALUES)
        print(report)
        assert ok, report
        # Negative control: one byte of an expert's fc2 changed in the target.
        damage(t / "out" / "iter_0000010" / "mp_rank_00_001" / "model_optim_rng.pt",
               "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight")
        load(t / "out", t / "view", "moe_mixtral", *target, iteration=10)
        ok, bad = mlr.compare_truth(src / "truth.pt", t / "view", MIN_VALUES)
        assert not ok and any("values differ" in x for x in bad["problems"]), bad


def test_resume_fits_only_the_same_ep():
    """ucp resume over a legacy MoE save folder: the same TP / PP / DP / EP and optimizer fit
    (the save folder itself is printed, nothing written); another EP gets a load folder with one
    rank folder per (tp, ep)."""
    src = source("moe_mixtral", 1, 1, 2, 2, "distributed")
    with Tmp("ucp-moe-legacy-") as t:
        save = t / "save"
        shutil.copytree(src / "save", save)
        p = run("resume", save, *flags(1, 1, 2, 2, "distributed"))
        assert p.stdout.strip() == str(save), p.stdout
        assert not (save / "ucp-resume").exists()
        p = run("resume", save, *flags(1, 1, 4, 4, "distributed"))
        load_dir = pathlib.Path(p.stdout.strip())
        assert load_dir != save and load_dir.is_relative_to(save), p.stdout
        ranks = sorted(x.name for x in (load_dir / ITER).glob("mp_rank_*"))
        assert ranks == [f"mp_rank_00_{e:03d}" for e in range(4)], ranks


def test_damaged_moe_saves_are_one_clear_error():
    """An EP rank's folder missing, a rank file holding one more local expert than E / EP
    (its last one then global expert 2 on EP rank 0, which EP rank 1 holds too), a rank file
    lacking a local expert (global 3 gone), args with ETP other than TP, a cut rank file: one
    error line naming the file or the layer and the global experts, exit 3, nothing under the
    output name; also through the sanitized ucp_san. Control: the intact save reads."""
    src = source("moe_mixtral", 1, 1, 2, 2, "distributed") / "save"
    fc1 = "decoder.layers.1.mlp.experts.local_experts.{}.linear_fc1.weight"
    with Tmp("ucp-moe-legacy-bad-") as t:
        run("to-universal", src, "-o", t / "u.h5")
        (t / "u.h5").unlink()

        d = t / "nofolder"
        shutil.copytree(src, d)
        shutil.rmtree(d / ITER / "mp_rank_00_001")
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "missing rank file", "mp_rank_00_001",
              "ep=2", out=t / "u.h5")

        d = t / "twice"
        shutil.copytree(src, d)

        def add_expert(sd):
            m = sd["model"]
            items = list(m.items())
            at = [k for k, _ in items].index(fc1.format(1))
            items.insert(at, (fc1.format(2), m[fc1.format(1)].clone()))
            sd["model"] = type(m)(items)
        rewrite(d / ITER / "mp_rank_00_000" / "model_optim_rng.pt", add_expert)
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "layer 1", "linear_fc1.weight",
              "global experts 2 stored more than once", "mp_rank_00_000", "mp_rank_00_001",
              out=t / "u.h5")

        d = t / "lacking"
        shutil.copytree(src, d)

        def drop_expert(sd):
            sd["model"] = type(sd["model"])(
                (k, v) for k, v in sd["model"].items() if "local_experts.1." not in k)
        rewrite(d / ITER / "mp_rank_00_001" / "model_optim_rng.pt", drop_expert)
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "layer 0", "global experts 3 missing",
              "of 4 experts over 2 EP ranks", out=t / "u.h5")

        # A run whose args say ETP 2 at TP 1 (a layout the legacy folders cannot hold).
        d = t / "etp"
        shutil.copytree(src, d)

        def etp2(sd):
            sd["args"].expert_tensor_parallel_size = 2
        rewrite(d / ITER / "mp_rank_00_000" / "model_optim_rng.pt", etp2)
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "mp_rank_00_000",
              "expert_tensor_parallel_size 2", "tensor_model_parallel_size 1", "ETP = TP",
              out=t / "u.h5")

        d = t / "cut"
        shutil.copytree(src, d)
        victim = d / ITER / "mp_rank_00_001" / "distrib_optim.pt"
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "mp_rank_00_001/distrib_optim.pt",
              out=t / "u.h5")


def test_etp_other_than_tp_is_one_usage_error():
    """--etp other than --tp: Megatron's legacy loader reads one folder per (tp, pp, ep), so
    the legacy target refuses it in one usage line naming both numbers; nothing written."""
    src = source("moe_mixtral", 1, 1, 2, 2, "distributed") / "save"
    with Tmp("ucp-moe-legacy-") as t:
        p = run("convert", src, "-o", t / "o", "--tp", 2, "--dp", 2, "--ep", 2, "--etp", 1,
                expect=2)
        one_error_line(p, "--etp 1", "--tp 2", "ETP = TP")
        assert not (t / "o").exists()


if __name__ == "__main__":
    try:
        testmain.run_tests(globals())
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
