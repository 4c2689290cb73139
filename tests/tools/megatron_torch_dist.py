"""Megatron-core torch_dist checkpoints saved and loaded by the real megatron-core (the tests' PyPI
environment: run with its python), on CPU with gloo, one process per rank.

  megatron_torch_dist.py --out DIR        the test cases: DIR/<case>/ a save folder each
                                          (CASES below)
  megatron_torch_dist.py save --out SAVE_DIR --tp T --pp P [--dp D] [--vpp V] [--no-optimizer]
                              [--impl local|transformer_engine] [--seed S]
  megatron_torch_dist.py load --ckpt SAVE_DIR --source SRC_ITER_DIR --tp T --pp P [--dp D]
                              [--vpp V] [--no-optimizer]

The model: a GPTModel of get_gpt_layer_local_spec() (GQA 4 heads / 2 groups, SwiGLU, RMSNorm, no
linear biases, bf16, untied output layer, rotary embeddings, 4 layers, hidden 32, ffn 48, true
vocabulary 100 = NullTokenizer --vocab-size 99, padded for the TP as Megatron pads it).

save: the state Megatron's training saves with --ckpt-format torch_dist
--use-distributed-optimizer --dist-ckpt-optim-fully-reshardable: model.sharded_state_dict(), the
distributed optimizer's fully_reshardable state built as DistributedOptimizer.
sharded_param_state_fully_reshardable builds it (make_sharded_optimizer_tensor of every model
ShardedTensor / factory with the 'optimizer.state.{param,exp_avg,exp_avg_sq}' prefixes; fp32 data
drawn from a seeded generator: Megatron's DistributedOptimizer needs CUDA), the optimizer's
param_groups and param_state_sharding_type, rng_state ShardedObjects, args, iteration 10,
content_metadata; dist_checkpointing.save, then the tracker.

load: builds the model at the given layout, loads model + optimizer + rng with
dist_checkpointing.load into model.sharded_state_dict() (factories and all), then
model.load_state_dict(strict=True); then checks every local shard of every model and optimizer
ShardedTensor (factories applied) against the global tensors torch's own dcp_to_torch_save reads
from SRC_ITER_DIR (rows below the true vocabulary; padding rows must be zero or the source's).
Prints one JSON line {"ok": bool, "checked": n, "mismatches": [...]} per rank; exits 1 on any
mismatch.
"""
import argparse
import json
import os
import pathlib
import socket
import sys
import tempfile
import warnings

import torch
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")
TRUE_VOCAB = 100
STATES = ("param", "exp_avg", "exp_avg_sq")
# case: (tp, pp, dp, vpp, optimizer)
CASES = {"tp2_pp2_dp1": (2, 2, 1, 1, True), "tp1_pp2_dp2_vpp2_noopt": (1, 2, 2, 2, False)}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_shims():
    # Megatron's save path synchronizes CUDA and builds a status tensor on the current device.
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def padded_vocab(tp, div=128):
    m = div * tp
    return (TRUE_VOCAB + m - 1) // m * m


def build(tp, pp, vpp):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(
        num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, use_cpu_initialization=True, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, normalization="RMSNorm", add_bias_linear=False,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)
    models = []
    for v in range(vpp):
        kw = {}
        if vpp > 1:
            kw["vp_stage"] = v
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kw) \
            if vpp > 1 else parallel_state.is_pipeline_first_stage()
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kw) \
            if vpp > 1 else parallel_state.is_pipeline_last_stage()
        models.append(GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=padded_vocab(tp), max_sequence_length=64, pre_process=pre,
            post_process=post, share_embeddings_and_output_weights=False,
            position_embedding_type="rope", **kw))
    # Training wraps the model in Float16Module, which casts every param (the
    # local spec's norms are built in fp32) to bf16.
    return [m.to(torch.bfloat16) for m in models]


def model_sd(models):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def optimizer_sd(msd, gen):
    """The fully_reshardable optimizer state of every model ShardedTensor / factory."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    out = {}
    for i, sh in enumerate(nested_values(msd)):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            continue
        for state in STATES:
            data = torch.empty(sh.data.shape, dtype=torch.float32)
            if gen is not None:
                data = torch.randn(sh.data.shape, generator=gen, dtype=torch.float32)
            out[f"{state}.{i}.{sh.key}"] = make_sharded_optimizer_tensor(
                sh, data, prefix=f"optimizer.state.{state}")
    return out


def rng_object(tp, pp, dp_rank):
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    state = [{"random_rng_state": None, "np_rng_state": None,
              "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": None,
              "rng_tracker_states": {}}]
    return ShardedObject("rng_state", state, (pp, tp),
                         (parallel_state.get_pipeline_model_parallel_rank(),
                          parallel_state.get_tensor_model_parallel_rank()), replica_id=dp_rank)


def init(rank, world, port, tp, pp, vpp):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    cpu_shims()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None)


def save_rank(rank, world, port, a):
    init(rank, world, port, a.tp, a.pp, a.vpp)
    from megatron.core import dist_checkpointing, parallel_state
    torch.manual_seed(a.seed)  # the same global model on every rank (CPU initialization)
    models = build(a.tp, a.pp, a.vpp)
    sd = model_sd(models)
    dp_rank = parallel_state.get_data_parallel_rank()
    gen = torch.Generator().manual_seed(a.seed * 1000 + rank)
    args = argparse.Namespace(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=a.vpp if a.vpp > 1 else None,
        data_parallel_size=a.dp, world_size=world, num_layers=4, hidden_size=32,
        ffn_hidden_size=48, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=8, swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        add_bias_linear=False, make_vocab_size_divisible_by=128, vocab_size=TRUE_VOCAB - 1,
        tokenizer_type="NullTokenizer", padded_vocab_size=padded_vocab(a.tp),
        max_position_embeddings=64, seq_length=64, bf16=True, fp16=False,
        params_dtype=torch.bfloat16, transformer_impl=a.impl, ckpt_format="torch_dist",
        use_distributed_optimizer=not a.no_optimizer,
        dist_ckpt_optim_fully_reshardable=not a.no_optimizer, optimizer="adam",
        iteration=10, consumed_train_samples=640, rank=rank, local_rank=rank % 8)
    sd.update({"args": args, "checkpoint_version": 3.0, "iteration": 10,
               "rng_state": rng_object(a.tp, a.pp, dp_rank),
               "num_floating_point_operations_so_far": 12345})
    content = {"distrib_optim_sharding_type": "fully_reshardable",
               "distrib_optim_fully_reshardable_mem_efficient": False,
               "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if not a.no_optimizer:
        group = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1,
                 "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                 "differentiable": False, "fused": None, "step": 10}
        groups = [dict(group, wd_mult=1.0, lr_mult=1.0, is_expert_parallel=False,
                       is_decoupled_lr=False),
                  dict(group, wd_mult=0.0, lr_mult=1.0, is_expert_parallel=False,
                       is_decoupled_lr=False)]
        sd["optimizer"] = {"optimizer": {"param_groups": groups},
                           "param_state": optimizer_sd(sd, gen),
                           "param_state_sharding_type": "fully_reshardable"}
        sd["opt_param_scheduler"] = {"max_lr": 1e-3, "num_steps": 640}
    iter_dir = pathlib.Path(a.out) / "iter_0000010"
    if rank == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, str(iter_dir), content_metadata=content)
    torch.distributed.barrier()
    if rank == 0:
        (pathlib.Path(a.out) / "latest_checkpointed_iteration.txt").write_text("10")
    torch.distributed.destroy_process_group()


def global_tensors(src_iter_dir):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as t:
        out = pathlib.Path(t) / "all.pt"
        dcp_to_torch_save(src_iter_dir, out)
        return torch.load(out, weights_only=False)


def check_shard(sh, full, mismatches, what):
    g = full.get(sh.key)
    if g is None:
        mismatches.append(f"{what} {sh.key}: not in the source checkpoint")
        return
    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    sl = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, shape))
    got = sh.data.reshape(shape)
    vocab = sh.key.endswith(("word_embeddings.weight", "output_layer.weight"))
    if vocab:  # rows below the true vocabulary are the model's; the rest padding
        rows = max(0, min(TRUE_VOCAB, sl[0].stop) - sl[0].start)
        got, sl = got[:rows], (slice(sl[0].start, sl[0].start + rows),) + sl[1:]
    want = g[sl]
    if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
        mismatches.append(f"{what} {sh.key} at {tuple(sh.global_offset)}: differs")


def load_rank(rank, world, port, a):
    init(rank, world, port, a.tp, a.pp, a.vpp)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    torch.manual_seed(999)  # other values than the checkpoint's
    models = build(a.tp, a.pp, a.vpp)
    sd = model_sd(models)
    sd["rng_state"] = rng_object(a.tp, a.pp, parallel_state.get_data_parallel_rank())
    if not a.no_optimizer:
        sd["optimizer"] = {"param_state": optimizer_sd(model_sd(models), None)}
    iter_dir = pathlib.Path(a.ckpt) / "iter_0000010"
    loaded = dist_checkpointing.load(sd, str(iter_dir))
    for i, m in enumerate(models):
        m.load_state_dict(loaded["model" if len(models) == 1 else f"model{i}"], strict=True)
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    full = global_tensors(a.source)
    mismatches, checked = [], 0
    # The model's parameters now, as shards (factories applied).
    after = model_sd(models)
    apply_factories(after)
    for sh in nested_values(after):
        if isinstance(sh, ShardedTensor):
            check_shard(sh, full, mismatches, "model")
            checked += 1
    if not a.no_optimizer:
        osd = {"optimizer": {"param_state": optimizer_sd(model_sd(models), None)}}
        apply_factories(osd)
        dist_checkpointing.load(osd, str(iter_dir))
        for sh in nested_values(osd):
            if isinstance(sh, ShardedTensor):
                check_shard(sh, full, mismatches, "optimizer")
                checked += 1
        groups = common["optimizer"]["optimizer"]["param_groups"]
        if len(groups) != 2 or common["optimizer"]["param_state_sharding_type"] != \
                "fully_reshardable":
            mismatches.append(f"optimizer common state: {common['optimizer']}")
    cm = common.get("content_metadata", {})
    if not a.no_optimizer and cm.get("distrib_optim_sharding_type") != "fully_reshardable":
        mismatches.append(f"content_metadata {cm}")
    if common.get("iteration") != 10:
        mismatches.append(f"iteration {common.get('iteration')}")
    # One write (atomic on a pipe below 4 KiB), so ranks' lines never mix.
    line = json.dumps({"rank": rank, "ok": not mismatches, "checked": checked,
                       "mismatches": [m[:150] for m in mismatches[:10]]})
    os.write(1, (line + "\n").encode())
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if mismatches:
        sys.exit(1)


def run(a):
    world = a.tp * a.pp * a.dp
    fn = save_rank if a.mode == "save" else load_rank
    ctx = mp.start_processes(fn, args=(world, free_port(), a), nprocs=world, join=False,
                             start_method="fork")
    while not ctx.join():
        pass
    return all(p.exitcode == 0 for p in ctx.processes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", choices=("cases", "save", "load"), default="cases")
    ap.add_argument("--out")
    ap.add_argument("--ckpt")
    ap.add_argument("--source")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--no-optimizer", action="store_true")
    ap.add_argument("--impl", default="local")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.mode != "cases":
        sys.exit(0 if run(a) else 1)
    out = pathlib.Path(a.out)
    for name, (tp, pp, dp, vpp, opt) in CASES.items():
        c = argparse.Namespace(**vars(a))
        c.mode, c.out, c.tp, c.pp, c.dp, c.vpp = "save", str(out / name), tp, pp, dp, vpp
        c.no_optimizer = not opt
        if not run(c):
            sys.exit(f"saving {name} failed")
        print("saved", name, flush=True)


if __name__ == "__main__":
    main()
