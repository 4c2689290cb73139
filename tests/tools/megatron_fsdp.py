"""Megatron-FSDP `fsdp_dtensor` checkpoints saved by the real megatron-core (the tests'
PyPI environment: run with its python), on CPU with gloo, one process per rank.

  megatron_fsdp.py save --out SAVE_DIR [--dp D] [--seed S] [--size hidden,layers,ffn,heads,groups]

The model is megatron_torch_dist.py's GPTModel (GQA, SwiGLU, RMSNorm, bf16, untied), wrapped as
training's --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params wraps it
(megatron.core.distributed.fsdp's FullyShardedDataParallel: fp32 main weights as DTensors,
unevenly sharded over DP, TP-split as Megatron splits them), with megatron-core's own
DistributedOptimizer over it (get_megatron_optimizer). Megatron-FSDP is CUDA-bound;
mcore_cpu.shims() lets it run on CPU (streams as no-ops, "cuda" tensors made on the CPU, CPU
device meshes; the current device 0, as Megatron-FSDP builds torch.device("cuda", index)).

save: the state Megatron-LM's training saves with --ckpt-format fsdp_dtensor (training/
checkpointing.py: generate_state_dict, preprocess_fsdp_dtensor_state_dict, torch's dcp.save with
a FileSystemWriter): "model" the wrapper's state_dict(), "optimizer" the optimizer's
sharded_state_dict with distrib_optim_sharding_type fsdp_dtensor, args, checkpoint_version,
iteration 10, the scheduler's state, the rng states (get_rng_state's list) and the rerun state;
megatron-core's handle_fp8_extra_state_case,
handle_swiglu_in_state_dict (linear_fc1 as weight_w / weight_v) and
preprocess_state_dict_for_uneven_dtensor; then the tracker. The optimizer's state is set to
known values after torch's AdamW created it: exp_avg = 0.5 * w + 1, exp_avg_sq = w * w + 0.25
of each main weight w, step 10.

TP stays 1: the adapter's TP path needs Transformer Engine (it names TELinear); the keys are
global tensors whatever the TP.
"""
import argparse
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_cpu  # noqa: E402
import megatron_torch_dist as mtd  # noqa: E402

ITERATION = 10


def build(tp):
    """The FSDP-wrapped model and megatron-core's DistributedOptimizer over it."""
    from megatron.core.distributed.distributed_data_parallel_config import \
        DistributedDataParallelConfig
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    model = mtd.build(tp, 1, 1)[0]
    ddp = DistributedDataParallelConfig(
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True)
    wrapped = FullyShardedDataParallel(model.config, ddp, model, device=torch.device("cpu"))
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, adam_beta1=0.9, adam_beta2=0.95,
                        adam_eps=1e-8, weight_decay=0.1, bf16=True,
                        use_distributed_optimizer=True), [wrapped])
    return wrapped, opt


class _Params:
    """The wrapper as handle_swiglu_in_state_dict looks its params up. It asks the model for
    "module." + a model key (the wrapper's "module.module.<name>": found) and for an optimizer
    key less its first "module." (the optimizer names params as the wrapper's named_parameters
    does, "module.module.<name>", so it asks for "module.<name>", which the wrapper lacks:
    megatron-core 0.16 fails there on the wrapper itself). Both resolve to the model's <name>."""

    def __init__(self, wrapped):
        self.wrapped, self.config = wrapped, wrapped.config

    def get_parameter(self, name):
        while name.startswith("module."):
            name = name[len("module."):]
        return self.wrapped.get_parameter("module.module." + name)


def state_dict(wrapped, opt, args=None):
    """What training's save (or load) hands dcp: generate_state_dict's fsdp_dtensor entries,
    then preprocess_fsdp_dtensor_state_dict."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import \
        preprocess_state_dict_for_uneven_dtensor
    from megatron.core.transformer.fsdp_dtensor_checkpoint import (
        handle_fp8_extra_state_case, handle_swiglu_in_state_dict)
    sd = {"model": wrapped.state_dict_for_save_checkpoint(),
          "optimizer": opt.sharded_state_dict(
              {}, metadata={"distrib_optim_sharding_type": "fsdp_dtensor"})}
    if args is not None:
        sd.update({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                   "opt_param_scheduler": {"max_lr": 1e-3, "num_steps": 640},
                   "num_floating_point_operations_so_far": 12345})
    handle_fp8_extra_state_case(sd["model"])
    sd["model"], sd["optimizer"] = handle_swiglu_in_state_dict(
        _Params(wrapped), sd["model"], sd["optimizer"])
    preprocess_state_dict_for_uneven_dtensor(sd)
    return sd


def set_states(opt):
    """Adam's state created by torch (a zero-gradient step, as the optimizer's own load does),
    then set to known functions of each main weight."""
    opt._init_optimizer_states_with_dummy_values()
    state = opt.optimizer.state
    # in the params' order on every rank, as a training step leaves it (the uneven DTensors'
    # chunk metadata is gathered key by key)
    ordered = [(p, state.pop(p, {})) for g in opt.optimizer.param_groups for p in g["params"]]
    state.update(ordered)
    for p, st in ordered:
        if not st:
            # An empty local shard, which the zero-gradient step skips: its (empty) state as
            # torch's AdamW creates it, so that every rank holds every key (the swiglu
            # split's collectives run per key).
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        with torch.no_grad():
            st["exp_avg"].copy_(p * 0.5 + 1)
            st["exp_avg_sq"].copy_(p * p + 0.25)
        st["step"] = torch.tensor(float(ITERATION))


def init(rank, world, port, tp):
    mtd.init(rank, world, port, tp, 1, 1)
    # Tensor.type() left as torch has it: Megatron-FSDP's optimizer never asks it for CUDA.
    mcore_cpu.shims(current_device=0, cuda_type=False)


def save_rank(rank, world, port, a):
    import torch.distributed.checkpoint as dcp
    init(rank, world, port, a.tp)
    torch.manual_seed(a.seed)  # the same global model on every rank (CPU initialization)
    wrapped, opt = build(a.tp)
    set_states(opt)
    S = mtd.SIZE
    args = argparse.Namespace(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=a.dp, world_size=world,
        num_layers=S["layers"], hidden_size=S["hidden"], ffn_hidden_size=S["ffn"],
        num_attention_heads=S["heads"], group_query_attention=True,
        num_query_groups=S["groups"], kv_channels=S["hidden"] // S["heads"], swiglu=True,
        normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, add_bias_linear=False,
        make_vocab_size_divisible_by=128, vocab_size=mtd.TRUE_VOCAB - 1,
        tokenizer_type="NullTokenizer", padded_vocab_size=mtd.padded_vocab(a.tp),
        max_position_embeddings=64, seq_length=64, bf16=True, fp16=False,
        params_dtype=torch.bfloat16, transformer_impl="local", ckpt_format="fsdp_dtensor",
        use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
        use_distributed_optimizer=True, optimizer="adam", iteration=ITERATION,
        consumed_train_samples=640, rank=rank, local_rank=rank % 8)
    sd = state_dict(wrapped, opt, args)
    # get_rng_state("fsdp_dtensor"): a list of each rank's generators (no ShardedObject for
    # this format), which dcp.save flattens into uint8 tensor keys; the rerun state machine's.
    import random
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    sd["rng_state"] = [{"random_rng_state": random.getstate(),
                        "np_rng_state": np.random.get_state(),
                        "torch_rng_state": torch.get_rng_state(),
                        "cuda_rng_state": torch.get_rng_state(),  # (no CUDA here)
                        "rng_tracker_states": get_cuda_rng_tracker().get_states()}]
    sd["rerun_state_machine"] = {"mode": "disabled", "rerun_requested": False}
    iter_dir = pathlib.Path(a.out) / f"iter_{ITERATION:07d}"
    if rank == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(iter_dir)))
    torch.distributed.barrier()
    if rank == 0:
        (pathlib.Path(a.out) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    torch.distributed.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("save",))
    ap.add_argument("--out", required=True)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--size", help="hidden,layers,ffn,heads,groups (default 32,4,48,4,2)")
    a = ap.parse_args()
    a.tp = 1
    if a.size:
        mtd.SIZE.update(zip(("hidden", "layers", "ffn", "heads", "groups"),
                            map(int, a.size.split(","))))
    import torch.multiprocessing as mp
    mtd.preload()
    world = a.tp * a.dp
    import oracle_checks
    ctx = mp.start_processes(save_rank, args=(world, mtd.free_port(), a), nprocs=world,
                             join=False, start_method="fork")
    oracle_checks.join_context(ctx, 300, "Megatron-FSDP save")  # a rank still running: killed, failed


if __name__ == "__main__":
    main()
