"""Real PyTorch DCP checkpoints for the tests, saved by torch itself (the newest torch of the
tests' PyPI environment; run with its python), on CPU with gloo in several processes.

Usage:
  make_dcp_ckpts.py --out DIR [--case NAME ...]
  make_dcp_ckpts.py --load-check CKPT TRUTH WORLD MODE   (see load_check)

Cases (DIR/<case>/ckpt is the checkpoint, DIR/<case>/truth.pt the full state it holds):
  fsdp2_w3        a small GPT-like model sharded with FSDP2 (fully_shard) on 3 ranks, two Adam
                  steps, get_state_dict() saved: Shard(0) DTensors with uneven and empty chunks,
                  0-d steps, param groups as objects
  fsdp2_bf16_w2   the same in bf16 on 2 ranks
  dtensor2d_w4    DTensors on a 2x2 mesh: Shard(0)/Shard(1), Replicate/Shard(0), Shard(1)/Replicate
  sharded_w2      FSDP1-style ShardedTensors (torch's own _create_chunk_sharded_tensor), 2 ranks
  nopg            no process group: plain tensors, nested dicts, objects (single process)
  ranklocal_w2    save(..., use_collectives=False): one __R.metadata per rank, replicas of the
                  replicated tensors
  zstd_w2         items compressed with torch's ZStandard extension, 2 ranks
truth.pt holds {key path (tuple): full tensor or object}, the state each case saved, taken from the
live tensors (DTensor.full_tensor(), the full tensor a ShardedTensor was cut from).
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

CASES = ("fsdp2_w3", "fsdp2_bf16_w2", "dtensor2d_w4", "sharded_w2", "nopg", "ranklocal_w2",
         "zstd_w2")
WORLD = {"fsdp2_w3": 3, "fsdp2_bf16_w2": 2, "dtensor2d_w4": 4, "sharded_w2": 2, "nopg": 1,
         "ranklocal_w2": 2, "zstd_w2": 2}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(12)
        self.qkv = torch.nn.Linear(12, 36)
        self.proj = torch.nn.Linear(12, 12, bias=False)
        self.fc = torch.nn.Linear(12, 20)
        self.out = torch.nn.Linear(20, 12)

    def forward(self, h):
        h = h + self.proj(self.qkv(self.ln(h))[..., :12])
        return h + self.out(torch.relu(self.fc(h)))


class Gpt(torch.nn.Module):
    """Embedding, two blocks of norm + attention projection + MLP, final norm; odd sizes so that
    Shard(0) chunks are uneven (and empty on some ranks)."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.wte = torch.nn.Embedding(37, 12)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.ln_f = torch.nn.LayerNorm(12)
        self.head = torch.nn.Linear(12, 2)
        self.to(dtype)

    def forward(self, x):
        h = self.wte(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


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


def fsdp2_state(world, dtype):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Gpt(dtype)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x = torch.randint(0, 37, (4, 5), generator=g)
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


def dtensor2d_state(world):
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
    mesh = DeviceMesh("cpu", torch.arange(world).reshape(2, 2))
    g = torch.Generator().manual_seed(2)
    a, b, c = torch.randn(7, 9, generator=g), torch.randn(10, 5, generator=g), torch.randn(6, 11, generator=g)
    return {"model": {"a": distribute_tensor(a, mesh, [Shard(0), Shard(1)]),
                      "b": distribute_tensor(b, mesh, [Replicate(), Shard(0)]),
                      "c": distribute_tensor(c, mesh, [Shard(1), Replicate()])},
            "step": 7}


def sharded_state(world, rank):
    from torch.distributed.fsdp._shard_utils import _create_chunk_sharded_tensor
    g = torch.Generator().manual_seed(3)
    full_w, full_v = torch.randn(9, 4, generator=g), torch.randn(5, generator=g)
    pg = dist.group.WORLD
    sd = {"model": {"w": _create_chunk_sharded_tensor(full_w, rank, world, 1, pg),
                    "v": _create_chunk_sharded_tensor(full_v, rank, world, 1, pg)}}
    return sd, {("model", "w"): full_w, ("model", "v"): full_v}


def plain_state():
    g = torch.Generator().manual_seed(4)
    return {"model": {"w": torch.randn(6, 4, generator=g),
                      "h": torch.randn(3, generator=g).to(torch.float16)},
            "optimizer": {"state": {"w": {"step": torch.tensor(5.0), "exp_avg": torch.randn(6, 4, generator=g)}},
                          "param_groups": [{"lr": 0.5, "params": ["w"]}]},
            "extra": {"epoch": 3, "name": "run-7"}}


def run_rank(rank, world, port, case, out):
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    ckpt = out / case / "ckpt"
    truth = None
    kwargs = {}
    if case.startswith("fsdp2"):
        sd = fsdp2_state(world, torch.bfloat16 if "bf16" in case else torch.float32)
    elif case == "dtensor2d_w4":
        sd = dtensor2d_state(world)
    elif case == "sharded_w2":
        sd, truth = sharded_state(world, rank)
    elif case == "nopg":
        sd = plain_state()
        kwargs["no_dist"] = True
    elif case == "ranklocal_w2":
        from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
        mesh = DeviceMesh("cpu", list(range(world)))
        g = torch.Generator().manual_seed(5)
        sd = {"model": {"a": distribute_tensor(torch.randn(5, 3, generator=g), mesh, [Shard(0)]),
                        "s": torch.tensor(2.5)}}
        kwargs["use_collectives"] = False
    elif case == "zstd_w2":
        from torch.distributed.checkpoint._extension import ZStandard
        from torch.distributed.tensor import DeviceMesh, Shard, distribute_tensor
        mesh = DeviceMesh("cpu", list(range(world)))
        g = torch.Generator().manual_seed(6)
        sd = {"model": {"a": distribute_tensor(torch.randn(8, 3, generator=g), mesh, [Shard(0)]),
                        "b": torch.randn(4, generator=g)}, "meta": {"tokens": 123}}
        kwargs["storage_writer"] = dcp.FileSystemWriter(str(ckpt), _extensions=[ZStandard()])
    if truth is None:
        truth = {k: full(v) for k, v in flatten(sd).items()}
    if "storage_writer" not in kwargs:
        kwargs["checkpoint_id"] = str(ckpt)
    dcp.save(sd, **kwargs)
    if rank == 0:
        torch.save(truth, out / case / "truth.pt")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def make(out, case):
    world = WORLD[case]
    (out / case).mkdir(parents=True, exist_ok=True)
    if world == 1:
        run_rank(0, 1, 0, case, out)
    else:
        import oracle_checks
        ctx = mp.start_processes(run_rank, args=(world, free_port(), case, out), nprocs=world,
                                 join=False, start_method="fork")
        oracle_checks.join_context(ctx, 300, case)  # a rank still running then: killed, failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", action="append", choices=CASES)
    a = ap.parse_args(argv)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    out = pathlib.Path(a.out)
    for case in a.case or CASES:
        make(out, case)
        print("made", case, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
