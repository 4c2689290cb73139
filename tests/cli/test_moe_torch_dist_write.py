"""Mixture-of-experts torch_dist checkpoints written by ucp, judged by the real megatron-core (the
tests' PyPI environment, run with its python): the saves of tests/tools/make_moe_torch_dist.py
(megatron-core 0.16's MoE GPTModel, Mixtral-like with every layer MoE and DeepSeek-like with a
dense first layer, a shared expert and the router's expert bias, after a real Adam step of the
chained DistributedOptimizer) are converted by `ucp convert` to other EP / ETP / TP / PP / DP
layouts, and megatron-core loads each result at its layout as training does
(make_moe_torch_dist.run_load: the model and its chained DistributedOptimizer built at the target
layout, dist_checkpointing.load of both sharded state dicts in the form the checkpoint names,
load_state_dict(strict=True), the optimizer's load_state_dict). Every shard the model and the
optimizer then hold (the optimizer's by its own fully_reshardable sharded_state_dict: fp32 main
params and Adam moments) must equal the source save's truth.pt (gathered by the generator from
the ranks' memory, not from files) bit for bit, with the Adam step, a minimum count of values
and a negative control in every rank (a changed expert value is detected), plus one damaged
output that megatron-core's load must reject. And the universal file written back at the
source's own layout reproduces every tensor of the source's files (torch's own DCP reader).
"""
import json
import os
import pathlib
import shutil
import sys
import tempfile

import torch

import testmain  # noqa: E402
from testmain import Tmp, run  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import make_moe_torch_dist as moe  # noqa: E402
import megatron_torch_dist as mtd  # noqa: E402

DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "moe_torch_dist"
ITER = "iter_0000010"
WORK = pathlib.Path(tempfile.mkdtemp(prefix="ucp-moe-w-"))
TRUTH = {}


def truth(name):
    if name not in TRUTH:
        TRUTH[name] = torch.load(DATA / name / "truth.pt", weights_only=False)
    return TRUTH[name]


def convert(src, out, tp, pp=1, dp=1, ep=1, etp=None, optim="fully_reshardable", vpp=1):
    """`ucp convert SRC -o OUT` for the layout, with --json: its target_topology names ep and
    etp."""
    flags = ["--tp", tp, "--pp", pp, "--vpp", vpp, "--dp", dp, "--ep", ep, "--json"]
    if optim != "non_distributed":  # else the optimizer of a run without the distributed one
        flags += ["--distributed-optimizer", "--optimizer-sharding", optim]
    if etp is not None:
        flags += ["--etp", etp]
    doc = json.loads(run("convert", src, "-o", out, *flags).stdout)
    topo = doc["target_topology"]
    assert (topo["tp"], topo["pp"], topo["vpp"], topo["dp"], topo["ep"], topo["etp"]) == \
        (tp, pp, vpp, dp, ep, etp or tp), topo
    return out


def loads(ckpt, source, variant, tp, pp=1, dp=1, ep=1, etp=None, optim="fully_reshardable",
          vpp=1):
    """megatron-core's load of `ckpt` at the layout, compared with save `source`'s truth."""
    ok, verdicts = moe.run_load(ckpt, truth(source), variant, tp, pp, dp, ep, etp, optim,
                                vpp=vpp)
    world = tp * pp * dp
    assert ok and len(verdicts) == world and all(v["ok"] for v in verdicts), \
        (ckpt, ok, verdicts)
    # Every rank compared its model and optimizer shards: at least the model's values
    # divided over the model-parallel ranks, times four (weights, main params, moments).
    model = sum(t.numel() for t in truth(source)["model"].values())
    for v in verdicts:
        assert v["values"] >= 4 * model // (tp * pp * max(ep, etp or tp)) // 2, v
        assert v["expert_shards"] > 0 and v["steps"] == truth(source)["steps"], v
    return verdicts


CASES = [
    # (name, source, variant, target (tp, pp, dp, ep, etp), form, source of the conversion)
    ("ep2_to_ep1", "mixtral_tp1_pp2_dp2_ep2", "mixtral", (1, 2, 2, 1, 1),
     "fully_reshardable", None),
    ("ep1_to_ep4", "mixtral_tp1_pp2_dp2_ep2", "mixtral", (1, 1, 4, 4, 1),
     "fully_reshardable", "ep2_to_ep1"),
    ("etp2_to_etp1", "mixtral_tp2_etp2_ep2_dp2", "mixtral", (2, 1, 2, 2, 1),
     "fully_reshardable", None),
    ("tp_pp_ep_fixed", "mixtral_tp1_pp2_dp2_ep2", "mixtral", (2, 1, 2, 2, None),
     "fully_reshardable", None),
    ("etp_above_tp_dpr", "mixtral_tp1_pp2_dp2_ep2", "mixtral", (1, 1, 4, 2, 2),
     "dp_reshardable", None),
    ("deepseek_dp_change_dpr", "deepseek_tp2_etp1_ep2", "deepseek", (2, 1, 2, 2, 1),
     "dp_reshardable", None),
    ("deepseek_dpr_to_ep4", "deepseek_tp2_etp1_ep2_dpr", "deepseek", (1, 1, 4, 4, 1),
     "fully_reshardable", None),
    ("mixtral_dpr_to_ep4_dpr", "mixtral_tp1_dp2_ep2_dpr", "mixtral", (1, 1, 4, 4, 1),
     "dp_reshardable", None),
    ("deepseek_ep1_dpr", "deepseek_tp2_etp1_ep2", "deepseek", (1, 1, 2, 1, 1),
     "dp_reshardable", None),
    ("deepseek_ep1_dpr_to_ep2_dpr", "deepseek_tp2_etp1_ep2", "deepseek", (2, 1, 2, 2, 1),
     "dp_reshardable", "deepseek_ep1_dpr"),
    # the non-distributed optimizer's form (Float16OptimizerWithFloat16Params, chained at EP > 1)
    ("mixtral_non_distributed_ep4", "mixtral_tp1_pp2_dp2_ep2", "mixtral", (1, 1, 4, 4, 1),
     "non_distributed", None),
    ("deepseek_non_distributed_ep1", "deepseek_tp2_etp1_ep2", "deepseek", (1, 1, 2, 1, 1),
     "non_distributed", None),
]


def test_conversions_load_in_megatron_core_with_every_shard_of_the_source():
    """EP alone (2 -> 1, then 1 -> 4 from that output), ETP alone (2 -> 1), ETP above TP, TP/PP
    with EP fixed, a DP change, Mixtral- and DeepSeek-like, fully_reshardable and
    dp_reshardable outputs, from fully_reshardable and dp_reshardable sources, EP 1 (experts in
    the dense optimizer) and back, the non-distributed optimizer's form: each loads in
    megatron-core at its layout (into the optimizer of that form) with every shard equal to
    the source's."""
    done = {}
    for name, source, variant, (tp, pp, dp, ep, etp), optim, via in CASES:
        src = done[via] if via else DATA / source
        out = convert(src, WORK / name, tp, pp, dp, ep, etp, optim)
        loads(out, source, variant, tp, pp, dp, ep, etp, optim)
        done[name] = out


def test_a_virtual_pipeline_is_read_and_written_in_both_forms():
    """A 4-layer Mixtral-like save at PP 2 x VPP 2 (two model chunks a rank, each with its own
    DDP buffers, the chained optimizer's state dp_reshardable: buckets per chunk, dense over DP
    and expert over expert-DP) is read: converted to EP 4 without a pipeline; that is written
    back at PP 2 x VPP 2 in the dp_reshardable and the fully_reshardable forms. megatron-core
    loads each at its layout (the chunks built as training builds them) with every shard of
    the source."""
    name = "mixtral_l4_tp1_pp2_vpp2_dp2_ep2_dpr"
    assert truth(name)["config"]["vpp"] == 2 and truth(name)["config"]["layers"] == 4
    ep4 = convert(DATA / name, WORK / "vpp_to_ep4", 1, 1, 4, 4, 1)
    loads(ep4, name, "mixtral", 1, 1, 4, 4, 1)
    for optim in ("dp_reshardable", "fully_reshardable"):
        out = convert(ep4, WORK / f"vpp2_{optim}", 1, 2, 2, 2, 1, optim, vpp=2)
        loads(out, name, "mixtral", 1, 2, 2, 2, 1, optim, vpp=2)


def flip_expert_byte(iter_dir):
    """Changes one byte of the tensor data of an expert's fc2 chunk in its rank file (the
    item found through torch's DCP metadata, its data record through the torch.save zip it
    is); returns the key."""
    import io
    import struct
    import zipfile
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(str(iter_dir)).read_metadata()
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    for idx, info in md.storage_data.items():
        if idx.fqn != key:
            continue
        path = iter_dir / info.relative_path
        data = bytearray(path.read_bytes())
        item = bytes(data[info.offset:info.offset + info.length])
        z = zipfile.ZipFile(io.BytesIO(item))
        rec = next(i for i in z.infolist() if i.filename.endswith("/data/0"))
        name_len, extra_len = struct.unpack("<HH", item[rec.header_offset + 26:
                                                          rec.header_offset + 30])
        start = rec.header_offset + 30 + name_len + extra_len
        data[info.offset + start + rec.file_size // 2] ^= 0x40
        path.write_bytes(bytes(data))
        return key
    raise AssertionError(f"{key} not in {iter_dir}")


def test_negative_control_a_damaged_expert_fails_the_load_check():
    """The same check fails on an output whose one expert byte is changed."""
    out = convert(DATA / "mixtral_tp2_etp2_ep2_dp2", WORK / "damaged", 2, 1, 2, 2, 1)
    flip_expert_byte(out / ITER)
    ok, verdicts = moe.run_load(out, truth("mixtral_tp2_etp2_ep2_dp2"), "mixtral", 2, 1, 2, 2,
                                1)
    assert not ok and any("linear_fc2" in m for v in verdicts for m in v["mismatches"]), \
        verdicts


def test_what_is_not_written_is_one_usage_line():
    """dp_reshardable state at EP 1 with ETP != TP (the experts would share dense buffers over
    ranks that hold other expert shards) is refused naming the sizes, nothing written; the
    same layout in the fully_reshardable form is written (control)."""
    with Tmp("ucp-moe-w-bad-") as t:
        p = run("convert", DATA / "mixtral_tp2_etp2_ep2_dp2", "-o", t / "o", "--tp", 2, "--dp",
                2, "--ep", 1, "--etp", 1, "--distributed-optimizer", "--optimizer-sharding",
                "dp_reshardable", expect=2)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "etp 1 != tp 2" in lines[0], p.stderr
        assert not (t / "o").exists()
        run("convert", DATA / "mixtral_tp2_etp2_ep2_dp2", "-o", t / "o", "--tp", 2, "--dp", 2,
            "--ep", 1, "--etp", 1, "--distributed-optimizer")
        assert (t / "o" / ITER / "metadata.json").exists()


def test_universal_round_trip_reproduces_the_files():
    """torch_dist -> universal -> torch_dist at the source's own layout: every tensor of the
    source's files (model, optimizer state in its form: dp_reshardable buckets but for the
    padding between params, which megatron-core leaves uninitialized and ucp writes as zeros)
    equal, read by torch's own DCP reader; the same keys but for ucp's common_state item."""
    layouts = {"mixtral_tp1_pp2_dp2_ep2": (1, 2, 2, 2, 1, "fully_reshardable"),
               "deepseek_tp2_etp1_ep2": (2, 1, 1, 2, 1, "fully_reshardable"),
               "mixtral_tp1_dp2_ep2_dpr": (1, 1, 2, 2, 1, "dp_reshardable")}
    for name, (tp, pp, dp, ep, etp, optim) in layouts.items():
        h5 = WORK / f"{name}.h5"
        run("to-universal", DATA / name, "-o", h5)
        out = WORK / f"rt_{name}"
        run("reshape", h5, "-o", out, "--format", "megatron-torch-dist", "--tp", tp, "--pp", pp,
            "--dp", dp, "--ep", ep, "--etp", etp, "--distributed-optimizer",
            "--optimizer-sharding", optim)
        want = mtd.global_tensors(str(DATA / name / ITER), raw=True)
        got = mtd.global_tensors(str(out / ITER), raw=True)
        assert set(got) - set(want) <= {"common_state/shard_0_1"} and set(want) <= set(got), \
            sorted(set(got) ^ set(want))[:10]
        values = 0
        for k, w in want.items():
            if not isinstance(w, torch.Tensor):
                continue
            g = got[k]
            assert g.dtype == w.dtype and g.shape == w.shape, (k, g.shape, w.shape)
            if ".bucket_idx_" in k and "chained_0." in k:
                # the padding between params: ucp's zeros, megatron-core's uninitialized
                same = (g == w) | (g == 0)
            else:
                same = g == w
            assert bool(same.all()), (name, k)
            values += w.numel()
        assert values > 20000, values
        # Negative control: a changed expert value is a difference.
        k = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" \
            if name.startswith("deepseek") else \
            "decoder.layers.mlp.experts.experts.linear_fc1.weight"
        bad = got[k].clone()
        bad.view(-1)[7] += 1
        assert not torch.equal(bad, want[k])


def test_resume_fits_at_the_saved_layout_else_writes_a_load_folder():
    """`ucp resume` over a MoE save folder: at the save's own TP/PP/DP/EP/ETP it hands out the
    save folder itself (nothing written); at another EP a load folder named for the layout
    (-ep4-etp1), which megatron-core loads at that layout with every shard of the save."""
    name = "mixtral_tp1_dp2_ep2_dpr"
    save = DATA / name
    doc = json.loads(run("resume", save, "--tp", 1, "--dp", 2, "--ep", 2, "--etp", 1,
                         "--distributed-optimizer", "--optimizer-sharding", "dp_reshardable",
                         "-o", WORK / "resume_same", "--json").stdout)
    assert doc["load"] == str(save) and not doc["reshaped"], doc
    assert not (WORK / "resume_same").exists()
    # Control: another EP is not the saved layout.
    with Tmp("ucp-moe-resume-") as t:
        shutil.copytree(save, t / "save")
        doc = json.loads(run("resume", t / "save", "--tp", 1, "--dp", 4, "--ep", 4,
                             "--distributed-optimizer", "--json").stdout)
        load = pathlib.Path(doc["load"])
        assert doc["reshaped"] and load.parent == t / "save" / "ucp-resume", doc
        assert load.name.endswith("-tp1-pp1-vpp1-dp4-ep4-etp1-do"), load.name
        loads(load, name, "mixtral", 1, 1, 4, 4, 1, "fully_reshardable")


if __name__ == "__main__":
    try:
        testmain.run_tests(globals())
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
