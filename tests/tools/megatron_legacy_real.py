"""Megatron-LM legacy checkpoints (--ckpt-format torch) saved and loaded by the real megatron-core
(the tests' PyPI environment: run with its python), on CPU with gloo, one forked process per rank.

  megatron_legacy_real.py save --out SAVE_DIR --view VIEW_DIR --tp T --pp P [--vpp V] [--dp D]
                               [--ep E] [--optim float16|distributed] [--variant NAME]
  megatron_legacy_real.py load --ckpt SAVE_DIR --view VIEW_DIR --tp T --pp P [--vpp V] [--dp D]
                               [--ep E] [--optim float16|distributed] [--variant NAME]
  megatron_legacy_real.py compare SOURCE_VIEW TARGET_VIEW
  megatron_legacy_real.py compare-truth TRUTH_PT TARGET_VIEW   (make_moe_torch_dist.py's truth)

The model: megatron-core's GPTModel of get_gpt_layer_local_spec() (GQA 4 heads / 2 groups, SwiGLU,
RMSNorm, bf16, rotary embeddings, 4 layers, hidden 32, ffn 48, true vocabulary 100 =
NullTokenizer --vocab-size 99, padded for the TP as Megatron pads it), as training builds it:
Float16Module, megatron-core's DistributedDataParallel (one bucket per chunk, chunks after the
first unbucketed, as training's get_model), megatron-core's optimizer from get_megatron_optimizer
(bf16: Float16OptimizerWithFloat16Params over torch's Adam, or with --optim distributed the
DistributedOptimizer). VARIANTS: no linear biases and an untied output layer, or biases and tied
embeddings (the last stage's copy of the word embeddings with PP > 1).

Mixture of experts (--variant moe_mixtral | moe_deepseek; no VPP): make_moe_torch_dist.py's models
(its config and get_gpt_decoder_block_spec, local spec: 2 layers, 4 routed experts of ffn 8, top-2,
SequentialMLP; deepseek: a dense first layer, then a MoE layer with a shared expert and the
sigmoid router's fp32 expert bias), every (layer, global expert) made distinct, at --ep E (ETP =
TP: the legacy loader reads one folder per (tp, pp, ep)). megatron-core's optimizer is then a
ChainedOptimizer (dense half over DP, expert half over expert DP). What Megatron-LM's
save_checkpoint writes for it: mp_rank_TT[_PPP]_EEE/ (the EP suffix with EP > 1) from the ranks
of expert-DP rank 0, each holding the dense params and its EP rank's local experts
(...mlp.experts.local_experts.<i>..., i local), "optimizer" the list of both halves' state dicts,
and distrib_optim.pt the list [dense state or None, expert state or None] (each half's DP rank 0
writes its state: the dense one in the EP rank 0 folders only).

save: two real optimizer steps (optimizer.step(): fp32 main params, Adam, grad clipping, the
distributed optimizer's param all-gather) from gradients set to a function of each param's values
(the same on every replica), then the files Megatron-LM's save_checkpoint writes for
--ckpt-format torch (megatron/training/checkpointing.py: generate_state_dict and
get_checkpoint_name): iter_0000002/mp_rank_TT[_PPP]/model_optim_rng.pt from DP rank 0 of each
(tp, pp) with args, checkpoint_version 3.0, iteration, model | model0.., the optimizer's
state_dict(), opt_param_scheduler, rng_state, num_floating_point_operations_so_far; with the
distributed optimizer its save_parameter_state's distrib_optim.pt beside it; the tracker last.

CPU shims: mcore_cpu.shims() (CUDA streams as no-ops, "cuda" tensors made on the CPU, the current
device "cpu", Tensor.type() naming CPU tensors as CUDA ones: the optimizers' constructors check it;
and the Adam step kept on load: megatron-core 0.16 without Apex / Transformer Engine fails to
load_parameter_state its own distrib_optim.pt, KeyError 'step').

load: builds the same at the target layout and loads as Megatron-LM's load_checkpoint does:
each rank's model_optim_rng.pt, the args' TP / PP checked (check_checkpoint_args), every model
chunk's GPTModel.load_state_dict(strict=True), the optimizer's load_state_dict of the "optimizer"
entry and, with the distributed optimizer, load_parameter_state of distrib_optim.pt.

save and load then write the VIEW: what the real framework holds, in global coordinates given by
megatron-core's own sharded_state_dict metadata (keys, global shapes and offsets; factories
applied): every model tensor of every rank, the fp32 main params and Adam moments from the
optimizer itself (Float16OptimizerWithFloat16Params' sharded_state_dict, or the
DistributedOptimizer's own per-param shard map, gathered over DP), every Adam step, the param
groups' hyper-parameters. compare assembles both views into global tensors (replicas that
disagree are a failure) and requires every source value below the true vocabulary equal bit for
bit in the target. No ucp code and no tests/tools/megatron_spec.py is involved.
"""
import argparse
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import mcore_cpu  # noqa: E402
import megatron_torch_dist as mtd  # noqa: E402

warnings.filterwarnings("ignore")
STEPS = 2
LR = 7.5e-4  # the param groups' lr at the save (what a scheduler would have set)
VARIANTS = {"gqa_swiglu_untied": {"bias": False, "tied": False},
            "gqa_swiglu_bias_tied": {"bias": True, "tied": True},
            # Mixture of experts (make_moe_torch_dist.py's models: 2 layers, 4 routed experts of
            # ffn 8, top-2, SequentialMLP): every layer MoE, or a dense first layer then a MoE
            # layer with a shared expert and the sigmoid router's expert bias.
            "moe_mixtral": {"bias": False, "tied": False, "moe": "mixtral"},
            "moe_deepseek": {"bias": False, "tied": False, "moe": "deepseek"}}


def vocab_divisor(variant):
    """Megatron's --make-vocab-size-divisible-by of the variant's args: 64 for the MoE variants,
    as make_moe_torch_dist.py's saves say (their 128 rows at TP 1 and 2), else Megatron's 128."""
    return 64 if VARIANTS[variant].get("moe") else 128


def init(rank, world, port, tp, pp, vpp, ep=1, etp=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mcore_cpu.shims()
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp or tp)


def moe_model(a):
    """The MoE variants' GPTModel of this rank (make_moe_torch_dist.py's config and layer spec,
    the vocabulary padded for the TP as Megatron pads it: a.vocab rows, else this tool's
    padding), each (layer, global expert) made distinct, in bf16 as Float16Module leaves it
    but the router's expert bias in fp32 (Megatron keeps it so)."""
    import make_moe_torch_dist as moe
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    cfg = moe.config(argparse.Namespace(variant=VARIANTS[a.variant]["moe"], tp=a.tp, pp=a.pp,
                                        ep=a.ep, etp=a.etp or a.tp))
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    m = GPTModel(config=cfg, transformer_layer_spec=spec,
                 vocab_size=getattr(a, "vocab", None)
                 or mtd.padded_vocab(a.tp, vocab_divisor(a.variant)),
                 max_sequence_length=64, pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage(),
                 share_embeddings_and_output_weights=False, position_embedding_type="rope")
    moe.distinct_experts(m, a.seed)
    return cfg, m


def build(a):
    """(GPTModel chunks, DDP-wrapped chunks, optimizer) of this rank, as training builds them."""
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    v = VARIANTS[a.variant]
    S = mtd.SIZE
    if v.get("moe"):
        cfg, m = moe_model(a)
        bias = {n: b.clone() for n, b in m.named_buffers() if n.endswith("expert_bias")}
        wrapped_model = Float16Module(cfg, m)
        for n, b in bias.items():
            m.get_buffer(n).data = b
        dist = a.optim == "distributed"
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=dist,
                                            grad_reduce_in_fp32=True)
        wrapped = [DistributedDataParallel(cfg, ddp, wrapped_model)]
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.1,
                            adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=True,
                            params_dtype=torch.bfloat16, use_distributed_optimizer=dist,
                            clip_grad=1.0), wrapped)
        return [m], wrapped, opt
    cfg = TransformerConfig(
        num_layers=S["layers"], hidden_size=S["hidden"], num_attention_heads=S["heads"],
        num_query_groups=S["groups"], ffn_hidden_size=S["ffn"], use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=v["bias"], bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=a.vpp if a.vpp > 1 else None)
    models = []
    for c in range(a.vpp):
        kw = {"vp_stage": c} if a.vpp > 1 else {}
        stage = {"ignore_virtual": False, **kw} if a.vpp > 1 else {}
        models.append(GPTModel(
            config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=mtd.padded_vocab(a.tp), max_sequence_length=64,
            pre_process=parallel_state.is_pipeline_first_stage(**stage),
            post_process=parallel_state.is_pipeline_last_stage(**stage),
            share_embeddings_and_output_weights=v["tied"], position_embedding_type="rope", **kw))
    dist = a.optim == "distributed"
    ddp = DistributedDataParallelConfig(use_distributed_optimizer=dist, grad_reduce_in_fp32=True)
    wrapped = [DistributedDataParallel(cfg, ddp, Float16Module(cfg, m), disable_bucketing=c > 0)
               for c, m in enumerate(models)]
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.1,
                        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, bf16=True,
                        params_dtype=torch.bfloat16, use_distributed_optimizer=dist,
                        clip_grad=1.0), wrapped)
    return models, wrapped, opt


def train(models, wrapped, opt):
    """STEPS real optimizer steps, the gradients a function of each param's values (every replica
    of a param, DP, TP or the tied embeddings' copy, gets the same)."""
    for g in opt.param_groups:
        g["lr"] = LR
    for step in range(STEPS):
        for w in wrapped:
            w.zero_grad_buffer()
        opt.zero_grad()
        for m in models:
            for p in m.parameters():
                p.main_grad.copy_(torch.sin(p.detach().float() * 3.0 + step))
        ok, _, _ = opt.step()
        assert ok, "the optimizer step was skipped"


def rank_dir(save, tp_rank, pp_rank, pp, ep_rank=0, ep=1, iteration=STEPS):
    """get_checkpoint_name's folder: mp_rank_TT[_PPP][_EEE] (the PP suffix with PP > 1, the EP
    suffix with EP > 1)."""
    name = f"mp_rank_{tp_rank:02d}"
    if pp > 1:
        name += f"_{pp_rank:03d}"
    if ep > 1:
        name += f"_{ep_rank:03d}"
    return pathlib.Path(save) / f"iter_{iteration:07d}" / name


def save_args(a, world):
    S = mtd.SIZE
    v = VARIANTS[a.variant]
    if v.get("moe"):
        import make_moe_torch_dist as moe
        M = moe.SIZE
        deepseek = v["moe"] == "deepseek"
        ns = save_args(argparse.Namespace(**dict(vars(a), variant="gqa_swiglu_untied")), world)
        ns.__dict__.update(
            num_layers=M["layers"], hidden_size=M["hidden"], ffn_hidden_size=M["ffn"],
            num_attention_heads=M["heads"], num_query_groups=M["groups"],
            kv_channels=M["hidden"] // M["heads"], expert_model_parallel_size=a.ep,
            expert_tensor_parallel_size=a.etp or a.tp, num_experts=M["experts"],
            moe_ffn_hidden_size=M["moe_ffn"], moe_router_topk=M["topk"],
            moe_grouped_gemm=False, moe_layer_freq=[0, 1] if deepseek else 1,
            moe_shared_expert_intermediate_size=M["shared_ffn"] if deepseek else None,
            moe_router_enable_expert_bias=deepseek,
            make_vocab_size_divisible_by=vocab_divisor(a.variant),
            padded_vocab_size=mtd.padded_vocab(a.tp, vocab_divisor(a.variant)))
        return ns
    return argparse.Namespace(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=a.vpp if a.vpp > 1 else None,
        data_parallel_size=a.dp, world_size=world, num_layers=S["layers"],
        hidden_size=S["hidden"], ffn_hidden_size=S["ffn"], num_attention_heads=S["heads"],
        group_query_attention=True, num_query_groups=S["groups"],
        kv_channels=S["hidden"] // S["heads"], swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", untie_embeddings_and_output_weights=not v["tied"],
        add_bias_linear=v["bias"], make_vocab_size_divisible_by=128,
        vocab_size=mtd.TRUE_VOCAB - 1, tokenizer_type="NullTokenizer",
        padded_vocab_size=mtd.padded_vocab(a.tp), max_position_embeddings=64, seq_length=64,
        bf16=True, fp16=False, params_dtype=torch.bfloat16, transformer_impl="local",
        ckpt_format="torch", use_distributed_optimizer=a.optim == "distributed",
        accumulate_allreduce_grads_in_fp32=True, overlap_grad_reduce=False,
        ddp_bucket_size=None, optimizer="adam", lr=1e-3, min_lr=1e-5, weight_decay=0.1,
        adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=1.0, iteration=STEPS,
        consumed_train_samples=STEPS * 32, train_iters=100, rank=0, local_rank=0)


def save_rank(rank, world, port, a):
    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    init(rank, world, port, a.tp, a.pp, a.vpp, a.ep, a.etp)
    torch.manual_seed(a.seed)  # the same global model on every rank (CPU initialization)
    models, wrapped, opt = build(a)
    train(models, wrapped, opt)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    path = rank_dir(a.out, tp_rank, pp_rank, a.pp,
                    parallel_state.get_expert_model_parallel_rank(), a.ep)
    path.mkdir(parents=True, exist_ok=True)
    if a.optim == "distributed":
        # Every (expert) DP rank takes part in the gathers; a ChainedOptimizer (MoE: dense and
        # expert halves) writes [dense state or None, expert state or None] on the ranks that
        # are DP rank 0 of either half's group.
        opt.save_parameter_state(str(path / "distrib_optim.pt"))
    # save_checkpoint: the ranks of expert-DP rank 0 write model_optim_rng.pt (with EP 1 the
    # DP rank 0 ones; with MoE each EP rank's local experts and the dense params).
    if parallel_state.get_expert_data_parallel_rank() == 0:
        sd = {"args": save_args(a, world), "checkpoint_version": 3.0, "iteration": STEPS}
        for c, m in enumerate(wrapped):
            sd["model" if len(wrapped) == 1 else f"model{c}"] = \
                m.state_dict_for_save_checkpoint()
        sd["optimizer"] = opt.state_dict()
        sd["opt_param_scheduler"] = {"max_lr": 1e-3, "min_lr": 1e-5, "lr_warmup_steps": 0,
                                     "num_steps": STEPS * 32, "lr_decay_steps": 3200,
                                     "lr_decay_style": "cosine"}
        sd["rng_state"] = [{"random_rng_state": random.getstate(),
                            "np_rng_state": np.random.get_state(),
                            "torch_rng_state": torch.get_rng_state(),
                            "cuda_rng_state": torch.get_rng_state(),  # (no CUDA here)
                            "rng_tracker_states": mrandom.get_cuda_rng_tracker().get_states()}]
        sd["num_floating_point_operations_so_far"] = 12345
        torch.save(sd, path / "model_optim_rng.pt")
    torch.distributed.barrier()
    if rank == 0:
        (pathlib.Path(a.out) / "latest_checkpointed_iteration.txt").write_text(str(STEPS))
    write_view(a, models, opt, rank)
    torch.distributed.destroy_process_group()


def load_rank(rank, world, port, a):
    from megatron.core import parallel_state
    init(rank, world, port, a.tp, a.pp, a.vpp, a.ep, a.etp)
    tracker = pathlib.Path(a.ckpt) / "latest_checkpointed_iteration.txt"
    assert tracker.read_text().strip() == str(a.iteration), \
        f"{tracker}: {tracker.read_text()!r}"
    path = rank_dir(a.ckpt, parallel_state.get_tensor_model_parallel_rank(),
                    parallel_state.get_pipeline_model_parallel_rank(), a.pp,
                    parallel_state.get_expert_model_parallel_rank(), a.ep, a.iteration)
    sd = torch.load(path / "model_optim_rng.pt", map_location="cpu", weights_only=False)
    args = sd["args"]
    if VARIANTS[a.variant].get("moe"):
        # The run's vocabulary as Megatron pads it for this TP (_vocab_size_with_padding: the
        # NullTokenizer's vocab_size + 1 rounded up to make_vocab_size_divisible_by x TP), from
        # the run's args, not from the padded_vocab_size ucp wrote: another tool's save
        # (make_moe_torch_dist.py's, divisible by 64) keeps its own padding.
        assert args.tokenizer_type == "NullTokenizer", args.tokenizer_type
        m = args.make_vocab_size_divisible_by * a.tp
        a.vocab = -(-(args.vocab_size + 1) // m) * m
    torch.manual_seed(a.seed + 1000)  # not the source's weights
    models, wrapped, opt = build(a)
    want_args = [("tensor_model_parallel_size", a.tp), ("pipeline_model_parallel_size", a.pp)]
    if VARIANTS[a.variant].get("moe"):
        want_args += [("expert_model_parallel_size", a.ep)]
    problems = [f"{path}: args.{k} {getattr(args, k, None)!r}, expected {want!r}"
                for k, want in want_args if getattr(args, k, None) != want]
    if sd.get("checkpoint_version") != 3.0 or sd.get("iteration") != a.iteration:
        problems.append(f"{path}: checkpoint_version {sd.get('checkpoint_version')!r}, "
                        f"iteration {sd.get('iteration')!r}")
    assert not problems, problems
    if len(models) == 1:
        models[0].load_state_dict(sd["model"], strict=True)
    else:
        for c, m in enumerate(models):
            m.load_state_dict(sd[f"model{c}"], strict=True)
    opt.load_state_dict(sd["optimizer"])
    if a.optim == "distributed":
        opt.load_parameter_state(str(path / "distrib_optim.pt"))
    write_view(a, models, opt, rank)
    torch.distributed.destroy_process_group()


def write_view(a, models, opt, rank):
    """VIEW/rank_R.pt: [(kind, key, global shape, global offset, tensor)] of this rank's model
    and optimizer ShardedTensors (megatron-core's metadata, factories applied), the Adam steps
    and the param groups' hyper-parameters."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    if len(models) == 1:
        msd = {"model": models[0].sharded_state_dict()}
    else:
        msd = {f"model{c}": m.sharded_state_dict() for c, m in enumerate(models)}
    chain = getattr(opt, "chained_optimizers", [opt])
    if a.optim == "distributed":
        osd = [distributed_view(o, msd) for o in chain]
    else:
        osd = [o.sharded_state_dict(msd) for o in chain]
    entries = []
    for kind, sd in [("model", msd)] + [("optimizer", o) for o in osd]:
        if sd is None:
            continue  # the distributed optimizer's view is on DP rank 0 only
        apply_factories(sd)
        for sh in nested_values(sd):
            if not isinstance(sh, ShardedTensor):
                continue
            assert sh.flattened_range is None, sh.key
            entries.append((kind, sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                            sh.data.detach().clone()))
    steps, groups = [], set()
    for o in chain:
        inner = o.optimizer
        steps += [float(s["step"]) for s in inner.state.values() if "step" in s]
        steps += [float(g["step"]) for g in inner.param_groups if "step" in g]
        groups |= {(round(g["lr"], 12), tuple(g["betas"]), g["eps"], g["weight_decay"],
                    g.get("wd_mult"), g.get("lr_mult")) for g in inner.param_groups}
    groups = sorted(groups)
    pathlib.Path(a.view).mkdir(parents=True, exist_ok=True)
    torch.save({"entries": entries, "steps": steps, "groups": groups},
               pathlib.Path(a.view) / f"rank_{rank}.pt")


def distributed_view(opt, msd):
    """The DistributedOptimizer's main params and Adam moments in model space, on DP rank 0
    (None elsewhere): each DP rank's part of each param as the optimizer itself maps it
    (_get_model_param_range_map, _get_main_param_and_optimizer_states), gathered over DP and
    shaped by the param's ShardedTensor (make_sharded_optimizer_tensor). Not megatron-core
    0.16's fully_reshardable gather: it places the state of a buffer's second bucket (the
    shared embedding's) at the padded offsets in the compacted buffer (its issue #504)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    mine = {p for buf in opt.buffers for p in buf.param_index_map}  # the same on every DP rank
    shs = [sh for sh in nested_values(msd) if isinstance(sh, (ShardedTensor, ShardedTensorFactory))
           and sh.data in mine]
    pieces = []
    for sh in shs:
        if sh.data not in opt.model_param_gbuf_map:
            pieces.append(None)  # no element of it on this DP rank
            continue
        r = opt._get_model_param_range_map(sh.data)["param"]
        tensors = opt._get_main_param_and_optimizer_states(sh.data)
        pieces.append((r.start, r.end, {k: tensors[k].detach().reshape(-1).clone()
                                        for k in ("param", "exp_avg", "exp_avg_sq")}))
    group = opt.data_parallel_group  # the expert half's: the expert-DP group
    every = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(every, pieces, group=group)
    if torch.distributed.get_rank(group) != 0:
        return None
    out = {}
    for i, sh in enumerate(shs):
        n = sh.data.numel()
        held = torch.zeros(n, dtype=torch.int32)
        full = {k: torch.zeros(n) for k in ("param", "exp_avg", "exp_avg_sq")}
        for rank_pieces in every:
            if rank_pieces[i] is None:
                continue
            start, end, tensors = rank_pieces[i]
            held[start:end] += 1
            for k, t in tensors.items():
                full[k][start:end] = t
        assert bool((held == 1).all()), f"{sh.key}: DP ranges do not cover it once"
        for k, t in full.items():
            out[f"{k}.{i}"] = make_sharded_optimizer_tensor(
                sh, t.reshape(sh.data.shape), prefix=f"optimizer.state.{k}")
    return out


def run(a, deadline_s=120):
    """Forks the world's ranks (megatron-core imported once, here); (ok, message). A rank still
    running at the deadline fails the run (every rank is killed)."""
    world = a.tp * a.pp * a.dp
    fn = {"save": save_rank, "load": load_rank}[a.mode]
    mtd.preload()
    if VARIANTS[a.variant].get("moe"):
        import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    import megatron.core.distributed  # noqa: F401
    import megatron.core.transformer.module  # noqa: F401
    import torch.multiprocessing as mp
    ctx = mp.start_processes(fn, args=(world, mtd.free_port(), a), nprocs=world, join=False,
                             start_method="fork")
    end = time.monotonic() + deadline_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > end:
                for p in ctx.processes:
                    if p.is_alive():
                        os.kill(p.pid, signal.SIGKILL)
                for p in ctx.processes:
                    p.join()
                return False, f"{a.mode}: a rank still ran after {deadline_s} s"
    except Exception as e:  # a rank raised or died (torch stops the others): a verdict
        return False, f"{a.mode}: {str(e)[-4000:]}"
    codes = [p.exitcode for p in ctx.processes]
    return all(c == 0 for c in codes), f"{a.mode}: exit codes {codes}"


def options(mode, tp, pp, vpp=1, dp=1, optim="float16", variant="gqa_swiglu_untied", seed=1,
            ep=1, etp=None, iteration=STEPS, **paths):
    """The arguments of a save or load; `iteration`: the checkpoint a load expects (another
    tool's save, e.g. make_moe_torch_dist.py's iteration 10, converted)."""
    a = argparse.Namespace(mode=mode, tp=tp, pp=pp, vpp=vpp, dp=dp, optim=optim,
                           variant=variant, seed=seed, ep=ep, etp=etp, iteration=iteration,
                           out=None, ckpt=None, view=None)
    for k, v in paths.items():
        setattr(a, k, str(v))
    return a


def assemble(view):
    """{(kind, key): global tensor}, {(kind, key): mask of the elements some rank holds}, the
    steps and groups of all ranks, and the problems (replicas that disagree)."""
    full, mask, steps, groups, problems = {}, {}, [], set(), []
    for f in sorted(pathlib.Path(view).glob("rank_*.pt")):
        v = torch.load(f, weights_only=False)
        steps += v["steps"]
        groups.update(v["groups"])
        for kind, key, shape, offset, data in v["entries"]:
            if kind == "optimizer":
                key = key.replace("optimizer.state.fp32_param.", "optimizer.state.param.")
            k = (kind, key)
            if k not in full:
                full[k] = torch.zeros(shape, dtype=data.dtype)
                mask[k] = torch.zeros(shape, dtype=torch.bool)
            if tuple(full[k].shape) != shape or full[k].dtype != data.dtype:
                problems.append(f"{key}: global {shape} {data.dtype} and "
                                f"{tuple(full[k].shape)} {full[k].dtype} on other ranks")
                continue
            box = tuple(slice(o, o + n) for o, n in
                        zip(offset, (1,) * (len(shape) - data.dim()) + tuple(data.shape)))
            d = data.reshape(full[k][box].shape)
            held = mask[k][box]
            if held.any() and not torch.equal(full[k][box][held], d[held]):
                problems.append(f"{key}: replicas differ at offset {offset} ({f.name})")
            full[k][box] = d
            mask[k][box] = True
    return full, mask, steps, groups, problems


VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")


def compare(source_view, target_view, min_values=1):
    """Every source value equal bit for bit in the target (rows below the true vocabulary of the
    vocabulary-parallel tensors), the same keys, every target element held by some rank, the
    steps and param groups equal. Returns (ok, report dict)."""
    src, src_mask, src_steps, src_groups, problems = assemble(source_view)
    dst, dst_mask, dst_steps, dst_groups, dst_problems = assemble(target_view)
    problems += [f"target: {p}" for p in dst_problems]
    if set(src) != set(dst):
        problems.append(f"keys only in the source: {sorted(set(src) - set(dst))[:8]}, "
                        f"only in the target: {sorted(set(dst) - set(src))[:8]}")
    checked = 0
    for k in sorted(set(src) & set(dst)):
        s, t = src[k], dst[k]
        if not bool(src_mask[k].all()) or not bool(dst_mask[k].all()):
            problems.append(f"{k[1]}: elements no rank holds")
        if any(k[1].endswith(n) for n in VOCAB_KEYS):
            s, t = s[:mtd.TRUE_VOCAB], t[:mtd.TRUE_VOCAB]
        if s.shape != t.shape or s.dtype != t.dtype:
            problems.append(f"{k[1]}: {tuple(t.shape)} {t.dtype}, "
                            f"the source's {tuple(s.shape)} {s.dtype}")
            continue
        if not torch.equal(s.view(torch.uint8) if s.dtype == torch.bool else s, t):
            n = int((s != t).sum())
            problems.append(f"{k[1]}: {n} of {s.numel()} values differ")
        checked += s.numel()
    if not src_steps or set(src_steps) != {float(STEPS)}:
        problems.append(f"source steps {sorted(set(src_steps))}")
    if not dst_steps or set(dst_steps) != set(src_steps):
        problems.append(f"target steps {sorted(set(dst_steps))}, source's "
                        f"{sorted(set(src_steps))}")
    if dst_groups != src_groups:
        problems.append(f"param groups {sorted(dst_groups)}, source's {sorted(src_groups)}")
    if checked < min_values:
        problems.append(f"only {checked} values compared (at least {min_values} expected)")
    kinds = sorted({k[1].split(".")[2] if k[0] == "optimizer" else "model" for k in src})
    return not problems, {"ok": not problems, "checked": checked, "keys": len(src),
                          "kinds": kinds, "steps": len(dst_steps), "problems": problems[:20]}


def view_tensors(view):
    """The assembled VIEW under make_moe_torch_dist.py's truth names: {"model": {name: tensor},
    "param" | "exp_avg" | "exp_avg_sq": {name: tensor}} (a key stacked over layers split into
    decoder.layers.<l>.…, an expert key into …mlp.experts.<e>.…), the steps, and the problems
    assemble found."""
    import re
    full, mask, steps, _, problems = assemble(view)
    out = {}
    for (kind, key), t in full.items():
        if not bool(mask[(kind, key)].all()):
            problems.append(f"{key}: elements no rank holds")
        group = "model"
        if kind == "optimizer":
            group, key = key[len("optimizer.state."):].split(".", 1)
        items = [(key, t)]
        if ".mlp.experts.experts." in key:
            head, rest = key.split(".mlp.experts.experts.")
            if re.fullmatch(r"decoder\.layers\.\d+", head):
                items = [(f"{head}.mlp.experts.{e}.{rest}", t[e]) for e in range(t.shape[0])]
            else:
                items = [(f"decoder.layers.{l}.mlp.experts.{e}.{rest}", t[l, e])
                         for l in range(t.shape[0]) for e in range(t.shape[1])]
        elif key.startswith("decoder.layers.") and not re.match(r"decoder\.layers\.\d+\.", key):
            rest = key[len("decoder.layers."):]
            items = [(f"decoder.layers.{l}.{rest}", t[l]) for l in range(t.shape[0])]
        for name, x in items:
            out.setdefault(group, {})[name] = x
    return out, steps, problems


def compare_truth(truth_path, view, min_values=1):
    """Every value of make_moe_torch_dist.py's truth (the source's model and fully_reshardable
    optimizer state, gathered from the saving ranks' memory) equal bit for bit in the target
    VIEW (the vocabulary rows the truth has), the same names, every Adam step the truth's.
    Returns (ok, report dict)."""
    truth = torch.load(truth_path, weights_only=False)
    got, steps, problems = view_tensors(view)
    want = {"model": truth["model"], **truth.get("optimizer", {})}
    checked = 0
    for group, tensors in want.items():
        have = got.get(group, {})
        if set(have) != set(tensors):
            problems.append(f"{group}: only in the truth {sorted(set(tensors) - set(have))[:6]}, "
                            f"only in the target {sorted(set(have) - set(tensors))[:6]}")
        for name, s in tensors.items():
            t = have.get(name)
            if t is None:
                continue
            if any(name.endswith(n) for n in VOCAB_KEYS) and t.shape[0] >= s.shape[0]:
                t = t[:s.shape[0]]
            if s.shape != t.shape or s.dtype != t.dtype:
                problems.append(f"{group} {name}: {tuple(t.shape)} {t.dtype}, the truth's "
                                f"{tuple(s.shape)} {s.dtype}")
            elif not torch.equal(s, t):
                problems.append(f"{group} {name}: {int((s != t).sum())} of {s.numel()} values "
                                "differ")
            checked += s.numel()
    if not steps or set(steps) != set(truth["steps"]):
        problems.append(f"target steps {sorted(set(steps))}, the truth's {truth['steps']}")
    if checked < min_values:
        problems.append(f"only {checked} values compared (at least {min_values} expected)")
    return not problems, {"ok": not problems, "checked": checked, "groups": sorted(want),
                          "steps": len(steps), "problems": problems[:20]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("save", "load", "compare", "compare-truth"))
    ap.add_argument("views", nargs="*", help="compare: SOURCE_VIEW TARGET_VIEW")
    ap.add_argument("--out")
    ap.add_argument("--ckpt")
    ap.add_argument("--view")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1, help="expert parallel (MoE variants)")
    ap.add_argument("--etp", type=int, default=None, help="expert tensor parallel (default: --tp)")
    ap.add_argument("--optim", choices=("float16", "distributed"), default="float16")
    ap.add_argument("--variant", choices=sorted(VARIANTS), default="gqa_swiglu_untied")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--iteration", type=int, default=STEPS, help="load: the expected iteration")
    a = ap.parse_args()
    if a.mode in ("compare", "compare-truth"):
        ok, report = (compare if a.mode == "compare" else compare_truth)(*a.views)
        print(json.dumps(report))
    else:
        ok, message = run(a)
        print(message, file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
