"""Mixture-of-experts torch_dist checkpoints saved by the real megatron-core (the tests' PyPI
environment: run with its python), on CPU with gloo, one process per rank, and the truth of
each: the whole model and its optimizer state gathered from the ranks' memory.

  make_moe_torch_dist.py --out DIR [--variant mixtral|deepseek] [--tp T] [--pp P] [--vpp V] [--dp D]
                         [--ep E] [--etp X] [--no-optimizer] [--seed S]
                         [--size LAYERS,HIDDEN,EXPERTS,MOE_FFN] [--no-truth]
                         one save folder DIR (iter_0000010/, latest_checkpointed_iteration.txt)
                         and DIR/truth.pt (not with --no-truth: the benchmarks' large saves)
  make_moe_torch_dist.py check DIR        the truth against the save (torch's own DCP reader)
                                          and against the model's structure; exits 1 on a
                                          problem
  make_moe_torch_dist.py describe DIR     what the save holds: keys, global shapes, chunks,
                                          the _extra_state objects, common.pt
  make_moe_torch_dist.py load CKPT --truth SAVE [--variant V] [--tp T] [--pp P] [--vpp V] [--dp D]
                         [--ep E] [--etp X] [--optim fully_reshardable|dp_reshardable|
                         non_distributed]
                                          megatron-core loads CKPT (a torch_dist save, e.g.
                                          one ucp wrote) at that layout: the model and the
                                          optimizer of that form built there,
                                          dist_checkpointing.load, load_state_dict(strict=True),
                                          the optimizer's load_state_dict; every model and
                                          optimizer shard then held equal to SAVE's truth.pt
                                          (a larger padded vocabulary: zeros past its rows),
                                          the Adam step too, a negative control per rank (a
                                          changed expert value found); exits 1 on a problem.
                                          Tests call run_load() in their own process instead.

The model: megatron-core 0.16's GPTModel of get_gpt_decoder_block_spec (local spec, RMSNorm, no
Transformer Engine), 2 layers, hidden 16, 4 heads in 2 query groups (GQA), SwiGLU, no linear
biases, RoPE, untied output layer, bf16, vocabulary 128; MoE: 4 routed experts of ffn 8
(SequentialMLP, moe_grouped_gemm off), top-2 router, alltoall dispatcher.
  mixtral:  every layer MoE (the torch_dist keys are stacked over layers: [L, E, ...]);
  deepseek: layer 0 dense (moe_layer_freq [0, 1], ffn 24), layer 1 MoE with a shared expert
            (ffn 16, with its gate), the sigmoid router with its expert bias (per-layer keys).
The parallel state is megatron-core's own: initialize_model_parallel(tp, pp,
expert_model_parallel_size=ep, expert_tensor_parallel_size=etp) on world = tp x pp x dp ranks.

The optimizer: training's objects, megatron-core's real DistributedDataParallel and
get_megatron_optimizer's real DistributedOptimizer (a ChainedOptimizer of a dense and an expert
DistributedOptimizer, the expert one over the expert data-parallel group), run on CPU through
tests/tools/mcore_cpu.py's shims; REAL_STEPS real Adam steps; its own sharded_state_dict in the
fully_reshardable form (--optim dp_reshardable: that form), as training's save asks for it (the
truth always from the fully_reshardable form). Saved with dist_checkpointing.save with
args, iteration 10, the rng state and content_metadata, as training's save_checkpoint does.

truth.pt (torch.save of a dict), gathered from every rank's memory, not from the files: each
rank's model.sharded_state_dict() (factories applied: the SwiGLU fc1 in its gate and up chunks)
and the optimizer's fully_reshardable sharded_state_dict, whose ShardedTensors say where each
local tensor sits in the global one (Megatron's own metadata); rank 0 places every chunk and
checks that the chunks of a key cover it exactly once (replicas: replica_id != 0, compared equal
to the main copy). Entries:
  "model":     {name: tensor}   the global tensors, names with explicit indices: the torch_dist
                                key with the layer index put back after "decoder.layers." when
                                the key is stacked, and expert keys ...mlp.experts.experts.X as
                                ...mlp.experts.<e>.X (e the global expert index), e.g.
                                decoder.layers.1.mlp.experts.3.linear_fc1.weight [2F, H]
                                ([gate; up]); the MoE pre-MLP norm under its torch_dist key
                                (mlp.linear_fc1.layer_norm_weight)
  "optimizer": {"param" | "exp_avg" | "exp_avg_sq": {name: fp32 tensor}}  (no --no-optimizer)
  "steps":     the Adam steps the optimizer holds; "extra_state": {name: object} per linear
               (experts per global expert); "config": the sizes; "ranks": each rank's
               coordinates from megatron-core's parallel_state (tp, pp, dp, ep, etp, edp);
               "sharding": per rank, (key, global shape, global offset, local shape, prepended
               axes, replica_id) of each ShardedTensor (ShardedObject: unique key, shape,
               offset, None, None, replica_id) of the model's and the optimizer's sharded
               state dicts, as megatron-core made them

What megatron-core 0.16 saves for these models (seen with `describe`; the readers and writers of
MoE torch_dist files are built from it):
* Keys. mixtral (every layer MoE): every layer key is stacked over layers, e.g.
  decoder.layers.self_attention.linear_qkv.weight [L, 32, 16] (prepend_axis_num 1),
  decoder.layers.mlp.router.weight [L, E, H] (bf16), decoder.layers.mlp.linear_fc1.layer_norm_weight
  [L, H] (the MoE layer's pre_mlp_layernorm under the local spec's sharded name), and the experts
  stacked over layers and global experts, prepend_axis_num 2:
  decoder.layers.mlp.experts.experts.linear_fc1.weight [L, E, 2F, H],
  decoder.layers.mlp.experts.experts.linear_fc2.weight [L, E, H, F].
  deepseek (a dense layer: moe_layer_freq [0, 1]): every key per layer, decoder.layers.<g>.…:
  decoder.layers.0.mlp.linear_fc1.weight [2 ffn, H], decoder.layers.1.mlp.experts.experts.
  linear_fc1.weight [E, 2F, H] (prepend_axis_num 1), …linear_fc2.weight [E, H, F],
  decoder.layers.1.mlp.shared_experts.linear_fc1.weight [2S, H] (SwiGLU factory, gate and up
  chunks over TP), …shared_experts.linear_fc2.weight [H, S] (dim 1 over TP),
  …shared_experts.gate_weight [1, H], …mlp.router.weight [E, H] bf16, …mlp.router.expert_bias [E]
  fp32 (a buffer: no optimizer state).
* Chunks. Each (layer, expert) is its own chunk along the prepended axes (local_shape without
  them). An expert's fc1 is always two chunks, gate rows then up rows ([F/ETP, H] at rows
  etp_rank*F/ETP and F + etp_rank*F/ETP), even at ETP 1; fc2 is cut over ETP on its last axis.
  torch's DCP metadata then lists e.g. 16 chunks (1, 1, 8, 16) for a [2, 4, 16, 16] fc1.
* replica_id (3 ints): dense params (0, tp_rank if replicated over TP else 0, dp_rank); expert
  params (0, etp_rank if replicated over ETP else 0, expert-dp rank); the router, its bias, the
  norms and the shared-expert gate are replicated over TP (and EP: they are dense).
* ShardedObjects (_extra_state, None with the local spec): per layer and linear; the experts'
  one per (layer, global expert): stacked …mlp.experts.experts.linear_fc1._extra_state/
  shard_<l>.<e>_<L>.<E>, per layer decoder.layers.<g>.mlp.experts.experts.linear_fc1.
  _extra_state/shard_<e>_<E>; dense stacked …self_attention.linear_qkv._extra_state/shard_<l>_<L>,
  per layer …/shard_0_1. No router or norm objects. rng_state/shard_<pp>.<tp>_<PP>.<TP>.
* Optimizer (fully_reshardable; training's chained_optim_avoid_prefix): tensors
  optimizer.state.{param,exp_avg,exp_avg_sq}.<model key>, fp32, the model key's global shape,
  chunks and replica ids (every DP / expert-DP rank holds the whole TP-local state, the others as
  replicas); common.pt "optimizer" is a list of two (the ChainedOptimizer): [0] the dense
  DistributedOptimizer {"optimizer": {"param_groups": [wd_mult 1.0 group, wd_mult 0.0 group;
  is_expert_parallel False, step]}, "param_state_sharding_type": "fully_reshardable"}, [1] the
  expert one (one group, is_expert_parallel True). common.pt also has args, checkpoint_version,
  iteration, num_floating_point_operations_so_far, opt_param_scheduler, content_metadata.
* Optimizer, dp_reshardable (--optim dp_reshardable): flat buckets per chained optimizer and
  data-parallel group, chained_<i>.optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.
  dtype_(torch.bfloat16, torch.float32).bucket_idx_<k>.{param,exp_avg,exp_avg_sq} (the
  "chained_<i>." prefix stays although chained_optim_avoid_prefix is set), one chunk per param
  range a rank owns, params in the buffer's (reverse) order; chained_0 the dense half (one group
  per TP x PP position, the bucket split over DP), chained_1 the expert half with one
  dp_group_idx per expert-DP group (at TP 1, PP 1, DP 2, EP 2: dp_group_idx_0 on ep rank 0,
  dp_group_idx_1 on ep rank 1, each a 1536-element bucket: 2 layers x 2 local experts x (fc2 128 +
  fc1 256)); ShardedObjects …dp_group_idx_<g>.{optimizer,per_bucket_numel,
  per_bucket_numel_unpadded}/shard_0_1 with replica_id (0, 0, dp rank).
"""
import argparse
import os
import pathlib
import re
import sys
import warnings

import torch
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_torch_dist as mtd  # noqa: E402

ITERATION = 10
REAL_STEPS = 1
VOCAB = 128
SIZE = {"layers": 2, "hidden": 16, "heads": 4, "groups": 2, "ffn": 24, "moe_ffn": 8,
        "experts": 4, "topk": 2, "shared_ffn": 16}
STATES = ("param", "exp_avg", "exp_avg_sq")
SHARDING = []  # this rank's (key, global shape, offset, local shape, prepended axes, replica_id)
EXPERTS_INFIX = ".mlp.experts.experts."


def config(a):
    from megatron.core.transformer.transformer_config import TransformerConfig
    kw = {}
    if a.variant == "deepseek":
        kw = dict(moe_layer_freq=[0, 1], moe_shared_expert_intermediate_size=SIZE["shared_ffn"],
                  moe_shared_expert_gate=True, moe_router_score_function="sigmoid",
                  moe_router_enable_expert_bias=True)
    return TransformerConfig(
        num_layers=SIZE["layers"], hidden_size=SIZE["hidden"],
        num_attention_heads=SIZE["heads"], num_query_groups=SIZE["groups"],
        ffn_hidden_size=SIZE["ffn"], moe_ffn_hidden_size=SIZE["moe_ffn"],
        num_moe_experts=SIZE["experts"], moe_router_topk=SIZE["topk"], moe_grouped_gemm=False,
        moe_token_dispatcher_type="alltoall", use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", add_bias_linear=False, bf16=True,
        params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=vpp_of(a) if vpp_of(a) > 1 else None,
        expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp, **kw)


def vpp_of(a):
    return getattr(a, "vpp", 1) or 1


def build(a):
    """This rank's model chunks (one, or VPP of them: the layers of virtual stage v each)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    cfg = config(a)
    vpp = vpp_of(a)
    models = []
    for v in range(vpp):
        kw = {"vp_stage": v} if vpp > 1 else {}
        spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False,
                                          normalization="RMSNorm", **kw)
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, **kw) \
            if vpp > 1 else parallel_state.is_pipeline_first_stage()
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, **kw) \
            if vpp > 1 else parallel_state.is_pipeline_last_stage()
        model = GPTModel(config=cfg, transformer_layer_spec=spec,
                         vocab_size=getattr(a, "vocab", None) or VOCAB,
                         max_sequence_length=64, pre_process=pre, post_process=post,
                         share_embeddings_and_output_weights=False,
                         position_embedding_type="rope", **kw)
        # Training's Float16Module casts every param (the local spec's norms are fp32) to
        # bf16; the router's expert bias is an fp32 buffer Megatron keeps in fp32.
        bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
        model = model.to(torch.bfloat16)
        for n, b in bias.items():
            model.get_buffer(n).data = b
        models.append(model)
    return models


def model_sd_keys(models):
    """[(state dict key, chunk)]: "model", or "model0".."model{VPP-1}" as training names them."""
    if len(models) == 1:
        return [("model", models[0])]
    return [(f"model{i}", m) for i, m in enumerate(models)]


def model_sd(models):
    """The model part of training's state dict, each chunk's sharded_state_dict."""
    return {k: m.sharded_state_dict() for k, m in model_sd_keys(models)}


def coordinates():
    from megatron.core import parallel_state as ps
    return {"tp": ps.get_tensor_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "dp": ps.get_data_parallel_rank(), "ep": ps.get_expert_model_parallel_rank(),
            "etp": ps.get_expert_tensor_parallel_rank(),
            "edp": ps.get_expert_data_parallel_rank()}


def truth_name(key, index):
    """The truth's name of the chunk of `key` at prepended-axis indices `index`: the expert index
    after mlp.experts. for an expert key (the last prepended axis), the layer index back after
    decoder.layers. for a key stacked over layers (the first). An optimizer key
    (optimizer.state.<state>.<model key>) is named <state>/<name of the model key>."""
    if key.startswith("optimizer.state."):
        state, key = key[len("optimizer.state."):].split(".", 1)
        return f"{state}/" + truth_name(key, index)
    index = list(index)
    if EXPERTS_INFIX in key:
        key = key.replace(EXPERTS_INFIX, f".mlp.experts.{index.pop()}.")
    if key.startswith("decoder.layers.") and not re.match(r"decoder\.layers\.\d+\.", key):
        key = f"decoder.layers.{index[0]}." + key[len("decoder.layers."):]
    return key


def is_main(replica_id):
    return all(r == 0 for r in (replica_id if isinstance(replica_id, tuple) else (replica_id,)))


def local_pieces(sd):
    """[(name, global offset, local tensor, replica_id, global shape)] of the ShardedTensors of
    `sd` (factories applied), the prepended axes (layers, experts) turned into names; and
    {name: object} of its main ShardedObjects (one per (layer, expert) for the experts'
    _extra_state)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (ShardedObject, ShardedTensor,
                                                          apply_factories)
    apply_factories(sd)
    pieces, objects = [], {}
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            SHARDING.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                             tuple(sh.local_shape), sh.prepend_axis_num, sh.replica_id))
            n = sh.prepend_axis_num
            pieces.append((truth_name(sh.key, sh.global_offset[:n]), tuple(sh.global_offset[n:]),
                           sh.data.detach().clone().cpu(), sh.replica_id,
                           tuple(sh.global_shape[n:])))
        elif isinstance(sh, ShardedObject):
            SHARDING.append((sh.unique_key, tuple(sh.global_shape), tuple(sh.global_offset),
                             None, None, sh.replica_id))
            if is_main(sh.replica_id):
                objects[truth_name(sh.key, sh.global_offset)] = sh.data
    return pieces, objects


def record_sharding(sd):
    """Adds the ShardedTensors and ShardedObjects of `sd` to SHARDING (nothing else)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    for sh in nested_values(sd):
        if isinstance(sh, ShardedTensor):
            SHARDING.append((sh.key, tuple(sh.global_shape), tuple(sh.global_offset),
                             tuple(sh.local_shape), sh.prepend_axis_num, sh.replica_id))
        elif isinstance(sh, ShardedObject):
            SHARDING.append((sh.unique_key, tuple(sh.global_shape), tuple(sh.global_offset),
                             None, None, sh.replica_id))


def distinct_experts(model, seed):
    """Megatron's CPU initialization draws each rank's local experts from the same generator
    state, so expert i of every ep rank starts equal: add a constant per (layer, global expert)
    to every element of its params (the same on every shard, whatever the split), so that a
    swapped or duplicated expert shows."""
    for layer in model.decoder.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        for i, local in enumerate(experts.local_experts):
            e = layer.mlp.local_expert_indices[i]
            with torch.no_grad():
                for p in local.parameters():
                    p.add_(0.0625 * (1 + e) + 0.5 * layer.layer_number + 0.001 * seed)


def assemble(every):
    """Rank 0: the global tensors from every rank's pieces; replicas must equal the main copy,
    main copies must cover each tensor exactly once."""
    full, cover, replicas = {}, {}, []
    for pieces in every:
        for name, offset, data, replica, shape in pieces:
            if name not in full:
                full[name] = torch.zeros(shape, dtype=data.dtype)
                cover[name] = torch.zeros(shape, dtype=torch.int32)
            assert tuple(full[name].shape) == shape, (name, full[name].shape, shape)
            sl = tuple(slice(o, o + s) for o, s in zip(offset, data.shape))
            if is_main(replica):
                full[name][sl] = data.reshape(full[name][sl].shape)
                cover[name][sl] += 1
            else:
                replicas.append((name, sl, data))
    for name, c in cover.items():
        assert bool((c == 1).all()), f"{name}: main chunks cover it {c.min()}..{c.max()} times"
    for name, sl, data in replicas:
        assert torch.equal(full[name][sl], data.reshape(full[name][sl].shape)), \
            f"{name}: a replica differs from the main copy"
    return full


def save_rank(rank, world, port, a):
    mtd.fork_results_queue()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mtd.cpu_shims()
    import mcore_cpu
    mcore_cpu.shims()  # also the MoE dispatcher's CUDA stream
    from megatron.core import dist_checkpointing, parallel_state
    parallel_state.initialize_model_parallel(
        a.tp, a.pp, virtual_pipeline_model_parallel_size=vpp_of(a) if vpp_of(a) > 1 else None,
        expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    torch.manual_seed(a.seed)  # the same global model on every rank (CPU initialization)
    models = build(a)
    for model in models:
        distinct_experts(model, a.seed)
    opt = None
    if not a.no_optimizer:
        chunks, opt = mcore_cpu.ddp_and_optimizer(models)
        mcore_cpu.train_steps(chunks, opt, REAL_STEPS)
    content = {"distrib_optim_sharding_type": a.optim,
               "distrib_optim_fully_reshardable_mem_efficient": False,
               "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    sd = model_sd(models)
    args = argparse.Namespace(
        tensor_model_parallel_size=a.tp, pipeline_model_parallel_size=a.pp,
        virtual_pipeline_model_parallel_size=vpp_of(a) if vpp_of(a) > 1 else None,
        data_parallel_size=a.dp,
        expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp, world_size=world,
        num_layers=SIZE["layers"], hidden_size=SIZE["hidden"], ffn_hidden_size=SIZE["ffn"],
        num_attention_heads=SIZE["heads"], group_query_attention=True,
        num_query_groups=SIZE["groups"], kv_channels=SIZE["hidden"] // SIZE["heads"],
        num_experts=SIZE["experts"], moe_ffn_hidden_size=SIZE["moe_ffn"],
        moe_router_topk=SIZE["topk"], moe_grouped_gemm=False,
        moe_layer_freq=[0, 1] if a.variant == "deepseek" else 1,
        moe_shared_expert_intermediate_size=SIZE["shared_ffn"] if a.variant == "deepseek"
        else None, moe_router_enable_expert_bias=a.variant == "deepseek",
        swiglu=True, normalization="RMSNorm", position_embedding_type="rope",
        untie_embeddings_and_output_weights=True, add_bias_linear=False,
        # Megatron pads vocab_size 127 to a multiple of 64 x TP: 128 rows at TP 1 and 2, as
        # the model is built (a conversion to TP 4 pads to 256).
        make_vocab_size_divisible_by=64, vocab_size=VOCAB - 1, padded_vocab_size=VOCAB,
        tokenizer_type="NullTokenizer", max_position_embeddings=64, seq_length=64, bf16=True,
        fp16=False, params_dtype=torch.bfloat16, transformer_impl="local",
        ckpt_format="torch_dist", use_distributed_optimizer=opt is not None,
        dist_ckpt_optim_fully_reshardable=a.optim == "fully_reshardable", optimizer="adam",
        iteration=ITERATION,
        consumed_train_samples=640, rank=rank, local_rank=rank)
    sd.update({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
               "rng_state": mtd.rng_object(a.tp, a.pp, parallel_state.get_data_parallel_rank()),
               "num_floating_point_operations_so_far": 12345})
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(sd, metadata=content)
        sd["opt_param_scheduler"] = {"max_lr": 1e-3, "num_steps": 640}
    # What the truth needs, before the save (which consumes nothing, but keep it apart).
    pieces, objects = local_pieces(model_sd(models)) if not a.no_truth else ([], {})
    opt_pieces = []
    if opt is not None and not a.no_truth:
        osd = opt.sharded_state_dict(model_sd(models),
                                     metadata=dict(content,
                                                   distrib_optim_sharding_type="fully_reshardable"))
        opt_pieces = [x for x in local_pieces(osd)[0] if "/" in x[0]]
    if opt is not None and a.optim != "fully_reshardable":
        record_sharding(sd["optimizer"])  # the saved form's (the truth's is recorded above)
    iter_dir = pathlib.Path(a.out) / f"iter_{ITERATION:07d}"
    if rank == 0:
        iter_dir.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(sd, str(iter_dir), content_metadata=content)
    torch.distributed.barrier()
    every = [None] * world
    torch.distributed.gather_object(
        (pieces, objects, opt_pieces, coordinates(),
         sorted(mcore_cpu.held_steps(opt)) if opt is not None else [], SHARDING),
        every if rank == 0 else None, dst=0)
    if rank == 0:
        (pathlib.Path(a.out) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    if rank == 0 and not a.no_truth:
        truth = {"model": assemble([e[0] for e in every]), "extra_state": {},
                 "config": dict(SIZE, variant=a.variant, tp=a.tp, pp=a.pp, dp=a.dp, ep=a.ep,
                                etp=a.etp, vpp=vpp_of(a), vocab=VOCAB, iteration=ITERATION, optim=a.optim),
                 "ranks": [e[3] for e in every], "sharding": [e[5] for e in every],
                 "steps": sorted({s for e in every for s in e[4]})}
        for e in every:
            truth["extra_state"].update(e[1])
        if opt is not None:
            flat = assemble([e[2] for e in every])
            truth["optimizer"] = {s: {} for s in STATES}
            for name, t in flat.items():
                state, n = name.split("/", 1)
                truth["optimizer"][state][n] = t
        torch.save(truth, pathlib.Path(a.out) / "truth.pt")
    torch.distributed.destroy_process_group()


def run(a):
    import time
    SIZE.update(getattr(a, "sizes", {}))
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    world = a.tp * a.pp * a.dp
    ctx = mp.start_processes(save_rank, args=(world, mtd.free_port(), a), nprocs=world,
                             join=False, start_method="fork")
    return mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "moe save")


# ---------------------------------------------------------------- load

def compare_shard(sh, tensors, name, mismatches, perturb=False):
    """One local shard (factories applied) against the truth's global tensor `name`; the
    vocabulary keys' rows past the truth's (a larger padded vocabulary for the target TP) must
    be zeros. Returns the number of values compared. perturb: compare with a copy of the truth
    one of whose values is changed (the negative control)."""
    want = tensors.get(name)
    if want is None:
        mismatches.append(f"{sh.key} {name}: not in the truth")
        return 0
    n = sh.prepend_axis_num
    off = tuple(sh.global_offset[n:])
    got = sh.data.reshape(tuple(sh.local_shape))
    if want.dim() and sh.key.endswith(("word_embeddings.weight", "output_layer.weight")):
        end = off[0] + got.shape[0]
        if end > want.shape[0]:
            want = torch.cat([want, want.new_zeros((end - want.shape[0], *want.shape[1:]))])
    sl = tuple(slice(o, o + z) for o, z in zip(off, got.shape))
    want = want[sl]
    if perturb:
        want = want.clone()
        want.view(-1)[want.numel() // 2] += 1
    if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
        mismatches.append(f"{sh.key} -> {name} at {off}: differs")
    return got.numel()


def load_rank(rank, world, port, a):
    """Loads checkpoint a.ckpt into megatron-core's MoE GPTModel and chained
    DistributedOptimizer built at a.tp/a.pp/a.dp/a.ep/a.etp, as training's load does
    (dist_checkpointing.load of the model's and the optimizer's sharded state dicts in the
    form the checkpoint's content_metadata names, load_state_dict(strict=True), the
    optimizer's load_state_dict), then compares every shard the model and the optimizer hold
    (the optimizer's by its own fully_reshardable sharded_state_dict) with a.truth."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mtd.cpu_shims()
    import mcore_cpu
    mcore_cpu.shims()
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    parallel_state.initialize_model_parallel(
        a.tp, a.pp, virtual_pipeline_model_parallel_size=vpp_of(a) if vpp_of(a) > 1 else None,
        expert_model_parallel_size=a.ep, expert_tensor_parallel_size=a.etp)
    torch.manual_seed(999)  # other values than the checkpoint's
    models = build(a)
    opt = None
    non_distributed = a.optim == "non_distributed"
    if not a.no_optimizer:
        # non_distributed: training without --use-distributed-optimizer (a ChainedOptimizer
        # of Float16OptimizerWithFloat16Params, the experts' own at EP > 1)
        _, opt = mcore_cpu.ddp_and_optimizer(models, distributed=not non_distributed)
        if not non_distributed:
            mcore_cpu.allocate_state(opt)
    iter_dir = pathlib.Path(a.ckpt) / f"iter_{ITERATION:07d}"
    content = dist_checkpointing.load_content_metadata(str(iter_dir)) or {}
    sd = model_sd(models)
    sd["rng_state"] = mtd.rng_object(a.tp, a.pp, parallel_state.get_data_parallel_rank())
    if opt is not None:
        sd["optimizer"] = opt.sharded_state_dict(model_sd(models), is_loading=True,
                                                 metadata=content)
    loaded = dist_checkpointing.load(sd, str(iter_dir))
    for key, model in model_sd_keys(models):
        model.load_state_dict(loaded[key], strict=True)
    if opt is not None:
        opt.load_state_dict(loaded["optimizer"])  # as training's load_checkpoint does
    truth = a.truth
    mismatches, checked, values, controls = [], 0, 0, []
    after = model_sd(models)
    apply_factories(after)
    shards = [("model", sh, truth["model"]) for sh in nested_values(after)
              if isinstance(sh, ShardedTensor)]
    steps = []
    if opt is not None and non_distributed:
        # What each half holds after its load_state_dict: fp32 main params, moments, step,
        # under the model's keys (the fully_reshardable form's names).
        held, held_steps = {}, set()
        for inner in opt.chained_optimizers:
            for group in inner.float16_groups:
                for p in group:
                    st = inner.optimizer.state[p.main_param]
                    held[id(p)] = {"param": p.main_param, "exp_avg": st["exp_avg"],
                                   "exp_avg_sq": st["exp_avg_sq"]}
                    held_steps.add(float(st["step"]))
        from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor
        osd = {}
        for i, sh in enumerate(nested_values(model_sd(models))):
            # the params (buffers such as the router's expert bias have no state)
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and id(sh.data) in held:
                for state in STATES:
                    osd[f"{state}.{i}"] = make_sharded_optimizer_tensor(
                        sh, held[id(sh.data)][state].clone(),
                        prefix=f"optimizer.state.{state}")
        apply_factories(osd)
        shards += [("optimizer", sh, None) for sh in nested_values(osd)
                   if isinstance(sh, ShardedTensor)]
        steps = sorted(held_steps)
        if steps != truth["steps"]:
            mismatches.append(f"Adam steps {steps}, the source's {truth['steps']}")
        if "distrib_optim_sharding_type" in content:
            mismatches.append(f"content_metadata {content}")
    elif opt is not None:
        osd = opt.sharded_state_dict(model_sd(models), metadata={
            "distrib_optim_sharding_type": "fully_reshardable",
            "chained_optim_avoid_prefix": True})
        apply_factories(osd)
        for sh in nested_values(osd):
            if isinstance(sh, ShardedTensor) and sh.key.startswith("optimizer.state."):
                shards.append(("optimizer", sh, None))
        steps = sorted(mcore_cpu.held_steps(opt))
        if steps != truth["steps"]:
            mismatches.append(f"Adam steps {steps}, the source's {truth['steps']}")
        if content.get("distrib_optim_sharding_type") != a.optim:
            mismatches.append(f"content_metadata {content}")
    for what, sh, tensors in shards:
        name = truth_name(sh.key, sh.global_offset[:sh.prepend_axis_num])
        if what == "optimizer":
            state, name = name.split("/", 1)
            tensors = truth["optimizer"][state]
        values += compare_shard(sh, tensors, name, mismatches)
        checked += 1
        if not controls and ".mlp.experts." in name:  # negative control, once
            missed = []
            compare_shard(sh, tensors, name, missed, perturb=True)
            controls.append(bool(missed))
    if not controls or not all(controls):
        mismatches.append(f"negative control (a changed expert value) not detected: {controls}")
    experts = sum(1 for w, sh, _ in shards if w == "model" and EXPERTS_INFIX in sh.key)
    mtd.report(a, {"rank": rank, "ok": not mismatches, "checked": checked, "values": values,
                   "expert_shards": experts, "steps": steps,
                   "mismatches": [m[:160] for m in mismatches[:10]]})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if mismatches:
        sys.exit(1)


def run_load(ckpt, truth, variant, tp, pp=1, dp=1, ep=1, etp=None, optim="fully_reshardable",
             no_optimizer=False, vpp=1):
    """`load` in the calling process (a test's, megatron-core imported once there; the ranks
    forked from it): (every rank exited 0, the ranks' verdicts). truth: a truth.pt's dict (the
    source's); the model is built with the vocabulary rows of the checkpoint's args
    (padded_vocab_size, which ucp sets for the target TP)."""
    import json
    import tempfile
    import time
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    iter_dir = pathlib.Path(ckpt) / f"iter_{ITERATION:07d}"
    args = torch.load(iter_dir / "common.pt", weights_only=False)["args"]
    a = argparse.Namespace(ckpt=str(ckpt), truth=truth, variant=variant, tp=tp, pp=pp, dp=dp,
                           ep=ep, etp=etp or tp, optim=optim, no_optimizer=no_optimizer,
                           vocab=args.padded_vocab_size, vpp=vpp)
    # the source's model size (a --size save's), whatever SIZE holds now
    SIZE.update({k: truth["config"][k] for k in SIZE if k in truth["config"]})
    with tempfile.TemporaryDirectory(prefix="ucp-moe-load-") as t:
        a.report = os.path.join(t, "verdicts")
        world = tp * pp * dp
        ctx = mp.start_processes(load_rank, args=(world, mtd.free_port(), a), nprocs=world,
                                 join=False, start_method="fork")
        ok = mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "moe load")
        path = pathlib.Path(a.report)
        lines = path.read_text().splitlines() if path.exists() else []
    return ok, [json.loads(line) for line in lines]


# ---------------------------------------------------------------- check

def problems_of(truth, dcp_full=None):
    """What is wrong with a truth (a list of strings): every expert param of every MoE layer
    present exactly once (global indices 0..E-1, no other index, no local names), the dense
    layer's MLP in the deepseek variant, shapes from the config; with `dcp_full` (torch's own
    reading of the save) every truth tensor equal to the save's slice, and every saved model
    tensor in the truth."""
    cfg = truth["config"]
    E, L, H, F = cfg["experts"], cfg["layers"], cfg["hidden"], cfg["moe_ffn"]
    moe_layers = [1] if cfg["variant"] == "deepseek" else list(range(L))
    out = []
    names = list(truth["model"])
    for group, tensors in [("model", truth["model"])] + \
            [(f"optimizer.{s}", d) for s, d in truth.get("optimizer", {}).items()]:
        seen = {}
        for n in tensors:
            m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)", n)
            if m:
                seen.setdefault((int(m[1]), m[3]), []).append(int(m[2]))
            if "local_experts" in n or ".experts.experts." in n:
                out.append(f"{group}: {n}: not a global expert name")
        for l in moe_layers:
            for p, shape in (("linear_fc1.weight", (2 * F, H)), ("linear_fc2.weight", (H, F))):
                got = sorted(seen.pop((l, p), []))
                if got != list(range(E)):
                    out.append(f"{group}: layer {l} {p}: experts {got}, want 0..{E - 1} once")
                for e in got:
                    t = tensors[f"decoder.layers.{l}.mlp.experts.{e}.{p}"]
                    if tuple(t.shape) != shape:
                        out.append(f"{group}: layer {l} expert {e} {p}: shape {tuple(t.shape)}")
        for (l, p), got in seen.items():
            out.append(f"{group}: layer {l} {p}: experts {got} in a layer that is not MoE")
    for l in range(L):
        router = f"decoder.layers.{l}.mlp.router.weight"
        if (l in moe_layers) != (router in truth["model"]):
            out.append(f"model: layer {l}: router {'missing' if l in moe_layers else 'extra'}")
    if cfg["variant"] == "deepseek":
        for n in ("decoder.layers.0.mlp.linear_fc1.weight",
                  "decoder.layers.1.mlp.shared_experts.linear_fc1.weight",
                  "decoder.layers.1.mlp.router.expert_bias"):
            if n not in truth["model"]:
                out.append(f"model: {n} missing")
    if dcp_full is not None:
        covered = set()
        for n in names:
            key, idx = saved_key(n, dcp_full)
            if key is None:
                out.append(f"model: {n}: no key of the save holds it")
                continue
            covered.add(key)
            want = dcp_full[key][idx] if idx else dcp_full[key]
            if not torch.equal(want, truth["model"][n]):
                out.append(f"model: {n}: differs from the save's {key}{list(idx)}")
        in_save = cfg.get("optim", "fully_reshardable") == "fully_reshardable"
        for s, tensors in (truth.get("optimizer", {}) if in_save else {}).items():
            for n, t in tensors.items():
                key, idx = saved_key(n, dcp_full, f"optimizer.state.{s}.")
                if key is None:
                    out.append(f"optimizer.{s}: {n}: not in the save")
                    continue
                want = dcp_full[key][idx] if idx else dcp_full[key]
                if not torch.equal(want, t):
                    out.append(f"optimizer.{s}: {n}: differs from the save's {key}")
        for key, t in dcp_full.items():
            if isinstance(t, torch.Tensor) and "optimizer." not in key and \
                    key not in covered and "_extra_state" not in key:
                out.append(f"save: {key}: not in the truth")
    return out


def saved_key(name, full, prefix=""):
    """The save's key holding truth name `name` and the prepended-axis index into it."""
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(.+)", name)
    if m:
        layer, expert, rest = int(m[1]), int(m[2]), m[3]
        for key, idx in ((f"decoder.layers.mlp.experts.experts.{rest}", (layer, expert)),
                         (f"decoder.layers.{layer}.mlp.experts.experts.{rest}", (expert,))):
            if prefix + key in full:
                return prefix + key, idx
        return None, ()
    if prefix + name in full:
        return prefix + name, ()
    m = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if m and prefix + f"decoder.layers.{m[2]}" in full:
        return prefix + f"decoder.layers.{m[2]}", (int(m[1]),)
    return None, ()


def check(folder):
    truth = torch.load(pathlib.Path(folder) / "truth.pt", weights_only=False)
    full = mtd.global_tensors(str(pathlib.Path(folder) / f"iter_{ITERATION:07d}"), raw=True)
    problems = problems_of(truth, full)
    n_values = sum(t.numel() for t in truth["model"].values())
    n_values += sum(t.numel() for d in truth.get("optimizer", {}).values() for t in d.values())
    # Negative controls: the checks find a dropped, a duplicated (renamed) and a changed expert.
    cfg = truth["config"]
    layer = 1
    victim = f"decoder.layers.{layer}.mlp.experts.{cfg['experts'] - 1}.linear_fc2.weight"
    controls = []
    dropped = dict(truth, model={k: v for k, v in truth["model"].items() if k != victim})
    controls.append(("dropped expert", problems_of(dropped)))
    dup = dict(truth["model"])
    dup[victim.replace(f".experts.{cfg['experts'] - 1}.", f".experts.{cfg['experts']}.")] = \
        dup[victim]
    controls.append(("extra expert", problems_of(dict(truth, model=dup))))
    changed = dict(truth["model"])
    changed[victim] = changed[victim].clone()
    changed[victim].view(-1)[0] += 1
    controls.append(("changed value", problems_of(dict(truth, model=changed), full)))
    for what, found in controls:
        if not found:
            problems.append(f"negative control '{what}': not detected")
    if n_values < 5000:
        problems.append(f"only {n_values} values compared")
    for p in problems:
        print(p)
    experts = sum(1 for n in truth["model"] if ".mlp.experts." in n)
    print(f"{len(truth['model'])} model tensors ({experts} expert tensors), "
          f"{sum(len(d) for d in truth.get('optimizer', {}).values())} optimizer tensors, "
          f"{n_values} values, steps {truth['steps']}, {len(controls)} negative controls: "
          f"{len(problems)} problems")
    return not problems


def describe(folder):
    """What the save holds, as torch's DCP metadata and common.pt say."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    iter_dir = pathlib.Path(folder) / f"iter_{ITERATION:07d}"
    md = FileSystemReader(str(iter_dir)).read_metadata()
    for key, m in sorted(md.state_dict_metadata.items()):
        if isinstance(m, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            print(f"T {key} {tuple(m.size)} {m.properties.dtype} chunks={chunks}")
        else:
            print(f"O {key}")
    common = torch.load(iter_dir / "common.pt", weights_only=False)

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        else:
            print(f"C {path} {type(x).__name__} {x if isinstance(x, (int, float, str)) else ''}")
    walk(common, "")
    print("metadata.json", (iter_dir / "metadata.json").read_text()
          if (iter_dir / "metadata.json").exists() else None)
    truth_path = pathlib.Path(folder) / "truth.pt"
    if truth_path.exists():
        truth = torch.load(truth_path, weights_only=False)
        for rank, (coords, sharding) in enumerate(zip(truth["ranks"], truth["sharding"])):
            print(f"R rank {rank} {coords}")
            for key, shape, offset, local, axes, replica in sharding:
                print(f"S rank {rank} {key} global {shape} offset {offset} local {local} "
                      f"prepended {axes} replica_id {replica}")


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "load":
        lp = argparse.ArgumentParser(description="load mode")
        lp.add_argument("ckpt")
        lp.add_argument("--truth", required=True, help="the source save (its truth.pt)")
        lp.add_argument("--variant", choices=("mixtral", "deepseek"), default="mixtral")
        for k in ("tp", "pp", "dp", "ep", "vpp"):
            lp.add_argument(f"--{k}", type=int, default=1)
        lp.add_argument("--etp", type=int, default=None)
        lp.add_argument("--optim", default="fully_reshardable",
                        choices=("fully_reshardable", "dp_reshardable", "non_distributed"))
        la = lp.parse_args(sys.argv[2:])
        truth = torch.load(pathlib.Path(la.truth) / "truth.pt", weights_only=False)
        ok, verdicts = run_load(la.ckpt, truth, la.variant, la.tp, la.pp, la.dp, la.ep,
                                la.etp, la.optim, vpp=la.vpp)
        for v in verdicts:
            print(v)
        sys.exit(0 if ok and verdicts and all(v["ok"] for v in verdicts) else 1)
    if len(sys.argv) > 2 and sys.argv[1] in ("check", "describe"):
        if sys.argv[1] == "check":
            sys.exit(0 if check(sys.argv[2]) else 1)
        describe(sys.argv[2])
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--variant", choices=("mixtral", "deepseek"), default="mixtral")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--vpp", type=int, default=1, help="model chunks per pipeline stage")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--etp", type=int, default=None, help="default: --tp")
    p.add_argument("--no-optimizer", action="store_true")
    p.add_argument("--optim", choices=("fully_reshardable", "dp_reshardable"),
                   default="fully_reshardable",
                   help="the distributed optimizer's form in the save (the truth's optimizer "
                        "state is gathered in the fully_reshardable form either way)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--check", action="store_true", help="run `check` on the save afterwards")
    p.add_argument("--size", metavar="LAYERS,HIDDEN,EXPERTS,MOE_FFN",
                   help="another model size (the benchmarks': bench/moe_bench.py); heads, "
                        "groups, top-k and the vocabulary stay")
    p.add_argument("--no-truth", action="store_true",
                   help="no truth.pt (a large save's: the whole model gathered on rank 0)")
    # Several saves in one process (megatron-core imported once): groups of
    # arguments separated by `--and`.
    groups, cur = [], []
    for x in sys.argv[1:]:
        if x == "--and":
            groups.append(cur)
            cur = []
        else:
            cur.append(x)
    groups.append(cur)
    runs = []
    default_size = dict(SIZE)
    for g in groups:
        a = p.parse_args(g)
        SIZE.clear()
        SIZE.update(default_size)  # each save its own size (run() sets it again)
        if a.size:
            SIZE.update(zip(("layers", "hidden", "experts", "moe_ffn"),
                            (int(x) for x in a.size.split(","))))
        a.sizes = dict(SIZE)
        if a.etp is None:
            a.etp = a.tp
        world = a.tp * a.pp * a.dp
        if a.tp > 2:
            p.error("--tp up to 2 (the vocabulary of 128 rows is Megatron's padding of 127 "
                    "for TP 1 and 2)")
        if SIZE["layers"] % (a.pp * a.vpp):
            p.error(f"pp {a.pp} x vpp {a.vpp} must divide the {SIZE['layers']} layers")
        if world % (a.etp * a.ep * a.pp) or SIZE["experts"] % a.ep:
            p.error(f"etp {a.etp} x ep {a.ep} x pp {a.pp} must divide the world {world} and "
                    f"ep the {SIZE['experts']} experts")
        runs.append(a)
    for a in runs:
        if not run(a):
            sys.exit(1)
        if a.check and not check(a.out):
            sys.exit(1)


if __name__ == "__main__":
    main()
