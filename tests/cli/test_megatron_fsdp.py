"""Megatron-FSDP's fsdp_dtensor checkpoints read by ucp, against the real megatron-core (the
tests' PyPI environment, run with its python): tests/tools/megatron_fsdp.py saves one as
Megatron-LM's training does (FullyShardedDataParallel over the GPTModel, megatron-core's
DistributedOptimizer, handle_swiglu_in_state_dict, dcp.save); ucp converts it to torch_dist at
another TP/PP and megatron-core's dist_checkpointing.load gives every model and optimizer shard
equal to the source's as torch's dcp_to_torch_save reads it (fc1's _w / _v halves joined by the
rule written here from the format, not by ucp).
"""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tools"
from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402
ITER = "iter_0000010"


def tool():
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    import megatron_torch_dist
    return megatron_torch_dist


def masters_of(model, want):
    """{DCP model key: the source's fp32 main weight} (torch_dist_view's
    optimizer.state.param.<name>, layers stacked on the first dim) for every model tensor that
    has one of its shape (a padded vocabulary has not)."""
    out = {}
    for k, v in model.items():
        m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", k)
        key = "optimizer.state.param." + (f"decoder.layers.{m.group(2)}" if m else k)
        if not isinstance(v, torch.Tensor) or key not in want:
            continue
        w = want[key][int(m.group(1))] if m else want[key]
        if isinstance(w, torch.Tensor) and w.shape == v.shape:
            out[k] = w
    return out


def equal_tensors(got, want, what):
    """torch.equal for every key of `want`; returns the number of elements compared."""
    for k, w in want.items():
        assert torch.equal(got[k], w), (what, k)
    return sum(w.numel() for w in want.values())


def save_fsdp(out, dp=2):
    p = subprocess.run([sys.executable, str(TOOLS / "megatron_fsdp.py"), "save", "--out",
                        str(out), "--dp", str(dp)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]


def torch_dist_view(fsdp_iter):
    """The fsdp_dtensor checkpoint's tensors, as torch's dcp_to_torch_save reads them, under the
    keys megatron_torch_dist.py's load compares shards with: names without the wrappers'
    "module." prefixes, SwiGLU's fc1 = [weight_w; weight_v] (the gate rows, then the up rows),
    the decoder layers stacked on a leading dim and the norms named as in torch_dist's keys
    (the local spec's sharded_state_dict_keys_map), the fp32 main weights as
    optimizer.state.param.<key>, the moments as optimizer.state.<exp_avg|exp_avg_sq>.<key>."""
    def strip(n):
        while n.startswith("module."):
            n = n[len("module."):]
        return n
    def flat(d, prefix=""):  # torch rebuilds the nesting it saved: its keys again
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    per = {}
    for k, v in flat(tool().global_tensors(fsdp_iter, raw=True)):
        if not torch.is_tensor(v):
            continue
        if k.startswith("model."):
            kind, name = "param", strip(k[len("model."):])
        elif k.startswith("optimizer.state."):
            name, kind = k[len("optimizer.state."):].rsplit(".", 1)
            name = strip(name)
        else:
            continue
        if kind != "step":
            per[(kind, name)] = v
    for kind, name in [k for k in per if k[1].endswith("_w")]:
        per[(kind, name[:-2])] = torch.cat([per.pop((kind, name)),
                                            per.pop((kind, name[:-2] + "_v"))])
    layers, out = {}, {}
    for (kind, name), v in per.items():
        m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
        if m:  # the local spec's norms under Transformer Engine's torch_dist keys
            key = m[2].replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            key = key.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
            layers.setdefault((kind, "decoder.layers." + key), {})[int(m[1])] = v
        else:
            out[f"optimizer.state.{kind}.{name}"] = v
    for (kind, key), by_layer in layers.items():
        out[f"optimizer.state.{kind}.{key}"] = torch.stack(
            [by_layer[i] for i in range(len(by_layer))])
    return out


def test_fsdp_dtensor_to_torch_dist():
    """A Megatron-FSDP save (TP 1 x DP 2: each main weight and moment unevenly sharded over DP,
    fc1 in halves) converted to torch_dist at TP 2 with the distributed optimizer:
    megatron-core loads it (as training loads a checkpoint without _extra_state or rng state),
    every model weight the source's fp32 main weight in bf16, every optimizer shard (main
    weight, both moments) the source's; the param groups keep the source's hyper-parameters
    (Adam's betas 0.9 / 0.95, not torch's defaults), the iteration is the source's; so do
    the groups torch reads from a DCP conversion. The save
    folder and its iteration folder are both detected; a torch_dist folder named as
    Megatron-FSDP's is refused in one line, so is Megatron's torch_dcp. ucp resume falls back
    past a cut rank file."""
    t = pathlib.Path(tempfile.mkdtemp(prefix="ucp-mfsdp-"))
    try:
        save_fsdp(t / "fsdp")
        p = run("inspect", t / "fsdp", "--json")
        assert '"megatron-fsdp"' in p.stdout, p.stdout[:500]
        p = run("convert", t / "fsdp", "-o", t / "td", "--format", "megatron-torch-dist",
                "--tp", 2, "--pp", 1, "--dp", 1, "--distributed-optimizer")
        assert "megatron-fsdp" in p.stdout, p.stdout
        want = torch_dist_view(t / "fsdp" / ITER)
        ok, ranks = tool().run_load(t / "td", t / "fsdp" / ITER, 2, 1, 1, log_all=True,
                                    masters=True, full=want)
        assert ok and len(ranks) == 2 and all(r["ok"] and r["checked"] > 0 for r in ranks), \
            ranks
        from megatron.core import dist_checkpointing
        common = dist_checkpointing.load_common_state_dict(str(t / "td" / ITER))
        groups = common["optimizer"]["optimizer"]["param_groups"]
        assert len(groups) == 2 and all(
            tuple(g["betas"]) == (0.9, 0.95) and g["lr"] == 1e-3 for g in groups), groups
        assert common["iteration"] == 10
        # To PyTorch DCP: torch reads the groups with the source's hyper-parameters (from
        # the metas; no pickled groups to copy) and every param's fp32 main weight.
        run("convert", t / "fsdp", "-o", t / "dcp", "--format", "dcp", "--dp", 1, "-q")
        got = tool().global_tensors(t / "dcp", raw=True)
        groups = got["optimizer"]["param_groups"]
        assert len(groups) == 2 and all(
            tuple(g["betas"]) == (0.9, 0.95) and g["eps"] == 1e-8 for g in groups), groups
        assert sorted(g["wd_mult"] for g in groups) == [0.0, 1.0], groups
        qkv = "decoder.layers.self_attention.linear_qkv.weight"
        assert torch.equal(got["model"]["decoder.layers.1.self_attention.linear_qkv.weight"],
                           want["optimizer.state.param." + qkv][1])
        # Every model tensor with a main weight in the source; at least every layer's qkv.
        sys.path.insert(0, str(TOOLS))
        import oracle_checks
        masters = masters_of(got["model"], want)
        oracle_checks.checked(lambda g: equal_tensors(g, masters, "DCP model"),
                              {k: got["model"][k] for k in masters},
                              want["optimizer.state.param." + qkv].numel(), "DCP model")
        # The universal file keeps the objects: the rng states torch flattened into uint8
        # tensors come back as torch.load reads them, args as the Megatron blob.
        import h5py
        import io
        run("to-universal", t / "fsdp", "-o", t / "u.h5", "-q")
        src = tool().global_tensors(t / "fsdp" / ITER, raw=True)
        with h5py.File(t / "u.h5") as f:
            blob = f["opaque/megatron_fsdp/rng_state.0.torch_rng_state"][()].tobytes()
            assert torch.equal(torch.load(io.BytesIO(blob)),
                               src["rng_state"][0]["torch_rng_state"])
            args = torch.load(io.BytesIO(f["opaque/args"][()].tobytes()), weights_only=False)
            assert args.ckpt_format == "fsdp_dtensor"
        # The iteration folder itself reads the same.
        run("convert", t / "fsdp" / ITER, "-o", t / "td2", "--format", "megatron-torch-dist",
            "--tp", 2, "--pp", 1, "--dp", 1, "--distributed-optimizer", "-q")
        a = sorted(p.name for p in (t / "td2" / ITER).iterdir())
        assert a == sorted(p.name for p in (t / "td" / ITER).iterdir())
        assert all((t / "td" / ITER / n).read_bytes() == (t / "td2" / ITER / n).read_bytes()
                   for n in a if n.endswith(".distcp"))
        # --from megatron-fsdp on torch_dist's folder: one line naming the format to use.
        p = run("convert", t / "td", "-o", t / "bad", "--from", "megatron-fsdp",
                "--format", "dcp", "--dp", 1, expect=3)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "megatron-torch-dist" in lines[0], p.stderr
        assert not (t / "bad").exists()
        # Megatron's other DCP format, torch_dcp, looks alike: refused by its args.
        import argparse
        import torch.distributed.checkpoint as dcp
        dcp.save({"model": {"module.decoder.final_layernorm.weight": torch.ones(4)},
                  "args": argparse.Namespace(ckpt_format="torch_dcp",
                                             tensor_model_parallel_size=1)},
                 checkpoint_id=t / "tdcp" / "iter_0000001", no_dist=True)
        (t / "tdcp" / "latest_checkpointed_iteration.txt").write_text("1")
        p = run("convert", t / "tdcp", "-o", t / "bad", "--format", "dcp", "--dp", 1, expect=3)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "ckpt_format 'torch_dcp'" in lines[0], p.stderr
        # ucp resume past a cut rank file: iteration 20 (a copy of 10 with __1_0.distcp cut)
        # is skipped, iteration 10 reshaped; ucp resume without --format says to give one.
        shutil.copytree(t / "fsdp" / ITER, t / "fsdp" / "iter_0000020")
        cut = t / "fsdp" / "iter_0000020" / "__1_0.distcp"
        os.truncate(cut, cut.stat().st_size // 2)
        (t / "fsdp" / "latest_checkpointed_iteration.txt").write_text("20")
        p = run("resume", t / "fsdp", "--format", "megatron-torch-dist", "--tp", 2, "--pp", 1,
                "--dp", 1, "--distributed-optimizer")
        out = p.stdout + p.stderr
        assert "iter_0000020" in out and "from iter_0000010" in out, out
        p = run("resume", t / "fsdp", expect=2)
        assert "pass --format" in p.stderr, p.stderr
    finally:
        shutil.rmtree(t)


if __name__ == "__main__":
    test_fsdp_dtensor_to_torch_dist()
