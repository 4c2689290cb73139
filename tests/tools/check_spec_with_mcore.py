"""megatron_spec.py's reading of Megatron's DDP buffer layout, checked against
the real megatron-core (the tests' PyPI environment) on CPU: for seeded random
parameter lists (sizes, a shared embedding first or last, bucket sizes, with
and without the distributed optimizer) at data-parallel sizes 2 and 3,
megatron_spec.buffer_layout gives the same param ranges, buckets and
unpadded bucket sizes as megatron-core's own _ParamAndGradBuffer, and
megatron_spec's DP ranges equal DistributedOptimizer._build_model_gbuf_range.
Also checked against megatron-core: megatron_spec.chunk_layers (the layers of
each pipeline chunk) for every topology of the corpus grid against
get_num_layers_to_build / get_transformer_layer_offset; and each corpus variant's
params (names, local shapes at TP 1 and TP 2, order) against a GPTModel megatron-core
builds with them on CPU. That model takes the local layer spec (Transformer
Engine does not run here), whose norms are modules of their own: megatron_spec's
Transformer Engine names map onto them (linear_qkv.layer_norm_* =
input_layernorm.*, linear_fc1.layer_norm_* = pre_mlp_layernorm.*), and only the
other params' order is compared.
The generator, the comparator and check_universal.py all use megatron_spec;
buffer_layout_test.cc compares the C++ with it: this ties both to Megatron.

  check_spec_with_mcore.py [--cases N]      (forks the ranks itself, after importing
                                            torch and megatron-core once)
"""
import argparse
import os
import pathlib
import random
import socket
import sys
import types

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def random_case(rng):
    n = rng.randint(1, 12)
    numels = [rng.choice([rng.randint(1, 70), rng.randint(100, 5000)]) for _ in range(n)]
    shared = [False] * n
    where = rng.choice(["none", "first", "last", "both"])
    if where in ("first", "both"):
        shared[0] = True
    if where in ("last", "both") and n > 1:
        shared[-1] = True
    bucket = rng.choice([None, None, rng.randint(50, 8000)])
    distopt = rng.random() < 0.75
    return numels, shared, bucket, distopt


def rank_main(rank, world, port, seed, cases, errors):
    import torch
    if not torch.cuda.is_available():  # the buffers go to the current device
        torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from megatron.core import parallel_state
        from megatron.core.distributed.distributed_data_parallel_config import \
            DistributedDataParallelConfig
        from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBuffer
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
        import megatron_spec as S
        parallel_state.initialize_model_parallel(1, 1)
        dp_group = parallel_state.get_data_parallel_group()
        rng = random.Random(seed)
        checked = 0
        for c in range(cases):
            numels, shared, bucket, distopt = random_case(rng)
            where = f"UCP_TEST_SEED={seed} case {c}: numels {numels} shared {shared} " \
                    f"bucket {bucket} distopt {distopt} dp {world}"
            keys = [f"p{i}" for i in range(len(numels))]
            try:
                ours = S.buffer_layout(list(zip(keys, numels, shared)), world, distopt, bucket,
                                       "0.13")
            except S.MegatronVersionError:
                continue  # not a layout 0.13 makes
            params = []
            for n, s in zip(numels, shared):
                p = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
                if s:
                    p.shared_embedding = True
                params.append(p)
            buf = _ParamAndGradBuffer(
                DistributedDataParallelConfig(use_distributed_optimizer=distopt,
                                              grad_reduce_in_fp32=True, bucket_size=bucket),
                torch.bfloat16, torch.float32, params, dp_group, bucket,
                {p: k for k, p in zip(keys, params)}, 1.0, list(range(len(params))), False,
                pg_collection=types.SimpleNamespace(
                    tp=parallel_state.get_tensor_model_parallel_group(),
                    dp_cp=parallel_state.get_data_parallel_group(with_context_parallel=True)))
            theirs = [buf.param_index_map[p] for p in params]
            mine = [ours.index[k] for k in keys]
            if theirs != mine:
                errors.append(f"{where}: param ranges {mine}, Megatron's {theirs}")
                continue
            tb = [(b.offset, b.offset + b.grad_data.numel(), b.numel_unpadded)
                  for b in buf.buckets]
            if tb != list(ours.buckets):
                errors.append(f"{where}: buckets {ours.buckets}, Megatron's {tb}")
                continue
            if distopt:
                for b in range(len(tb)):
                    lo, hi = ours.dp_range(b, world, rank)
                    rmap = DistributedOptimizer._build_model_gbuf_range(buf, b)["param_map"]
                    for k, p in zip(keys, params):
                        s, e, pb = ours.index[k]
                        a, z = max(s, lo), min(e, hi)
                        if pb != b or a >= z:
                            if p in rmap:
                                errors.append(f"{where}: {k} in Megatron's DP range of bucket {b}")
                            continue
                        r = rmap[p]["gbuf_world"]
                        if (r.start, r.end) != (a, z):
                            errors.append(f"{where}: {k} DP range {(a, z)}, Megatron's "
                                          f"{(r.start, r.end)}")
            checked += 1
        if rank == 0:
            print(f"dp {world}: {checked} layouts equal Megatron's", flush=True)
            if checked < cases // 2:
                errors.append(f"dp {world}: only {checked} of {cases} cases checked")
        # The corpus variants' params, TP 2 on 2 ranks, TP 1 on 3; placement once.
        tp = 2 if world == 2 else 1
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tp, 1)
        check_params(tp, errors if rank == 0 else [], rank == 0)
        if rank == 0 and world == 2:
            check_placement(errors)
    except Exception as e:  # noqa: BLE001 - reported by the parent
        errors.append(f"rank {rank}: {type(e).__name__}: {e}")
    finally:
        torch.distributed.destroy_process_group()


# megatron_spec's Transformer Engine norm names -> the local spec's norm modules.
TE_TO_LOCAL = (("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
               ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."))


def local_name(name):
    for te, local in TE_TO_LOCAL:
        if te in name:
            return name.replace(te, local)
    return name


def check_placement(errors):
    """chunk_layers of every (variant, grid topology) with pp > 1 against megatron-core."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
    import megatron_spec as S
    checked = 0
    for cfg in S.VARIANTS.values():
        for t in S.all_topologies(cfg, "full"):
            if t.pp == 1:
                continue
            tc = TransformerConfig(
                num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                num_attention_heads=cfg.num_attention_heads, pipeline_model_parallel_size=t.pp,
                virtual_pipeline_model_parallel_size=t.vpp if t.vpp > 1 else None,
                pipeline_dtype=torch.bfloat16)
            for pp in range(t.pp):
                for vp in range(t.vpp):
                    n = get_num_layers_to_build(tc, vp_stage=vp if t.vpp > 1 else None,
                                                pp_rank=pp)
                    off = get_transformer_layer_offset(tc, vp_stage=vp if t.vpp > 1 else None,
                                                       pp_rank=pp)
                    ours = S.chunk_layers(cfg, t, pp, vp)
                    if ours != list(range(off, off + n)):
                        errors.append(f"{cfg.name} {t.name} pp {pp} vp {vp}: layers {ours}, "
                                      f"Megatron's {list(range(off, off + n))}")
                    checked += 1
    print(f"{checked} pipeline chunks place the layers as Megatron does", flush=True)
    if checked < 20:
        errors.append(f"only {checked} pipeline chunks checked")


def check_params(tp, errors, verbose):
    """Each variant's params (TP `tp`, one pipeline stage) against megatron-core's GPTModel."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    import megatron_spec as S
    for cfg in S.VARIANTS.values():
        tc = TransformerConfig(
            num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
            num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_query_groups,
            kv_channels=cfg.kv_channels, ffn_hidden_size=cfg.ffn_hidden_size,
            add_bias_linear=cfg.add_bias_linear, gated_linear_unit=cfg.swiglu,
            activation_func=torch.nn.functional.silu if cfg.swiglu else torch.nn.functional.gelu,
            normalization=cfg.normalization, use_cpu_initialization=True,
            tensor_model_parallel_size=tp)
        model = GPTModel(
            config=tc, transformer_layer_spec=get_gpt_layer_local_spec(
                normalization=cfg.normalization),
            vocab_size=S.padded_vocab_size(cfg, tp),
            max_sequence_length=cfg.max_position_embeddings,
            position_embedding_type=cfg.position_embedding_type,
            share_embeddings_and_output_weights=cfg.tied)
        theirs = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
        t = S.Topology(tp, 1, 1, 1, False)
        ours = [(local_name(e.key), S.local_shape(e.param, cfg, tp))
                for e in S.chunk_params(cfg, t, 0, 0)]
        where = f"{cfg.name} tp {tp}"
        if dict(ours) != dict(theirs):
            diff = sorted(set(ours) ^ set(theirs))[:6]
            errors.append(f"{where}: params differ from Megatron's GPTModel: {diff}")
        norms = tuple(local for _, local in TE_TO_LOCAL)
        def plain(lst):
            return [n for n, _ in lst if not any(x in n for x in norms)]
        if plain(ours) != plain(theirs):
            errors.append(f"{where}: param order differs from Megatron's GPTModel")
    if verbose:
        print(f"tp {tp}: {len(S.VARIANTS)} variants checked against Megatron's params",
              flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=60)
    a = ap.parse_args()
    seed = int(os.environ.get("UCP_TEST_SEED", random.randrange(1 << 30)))
    print(f"UCP_TEST_SEED={seed}", flush=True)
    import torch.multiprocessing as mp
    import oracle_checks
    # Imported here once; the ranks are forked from this process (no import of their own).
    import megatron_spec  # noqa: F401
    import megatron_torch_dist
    megatron_torch_dist.preload()
    ctx = mp.get_context("fork")
    failures = []
    for world in (2, 3):
        with ctx.Manager() as m:
            errors = m.list()
            port = free_port()
            procs = [ctx.Process(target=rank_main, args=(r, world, port, seed, a.cases, errors))
                     for r in range(world)]
            for p in procs:
                p.start()
            # A rank still running at the deadline is killed and a failure, never a pass.
            try:
                oracle_checks.join_ranks(procs, 600, f"dp {world}")
            except AssertionError as e:
                failures.append(str(e))
            failures += list(errors)
    for f in failures[:20]:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
