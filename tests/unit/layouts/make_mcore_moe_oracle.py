"""Writes data/mcore_0.16_moe_oracle.json: where megatron-core 0.16 itself puts every param of its
MoE GPTModels (tests/tools/make_moe_torch_dist.py's Mixtral-like and DeepSeek-like models: 2
layers, 4 SequentialMLP experts, GQA, SwiGLU, a shared expert and expert bias in the DeepSeek-like
one) at several TP/PP/DP/EP/ETP: for every rank its coordinates from parallel_state and every
ShardedTensor of model.sharded_state_dict() (factories applied: key, global shape, global offset,
local shape, prepended axes, replica_id). Read by moe_test.cc (MoeMcoreOracleTest). Not run by
ctest (a minute or two); regenerate with the tests' venv python:

  ~/.cache/ucp/venv/bin/python make_mcore_moe_oracle.py --out data/mcore_0.16_moe_oracle.json
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tools"))
import make_moe_torch_dist as moe  # noqa: E402
import megatron_torch_dist as mtd  # noqa: E402

# variant, tp, pp, dp, ep, etp
RUNS = [("mixtral", 1, 1, 2, 2, 1), ("mixtral", 2, 1, 2, 4, 1), ("mixtral", 2, 2, 1, 1, 2),
        ("mixtral", 1, 1, 4, 2, 1), ("deepseek", 2, 1, 1, 2, 1), ("deepseek", 2, 2, 1, 1, 2),
        ("deepseek", 1, 2, 2, 2, 1)]


def rank_fn(rank, world, port, a, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mtd.cpu_shims()
    import mcore_cpu
    mcore_cpu.shims()
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    parallel_state.initialize_model_parallel(
        a.tp, a.pp, expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    torch.manual_seed(1)
    model, = moe.build(a)  # one chunk (no VPP)
    sd = model.sharded_state_dict()
    apply_factories(sd)
    entries = [[sh.key, list(sh.global_shape), list(sh.global_offset), list(sh.local_shape),
                sh.prepend_axis_num, list(sh.replica_id)]
               for sh in nested_values(sd) if isinstance(sh, ShardedTensor)]
    every = [None] * world
    torch.distributed.gather_object({"coordinates": moe.coordinates(), "entries": entries},
                                    every if rank == 0 else None, dst=0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(every, f)
    torch.distributed.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401
    runs = []
    for variant, tp, pp, dp, ep, etp in RUNS:
        a = argparse.Namespace(variant=variant, tp=tp, pp=pp, dp=dp, ep=ep, etp=etp)
        tmp = f"{args.out}.rank_{len(runs)}.json"
        world = tp * pp * dp
        ctx = mp.start_processes(rank_fn, args=(world, mtd.free_port(), a, tmp), nprocs=world,
                                 join=False, start_method="fork")
        assert mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "moe oracle"), a
        with open(tmp) as f:
            ranks = json.load(f)
        os.remove(tmp)
        runs.append({"variant": variant, "tp": tp, "pp": pp, "dp": dp, "ep": ep, "etp": etp,
                     "sizes": moe.SIZE, "vocab": moe.VOCAB, "ranks": ranks})
        print(variant, tp, pp, dp, ep, etp, "ok", flush=True)
    with open(args.out, "w") as f:
        json.dump({"megatron_core": "0.16", "runs": runs}, f, separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
