"""ucp against the real DeepSpeed (the tests' PyPI environment, CPU, gloo) on
mixture-of-experts models: deepspeed.moe.layer.MoE, 4 experts over ep ranks,
top-1 gate, between two dense layers (tests/tools/deepspeed_real.py --model moe).

The newest DeepSpeed runs every test; 0.14.5 (its entry puts it first on
PYTHONPATH; it saves the model states without param_shapes, and expp_rank
files) the world-2 cases. UCP_DEEPSPEED_VERSION names the one that must run.

1. DeepSpeed trains and saves at ZeRO STAGE, DTYPE, WORLD ranks, EP: the
   non-expert mp_rank_00_model_states.pt, one layer_0_expert_{G} file per
   global expert, the ZeRO partitions (the expert group partitioned over the
   expert-data-parallel ranks, partition_count dp / ep) or at ZeRO 0 each ep
   rank's torch optimizer (expp_rank_{E} files), and reports what the engine
   holds in memory under the global expert names;
2. `ucp to-universal` holds exactly that (tests/tools/check_deepspeed.py
   universal; its negative control: one changed master byte fails it);
3. `ucp convert --dp N --ep E [--zero-stage S]`: a fresh DeepSpeed engine at
   N ranks, ep E, stage S loads ucp's files (engine.load_checkpoint) and then
   holds the source's module params, fp32 masters, Adam moments, param groups
   and step counters bit for bit (tests/tools/deepspeed_real.py load; its
   negative control: one changed byte of an expert's moment fails it);
4. malformed saves (an expert file missing, an expert saved twice, an expert
   group's partition_count not the expert-data-parallel size) are one error
   line naming the expert or the group, exit 3, nothing written; under ctest
   also through the sanitized ucp_san (UCP_SAN).
DeepSpeed's own ds_to_universal converts no such checkpoint, so it is no oracle
here: 0.14.5 stops at the missing param_shapes (deepspeedai/DeepSpeed#5716),
0.19.8 joins the ep ranks' same-named local experts as data-parallel shards
("RuntimeError: shape '[6]' is invalid for input of size 12" on this model).
"""
import functools
import json
import os
import pathlib
import shutil
import sys
import tempfile

import torch

TOOLS = pathlib.Path(os.environ["UCP_SOURCE_DIR"]) / "tests" / "tools"
sys.path.insert(0, str(TOOLS))
import deepspeed_real  # noqa: E402 (imports DeepSpeed only when a command runs)
import testmain  # noqa: E402
from testmain import fails, one_error_line, run, run_both  # noqa: E402

WORK = pathlib.Path(tempfile.mkdtemp(prefix="ucp-dsmoe-"))
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts."

# (stage, dtype, world, ep) of the source -> its targets (world, ep, stage).
CASES = {
    (1, "fp32", 2, 2): [(4, 2, 1), (2, 1, 2), (2, 2, 0)],
    (2, "bf16", 2, 2): [(4, 4, 2), (1, 1, 1)],
    (1, "fp32", 4, 2): [(2, 2, 2)],
    (0, "fp32", 2, 2): [(4, 2, 0), (2, 1, 2)],
}


def ds(*args, expect_ok=True):
    """tests/tools/deepspeed_real.py's command in this process (ranks forked from here). A
    load compares at least 60 values; returns rank 0's verdict for a load."""
    out, ok = deepspeed_real.command(args)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    print(last, flush=True)
    assert ok == expect_ok, (args, out[-2000:])
    if args[0] == "load":
        verdict = json.loads(last)
        assert verdict["checked"] >= 60, verdict
        return verdict
    return out


@functools.cache
def source(stage, dtype, world, ep):
    """The real DeepSpeed's MoE save (made once per test process)."""
    out = WORK / f"src-z{stage}-{dtype}-w{world}-ep{ep}"
    ds("make", "--world", world, "--stage", stage, "--dtype", dtype, "--model", "moe",
       "--ep", ep, "--out", out)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["num_experts"] == 4 and meta["ep"] == ep, meta
    # The DeepSpeed the entry names ran (not another one found first).
    assert meta["deepspeed_version"] == os.environ["UCP_DEEPSPEED_VERSION"], \
        (meta["deepspeed_version"], os.environ["UCP_DEEPSPEED_VERSION"])
    tag = out / "global_step2"
    experts = sorted(p.name for p in tag.glob("layer_*_expert_*_model_states.pt"))
    assert experts == [f"layer_0_expert_{g}_mp_rank_00_model_states.pt" for g in range(4)], \
        experts
    return out


def check_universal(h5, src):
    """check_deepspeed.py's universal check (at least 300 values) and its negative control."""
    import check_deepspeed as ck
    import h5py
    ck.cmd_universal(str(h5), str(src), 300)
    bad = h5.with_name(h5.stem + "-changed.h5")
    shutil.copy(h5, bad)
    with h5py.File(bad, "r+") as f:
        d = f["params"][EXPERT + "3.fc2.weight"]["fp32"]
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


def change_expert_moment(folder, rank):
    """The load oracle's negative control: one byte of the expert group's exp_avg_sq in dp
    rank `rank`'s optimizer file changed."""
    f = next((folder / "global_step2").glob(f"*zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
    o = torch.load(f, weights_only=False)
    t = o["optimizer_state_dict"]["base_optimizer_state"]["state"][1]["exp_avg_sq"]
    t.view(-1).view(torch.uint8)[0] ^= 1
    torch.save(o, f)


def run_case(stage, dtype, world, ep):
    src = source(stage, dtype, world, ep)
    with testmain.Tmp("ucp-dsmoe-case-") as t:
        run("to-universal", src, "-o", t / "u.h5", "-q")
        check_universal(t / "u.h5", src)
        print(f"ok ucp to-universal holds the engine's state (ZeRO {stage} {dtype} world "
              f"{world} ep {ep})", flush=True)
        for n, e, s in CASES[(stage, dtype, world, ep)]:
            if s == 0 and os.environ["UCP_DEEPSPEED_VERSION"] == "0.14.5":
                continue  # 0.14.5 loads no MoE checkpoint at ZeRO 0 (test_zero0_...)
            out = t / f"w{n}ep{e}z{s}"
            run("convert", src, "-o", out, "--dp", n, "--ep", e, "--zero-stage", s, "-q",
                "--no-sync")
            tag = out / "global_step2"
            assert len(list(tag.glob("layer_0_expert_*_mp_rank_00_model_states.pt"))) == 4
            if s == 0:  # each ep rank's optimizer
                assert len(list(tag.glob("expp_rank_*_mp_rank_00_optim_states.pt"))) == e
            else:
                assert len(list(tag.glob("*zero_pp_rank_*_optim_states.pt"))) == n
            (t / f"scratch-{n}-{e}").mkdir()
            ds("load", "--world", n, "--stage", s, "--dtype", dtype, "--model", "moe", "--ep",
               e, "--dir", out, "--truth", src, "--scratch", t / f"scratch-{n}-{e}")
            print(f"ok DeepSpeed loads ucp's files at world {n}, ep {e}, ZeRO {s}", flush=True)
            if (stage, dtype, world, ep) == (1, "fp32", 2, 2) and (n, e) == (4, 2):
                change_expert_moment(out, 3)
                (t / "scratch-changed").mkdir()
                verdict = ds("load", "--world", n, "--stage", s, "--dtype", dtype, "--model",
                             "moe", "--ep", e, "--dir", out, "--truth", src, "--scratch",
                             t / "scratch-changed", expect_ok=False)
                assert any(EXPERT + "3." in f and "values differ" in f
                           for f in verdict["failures"]), verdict
                print("ok the load oracle fails on one changed byte of an expert's moment",
                      flush=True)


def test_zero1_fp32_world2_ep2():
    run_case(1, "fp32", 2, 2)


def test_zero2_bf16_world2_ep2():
    run_case(2, "bf16", 2, 2)


def test_zero1_fp32_world4_ep2():
    """Expert data parallel 2: each expert group partitioned over two ranks."""
    run_case(1, "fp32", 4, 2)


def test_zero0_fp32_world2_ep2():
    """ZeRO 0: each ep rank's torch optimizer in its expp_rank file (DeepSpeed 0.14.5 loads
    no such checkpoint, its own neither: KeyError 'optimizer' in _load_checkpoint)."""
    run_case(0, "fp32", 2, 2)


def test_malformed_moe_saves_are_one_clear_error():
    """A missing expert file, an expert saved twice (under both file names; another expert's
    params in its file), an expert group's partition_count that is not dp / ep: one error line
    naming the expert or group, exit 3, no output; ucp resume skips a save missing an expert
    with that reason, ucp verify refuses it. The intact save converts, and read under the
    legacy expert file names holds the engine's state (controls)."""
    src = source(1, "fp32", 2, 2)
    with testmain.Tmp("ucp-dsmoe-bad-") as t:
        run("to-universal", src, "-o", t / "ok.h5", "-q")  # the control

        def damaged(name):
            d = t / name
            shutil.copytree(src, d)
            return d, d / "global_step2"

        # The legacy names (expert_{G}_..., every layer's params of expert G: here the one
        # MoE layer's) read the same.
        d, tag = damaged("legacy")
        for g in range(4):
            (tag / f"layer_0_expert_{g}_mp_rank_00_model_states.pt").rename(
                tag / f"expert_{g}_mp_rank_00_model_states.pt")
        run("to-universal", d, "-o", t / "legacy.h5", "-q")
        import check_deepspeed as ck
        ck.cmd_universal(str(t / "legacy.h5"), str(src), 300)

        d, tag = damaged("missing")
        (tag / "layer_0_expert_2_mp_rank_00_model_states.pt").unlink()
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "expert 2 of MoE layer 0 is missing",
              "layer_0_expert_2_mp_rank_00_model_states.pt", out=t / "u.h5")

        d, tag = damaged("twice")
        shutil.copy(tag / "layer_0_expert_1_mp_rank_00_model_states.pt",
                    tag / "expert_1_mp_rank_00_model_states.pt")
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "expert 1 saved twice",
              "layer_0_expert_1_mp_rank_00_model_states.pt", "expert_1_mp_rank_00_model_states.pt",
              out=t / "u.h5")

        d, tag = damaged("other")  # expert 3's file holds expert 1's params
        shutil.copy(tag / "layer_0_expert_1_mp_rank_00_model_states.pt",
                    tag / "layer_0_expert_3_mp_rank_00_model_states.pt")
        fails(["convert", d, "-o", t / "out", "--dp", 2, "--ep", 1], 3,
              "layer_0_expert_3_mp_rank_00_model_states.pt", EXPERT + "1.",
              "a param of expert 1 in expert 3's file", out=t / "out")

        d, tag = damaged("count")
        f = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        o = torch.load(f, weights_only=False)
        assert o["optimizer_state_dict"]["partition_count"] == [2, 1]
        o["optimizer_state_dict"]["partition_count"] = [2, 2]
        torch.save(o, f)
        fails(["to-universal", d, "-o", t / "u.h5"], 3, str(f), "partition_count[1] is 2",
              "expert-data-parallel size is 1", out=t / "u.h5")

        # ucp resume skips a newer save missing an expert, with that reason, and resumes
        # from the intact one: as saved at its own ep, resharded at another; ucp verify
        # refuses the damaged one.
        save = t / "save"
        save.mkdir()
        shutil.copytree(src / "global_step2", save / "global_step2")
        shutil.copytree(src / "global_step2", save / "global_step4")
        (save / "global_step4" / "layer_0_expert_1_mp_rank_00_model_states.pt").unlink()
        (save / "latest").write_text("global_step4")
        for ep, reshaped in ((2, False), (1, True)):
            p = run("resume", save, "--dp", 2, "--ep", ep, "--json", "--no-sync")
            j = json.loads(p.stdout)
            assert j["checkpoint"] == "global_step2" and j["reshaped"] == reshaped, j
            assert [s["name"] for s in j["skipped"]] == ["global_step4"], j
            assert "expert 1 of MoE layer 0 is missing" in j["skipped"][0]["reason"], j
        p = run_both("verify", save / "global_step4", expect=3)
        one_error_line(p, "expert 1 of MoE layer 0 is missing")

        # --ep that does not divide the experts or the data-parallel size: usage errors.
        fails(["convert", src, "-o", t / "out", "--dp", 3, "--ep", 3], 2,
              "--ep 3 does not divide the 4 experts of MoE layer 0", out=t / "out")
        line = fails(["convert", src, "-o", t / "out", "--dp", 2, "--ep", 4], 2,
                     "--ep 4 does not divide --dp 2", out=t / "out")
        assert "--etp" not in line, line  # DeepSpeed has no expert tensor parallelism


if __name__ == "__main__":
    try:
        testmain.run_tests(globals())
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
