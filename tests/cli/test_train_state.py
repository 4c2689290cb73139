"""The training state through another format and back, judged by the real frameworks (the tests'
PyPI environment, CPU, one process for both: each imports MindSpore and torch).

- MindSpore -> DCP, -> DeepSpeed, -> Megatron-core torch_dist, each back to MindSpore: a real
  nn.Adam save after two steps (its parameters, moments, global_step, learning_rate and the
  beta1_power / beta2_power it keeps for the bias correction, with betas other than the
  defaults) comes back from every format with what mindspore.load_checkpoint returns equal to
  the source on every record (type, shape, bytes). On the way, torch's own reading of the DCP
  folder holds step 2 for every param and the lr and betas nn.Adam trained with, torch.optim.Adam
  loads it, DeepSpeed's files hold global_steps 2, and ucp reads its own DCP output at
  iteration 2 (the folder's name tells none).
- DCP -> MindSpore -> DCP: a torch.optim.Adam save after three steps (folder name without a
  step) gives MindSpore the global_step, learning_rate and beta powers nn.Adam itself holds after
  three steps with those betas, and back in DCP torch.optim.Adam loads the same param groups and
  per-param step as the source's and, given the same gradients, steps to the same weights. eps
  and weight_decay, which MindSpore does not save, are torch's defaults in the source; ucp says
  in a note what it wrote for them.
"""
import json
import os
import pathlib
import tempfile

os.environ.setdefault("GLOG_v", "3")
import h5py  # noqa: E402
import numpy as np  # noqa: E402

from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402

# A one-layer Megatron-core GPT under its own names (so that Megatron's layout places it).
SHAPES = [("embedding.word_embeddings.weight", (128, 8)),
          ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", (8,)),
          ("decoder.layers.0.self_attention.linear_qkv.weight", (24, 8)),
          ("decoder.layers.0.self_attention.linear_proj.weight", (8, 8)),
          ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", (8,)),
          ("decoder.layers.0.mlp.linear_fc1.weight", (16, 8)),
          ("decoder.layers.0.mlp.linear_fc2.weight", (8, 16)),
          ("decoder.final_layernorm.weight", (8,)),
          ("output_layer.weight", (128, 8))]
LR, BETAS = 0.02, (0.85, 0.995)
SCALARS = ("global_step", "learning_rate", "beta1_power", "beta2_power")


def mindspore_adam(params, steps, lr, betas, seed):
    """nn.Adam over `params` after `steps` steps of seeded random gradients."""
    import mindspore as ms
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    opt = ms.nn.Adam(params, learning_rate=lr, beta1=betas[0], beta2=betas[1])
    rs = np.random.RandomState(seed)
    for _ in range(steps):
        opt(tuple(ms.Tensor(rs.randn(*p.shape).astype(np.float32)) for p in params))
    return opt


def mindspore_save(path):
    """A MindSpore save of the params and nn.Adam's state after two steps; what
    mindspore.load_checkpoint returns for it."""
    import mindspore as ms
    rs = np.random.RandomState(0)
    params = [ms.Parameter(ms.Tensor((rs.randn(*s) * 0.1).astype(np.float32)), name=n)
              for n, s in SHAPES]
    opt = mindspore_adam(params, 2, LR, BETAS, seed=1)
    items = [{"name": p.name, "data": p} for p in params]
    items += [{"name": p.name, "data": p} for p in (opt.moment1 + opt.moment2)]
    items += [{"name": n, "data": getattr(opt, n)} for n in SCALARS]
    ms.save_checkpoint(items, str(path))
    return mindspore_load(path)


def mindspore_load(path):
    import mindspore as ms
    return {k: v.asnumpy() for k, v in ms.load_checkpoint(str(path)).items()}


def only_ckpt(folder):
    files = sorted(pathlib.Path(folder).rglob("*.ckpt"))
    assert len(files) == 1, files
    return files[0]


def same_records(got, want, where):
    """Every record of `want` in `got` and no other, of the same type, shape and bytes; the
    number compared."""
    assert sorted(got) == sorted(want), (where, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (where, k, g.dtype, g.shape, w.dtype,
                                                            w.shape)
        assert g.tobytes() == w.tobytes(), (where, k, g, w)
    return len(want)


def torch_view(dcp_dir, out):
    """A DCP folder as torch's dcp_to_torch_save reads it."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(dcp_dir), str(out))
    return torch.load(out, weights_only=False)


def universal_iteration(ckpt, out):
    run("to-universal", ckpt, "-o", out, "-q")
    with h5py.File(out, "r") as f:
        return int(f.attrs["iteration"])


def mindspore_through_formats():
    import torch
    with tempfile.TemporaryDirectory(prefix="ucp-train-state-") as t:
        t = pathlib.Path(t)
        want = mindspore_save(t / "net.ckpt")
        assert sorted(want) == sorted([n for n, _ in SHAPES] +
                                      [f"moment{i}.{n}" for i in (1, 2) for n, _ in SHAPES] +
                                      list(SCALARS)), sorted(want)
        assert want["global_step"].tolist() == [2] and want["beta1_power"].item() < 1.0
        # Negative control: a beta power one float32 step away is a difference.
        bad = dict(want)
        bad["beta1_power"] = np.nextafter(want["beta1_power"], np.float32(0))
        try:
            same_records(bad, want, "control")
            raise RuntimeError("a changed beta1_power went unnoticed")
        except AssertionError:
            pass
        targets = {
            "dcp": ["--format", "dcp", "--dp", 1],
            "deepspeed": ["--format", "deepspeed", "--dp", 1, "--zero-stage", 1],
            "torch_dist": ["--format", "megatron-torch-dist", "--tp", 1, "--pp", 1, "--dp", 1,
                           "--distributed-optimizer",
                           "--model-var", "num_attention_heads=2"],
        }
        compared = 0
        for name, args in targets.items():
            p = run("convert", t / "net.ckpt", "-o", t / name, *args, "--json")
            notes = json.loads(p.stdout)["notes"]
            if name != "torch_dist":  # (Megatron's own note says defaults were used)
                # MindSpore does not save eps or weight decay: what was written is said.
                for k, v in (("eps", "1e-08"), ("weight_decay", "0")):
                    assert any(f"no Adam {k}: wrote {k} {v}" in n for n in notes), (name, notes)
            run("convert", t / name, "-o", t / f"{name}-ms", "--format", "mindspore", "-q")
            compared += same_records(mindspore_load(only_ckpt(t / f"{name}-ms")), want, name)
        assert compared == 3 * (3 * len(SHAPES) + len(SCALARS)), compared

        # torch's reading of the DCP folder: step 2 for every param, nn.Adam's lr and betas,
        # and torch.optim.Adam takes the groups.
        sd = torch_view(t / "dcp", t / "dcp.pt")
        state, groups = sd["optimizer"]["state"], sd["optimizer"]["param_groups"]
        assert sorted(state) == sorted(n for n, _ in SHAPES), sorted(state)
        for n, s in state.items():
            assert s["step"].item() == 2.0, (n, s["step"])
            assert s["exp_avg"].numpy().tobytes() == want[f"moment1.{n}"].tobytes(), n
        assert len(groups) == 1, groups
        g = groups[0]
        assert g["lr"] == LR and tuple(g["betas"]) == BETAS, g
        assert g["eps"] == 1e-8 and g["weight_decay"] == 0.0, g
        params = [torch.nn.Parameter(torch.zeros(s)) for _, s in SHAPES]
        opt = torch.optim.Adam(params, lr=1.0)
        index = {n: i for i, (n, _) in enumerate(SHAPES)}
        opt.load_state_dict({"state": {index[k]: v for k, v in state.items()},
                             "param_groups": [{**g, "params": [index[n] for n in g["params"]]}]})
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert opt.param_groups[0]["lr"] == LR and opt.state[params[0]]["step"].item() == 3.0
        # ucp's own DCP output, whose name tells no step: the step ucp wrote.
        assert universal_iteration(t / "dcp", t / "dcp.h5") == 2
        # DeepSpeed's files: global_steps and the optimizer's groups.
        ds = sorted((t / "deepspeed").rglob("mp_rank_00_model_states.pt"))
        assert len(ds) == 1, ds
        assert torch.load(ds[0], weights_only=False)["global_steps"] == 2
        osd = torch.load(next(ds[0].parent.glob("*optim_states.pt")), weights_only=False)
        osd = osd["optimizer_state_dict"]
        inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict", osd))
        dg = inner["param_groups"][0]
        assert dg["lr"] == LR and tuple(dg["betas"]) == BETAS, dg


def torch_adam_save(ckpt, steps):
    """A torch.optim.Adam DCP save (get_state_dict's layout: names for ids) after `steps`
    steps; the model, the optimizer and the gradients of one more step."""
    import torch
    import torch.distributed.checkpoint as dcp
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.03, betas=(0.8, 0.99))
    for _ in range(steps):
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    grads = [torch.randn_like(p) for p in model.parameters()]
    dcp.save({"model": model.state_dict(), "optimizer": by_name(model, opt.state_dict())},
             checkpoint_id=str(ckpt))
    return model, opt, grads


def by_name(model, osd):
    names = [n for n, _ in model.named_parameters()]
    return {"state": {names[i]: v for i, v in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in osd["param_groups"]]}


def loaded_adam(sd, grads):
    """A fresh model and torch.optim.Adam loaded from a DCP folder's view `sd`, stepped once
    with `grads`: the optimizer and the weights after."""
    import torch
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model.load_state_dict(sd["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1.0)
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    o = sd["optimizer"]
    opt.load_state_dict({"state": {index[k]: v for k, v in o["state"].items()},
                         "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                          for g in o["param_groups"]]})
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    steps = [opt.state[p]["step"].item() for p in model.parameters()]
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    opt.step()
    return groups, steps, [p.detach().clone() for p in model.parameters()]


def dcp_through_mindspore():
    import mindspore as ms
    import torch
    with tempfile.TemporaryDirectory(prefix="ucp-train-state-") as t:
        t = pathlib.Path(t)
        _, _, grads = torch_adam_save(t / "ckpt", steps=3)
        run("convert", t / "ckpt", "-o", t / "ms", "--format", "mindspore", "-q")
        got = mindspore_load(only_ckpt(t / "ms"))
        # nn.Adam after three steps with these betas and lr holds these records.
        ref = mindspore_adam([ms.Parameter(ms.Tensor(np.ones(3, np.float32)), name="p")], 3,
                             0.03, (0.8, 0.99), seed=0)
        for k in SCALARS:
            r = getattr(ref, k).asnumpy()
            assert got[k].dtype == r.dtype and got[k].shape == r.shape, (k, got[k], r)
            assert got[k].tobytes() == r.tobytes(), (k, got[k], r)
        p = run("convert", t / "ms", "-o", t / "back", "--format", "dcp", "--dp", 1, "--json")
        notes = json.loads(p.stdout)["notes"]
        for k, v in (("eps", "1e-08"), ("weight_decay", "0")):
            assert any(f"no Adam {k}: wrote {k} {v}" in n for n in notes), notes
        src = loaded_adam(torch_view(t / "ckpt", t / "src.pt"), grads)
        back = loaded_adam(torch_view(t / "back", t / "back.pt"), grads)
        assert back[0] == src[0], (back[0], src[0])
        assert src[1] == back[1] == [3.0] * 4, (src[1], back[1])
        assert len(src[2]) == len(back[2]) == 4
        for a, b in zip(src[2], back[2]):
            assert torch.equal(a, b)
        # Negative control: other betas are a different group.
        other = [dict(g, betas=(0.9, 0.99)) for g in src[0]]
        assert other != back[0]
        # Both DCP folders tell no step by their names: the iteration is the optimizer's.
        assert universal_iteration(t / "ckpt", t / "src.h5") == 3
        assert universal_iteration(t / "back", t / "back.h5") == 3


def test_training_state_through_formats():
    mindspore_through_formats()
    dcp_through_mindspore()


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
