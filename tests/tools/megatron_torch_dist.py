"""Megatron-core torch_dist checkpoints saved and loaded by the real megatron-core (the tests' PyPI
environment: run with its python), on CPU with gloo, one process per rank.

  megatron_torch_dist.py --out DIR        the test cases: DIR/<case>/ a save folder each
                                          (CASES below)
  megatron_torch_dist.py save --out SAVE_DIR --tp T --pp P [--dp D] [--vpp V] [--no-optimizer]
                              [--impl local|transformer_engine] [--seed S]
  megatron_torch_dist.py load --ckpt SAVE_DIR --source SRC_ITER_DIR --tp T --pp P [--dp D]
                              [--vpp V] [--no-optimizer]
  megatron_torch_dist.py hf --source SRC_ITER_DIR --hf HF_DIR
                              the source's logits (Megatron's forward) equal those of the
                              transformers folder (LlamaForCausalLM.from_pretrained)

The model: a GPTModel of get_gpt_layer_local_spec() (GQA 4 heads / 2 groups, SwiGLU, RMSNorm, no
linear biases, bf16, untied output layer, rotary embeddings, 4 layers, hidden 32, ffn 48, true
vocabulary 100 = NullTokenizer --vocab-size 99, padded for the TP as Megatron pads it).

save: the state Megatron's training saves with --ckpt-format torch_dist
--use-distributed-optimizer: the model wrapped in megatron-core's real DistributedDataParallel,
get_megatron_optimizer's real DistributedOptimizer over it (on CPU: tests/tools/mcore_cpu.py),
REAL_STEPS real Adam steps, then model.sharded_state_dict() and the optimizer's own
sharded_state_dict in the form --optim names (fully_reshardable, dp_reshardable,
dp_zero_gather_scatter: training's metadata, distrib_optim_sharding_type), rng_state
ShardedObjects, args, iteration 10, content_metadata; dist_checkpointing.save, then the tracker.
A case in TWINS saves the same trained state in other forms too. --optim non_distributed: the
optimizer without --use-distributed-optimizer, the real Float16OptimizerWithFloat16Params (after
the same real steps) and its own sharded_state_dict, which `load --optim non_distributed` loads
back into the real one through its load_state_dict.

load: builds the model at the given layout (with the real DDP and DistributedOptimizer for a
distributed optimizer's state), loads model + optimizer + rng with dist_checkpointing.load into
model.sharded_state_dict() and the optimizer's sharded_state_dict(is_loading=True) in the form the
checkpoint's content_metadata names (as training's load_checkpoint does), then
model.load_state_dict(strict=True) and optimizer.load_state_dict; then checks every local shard of
every model ShardedTensor, and every fp32 main param, exp_avg and exp_avg_sq the optimizer holds
then (rendered by its own fully_reshardable sharded_state_dict, gathered over DP), against the
global tensors torch's own dcp_to_torch_save reads from SRC_ITER_DIR (the vocabulary's padding
rows too: the source's where it has the row, zeros past it), and the Adam step it holds against
the source's. Prints one JSON line {"ok": bool, "checked": shards, "values": n, "steps": [...],
"mismatches": [...]} per rank; exits 1 on any mismatch. A rank still running at the deadline
(DEADLINE seconds) is killed and fails the run.
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
# case: (tp, pp, dp, vpp, optimizer). The distributed optimizer's forms are saved by megatron-core's
# real DistributedOptimizer after real Adam steps (mcore_cpu.py); a case in TWINS saves the same
# trained state once more in each form named there, as another case (the fully_reshardable twin
# of the dp_reshardable case is the oracle of what that converts to).
CASES = {"tp2_pp2_dp1": (2, 2, 1, 1, "fully_reshardable"),
         "tp1_pp2_dp2_vpp2_noopt": (1, 2, 2, 2, None),
         "tp2_pp1_dp2_dpr": (2, 1, 2, 1, "dp_reshardable"),
         "tp2_pp2_dp1_nondist": (2, 2, 1, 1, "non_distributed")}
# the dp_zero_gather_scatter form: core v0.7 - v0.15's default without a fully parallel save
# (0.16 still saves it)
TWINS = {"tp2_pp1_dp2_dpr": {"fully_reshardable": "tp2_pp1_dp2_dpr_twin",
                             "dp_zero_gather_scatter": "tp2_pp1_dp2_dpz"}}
REAL_STEPS = 2  # the Adam steps the real optimizer takes before the save
# Written from the format (no megatron-core since 0.16 saves it, and none loads it): the
# tp2_pp2_dp1 case's state in the distributed optimizer's pre-0.15 fully_sharded_model_space form.
FSMS_CASE = ("tp2_pp2_dp1_fsms", "tp2_pp2_dp1")
# Likewise the dp_reshardable case's state in the pre-0.15 fully_sharded_bucket_space form.
FSBS_CASE = ("tp2_pp1_dp2_fsbs", "tp2_pp1_dp2_dpr")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def preload():
    """Imports megatron-core's modules the rank functions use, once, in the process that forks
    the ranks (about 2 s of CPU each rank would otherwise spend importing them itself)."""
    import megatron.core.dist_checkpointing  # noqa: F401
    import megatron.core.dist_checkpointing.dict_utils  # noqa: F401
    import megatron.core.dist_checkpointing.mapping  # noqa: F401
    import megatron.core.dist_checkpointing.optimizer  # noqa: F401
    import megatron.core.distributed  # noqa: F401
    import megatron.core.distributed.distributed_data_parallel  # noqa: F401
    import megatron.core.distributed.distributed_data_parallel_config  # noqa: F401
    import megatron.core.distributed.param_and_grad_buffer  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.optimizer  # noqa: F401
    import megatron.core.optimizer.distrib_optimizer  # noqa: F401
    import megatron.core.optimizer.optimizer  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.tensor_parallel.random  # noqa: F401
    import megatron.core.transformer.transformer_config  # noqa: F401


def cpu_shims():
    # Megatron's save path synchronizes CUDA and builds a status tensor on the current device.
    if not torch.cuda.is_available():
        torch.cuda.synchronize = lambda *a, **k: None
        torch.cuda.current_device = lambda: "cpu"


def padded_vocab(tp, div=128):
    m = div * tp
    return (TRUE_VOCAB + m - 1) // m * m


# The model's size (the benchmark scales it up: --size hidden,layers,ffn,heads,groups).
SIZE = {"hidden": 32, "layers": 4, "ffn": 48, "heads": 4, "groups": 2}


def build(tp, pp, vpp):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    cfg = TransformerConfig(
        num_layers=SIZE["layers"], hidden_size=SIZE["hidden"],
        num_attention_heads=SIZE["heads"], num_query_groups=SIZE["groups"],
        ffn_hidden_size=SIZE["ffn"], use_cpu_initialization=True, gated_linear_unit=True,
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


def optimizer_sd(msd, states):
    """The non-distributed optimizer's held state (`states`, {id(param): {state: tensor}}) by
    model ShardedTensor / factory under the fully_reshardable keys
    (optimizer.state.{param,exp_avg,exp_avg_sq}.<key>), to compare with a source's."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
    out = {}
    for i, sh in enumerate(nested_values(msd)):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)):
            continue
        for state in STATES:
            data = torch.empty(sh.data.shape, dtype=torch.float32)
            if states is not None:
                data = states[id(sh.data)][state].clone()
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


def fork_results_queue():
    """Megatron's async file writer collects its workers' results through a Manager queue it
    starts with the "spawn" method, once per process: a new interpreter that imports the main
    module (torch and all) in every rank at every save. The same queue from a forked Manager
    (nothing imported again); what is written does not change."""
    import multiprocessing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = multiprocessing.get_context("fork").Manager().Queue()


def init(rank, world, port, tp, pp, vpp):
    fork_results_queue()  # before gloo starts its threads
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
    dp_rank = parallel_state.get_data_parallel_rank()
    opt = None
    if not a.no_optimizer:
        # Training's DDP and optimizer, REAL_STEPS real Adam steps.
        import mcore_cpu
        chunks, opt = mcore_cpu.ddp_and_optimizer(
            models, distributed=a.optim != "non_distributed")
        mcore_cpu.train_steps(chunks, opt, REAL_STEPS)
    # this form to a.out, then the same state in each of a.twins' forms ({form: out})
    for optim, out in [(a.optim, a.out)] + sorted((getattr(a, "twins", None) or {}).items()):
        save_one(a, rank, world, models, opt, optim, out, dp_rank)
    torch.distributed.destroy_process_group()


def save_one(a, rank, world, models, opt, optim, out, dp_rank):
    """One save of the rank's state, as training's save_checkpoint makes it with
    --ckpt-format torch_dist: model.sharded_state_dict(), the optimizer's sharded_state_dict in
    the form `optim` (the real DistributedOptimizer's; non_distributed: the real
    Float16OptimizerWithFloat16Params's), args, rng state, iteration 10, content_metadata."""
    from megatron.core import dist_checkpointing
    sd = model_sd(models)
    args = argparse.Namespace(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=a.vpp if a.vpp > 1 else None,
        data_parallel_size=a.dp, world_size=world, num_layers=SIZE["layers"],
        hidden_size=SIZE["hidden"], ffn_hidden_size=SIZE["ffn"],
        num_attention_heads=SIZE["heads"], group_query_attention=True,
        num_query_groups=SIZE["groups"], kv_channels=SIZE["hidden"] // SIZE["heads"],
        swiglu=True, normalization="RMSNorm",
        position_embedding_type="rope", untie_embeddings_and_output_weights=True,
        add_bias_linear=False, make_vocab_size_divisible_by=128, vocab_size=TRUE_VOCAB - 1,
        tokenizer_type="NullTokenizer", padded_vocab_size=padded_vocab(a.tp),
        max_position_embeddings=64, seq_length=64, bf16=True, fp16=False,
        params_dtype=torch.bfloat16, transformer_impl=a.impl, ckpt_format="torch_dist",
        use_distributed_optimizer=opt is not None and optim != "non_distributed",
        dist_ckpt_optim_fully_reshardable=optim == "fully_reshardable", optimizer="adam",
        iteration=10, consumed_train_samples=640, rank=rank, local_rank=rank % 8)
    sd.update({"args": args, "checkpoint_version": 3.0, "iteration": 10,
               "rng_state": rng_object(a.tp, a.pp, dp_rank),
               "num_floating_point_operations_so_far": 12345})
    # training's _build_sharded_state_dict_metadata
    content = {"distrib_optim_sharding_type": optim,
               "distrib_optim_fully_reshardable_mem_efficient": False,
               "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optim == "non_distributed":  # training names no sharding type then
        content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(sd, metadata=content)
        sd["opt_param_scheduler"] = {"max_lr": 1e-3, "num_steps": 640}
    iter_dir = pathlib.Path(out) / "iter_0000010"
    if rank == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    if opt is not None and optim == "dp_reshardable":  # (only the distributed one's)
        padding_pieces(sd["optimizer"]["param_state"], rank, pathlib.Path(out))
    torch.distributed.barrier()
    dist_checkpointing.save(sd, str(iter_dir), content_metadata=content)
    torch.distributed.barrier()
    if rank == 0:
        (pathlib.Path(out) / "latest_checkpointed_iteration.txt").write_text("10")


def padding_pieces(param_state, rank, out):
    """The pieces of the dp_reshardable buckets the real optimizer marks as padding (between
    params, and up to the unpadded bucket end: torch.empty, whatever memory held, discarded at
    load), gathered from every rank into OUT.padding.json: {key: [[start, length], ...]}, so
    that a comparison with another writer's buckets can leave them out."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    mine = []

    def walk(x):
        if isinstance(x, dict):
            pad = x.get("padding")
            if pad is not None and getattr(pad, "obj", False) is True:
                for v in x.values():
                    if isinstance(v, ShardedTensor):
                        mine.append((v.key, v.global_offset[0], v.local_shape[0]))
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(param_state)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    if rank == 0:
        pieces = {}
        for key, start, n in sorted(set(x for r in every for x in r)):
            pieces.setdefault(key, []).append([start, n])
        out.with_name(out.name + ".padding.json").write_text(json.dumps(pieces, indent=0))


def global_tensors(src_iter_dir, raw=False):
    """The source's tensors by key; the non-distributed optimizer's fp32 masters
    (optimizer.state.fp32_param.<key>) under the distributed one's name (param) unless `raw`."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as t:
        out = pathlib.Path(t) / "all.pt"
        dcp_to_torch_save(src_iter_dir, out)
        full = torch.load(out, weights_only=False)
    if raw:
        return full
    return {k.replace("optimizer.state.fp32_param.", "optimizer.state.param.", 1): v
            for k, v in full.items()}


def report(a, verdict):
    """A rank's verdict, one JSON line in one write (atomic below 4 KiB: ranks' lines never
    mix): to stdout, or appended to a.report for an in-process caller (run_load, run_hf)."""
    line = (json.dumps(verdict) + "\n").encode()
    if getattr(a, "report", None):
        fd = os.open(a.report, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.write(fd, line)
        os.close(fd)
    else:
        os.write(1, line)


def check_shard(sh, full, mismatches, what, masters=False, kept_rows=None):
    """Compares one local shard with the source's global tensor of its key; returns the number
    of values compared. masters: the shard is the source's fp32 master of its key in the
    shard's dtype (a model weight written from a framework that keeps only the masters).
    A vocabulary key's rows past the true vocabulary (Megatron's padding for the TP) are
    compared too: megatron-core loads them as stored (dist_checkpointing asks only for the
    padded global shape) and its optimizer keeps state for them like any other row, so a
    conversion must carry the source's: the source's padding rows where the source has that
    row (the same padded size: all of them; a smaller one: its first rows, as Megatron-LM's
    tools/checkpoint cut them), zeros past the source's padded size (Adam's fresh state).
    kept_rows: the rows a conversion through a smaller padded size kept (zeros past them)."""
    g = full.get(("optimizer.state.param." if masters else "") + sh.key)
    if g is None:
        mismatches.append(f"{what} {sh.key}: not in the source checkpoint")
        return 0
    shape = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    sl = tuple(slice(o, o + s) for o, s in zip(sh.global_offset, shape))
    got = sh.data.reshape(shape)
    if sh.key.endswith(("word_embeddings.weight", "output_layer.weight")):
        # the source's rows, zeros past them, up to the end of this shard's rows
        end = sl[0].stop
        if kept_rows is not None and kept_rows < g.shape[0]:
            g = g[:kept_rows]
        if end > g.shape[0]:
            g = torch.cat([g, g.new_zeros((end - g.shape[0],) + tuple(g.shape[1:]))])
    want = g[sl]
    if masters:
        want = want.to(got.dtype)
    if got.shape != want.shape or not torch.equal(got.to(want.dtype), want):
        mismatches.append(f"{what} {sh.key} at {tuple(sh.global_offset)}: differs")
    return got.numel()


def source_optimizer(source_iter):
    """(step, {group identifier: (lr, betas, eps, weight_decay)}) of a torch_dist source's
    optimizer as its common state keeps them (the distributed optimizer's: the groups' step;
    the non-distributed one's: common_step, else the groups'); (None, None) for another
    source or one without an optimizer."""
    path = pathlib.Path(source_iter) / "common.pt"
    if not path.exists():
        return None, None
    opt = torch.load(path, weights_only=False).get("optimizer")
    if not isinstance(opt, dict) or "optimizer" not in opt or \
            not isinstance(opt["optimizer"], dict):
        return None, None
    inner = opt["optimizer"]
    groups = inner.get("param_groups", [])
    steps = {float(g["step"]) for g in groups if "step" in g}
    if "common_step" in inner.get("state", {}):
        steps = {float(inner["state"]["common_step"])}
    hyper = {group_id(g): (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"])
             for g in groups}
    return (steps.pop() if len(steps) == 1 else None), hyper


def group_id(g):
    from megatron.core.optimizer.optimizer import param_group_identifier_keys
    return tuple(g.get(k) for k in param_group_identifier_keys)


def load_rank(rank, world, port, a):
    init(rank, world, port, a.tp, a.pp, a.vpp)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    torch.manual_seed(999)  # other values than the checkpoint's
    models = build(a.tp, a.pp, a.vpp)
    iter_dir = pathlib.Path(a.ckpt) / "iter_0000010"
    f16 = opt = None
    if a.optim == "non_distributed" and not a.no_optimizer:
        # Training's DDP and optimizer without --use-distributed-optimizer
        import mcore_cpu
        _, f16 = mcore_cpu.ddp_and_optimizer(models, distributed=False)
    elif not a.no_optimizer:
        # Training's DDP and distributed optimizer, state allocated as a run with torch's Adam
        # must (mcore_cpu.allocate_state); its sharded_state_dict(is_loading=True) in the form
        # the checkpoint's content_metadata names, as training's load_checkpoint asks for it.
        import mcore_cpu
        _, opt = mcore_cpu.ddp_and_optimizer(models)
        mcore_cpu.allocate_state(opt)
    sd = model_sd(models)
    sd["rng_state"] = rng_object(a.tp, a.pp, parallel_state.get_data_parallel_rank())
    content = dist_checkpointing.load_content_metadata(str(iter_dir)) or {}
    if f16 is not None:
        sd["optimizer"] = f16.sharded_state_dict(model_sd(models), is_loading=True)
    elif opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(model_sd(models), is_loading=True,
                                                 metadata=content)
    mismatches, checked, values = [], 0, 0
    if getattr(a, "log_all", False):
        # As training's --dist-ckpt-strictness log_all leaves the keys the
        # checkpoint lacks out of the load: the _extra_state objects (and only
        # those; megatron-core 0.16's own strictness handling fails on torch
        # 2.15's TensorProperties, so they are dropped here).
        def drop_extra(d):
            for k in list(d):
                v = d[k]
                if isinstance(v, dict):
                    drop_extra(v)
                elif getattr(v, "key", "").endswith("_extra_state") or \
                        str(k).endswith("_extra_state"):
                    del d[k]
        drop_extra(sd)
        sd.pop("rng_state")  # and --no-load-rng: such a checkpoint has none
    loaded = dist_checkpointing.load(sd, str(iter_dir))
    for i, m in enumerate(models):
        msd = loaded["model" if len(models) == 1 else f"model{i}"]
        if getattr(a, "log_all", False):
            res = m.load_state_dict(msd, strict=False)
            mismatches += [f"model key {k}: not loaded" for k in res.missing_keys
                           if not k.endswith("_extra_state")]
        else:
            m.load_state_dict(msd, strict=True)
    for o in (f16, opt):
        if o is not None:
            o.load_state_dict(loaded["optimizer"])  # as training's load_checkpoint does
    common = dist_checkpointing.load_common_state_dict(str(iter_dir))
    full = a.full  # read by run() before the fork
    want_step, want_groups = a.source_step, a.source_groups
    # The model's parameters now, as shards (factories applied).
    after = model_sd(models)
    apply_factories(after)
    for sh in nested_values(after):
        if isinstance(sh, ShardedTensor):
            values += check_shard(sh, full, mismatches, "model", getattr(a, "masters", False),
                                  getattr(a, "kept_rows", None))
            checked += 1
    if f16 is not None or opt is not None:
        if f16 is not None:
            # What the optimizer holds after its load_state_dict: main params, moments, step.
            held, steps = {}, set()
            inner = f16.chained_optimizers[0]
            for group in inner.float16_groups:
                for p in group:
                    st = inner.optimizer.state[p.main_param]
                    held[id(p)] = {"param": p.main_param, "exp_avg": st["exp_avg"],
                                   "exp_avg_sq": st["exp_avg_sq"]}
                    if "step" in st:
                        steps.add(float(st["step"]))
            inner_groups = inner.optimizer.param_groups
            # torch Adam's per-param step (from common_step), or, from a FusedAdam run (a step
            # on the groups, none per param), the groups' own.
            group_steps = {float(g["step"]) for g in
                           common["optimizer"]["optimizer"]["param_groups"] if "step" in g}
            if not steps:
                steps = group_steps
            osd = optimizer_sd(model_sd(models), held)
            if "param_state_sharding_type" in common.get("optimizer", {}):
                mismatches.append(f"optimizer common state: {common['optimizer']}")
        else:
            # What the real optimizer holds after its load_state_dict, gathered over DP by its
            # own fully_reshardable sharded_state_dict: each model param's fp32 main param and
            # Adam moments by the model's key and offsets.
            import mcore_cpu
            steps = mcore_cpu.held_steps(opt)
            inner_groups = [g for o in opt.chained_optimizers for g in o.optimizer.param_groups]
            osd = opt.sharded_state_dict(model_sd(models), metadata={
                "distrib_optim_sharding_type": "fully_reshardable",
                "chained_optim_avoid_prefix": True})["param_state"]
            if common.get("optimizer", {}).get("param_state_sharding_type") != a.optim:
                mismatches.append(f"optimizer common state: {common.get('optimizer')}")
        if want_step is not None and steps != {want_step}:
            mismatches.append(f"Adam steps {sorted(steps)}, the source's {want_step}")
        if not steps:
            mismatches.append("no Adam step held")
        apply_factories(osd)
        for sh in nested_values(osd):
            if isinstance(sh, ShardedTensor):
                values += check_shard(sh, full, mismatches, "optimizer",
                                      kept_rows=getattr(a, "kept_rows", None))
                checked += 1
        for g in inner_groups if want_groups is not None else []:
            got = (g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"])
            want = want_groups.get(group_id(g))
            if got != want:
                mismatches.append(f"param group {dict(g, params=len(g['params']))}: {want}")
    cm = common.get("content_metadata", {})
    want_type = None if a.optim == "non_distributed" else a.optim
    if not a.no_optimizer and cm.get("distrib_optim_sharding_type") != want_type:
        mismatches.append(f"content_metadata {cm}")
    if common.get("iteration") != 10:
        mismatches.append(f"iteration {common.get('iteration')}")
    report(a, {"rank": rank, "ok": not mismatches, "checked": checked, "values": values,
               "steps": sorted(steps) if not a.no_optimizer else None,
               "mismatches": [m[:150] for m in mismatches[:10]]})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if mismatches:
        sys.exit(1)


def fsms_rank(rank, world, port, src, out, seed):
    """Rewrites the fully_reshardable save `src` in the fully_sharded_model_space form of
    megatron-core <= 0.14 (reference/megatron.md 4.4, DistributedOptimizer.
    sharded_param_state_fs_model_space): optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<model
    key> hold, for each model chunk (the model key's chunking in src's .metadata: a TP piece of
    one layer), the DP ranks' flattened ranges of that local tensor. An N-D key (layer-stacked
    ones included) is stored reformulated: global [X/x, ..., x*...] (the chunk grid, then the
    local numel), each range a chunk at (*chunk index, range start) of size (1, ..., 1, len); a
    1-D key un-reformulated at (chunk offset + range start). Ranges split each local tensor in
    1-3 seeded pieces (DP ranks' bucket boundaries). Model keys, objects and the common state
    are src's; content_metadata and the optimizer's common dict name the form; .metadata gets
    the mcore_data of such saves ({fqn: {'nd_reformulated_orig_global_shape': shape}}).
    Written by torch's dcp.save from one rank (all shards local)."""
    import pickle
    import random
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import (
        Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata)
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    src_iter, out_iter = pathlib.Path(src) / "iter_0000010", pathlib.Path(out) / "iter_0000010"
    md = dcp.FileSystemReader(str(src_iter)).read_metadata().state_dict_metadata
    full = global_tensors(str(src_iter), raw=True)
    rnd = random.Random(seed)
    sd, mcore_data, cuts = {}, {}, {}

    def sharded(shards, shape):
        meta = ShardedTensorMetadata(
            shards_metadata=[ShardMetadata(list(o), list(t.shape), "rank:0/cpu")
                             for t, o in shards],
            size=torch.Size(shape), tensor_properties=TensorProperties(dtype=torch.float32))
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard.from_tensor_and_offsets(t, list(o), 0) for t, o in shards], meta)

    for fqn, value in full.items():
        if not fqn.startswith("optimizer.state."):  # objects too (see the dcp.save below)
            sd[fqn] = value
            continue
        state, key = fqn[len("optimizer.state."):].split(".", 1)
        chunks = md[key].chunks
        local = tuple(chunks[0].sizes)
        assert all(tuple(c.sizes) == local for c in chunks), (key, "a regular grid")
        glob = tuple(md[key].size)
        numel = 1
        for x in local:
            numel *= x
        name = "optimizer.state.{}.{}".format("fp32_param" if state == "param" else state, key)
        shards = []
        for c in sorted(chunks, key=lambda c: tuple(c.offsets)):
            box = tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))
            flat = value[box].reshape(-1).contiguous()
            # The same DP ranges for every state of a param's chunk.
            if (key, tuple(c.offsets)) not in cuts:
                cuts[(key, tuple(c.offsets))] = sorted(
                    rnd.sample(range(1, numel), min(rnd.randint(0, 2), numel - 1)))
            pts = cuts[(key, tuple(c.offsets))]
            for a, b in zip([0] + pts, pts + [numel]):
                piece = flat[a:b].clone()
                if len(glob) == 1:
                    shards.append((piece, (c.offsets[0] + a,)))
                else:
                    idx = tuple(o // n for o, n in zip(c.offsets, c.sizes))
                    shards.append((piece.view((1,) * len(glob) + (b - a,)), idx + (a,)))
        if len(glob) == 1:
            sd[name] = sharded(shards, glob)
        else:
            sd[name] = sharded(shards, tuple(g // n for g, n in zip(glob, local)) + (numel,))
            mcore_data[name] = {"nd_reformulated_orig_global_shape": glob}
    out_iter.mkdir(parents=True)
    # Objects as one BYTE_IO item each, torch.save of the object (as Megatron's are).
    dcp.save(sd, checkpoint_id=str(out_iter),
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    with open(out_iter / ".metadata", "rb") as f:
        meta = pickle.load(f)
    meta.mcore_data = mcore_data
    with open(out_iter / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    common = torch.load(src_iter / "common.pt", weights_only=False)
    common["content_metadata"]["distrib_optim_sharding_type"] = "fully_sharded_model_space"
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_model_space"
    torch.save(common, out_iter / "common.pt")
    shutil.copy(src_iter / "metadata.json", out_iter / "metadata.json")
    shutil.copy(pathlib.Path(src) / "latest_checkpointed_iteration.txt", pathlib.Path(out))
    torch.distributed.destroy_process_group()


def fsbs_rank(rank, world, port, src, out, seed):
    """Rewrites the dp_reshardable save `src` in the fully_sharded_bucket_space form of
    megatron-core v0.6 - v0.14 (DistributedOptimizer.sharded_param_state_fs_bucket_space, the
    form dp_reshardable descends from): the same per-bucket keys optimizer.distributed.
    dp_group_idx_G.gbuf_idx_B.dtype_(...).bucket_idx_K.{param,exp_avg,exp_avg_sq}, but each of
    global size dp * (padded bucket / dp), the padded bucket (per_bucket_numel), each DP rank's
    params' flattened ranges at dp_rank * local + their start in its slice (1-D flattened
    tensors are stored un-reformulated, reference/megatron.md 4.4), the padding past the
    unpadded end zeros (as its last DP rank pads); pieces cut at seeded points. Objects, model
    keys and the common state are src's, the form named in content_metadata and the
    optimizer's common dict. Written by torch's dcp.save from one rank."""
    import random
    import re
    import shutil
    import torch.distributed.checkpoint as dcp
    from torch.distributed._shard.sharded_tensor import (
        Shard, ShardedTensor, ShardedTensorMetadata, ShardMetadata)
    from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    src_iter, out_iter = pathlib.Path(src) / "iter_0000010", pathlib.Path(out) / "iter_0000010"
    full = global_tensors(str(src_iter), raw=True)
    rnd = random.Random(seed)
    sd = {}
    bucket = re.compile(r"optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\."
                        r"dtype_.*\.bucket_idx_(\d+)\.\w+$")
    for fqn, value in full.items():
        m = bucket.match(fqn)
        if not m:  # objects (dcp.save torch.saves them, as Megatron's) and model keys
            sd[fqn] = value
            continue
        g, v, b = map(int, m.groups())
        sizes = full[f"optimizer.distributed.dp_group_idx_{g}.per_bucket_numel/shard_0_1"]
        padded = list(sizes[0][v].values())[0][b]
        n = value.numel()
        assert padded >= n, (fqn, padded, n)
        data = torch.cat([value, torch.zeros(padded - n)])
        pts = sorted(rnd.sample(range(1, padded), 3))
        shards = [(data[a:z].clone(), (a,)) for a, z in zip([0] + pts, pts + [padded])]
        meta = ShardedTensorMetadata(
            shards_metadata=[ShardMetadata(list(o), list(t.shape), "rank:0/cpu")
                             for t, o in shards],
            size=torch.Size((padded,)), tensor_properties=TensorProperties(dtype=torch.float32))
        sd[fqn] = ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard.from_tensor_and_offsets(t, list(o), 0) for t, o in shards], meta)
    out_iter.mkdir(parents=True)
    # Objects as one BYTE_IO item each, torch.save of the object (as Megatron's are).
    dcp.save(sd, checkpoint_id=str(out_iter),
             planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    common = torch.load(src_iter / "common.pt", weights_only=False)
    common["content_metadata"]["distrib_optim_sharding_type"] = "fully_sharded_bucket_space"
    common["optimizer"]["param_state_sharding_type"] = "fully_sharded_bucket_space"
    torch.save(common, out_iter / "common.pt")
    shutil.copy(src_iter / "metadata.json", out_iter / "metadata.json")
    shutil.copy(pathlib.Path(src) / "latest_checkpointed_iteration.txt", pathlib.Path(out))
    torch.distributed.destroy_process_group()


def fully_sharded_bucket_space(src, out, seed=11):
    import shutil
    shutil.rmtree(out, ignore_errors=True)  # a leftover of an interrupted run
    import time
    ctx = mp.start_processes(fsbs_rank, args=(1, free_port(), src, out, seed), nprocs=1,
                             join=False, start_method="fork")
    return join(ctx, time.monotonic() + DEADLINE, "fully_sharded_bucket_space")


def fully_sharded_model_space(src, out, seed=7):
    import shutil
    shutil.rmtree(out, ignore_errors=True)  # a leftover of an interrupted run
    import time
    ctx = mp.start_processes(fsms_rank, args=(1, free_port(), src, out, seed), nprocs=1,
                             join=False, start_method="fork")
    return join(ctx, time.monotonic() + DEADLINE, "fully_sharded_model_space")


def hf_rank(rank, world, port, a):
    """`hf`: the source's model (dist_checkpointing.load into a TP1 PP1 GPTModel) and the
    transformers folder (LlamaForCausalLM.from_pretrained, every key found, none left over) give
    the same logits for the same tokens: both upcast to float32, Megatron's own forward (local
    spec, on CPU) against transformers' own."""
    init(rank, world, port, 1, 1, 1)
    import contextlib
    import transformers
    from megatron.core import dist_checkpointing
    from megatron.core.tensor_parallel import random as mrandom
    torch.manual_seed(999)
    models = build(1, 1, 1)
    loaded = dist_checkpointing.load(model_sd(models), str(pathlib.Path(a.source)))
    m = models[0]
    m.load_state_dict(loaded["model"], strict=True)
    # float32 everywhere (the softmax's bf16 flags too); no dropout RNG (a CUDA tracker).
    m.config.bf16 = False
    m = m.float().eval()
    for mod in m.modules():
        if hasattr(mod, "input_in_bf16"):
            mod.input_in_bf16 = mod.input_in_float16 = False
    mrandom.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, TRUE_VOCAB, (2, 16), generator=g)
    with torch.no_grad():
        want = m(tokens, torch.arange(16).expand(2, 16),
                 attention_mask=torch.triu(torch.ones(16, 16), diagonal=1).bool()[None, None])
        hf, info = transformers.LlamaForCausalLM.from_pretrained(
            a.hf, dtype=torch.float32, output_loading_info=True)
        got = hf.eval()(tokens).logits
    problems = [f"{k}: {sorted(v)}" for k, v in info.items() if v]
    want = want[..., :TRUE_VOCAB]
    if got.shape != want.shape:
        problems.append(f"logits {tuple(got.shape)}, Megatron's {tuple(want.shape)}")
    elif not torch.allclose(got, want, rtol=0, atol=1e-5 * float(want.abs().max())):
        problems.append(f"logits differ by up to {float((got - want).abs().max())}")
    report(a, {"ok": not problems, "problems": problems,
               "max_abs_logit": float(want.abs().max()),
               "max_abs_diff": float((got - want).abs().max())
               if got.shape == want.shape else None})
    torch.distributed.destroy_process_group()
    if problems:
        sys.exit(1)


# Seconds the ranks of one run may take (the deadline of an oracle: a rank still running then is
# a failure, its verdict missing).
DEADLINE = 120


def join(ctx, deadline, what):
    """Waits for the forked ranks of `ctx` until `deadline` (time.monotonic()); True when all
    exited 0. A rank that failed (torch stops the others) or one still running at the deadline
    (all are killed then) is a verdict, False, said on stderr."""
    import time
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                print(f"megatron_torch_dist {what}: ranks still running at the deadline, "
                      "killed", file=sys.stderr, flush=True)
                return False
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
        print(f"megatron_torch_dist {what}: {e}", file=sys.stderr, flush=True)
        return False
    return all(p.exitcode == 0 for p in ctx.processes)


def run(a):
    import time
    world = a.tp * a.pp * a.dp
    fn = {"save": save_rank, "load": load_rank, "hf": hf_rank}[a.mode]
    preload()
    if a.mode == "hf":
        import transformers  # noqa: F401 (here once, not in the rank)
    if a.mode == "load":  # once here, inherited by every rank
        if getattr(a, "full", None) is None:
            a.full = global_tensors(a.source)
        a.source_step, a.source_groups = source_optimizer(a.source)
        if getattr(a, "log_all", False) and getattr(a, "step", None) is None:
            # a chain through another framework: its step and groups only when asked for
            a.source_step, a.source_groups = None, None
        if getattr(a, "step", None) is not None:
            a.source_step = a.step
    deadline = time.monotonic() + (getattr(a, "deadline", None) or DEADLINE)
    ctx = mp.start_processes(fn, args=(world, free_port(), a), nprocs=world, join=False,
                             start_method="fork")
    return join(ctx, deadline, a.mode)


def in_process(a):
    """Runs `a` (load or hf) in the calling process (a test's: megatron-core imported once
    there, the ranks forked from it). Returns (every rank exited 0, the ranks' verdicts)."""
    with tempfile.TemporaryDirectory(prefix="ucp-mrun-") as t:
        a.report = os.path.join(t, "verdicts")
        ok = run(a)
        path = pathlib.Path(a.report)
        lines = path.read_text().splitlines() if path.exists() else []
    return ok, [json.loads(line) for line in lines]


def run_load(ckpt, source, tp, pp, dp=1, vpp=1, no_optimizer=False,
             optim="fully_reshardable", log_all=False, masters=False, full=None, step=None,
             deadline=None, kept_rows=None):
    """`load` in the calling process: (every rank exited 0, the ranks' verdicts).
    log_all: a checkpoint made from another framework's, loaded as training's
    --dist-ckpt-strictness log_all --no-load-rng do (it has no _extra_state entries and no rng
    state; any other key missing is a mismatch). masters: its model weights are compared with
    the source's fp32 masters rounded to the model's dtype (a framework that keeps only the
    masters, as MindSpore). full: the source's global tensors by torch_dist key (global_tensors'
    form), for a source that is no torch_dist checkpoint. optim: the optimizer's form the
    checkpoint must name (fully_reshardable, dp_reshardable: loaded into megatron-core's real
    DistributedOptimizer in that form; non_distributed: into its
    Float16OptimizerWithFloat16Params). step: the Adam step the optimizer must hold after the
    load (default: the source's, from its common state; with log_all only when given, then
    the optimizer's groups are compared with the source's too). deadline: seconds the ranks may take
    (DEADLINE); a rank still running then fails the run. kept_rows: the vocabulary rows a
    conversion chain through a smaller padded size kept of the source's (zeros past them)."""
    return in_process(argparse.Namespace(
        mode="load", ckpt=str(ckpt), source=str(source), tp=tp, pp=pp, dp=dp, vpp=vpp,
        no_optimizer=no_optimizer, optim=optim, impl="local", seed=1, log_all=log_all,
        masters=masters, full=full, step=step, deadline=deadline, kept_rows=kept_rows))


def run_hf(source, hf):
    """`hf` in the calling process: (it exited 0, its verdict as a list of one)."""
    return in_process(argparse.Namespace(mode="hf", source=str(source), hf=str(hf), tp=1, pp=1,
                                         dp=1, vpp=1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", nargs="?", choices=("cases", "save", "load", "hf"), default="cases")
    ap.add_argument("--hf", help="hf: the transformers folder to compare with --source")
    ap.add_argument("--out")
    ap.add_argument("--ckpt")
    ap.add_argument("--source")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--no-optimizer", action="store_true")
    ap.add_argument("--impl", default="local")
    ap.add_argument("--optim", default="fully_reshardable",
                    choices=("fully_reshardable", "dp_reshardable", "dp_zero_gather_scatter",
                             "non_distributed"),
                    help="save: the optimizer's form; load: the form the checkpoint must "
                         "hold (non_distributed loads into Megatron's "
                         "Float16OptimizerWithFloat16Params, the others into its real "
                         "DistributedOptimizer)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--size", help="hidden,layers,ffn,heads,groups (default 32,4,48,4,2)")
    a = ap.parse_args()
    if a.size:
        SIZE.update(zip(("hidden", "layers", "ffn", "heads", "groups"),
                        map(int, a.size.split(","))))
    if a.mode != "cases":
        sys.exit(0 if run(a) else 1)
    out = pathlib.Path(a.out)
    for name, (tp, pp, dp, vpp, opt) in CASES.items():
        c = argparse.Namespace(**vars(a))
        c.mode, c.out, c.tp, c.pp, c.dp, c.vpp = "save", str(out / name), tp, pp, dp, vpp
        c.no_optimizer = opt is None
        c.optim = opt or "fully_reshardable"
        c.twins = {form: str(out / twin) for form, twin in TWINS.get(name, {}).items()}
        if not run(c):
            sys.exit(f"saving {name} failed")
        print("saved", name, *TWINS.get(name, {}).values(), flush=True)
    if not fully_sharded_model_space(str(out / FSMS_CASE[1]), str(out / FSMS_CASE[0])):
        sys.exit(f"writing {FSMS_CASE[0]} failed")
    print("wrote", FSMS_CASE[0], flush=True)
    if not fully_sharded_bucket_space(str(out / FSBS_CASE[1]), str(out / FSBS_CASE[0])):
        sys.exit(f"writing {FSBS_CASE[0]} failed")
    print("wrote", FSBS_CASE[0], flush=True)


if __name__ == "__main__":
    main()
