"""PyTorch DCP: ucp against what DCP users compare it with, on one large checkpoint.

  <venv python> bench/dcp_bench.py BUILD_DIR [--gib 2.2] [--ranks 4] [--to 3] [--rounds 5]
                                   [--json FILE]
                                   [--ckpt DIR]

The checkpoint is saved by the real torch (the tests' PyPI environment: run this with its python)
from N gloo processes on CPU, laid out as FSDP2 saves a GPT-like model with Adam (get_state_dict
keys; every tensor a Shard(0) DTensor; the model, exp_avg and exp_avg_sq in fp32; 0-d steps; param
groups). In the same run, rounds alternated, `sync` before each timed command, medians [min-max]:

  ucp convert --dp M          vs  cp -r SRC DST && sync
  ucp convert --dp M --no-sync vs  cp -r SRC DST
  ucp export (safetensors)    vs  torch.distributed.checkpoint.format_utils.dcp_to_torch_save

with peak RSS (and bytes read, /proc/<pid>/io rchar, over the checkpoint's size) of each.
"""
import argparse
import json
import os
import pathlib
import socket
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import pairs as pairs_mod  # noqa: E402


def save_rank(rank, world, port, out, params):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DeviceMesh, DTensor, Shard
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = DeviceMesh("cpu", list(range(world)))
    g = torch.Generator().manual_seed(rank)

    def shard(shape):
        d0 = shape[0]
        cs = -(-d0 // world)
        rows = max(0, min((rank + 1) * cs, d0) - min(rank * cs, d0))
        local = torch.randn((rows,) + tuple(shape[1:]), generator=g)
        return DTensor.from_local(local, mesh, [Shard(0)], shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride(), run_check=False)
    model, state = {}, {}
    for name, shape in params:
        model[name] = shard(shape)
        state[name] = {"step": torch.tensor(100.0), "exp_avg": shard(shape), "exp_avg_sq": shard(shape)}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
               "params": [n for n, _ in params]}]
    dcp.save({"model": model, "optimizer": {"state": state, "param_groups": groups}}, checkpoint_id=out)
    dist.destroy_process_group()


def make(out, gib, ranks):
    # hidden 2048, vocab 32000, ffn 5632: 12 floats of optimizer state + weights per param.
    hidden, ffn, vocab = 2048, 5632, 32000
    params = [("tok_embeddings.weight", (vocab, hidden))]
    layer = [("attention.wqkv.weight", (3 * hidden, hidden)), ("attention.wo.weight", (hidden, hidden)),
             ("feed_forward.w13.weight", (2 * ffn, hidden)), ("feed_forward.w2.weight", (hidden, ffn)),
             ("attention_norm.weight", (hidden,)), ("ffn_norm.weight", (hidden,))]
    per_layer = sum(torch.Size(s).numel() for _, s in layer) * 12
    layers = max(1, int((gib * 2**30 - vocab * hidden * 12) // per_layer))
    for i in range(layers):
        params += [(f"layers.{i}.{n}", s) for n, s in layer]
    params += [("norm.weight", (hidden,)), ("output.weight", (vocab, hidden))]
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(save_rank, args=(ranks, port, str(out), params), nprocs=ranks, start_method="fork")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--gib", type=float, default=2.2)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--to", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json")
    ap.add_argument("--ckpt", help="keep the generated checkpoint in this folder; reuse it when present")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ucp-dcp-bench-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        src = pathlib.Path(a.ckpt).resolve() if a.ckpt else w / "ckpt"
        if not (src / ".metadata").is_file():
            make(src, a.gib, a.ranks)
        size = pairs_mod.tree_bytes(src)
        print(f"DCP checkpoint: {size / 2**30:.2f} GiB, {a.ranks} ranks -> {a.to}", flush=True)
        out = w / "out"
        d2t = ("import sys, torch; torch.set_num_threads(2); "
               "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save; "
               "dcp_to_torch_save(sys.argv[1], sys.argv[2])")
        pairs = {
            "convert (durable)": ([ucp, "convert", src, "-o", out, "--dp", a.to, "-q"],
                                  f"cp -r '{src}' '{out}' && sync", True),
            "convert (--no-sync)": ([ucp, "convert", src, "-o", out, "--dp", a.to, "-q", "--no-sync"],
                                    f"cp -r '{src}' '{out}'", True),
            "export (durable)": ([ucp, "export", src, "-o", out, "-q"],
                                 [sys.executable, "-c", d2t, src, out], False),
        }
        results = pairs_mod.run_pairs(pairs, a.rounds, size, out)
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
