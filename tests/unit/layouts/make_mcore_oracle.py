#!/usr/bin/python3
"""Writes data/mcore_core_v0.8.0_oracle.json: what Megatron-core itself says
about the names, shapes and tensor/pipeline placement of GPTModel params.

Not run by ctest (it needs Megatron-LM's source); its output is checked in and
read by mcore_oracle_test.cc. Regenerate with

  git -C <Megatron-LM clone> archive core_v0.8.0 megatron/core | tar -x -C /tmp/mlm
  /usr/bin/python3 make_mcore_oracle.py --megatron /tmp/mlm --out data/mcore_core_v0.8.0_oracle.json

For each model configuration and topology (tp, pp, vpp) it builds the real
GPTModel (local layer spec, CPU, gloo) on every rank, one model chunk per
virtual stage, and records per rank and chunk every state-dict key with its
local shape and what model.sharded_state_dict() says: the global shape and
the global offset of the local tensor (or, for the SwiGLU fc1 factory, of
each part of it), with the prepended layer axis giving the global layer
index. Vocabulary sizes are padded with Megatron's own loop
(megatron/training/tokenizer/tokenizer.py::_vocab_size_with_padding).
"""
import argparse
import json
import os
import sys
import warnings

CONFIGS = [
    dict(id="gelu_layernorm_bias_learned_tied", num_layers=4, hidden_size=16,
         num_attention_heads=4, num_query_groups=None, ffn_hidden_size=32,
         swiglu=False, add_bias_linear=True, tied=True, position="learned_absolute",
         qk_layernorm=False),
    dict(id="swiglu_gqa_nobias_rope_untied_qknorm", num_layers=4, hidden_size=16,
         num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24,
         swiglu=True, add_bias_linear=False, tied=False, position="rope",
         qk_layernorm=True),
    dict(id="swiglu_bias_learned_tied", num_layers=4, hidden_size=16,
         num_attention_heads=4, num_query_groups=None, ffn_hidden_size=24,
         swiglu=True, add_bias_linear=True, tied=True, position="learned_absolute",
         qk_layernorm=False),
]
TOPOLOGIES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 2, 2), (2, 2, 2)]
TRUE_VOCAB = 100
DIVISIBLE_BY = 8


def vocab_size_with_padding(orig, divisible_by, tp):
    # Megatron's loop, megatron/training/tokenizer/tokenizer.py.
    after = orig
    multiple = divisible_by * tp
    while (after % multiple) != 0:
        after += 1
    return after


def worker(rank, world, cfg, tp, pp, vpp, port, queue):
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    # Tied embeddings on PP > 1 are all-reduced at init after .cuda(); stay on
    # the CPU (gloo). Only values change, not names, shapes or placement.
    torch.Tensor.cuda = lambda self, *a, **k: self
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=(vpp if vpp > 1 else None))
    kwargs = {}
    if cfg["swiglu"]:
        kwargs.update(gated_linear_unit=True, activation_func=F.silu, bias_activation_fusion=False)
    config = TransformerConfig(
        num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
        num_attention_heads=cfg["num_attention_heads"],
        num_query_groups=cfg["num_query_groups"], ffn_hidden_size=cfg["ffn_hidden_size"],
        add_bias_linear=cfg["add_bias_linear"], qk_layernorm=cfg["qk_layernorm"],
        pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
        virtual_pipeline_model_parallel_size=(vpp if vpp > 1 else None),
        pipeline_dtype=torch.float32, use_cpu_initialization=True, **kwargs)
    padded = vocab_size_with_padding(TRUE_VOCAB, DIVISIBLE_BY, tp)
    chunks = []
    for v in range(vpp):
        if vpp > 1:
            parallel_state.set_virtual_pipeline_model_parallel_rank(v)
        model = GPTModel(
            config, get_gpt_layer_local_spec(qk_layernorm=cfg["qk_layernorm"]),
            vocab_size=padded, max_sequence_length=8,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=cfg["tied"],
            position_embedding_type=cfg["position"])
        sd = model.state_dict()
        sharded = model.sharded_state_dict()
        entries = []
        for key, value in sd.items():
            e = {"key": key}
            if isinstance(value, torch.Tensor):
                e["local_shape"] = list(value.shape)
            else:
                e["value"] = repr(value)
            sh = sharded.get(key)
            parts = []
            if sh is not None and type(sh).__name__ == "ShardedTensorFactory":
                built = sh.build()
                built = built if isinstance(built, (list, tuple)) else [built]
                base = value.storage_offset()
                for b in built:
                    # where this part sits in the local tensor (dim 0 offset)
                    row = value[0].numel() if value.dim() > 1 else 1
                    local_off = (b.data.storage_offset() - base) // row
                    parts.append(dict(kind="tensor", local_dim0_offset=local_off,
                                      data_shape=list(b.data.shape),
                                      global_shape=list(b.global_shape),
                                      global_offset=list(b.global_offset),
                                      prepend_axis_num=b.prepend_axis_num,
                                      replica_id=list(b.replica_id) if isinstance(b.replica_id, tuple) else [b.replica_id]))
            elif sh is not None and type(sh).__name__ == "ShardedTensor":
                parts.append(dict(kind="tensor", local_dim0_offset=0,
                                  data_shape=list(sh.data.shape),
                                  global_shape=list(sh.global_shape),
                                  global_offset=list(sh.global_offset),
                                  prepend_axis_num=sh.prepend_axis_num,
                                  replica_id=list(sh.replica_id) if isinstance(sh.replica_id, tuple) else [sh.replica_id]))
            elif sh is not None:
                parts.append(dict(kind=type(sh).__name__))
            e["sharded"] = parts
            entries.append(e)
        chunks.append(dict(vp_chunk=v, entries=entries))
    queue.put(dict(rank=rank, tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                   pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                   padded_vocab_size=padded, chunks=chunks))
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron", required=True, help="folder holding megatron/core (core_v0.8.0)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, args.megatron)
    os.environ["PYTHONPATH"] = args.megatron + os.pathsep + os.environ.get("PYTHONPATH", "")
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    runs = []
    port = 29600
    for cfg in CONFIGS:
        for tp, pp, vpp in TOPOLOGIES:
            world = tp * pp
            queue = ctx.Queue()
            port += 1
            procs = [ctx.Process(target=worker, args=(r, world, cfg, tp, pp, vpp, port, queue))
                     for r in range(world)]
            for p in procs:
                p.start()
            ranks = []
            while len(ranks) < world:
                try:
                    ranks.append(queue.get(timeout=5))
                except Exception:
                    if any(p.exitcode not in (None, 0) for p in procs):
                        for p in procs:
                            p.kill()
                        raise SystemExit(f"worker failed: {cfg['id']} tp{tp} pp{pp} vpp{vpp}")
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"worker failed: {cfg['id']} tp{tp} pp{pp} vpp{vpp}")
            ranks.sort(key=lambda r: r["rank"])
            variables = dict(num_layers=cfg["num_layers"], hidden_size=cfg["hidden_size"],
                             num_attention_heads=cfg["num_attention_heads"],
                             num_query_groups=cfg["num_query_groups"] or cfg["num_attention_heads"],
                             ffn_hidden_size=cfg["ffn_hidden_size"], vocab_size=TRUE_VOCAB,
                             make_vocab_size_divisible_by=DIVISIBLE_BY, swiglu=int(cfg["swiglu"]),
                             tied=int(cfg["tied"]), add_bias_linear=int(cfg["add_bias_linear"]))
            runs.append(dict(config=cfg["id"], variables=variables, tp=tp, pp=pp, vpp=vpp,
                             ranks=ranks))
            print(cfg["id"], tp, pp, vpp, "ok", flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(megatron="core_v0.8.0", spec="local", runs=runs), f, indent=None,
                  separators=(",", ":"))
        f.write("\n")


if __name__ == "__main__":
    main()
