"""Mixture-of-experts torch_dist checkpoints read into the universal file, against the real
megatron-core (the tests' PyPI environment, run with its python): saves made by
tests/tools/make_moe_torch_dist.py (megatron-core 0.16's MoE GPTModel, SequentialMLP, 4 experts,
saved with dist_checkpointing.save and the real chained DistributedOptimizer's state after an Adam
step, in its fully_reshardable and dp_reshardable forms (the dense half's buckets over DP, the
expert half's over expert DP); Mixtral-like: every layer MoE, keys stacked [L, E, ...]; DeepSeek-like:
a dense first layer, shared experts, the router's expert bias, per-layer keys) at several
TP/PP/DP/EP/ETP layouts; `ucp to-universal` of each is compared, atom by atom with h5py, with the
save's truth.pt (the global tensors gathered by the generator from the ranks' memory, not from
the files): every expert param whole under its global (layer, expert) name, with its fp32 main
param and Adam moments, the router, its bias, shared experts, norms and the rest; the source's
ep/etp recorded. Malformed saves (an expert's chunk dropped, one stored twice as a per-rank
naming bug stores it, a cut rank file) give one clear error line.
"""
import functools
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import tempfile

import h5py
import numpy as np
import torch

import testmain  # noqa: E402
from testmain import Tmp, fails, one_error_line, run  # noqa: E402

DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "moe_torch_dist"
ITER = "iter_0000010"
# name: (variant, tp, pp, dp, ep, etp)
SAVES = {
    "deepseek_tp2_etp1_ep2": ("deepseek", 2, 1, 1, 2, 1),
    "mixtral_tp1_pp2_dp2_ep2": ("mixtral", 1, 2, 2, 2, 1),
    "mixtral_tp2_etp2_ep2_dp2": ("mixtral", 2, 1, 2, 2, 2),
    # the optimizer state in its dp_reshardable form (the truth: the fully_reshardable one)
    "mixtral_tp1_dp2_ep2_dpr": ("mixtral", 1, 1, 2, 2, 1),
    "deepseek_tp2_etp1_ep2_dpr": ("deepseek", 2, 1, 1, 2, 1),
}
WORK = pathlib.Path(tempfile.mkdtemp(prefix="ucp-moe-"))


@functools.lru_cache(maxsize=None)
def truth(name):
    return torch.load(DATA / name / "truth.pt", weights_only=False)


@functools.lru_cache(maxsize=None)
def universal(name):
    """`ucp to-universal` of save `name` (once per process)."""
    out = WORK / f"{name}.h5"
    run("to-universal", DATA / name, "-o", out)
    return out


def universal_name(n):
    """The universal file's name of a truth name: the local spec's norm names (the saves'
    args.transformer_impl is local); expert names are the same (global layer and expert)."""
    n = n.replace(".mlp.linear_fc1.layer_norm_weight", ".pre_mlp_layernorm.weight")
    return n.replace(".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight")


def atoms(h5):
    """{(param, kind): array} of a universal file; a vocabulary's padding rows appended to
    their atom (the truth holds the padded tensors)."""
    out = {}
    with h5py.File(h5, "r") as f:
        for name, g in f["params"].items():
            pads = {k: d[()] for k, d in g["pad"].items()} if "pad" in g else {}
            for kind, d in g.items():
                if isinstance(d, h5py.Dataset):
                    a = d[()]
                    if kind in pads:
                        a = np.concatenate([a, pads[kind]])
                    out[(name, kind)] = a
    return out


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def compare(tr, got):
    """Every truth tensor equal to its atom, byte for byte; the universal file holds nothing
    else. Returns the number of values compared."""
    want = {}
    for n, t in tr["model"].items():
        # bf16 params are kept as the model's 'param' atom beside the fp32 main param; the
        # router's expert bias (an fp32 buffer) as 'param' too.
        want[(universal_name(n), "param")] = t
    for state, kind in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
        for n, t in tr.get("optimizer", {}).get(state, {}).items():
            want[(universal_name(n), kind)] = t
    assert set(want) == set(got), sorted(set(want) ^ set(got))[:10]
    values = 0
    for k, t in want.items():
        a = got[k]
        assert a.shape == tuple(t.shape), (k, a.shape, tuple(t.shape))
        assert a.itemsize == t.element_size(), (k, a.dtype, t.dtype)
        assert np.ascontiguousarray(a).tobytes() == as_bytes(t), k
        values += t.numel()
    return values


def source_of(h5):
    with h5py.File(h5, "r") as f:
        s = f.attrs["source"]
        return json.loads(s if isinstance(s, str) else s.decode())


def opaque_keys(h5):
    with h5py.File(h5, "r") as f:
        keys = []
        f["opaque"].visititems(lambda n, o: keys.append(n) if isinstance(o, h5py.Dataset)
                               else None)
        return set(keys)


def test_every_expert_read_whole_with_its_optimizer_state():
    """Each save's universal file equals its truth: every param of the model (experts under
    their global layer and expert index, fc1 as [gate; up]) and its fp32 main param and Adam
    moments, nothing more; the source's ep and etp; each expert's _extra_state under its
    global name. Negative controls: two experts swapped, one value changed, an expert left
    out of the truth all fail the comparison."""
    for name, (variant, tp, pp, dp, ep, etp) in SAVES.items():
        tr = truth(name)
        assert tr["config"]["ep"] == ep and tr["config"]["etp"] == etp, tr["config"]
        got = atoms(universal(name))
        values = compare(tr, got)
        experts = [n for n in tr["model"] if ".mlp.experts." in n]
        moe_layers = 1 if variant == "deepseek" else 2
        assert len(experts) == moe_layers * 4 * 2, experts
        # Every value of the model and three optimizer states of it (the bias: no state).
        assert values >= 4 * sum(t.numel() for t in tr["model"].values()) - 4 * 4, values
        src = source_of(universal(name))
        assert (src["tp"], src["pp"], src["dp"], src["ep"], src["etp"]) == \
            (tp, pp, dp, ep, etp), src
        # One _extra_state object per (MoE layer, global expert, linear).
        extra = {k for k in opaque_keys(universal(name)) if ".mlp.experts." in k}
        assert len(extra) == moe_layers * 4 * 2, sorted(extra)
        assert {k.split("extra_state/", 1)[1] for k in extra} == \
            {n.replace(".weight", "._extra_state") for n in experts}, sorted(extra)
        # Negative controls.
        e2 = "decoder.layers.1.mlp.experts.2.linear_fc2.weight"
        e3 = "decoder.layers.1.mlp.experts.3.linear_fc2.weight"
        swapped = dict(tr["model"])
        swapped[e2], swapped[e3] = swapped[e3], swapped[e2]
        changed = dict(tr["model"])
        changed[e3] = changed[e3].clone()
        changed[e3].view(-1)[5] += 1
        dropped = {k: v for k, v in tr["model"].items() if k != e3}
        for bad in (swapped, changed, dropped):
            try:
                compare(dict(tr, model=bad), got)
            except AssertionError:
                continue
            raise AssertionError("the comparison missed a wrong expert")


def test_layout_check_and_json_name_the_experts_and_ep():
    """`ucp layout check` lists every expert param of the save (each global layer and expert
    of the truth) with its expert rule, and nothing fails; `to-universal --json` reports the
    source's ep and etp (from megatron-core's args, compared with the generator's config)."""
    for name, (variant, tp, pp, dp, ep, etp) in SAVES.items():
        p = run("layout", "check", DATA / name, "--json")
        report = json.loads(p.stdout)
        assert report["layout"] == f"mcore-moe-{variant}", report["layout"]
        rules = {r["param"]: r["rule"] for r in report["params"]}
        assert all(r["ok"] for r in report["params"]), report["params"]
        experts = [n for n in truth(name)["model"] if ".mlp.experts." in n]
        assert len(experts) >= 8, experts
        for n in experts:
            want = "expert_fc1" if n.endswith("linear_fc1.weight") else "expert_fc2"
            assert rules.get(n) == want, (n, rules.get(n))
            extra = n.replace(".weight", "._extra_state")
            assert rules.get(extra) == "expert_extra_state", (extra, rules.get(extra))
        assert sum(1 for r in rules.values() if r.startswith("expert_")) == 2 * len(experts)
        with Tmp("ucp-moe-json-") as t:
            out = json.loads(run("to-universal", DATA / name, "-o", t / "u.h5", "--json").stdout)
        topo = out["source_topology"]
        assert (topo["tp"], topo["pp"], topo["dp"], topo["ep"], topo["etp"]) == \
            (tp, pp, dp, ep, etp), topo


def test_param_groups_of_both_optimizer_halves():
    """The universal file's param groups are the chained optimizer's: the dense half's two
    groups (wd_mult 1 and 0) and the expert half's (is_expert_parallel), each with the lr and
    Adam step megatron-core saved (common.pt, read with torch; for dp_reshardable the groups
    are in each half's objects, so there the step is checked against the truth's steps); the
    routed experts, and only they, in the expert group."""
    for name in SAVES:
        with h5py.File(universal(name), "r") as f:
            groups = json.loads(f.attrs["optimizer"])["groups"]
            group_of = {k: int(g.attrs["group"]) for k, g in f["params"].items()
                        if int(g.attrs.get("group", -1)) >= 0}
        assert [g["key"] for g in groups] == \
            [[1.0, 1.0, False, False], [0.0, 1.0, False, False], [1.0, 1.0, True, False]], groups
        for n, gi in group_of.items():
            routed = ".mlp.experts." in n
            assert groups[gi]["key"][2] == routed, (n, groups[gi])
        assert sum(1 for gi in group_of.values() if groups[gi]["key"][2]) == \
            sum(1 for n in truth(name)["model"] if ".mlp.experts." in n)
        assert all(g["step"] in truth(name)["steps"] for g in groups), (groups, truth(name)["steps"])
        if name.endswith("_dpr"):
            continue
        common = torch.load(DATA / name / ITER / "common.pt", weights_only=False)["optimizer"]
        saved = [g for half in (common[0], common[1]) for g in half["optimizer"]["param_groups"]]
        assert len(saved) == 3
        for g, want in zip(groups, saved):
            assert g["key"][0] == want["wd_mult"] and g["key"][2] == want["is_expert_parallel"]
            assert g["lr"] == want["lr"] and g["step"] == want["step"], (g, want)


def load_meta(iter_dir):
    with open(iter_dir / ".metadata", "rb") as f:
        return pickle.load(f)


def save_meta(iter_dir, meta):
    with open(iter_dir / ".metadata", "wb") as f:
        pickle.dump(meta, f)




def drop_keys(iter_dir, doomed):
    """Removes the keys (tensors and their optimizer states) `doomed(fqn)` names from the
    save's .metadata (torch's own unpickler and pickler); returns how many."""
    meta = load_meta(iter_dir)
    gone = [k for k in meta.state_dict_metadata if doomed(k)]
    for k in gone:
        del meta.state_dict_metadata[k]
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if not doomed(k.fqn)}
    save_meta(iter_dir, meta)
    return len(gone)


def test_a_lost_or_doubled_expert_is_one_clear_error():
    """Saves that lost experts are refused naming the layer and the global experts: a per-layer
    expert key whose expert axis holds only a rank's 2 local experts (a per-rank naming bug:
    every EP rank wrote its experts at local indices), a MoE layer's fc2 experts missing
    entirely (their keys gone, optimizer states too); an expert stored twice (expert 3's chunks
    at expert 1's index) is refused naming the key and the overlapping chunks; a cut rank file
    names the file. Nothing is written under the output name. The intact saves read (control).
    Each damaged save also goes through the sanitized ucp_san (ASan + UBSan, UCP_SAN): the same
    one line, no sanitizer report."""
    src = DATA / "deepseek_tp2_etp1_ep2"
    fc1 = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"
    with Tmp("ucp-moe-bad-") as t:
        # Local experts only: the expert axis of fc1 is 2, experts 2 and 3 are not there.
        d = t / "local"
        shutil.copytree(src, d)
        meta = load_meta(d / ITER)
        md = meta.state_dict_metadata[fc1]
        md.size = torch.Size([2, *md.size[1:]])
        md.chunks = [c for c in md.chunks if c.offsets[0] < 2]
        meta.storage_data = {k: v for k, v in meta.storage_data.items()
                             if not (k.fqn == fc1 and k.offset[0] >= 2)}
        save_meta(d / ITER, meta)
        fails(["to-universal", d, "-o", t / "u.h5"], 3, str(d / ITER), fc1, "layer 1",
              "global experts 2, 3 missing", out=t / "u.h5")

        # A MoE layer's fc2 experts gone (model and optimizer keys).
        d = t / "nofc2"
        shutil.copytree(src, d)
        assert drop_keys(d / ITER, lambda k: k.endswith(
            "decoder.layers.1.mlp.experts.experts.linear_fc2.weight")) == 4
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "layer 1", "linear_fc2.weight",
              "global experts 0, 1, 2, 3 missing", out=t / "u.h5")

        # The expert half of the optimizer lost (every expert's exp_avg_sq keys).
        d = t / "noexpertstate"
        shutil.copytree(src, d)
        assert drop_keys(d / ITER, lambda k: k.startswith("optimizer.state.exp_avg_sq.") and
                         ".mlp.experts.experts." in k) == 2
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "layer 1", "optimizer state exp_avg_sq",
              "global experts 0, 1, 2, 3 missing", out=t / "u.h5")

        # Doubled: (layer 1, expert 3)'s chunks stored at expert 1's index.
        d = t / "doubled"
        shutil.copytree(src, d)
        meta = load_meta(d / ITER)
        md = meta.state_dict_metadata[fc1]
        moved = 0
        for c in md.chunks:
            if c.offsets[0] == 3:
                c.offsets = torch.Size([1, *c.offsets[1:]])
                moved += 1
        assert moved == 2, moved  # gate and up rows
        data = {}
        for k, v in meta.storage_data.items():
            if k.fqn == fc1 and k.offset[0] == 3:
                k = type(k)(fqn=k.fqn, offset=torch.Size([1, *k.offset[1:]]),
                            index=(k.index or 0) + 1000)
            data[k] = v
        meta.storage_data = data
        save_meta(d / ITER, meta)
        fails(["to-universal", d, "-o", t / "u.h5"], 3, fc1, "overlap", out=t / "u.h5")

        # A cut rank file.
        d = t / "cut"
        shutil.copytree(src, d)
        victim = d / ITER / "__1_0.distcp"
        victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
        fails(["to-universal", d, "-o", t / "u.h5"], 3, "__1_0.distcp", out=t / "u.h5")

        # Control: the intact saves read.
        for name in SAVES:
            run("to-universal", DATA / name, "-o", t / "u.h5")
            (t / "u.h5").unlink()


def test_ep_etp_flags_listed_and_refused_as_megatron_refuses_them():
    """--ep/--etp: listed by `ucp formats --json` for the two Megatron targets (deepspeed: --ep
    for its own MoE layers, refused for these experts); the sizes
    megatron-core 0.16 refuses are one usage line naming the numbers, nothing written: an ep
    that does not divide the 4 experts (MoELayer: num_moe_experts % ep_size == 0), etp x ep x
    pp not dividing the world (initialize_model_parallel's RuntimeError), --ep on a format
    without expert parallelism. Control: the numbers next to them pass these checks
    (they fail later only while a target refuses MoE models, with another message)."""
    formats = {f["name"]: f for f in json.loads(run("formats", "--json").stdout)}
    for name in ("megatron", "megatron-torch-dist"):
        assert formats[name]["target_topology"] == ["tp", "pp", "vpp", "dp", "ep", "etp"], \
            formats[name]
    # DeepSpeed: --ep only (its MoE layers' expert groups split the dp ranks).
    assert formats["deepspeed"]["target_topology"] == ["tp", "pp", "dp", "ep"], \
        formats["deepspeed"]
    # DCP: --ep for torchtitan's stacked experts (engine/formats/dcp_plain/README.md).
    assert formats["dcp"]["target_topology"] == ["dp", "ep"], formats["dcp"]
    assert "ep" not in formats["mindspore"]["target_topology"], formats["mindspore"]
    help_text = run("convert", "--help").stdout
    assert "--ep N" in help_text and "--etp N" in help_text, help_text
    src = DATA / "mixtral_tp1_pp2_dp2_ep2"
    with Tmp("ucp-moe-flags-") as t:
        cases = [
            (["--tp", 1, "--dp", 3, "--ep", 3], ["--ep 3", "4 experts"]),
            (["--tp", 1, "--dp", 8, "--ep", 8], ["--ep 8", "4 experts"]),
            (["--tp", 1, "--dp", 2, "--ep", 2, "--etp", 2],
             ["--etp 2 x --ep 2 x --pp 1 = 4", "--tp 1 x --pp 1 x --dp 2 = 2"]),
            (["--tp", 2, "--pp", 2, "--dp", 1, "--ep", 4],
             ["--etp 2 x --ep 4 x --pp 2 = 16", "= 4 ranks"]),
        ]
        for flags, needles in cases:
            p = run("convert", src, "-o", t / "o", "--format", "megatron-torch-dist",
                    "--distributed-optimizer", *flags, expect=2)
            one_error_line(p, *needles)
            assert not (t / "o").exists(), flags
        p = run("convert", src, "-o", t / "o", "--format", "deepspeed", "--dp", 2, "--ep", 2,
                expect=2)
        one_error_line(p, "--ep", "no expert parallelism")
        p = run("convert", src, "-o", t / "o", "--format", "megatron", "--tp", 1, "--dp", 3,
                "--ep", 3, expect=2)
        one_error_line(p, "--ep 3", "4 experts")
        # Controls: valid sizes get past these checks.
        for flags in (["--tp", 1, "--dp", 2, "--ep", 2], ["--tp", 2, "--dp", 2, "--ep", 2],
                      ["--tp", 1, "--dp", 4, "--ep", 4, "--etp", 1]):
            p = subprocess.run([str(testmain.UCP), "convert", str(src), "-o", str(t / "o"),
                                "--format", "megatron", *map(str, flags)],
                               capture_output=True, text=True)
            assert "does not divide" not in p.stderr and "must be >= 1" not in p.stderr, \
                (flags, p.stderr)
            shutil.rmtree(t / "o", ignore_errors=True)


def test_dcp_target_takes_a_moe_model():
    """The two Megatron targets place experts (test_moe_torch_dist_write.py, test_moe_legacy.py);
    DCP, whose ranks hold any layout, takes a MoE model too."""
    name = "mixtral_tp1_pp2_dp2_ep2"
    with Tmp() as t:
        run("convert", DATA / name, "-o", t / "dcp", "--format", "dcp", "--dp", 1)
        assert (t / "dcp" / ".metadata").exists()


if __name__ == "__main__":
    import testmain
    try:
        testmain.run_tests(globals())
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
