"""torchtitan-style mixture-of-experts DCP saves for the tests, made by the real torch (the
tests' PyPI environment; run with its python) on CPU with gloo, 4 ranks.

torchtitan itself is not in the tests' environment, so its model and its `parallelize` are
rebuilt here by hand from what torchtitan does (moe.md, "torchtitan / PyTorch DCP"): the routed
experts are one module holding 3-D tensors `layers.{L}.moe.experts.w1 [E, F, D]`, `w3 [E, F, D]`,
`w2 [E, D, F]` (or the shape-suffixed `w1_EFD`, `w3_EFD`, `w2_EDF`), distributed `Shard(0)` over
the `ep` mesh, then `fully_shard` (FSDP2) over the `dp_shard_mod_ep` mesh with `Shard(0)`, or
`Shard(1)` when E / ep is smaller than that mesh (torchtitan's shard_placement_fn); everything
else `fully_shard` over all ranks; the router `moe.router.gate.weight [E, D]`, the `moe.expert_bias
[E]` buffer, shared experts `moe.shared_experts.w{1,2,3}.weight`, a dense first layer
(`feed_forward.w{1,2,3}.weight`), attention, norms, embeddings, output. Two Adam steps (FSDP2 and
torch's Adam), then get_state_dict and dcp.save, as torchtitan's checkpointer does. The mesh is
torchtitan's: (dp_shard_mod_ep, ep), ep the inner dim, so FSDP2 gives the experts torch's own
`_StridedShard(0)` / `Shard(1)` placements over the 2-D mesh.

Usage:
  make_dcp_moe.py --out DIR [--case NAME ...]

Cases (DIR/<case>/ckpt the save, DIR/<case>/truth.pt {key path: full tensor or object}):
  ep2_fsdp2          E=4 at ep 2 x fsdp 2: experts Shard(0) over ep, FSDP Shard(0) on top
  ep2_fsdp2_suffix   E=2 at ep 2 x fsdp 2: FSDP Shard(1) (1 local expert < 2), names w1_EFD,
                     w3_EFD, w2_EDF
  uneven_e3          E=3 at ep 2 x fsdp 2: torch.chunk gives the ep ranks 2 and 1 experts, FSDP's
                     Shard(0) then 1, 1 and 1, 0, so one rank's expert chunks are empty (the
                     .metadata is checked to hold them); experts in the older torchtitan order
                     (w1, w3 [E, D, F], w2 [E, F, D]). (E=6 at ep 4 would give an ep rank no
                     expert at all, which FSDP2 cannot shard: "_chunk_cat expects non-empty".)
"""
import argparse
import os
import pathlib
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

CASES = ("ep2_fsdp2", "ep2_fsdp2_suffix", "uneven_e3")
# experts, ep size, names with the shape suffix, the older [E, D, F] order
SPEC = {"ep2_fsdp2": (4, 2, False, False),
        "ep2_fsdp2_suffix": (2, 2, True, False),
        "uneven_e3": (3, 2, False, True)}
WORLD = 4
DIM, FFN, EXPERT_FFN, SHARED_FFN, VOCAB = 8, 12, 6, 12, 17


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n in ("wq", "wk", "wv", "wo"):
            setattr(self, n, torch.nn.Linear(DIM, DIM, bias=False))

    def forward(self, h):
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        a = torch.softmax(q @ k.transpose(-1, -2) / DIM ** 0.5, dim=-1)
        return self.wo(a @ v)


class FeedForward(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, hidden, bias=False)
        self.w2 = torch.nn.Linear(hidden, DIM, bias=False)
        self.w3 = torch.nn.Linear(DIM, hidden, bias=False)

    def forward(self, h):
        return self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))


class GroupedExperts(torch.nn.Module):
    """torchtitan's GroupedExperts: stacked [E, ...] weights. Under EP each rank computes its
    local experts only (to_local(); a token-dispatch all-to-all is not needed for a checkpoint)."""

    def __init__(self, experts, suffix, old_order):
        super().__init__()
        self.names = ("w1_EFD", "w2_EDF", "w3_EFD") if suffix else ("w1", "w2", "w3")
        self.old_order = old_order
        f, d = EXPERT_FFN, DIM
        shapes = ((experts, d, f), (experts, f, d), (experts, d, f)) if old_order else \
            ((experts, f, d), (experts, d, f), (experts, f, d))
        for n, s in zip(self.names, shapes):
            self.register_parameter(n, torch.nn.Parameter(torch.randn(s) * 0.2))
        self.first = 0  # global index of the first local expert

    def forward(self, h, scores):
        from torch.distributed.tensor import DTensor
        w1, w2, w3 = (getattr(self, n) for n in self.names)
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (w1, w2, w3))
        if self.old_order:  # h @ w1: [D, F]
            w1, w2, w3 = w1.transpose(1, 2), w2.transpose(1, 2), w3.transpose(1, 2)
        # Every rank's backward must reach its experts, even with none (an empty chunk), so that
        # FSDP's collectives run on all ranks alike.
        out = h * 0.0 * (w1.sum() + w2.sum() + w3.sum())
        for i in range(w1.shape[0]):
            y = (torch.nn.functional.silu(h @ w1[i].T) * (h @ w3[i].T)) @ w2[i].T
            out = out + y * scores[..., self.first + i: self.first + i + 1]
        return out


class Router(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate = torch.nn.Linear(DIM, experts, bias=False)


class MoE(torch.nn.Module):
    def __init__(self, experts, suffix, old_order):
        super().__init__()
        self.router = Router(experts)
        self.experts = GroupedExperts(experts, suffix, old_order)
        self.shared_experts = FeedForward(SHARED_FFN)
        self.register_buffer("expert_bias", torch.randn(experts) * 0.1)  # DeepSeek's, persistent

    def forward(self, h):
        scores = torch.softmax(self.router.gate(h) + self.expert_bias, dim=-1)
        return self.shared_experts(h) + self.experts(h, scores)


class Block(torch.nn.Module):
    def __init__(self, moe, experts=0, suffix=False, old_order=False):
        super().__init__()
        self.attention = Attention()
        self.attention_norm = torch.nn.RMSNorm(DIM)
        self.ffn_norm = torch.nn.RMSNorm(DIM)
        if moe:
            self.moe = MoE(experts, suffix, old_order)
        else:
            self.feed_forward = FeedForward(FFN)

    def forward(self, h):
        h = h + self.attention(self.attention_norm(h))
        mlp = self.moe if hasattr(self, "moe") else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Transformer(torch.nn.Module):
    """One dense layer, then two MoE layers (DeepSeek's first-k-dense)."""

    def __init__(self, experts, suffix, old_order):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleDict({
            "0": Block(False), "1": Block(True, experts, suffix, old_order),
            "2": Block(True, experts, suffix, old_order)})
        self.norm = torch.nn.RMSNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x):
        h = self.tok_embeddings(x)
        for b in self.layers.values():
            h = b(h)
        return self.output(self.norm(h))


def flatten(obj, prefix=()):
    """{key path: leaf} of nested dicts / lists."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, prefix + (k,)))
    elif isinstance(obj, list) and any(isinstance(x, (dict, list, torch.Tensor)) for x in obj):
        for i, v in enumerate(obj):
            out.update(flatten(v, prefix + (i,)))
    else:
        out[prefix] = obj
    return out


def full(v):
    from torch.distributed.tensor import DTensor
    if isinstance(v, DTensor):
        return v.full_tensor().detach().clone()
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return v


def parallelize(model, experts, ep, rank):
    """torchtitan's apply_moe_ep_tp + apply_fsdp for ep x (world / ep) ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor
    efsdp = WORLD // ep
    mesh = init_device_mesh("cpu", (efsdp, ep), mesh_dim_names=("dp_shard_mod_ep", "ep"))
    dp_shard = mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
    local = -(-experts // ep)
    for b in model.layers.values():
        if not hasattr(b, "moe"):
            continue
        ex = b.moe.experts
        ex.first = min(experts, mesh["ep"].get_local_rank() * local)
        for n in ex.names:
            p = getattr(ex, n)
            setattr(ex, n, torch.nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
        fully_shard(ex, mesh=mesh["dp_shard_mod_ep"],
                    shard_placement_fn=lambda p: Shard(0) if local >= efsdp else Shard(1))
    for b in model.layers.values():
        fully_shard(b, mesh=dp_shard)
    fully_shard(model, mesh=dp_shard)


def make_state(case, rank):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    experts, ep, suffix, old_order = SPEC[case]
    torch.manual_seed(0)
    model = Transformer(experts, suffix, old_order)
    parallelize(model, experts, ep, rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(2):
        x = torch.randint(0, VOCAB, (2, 5), generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def run_rank(rank, world, port, case, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    sd = make_state(case, rank)
    truth = {k: full(v) for k, v in flatten(sd).items()}
    dcp.save(sd, checkpoint_id=str(out / case / "ckpt"))
    if rank == 0:
        torch.save(truth, out / case / "truth.pt")
    dist.barrier()
    dist.destroy_process_group()


def check_layout(case, ckpt):
    """What each case is for is really in the .metadata torch wrote."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    experts, ep, suffix, _ = SPEC[case]
    name = "w1_EFD" if suffix else "w1"
    key = f"model.layers.1.moe.experts.{name}"
    m = md.state_dict_metadata[key]
    assert m.size[0] == experts, (key, m.size)
    chunks = [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks]
    empty = [c for c in chunks if 0 in c[1]]
    if case == "uneven_e3":
        assert empty, (key, chunks)
    if case == "ep2_fsdp2_suffix":  # FSDP's Shard(1): chunks split dim 1
        assert any(c[0][1] != 0 for c in chunks), (key, chunks)
    assert f"optimizer.state.layers.1.moe.experts.{name}.exp_avg" in md.state_dict_metadata
    return len(chunks), len(empty)


def make(out, case):
    import oracle_checks
    (out / case).mkdir(parents=True, exist_ok=True)
    ctx = mp.start_processes(run_rank, args=(WORLD, free_port(), case, out), nprocs=WORLD,
                             join=False, start_method="fork")
    oracle_checks.join_context(ctx, 300, case)
    return check_layout(case, out / case / "ckpt")


# --- load mode: torch's dcp.load of a checkpoint (ucp's output) at WORLD ranks --------------

def load_rank(rank, world, port, ckpt, truth_path, result_path):
    """Loads `ckpt` into DTensors laid out over `world` ranks (1-D mesh: experts and every
    tensor of 2+ dims Shard(1) at odd worlds, else Shard(0); 1-D tensors Shard(0); 0-d plain);
    rank 0 saves the full tensors to `result_path`."""
    from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = DeviceMesh("cpu", list(range(world)))
    want = torch.load(truth_path, weights_only=False)
    sd = {}
    for path, v in want.items():
        if not isinstance(v, torch.Tensor):
            continue
        d = sd
        for k in path[:-1]:
            d = d.setdefault(k, {})
        if v.dim() > 0:
            dim = 1 if (v.dim() > 1 and world % 2 == 1) else 0
            d[path[-1]] = distribute_tensor(torch.zeros_like(v), mesh, [Shard(dim)])
        else:
            d[path[-1]] = torch.zeros_like(v)
    dcp.load(sd, checkpoint_id=str(ckpt))
    got = {k: full(v) for k, v in flatten(sd).items()}
    if rank == 0:
        torch.save(got, result_path)
    dist.barrier()
    dist.destroy_process_group()


def load_check(ckpt, truth_path, world):
    """{key path: tensor} torch's dcp.load gives at `world` ranks (every tensor of truth.pt)."""
    import tempfile
    import oracle_checks
    ctx = mp.get_context("fork")
    port = free_port()
    with tempfile.TemporaryDirectory() as t:
        result = os.path.join(t, "got.pt")
        procs = [ctx.Process(target=load_rank, args=(r, world, port, ckpt, truth_path, result))
                 for r in range(world)]
        for p in procs:
            p.start()
        oracle_checks.join_ranks(procs, 120, f"dcp.load at {world} ranks")
        return torch.load(result, weights_only=True)


def torchtitan_load_rank(rank, world, port, case, ckpt, result_path):
    """The case's model, parallelized as at its save (EP x FSDP2), with a fresh Adam: loads
    `ckpt` as torchtitan's checkpointer does (get_state_dict, dcp.load, set_state_dict); rank 0
    saves the full state get_state_dict then gives to `result_path`."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    experts, ep, suffix, old_order = SPEC[case]
    torch.manual_seed(123)  # other values than the save's
    model = Transformer(experts, suffix, old_order)
    parallelize(model, experts, ep, rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=str(ckpt))
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    msd, osd = get_state_dict(model, opt)
    got = {k: full(v) for k, v in flatten({"model": msd, "optimizer": osd}).items()}
    if rank == 0:
        torch.save(got, result_path)
    dist.barrier()
    dist.destroy_process_group()


def torchtitan_load(case, ckpt):
    """{key path: tensor or object} of the case's EP x FSDP2 model and Adam after loading
    `ckpt` (torchtitan_load_rank) on 4 ranks."""
    import tempfile
    import oracle_checks
    with tempfile.TemporaryDirectory() as t:
        result = os.path.join(t, "got.pt")
        ctx = mp.start_processes(torchtitan_load_rank,
                                 args=(WORLD, free_port(), case, ckpt, result), nprocs=WORLD,
                                 join=False, start_method="fork")
        oracle_checks.join_context(ctx, 120, f"{case}: torchtitan-style load")
        return torch.load(result, weights_only=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--case", action="append", choices=CASES)
    a = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    out = pathlib.Path(a.out)
    for case in a.case or CASES:
        chunks, empty = make(out, case)
        print("made", case, f"({chunks} expert chunks, {empty} empty)", flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.exit(main())
