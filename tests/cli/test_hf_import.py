"""Hugging Face model folders as a source (`--from hf`), against the real frameworks (the tests'
PyPI environment).

transformers makes small random models with its own `save_pretrained`, sharded with an index
(`max_shard_size`): a LlamaForCausalLM with grouped-query attention (4 heads, 2 key / value heads)
and untied embeddings, a Qwen2ForCausalLM with its q/k/v biases and tied embeddings, a
Qwen3ForCausalLM with its QK norms (megatron-core's qk_layernorm) and a head dim that is not
hidden / heads (kv_channels). Every weight is random (norms and biases too: a misplaced one
shows).
- ucp converts each to Megatron-core torch_dist under Megatron's names (`--names mcore-llama`)
  at TP1·PP1 and TP2·PP2; the real megatron-core builds the GPTModel the config describes, loads
  the checkpoint with dist_checkpointing.load and load_state_dict (every key but the
  `_extra_state` objects a checkpoint of another framework has none of), and then
  - at TP1·PP1 its own fp32 forward gives transformers' logits within 1e-5 of their largest
    magnitude (negative control: one weight changed afterwards moves them past that);
  - at TP2·PP2 every local shard equals the global tensor this test builds from transformers'
    state dict, fused as megatron-core lays it out (written here from its sources: linear_qkv
    rows per query group [q heads of the group; k; v] (attention.py,
    get_query_key_value_tensors), linear_fc1 [gate; up] (mlp.py, glu), the vocabulary padded
    with zero rows to a multiple of 128 x TP); negative control: one element of the
    reference changed is found.
- The args Megatron starts from (`common.pt`'s, and every legacy rank file's): each field equal
  to what this test computes from config.json (Megatron-LM's argument names: sizes, query
  groups, kv_channels, SwiGLU, RMSNorm and its eps, rope and its base, untied output, QKV bias,
  QK norm, vocabulary and its padding for the TP, the parallel sizes; the MoE fields), with a
  negative control (one value changed is found); iteration 0 as `release` (Megatron-LM's
  read_metadata takes iteration 0 only so), no optimizer.
- Megatron's legacy format (`--format megatron`) at TP2: every rank's model_optim_rng.pt loaded
  by megatron-core's GPTModel.load_state_dict (Transformer Engine's norm names mapped to the
  local spec's by the spec's own sharded_state_dict_keys_map), every shard equal to the fused
  reference; `ucp export --hf` of it bit for bit (MoE: EP 2 legacy likewise).
- `ucp export --hf` of the universal file and of the TP2·PP2 output gives back transformers'
  tensors bit for bit (same names, dtype and values, read with the safetensors package), and
  transformers loads the export with no key missing; of the TP2·PP2 output the config's heads,
  eps, rotary base come back from the args (only the true vocabulary given).
- `--format dcp --dp 2`: torch's dcp.load reads every tensor under transformers' names.
- The same model as torch.save shards with an index (pytorch_model-*.bin): `ucp export --hf`
  gives back the same tensors bit for bit.
- A MixtralForCausalLM, a Qwen3MoeForCausalLM (QK norms, layer 0 dense) and a
  Qwen2MoeForCausalLM (layer 0 dense, a gated shared expert) (bf16, per-expert names): megatron-core's MoE GPTModel loads the torch_dist output at EP 1 and gives
  transformers' logits; EP 2 and back gives the tensors bit for bit.
  A bf16 MistralForCausalLM comes back bit for bit.
- transformers 5's fused experts (`save_original_format=False`: mlp.experts.gate_up_proj /
  down_proj) of the same three MoE models: the universal file equal, atom by atom (h5py), to
  that of transformers' per-expert save; `export --hf` writes the per-expert tensors; the fused
  Mixtral's torch_dist loaded by megatron-core, transformers' logits.
- An FP8 block-scaled LLaMA quantized here with the published block scheme (hidden 200 and ffn
  300: partial edge blocks; scales in another shard than their weights): refused without
  `--dequantize`; with it the universal file (h5py) and torch's dcp.load of the DCP output equal
  torch's own dequantization bit for bit (a flipped scale byte is seen); megatron-core loads the
  fp32 dequantized torch_dist at TP1 (transformers' logits on the same weights) and TP2; a missing
  scale, one of the wrong shape (both also under ucp_san), one without weight, another
  quant_method / fmt: one error line each.
- Malformed folders: an index naming a missing shard, a shard tensor the index does not name, a
  header cut short, a config that disagrees with the shapes, an unknown architecture, a tensor
  with no place, a tied model's saved lm_head that differs from the embedding: one error line
  naming the file and tensor / setting, non-zero exit, nothing written; each also through the
  sanitized ucp_san (UCP_SAN: ASan + UBSan), with the same line and no sanitizer report.
"""
import argparse
import contextlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import megatron_torch_dist as mtd  # noqa: E402

from testmain import Tmp, run  # noqa: E402

SAN = os.environ.get("UCP_SAN")  # ucp_san (ASan + UBSan) under ctest
TOKENS = (2, 12)
MIN_VALUES = 2000  # values each oracle compares at least
MODELS = {
    # GQA, untied
    "llama": dict(arch="LlamaForCausalLM", hidden_size=32, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                  vocab_size=100, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  max_position_embeddings=64, rope_theta=500000.0),
    # QKV bias, tied
    "qwen2": dict(arch="Qwen2ForCausalLM", hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=40,
                  vocab_size=150, tie_word_embeddings=True, rms_norm_eps=1e-6,
                  max_position_embeddings=64, rope_theta=10000.0),
    # QK norms, a head dim that is not hidden / heads, untied
    "qwen3": dict(arch="Qwen3ForCausalLM", hidden_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  intermediate_size=40, vocab_size=120, tie_word_embeddings=False,
                  rms_norm_eps=1e-6, max_position_embeddings=64, rope_theta=1000000.0),
    # FP8 block-scaled copy (test_fp8_block_scaled): sizes that leave partial 128 x 128 blocks
    "fp8": dict(arch="LlamaForCausalLM", hidden_size=200, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, intermediate_size=300,
                vocab_size=100, tie_word_embeddings=False, rms_norm_eps=1e-5,
                max_position_embeddings=64, rope_theta=10000.0),
}


def head_dim(s):
    return s.get("head_dim") or s["hidden_size"] // s["num_attention_heads"]


def one_error_line(p, *needles):
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def make_hf(out, kind, seed=1):
    """transformers' save_pretrained of a random `kind` model, sharded (an index); returns its
    state dict."""
    import transformers
    spec = dict(MODELS[kind])
    arch = spec.pop("arch")
    theta = spec.pop("rope_theta")
    cfg_cls = {"LlamaForCausalLM": transformers.LlamaConfig,
               "Qwen2ForCausalLM": transformers.Qwen2Config,
               "Qwen3ForCausalLM": transformers.Qwen3Config}[arch]
    cfg = cfg_cls(**spec, rope_parameters={"rope_type": "default", "rope_theta": theta})
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if n.endswith("norm.weight") else 0.1)
                    + (1.0 if n.endswith("norm.weight") else 0.0))
    model.save_pretrained(out, max_shard_size="20KB")
    assert (pathlib.Path(out) / "model.safetensors.index.json").exists()
    return {k: v.clone() for k, v in model.state_dict().items()}


def hf_logits(hf_dir):
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    tokens = torch.randint(0, 100, TOKENS, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return tokens, model.eval()(tokens).logits


def padded_vocab(v, tp):
    m = 128 * tp
    return (v + m - 1) // m * m


def megatron_reference(sd, kind, tp):
    """{torch_dist key: global tensor} of transformers' state dict `sd`, fused as megatron-core
    keeps it (the module's doc)."""
    s = MODELS[kind]
    nq, ng = s["num_attention_heads"], s["num_key_value_heads"]
    d = head_dim(s)
    vocab = padded_vocab(s["vocab_size"], tp)
    out = {}

    def pad(t):
        return torch.cat([t, t.new_zeros((vocab - t.shape[0],) + tuple(t.shape[1:]))])

    out["embedding.word_embeddings.weight"] = pad(sd["model.embed_tokens.weight"])
    if not s["tie_word_embeddings"]:
        out["output_layer.weight"] = pad(sd["lm_head.weight"])
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    for i in range(s["num_hidden_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        for part in ("weight", "bias") if kind == "qwen2" else ("weight",):
            q = sd[h + f"self_attn.q_proj.{part}"]
            k = sd[h + f"self_attn.k_proj.{part}"]
            v = sd[h + f"self_attn.v_proj.{part}"]
            rest = tuple(q.shape[1:])
            q = q.reshape((ng, nq // ng * d) + rest)
            k = k.reshape((ng, d) + rest)
            v = v.reshape((ng, d) + rest)
            out[m + f"self_attention.linear_qkv.{part}"] = \
                torch.cat([q, k, v], dim=1).reshape((-1,) + rest)
        out[m + "self_attention.linear_qkv.layer_norm_weight"] = sd[h + "input_layernorm.weight"]
        if kind == "qwen3":  # Megatron's qk_layernorm
            out[m + "self_attention.q_layernorm.weight"] = sd[h + "self_attn.q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = sd[h + "self_attn.k_norm.weight"]
        out[m + "self_attention.linear_proj.weight"] = sd[h + "self_attn.o_proj.weight"]
        out[m + "mlp.linear_fc1.layer_norm_weight"] = sd[h + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([sd[h + "mlp.gate_proj.weight"],
                                                       sd[h + "mlp.up_proj.weight"]])
        out[m + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
    # torch_dist keys stack the layers: decoder.layers.<rest> [layers, ...]
    stacked = {}
    for k in [k for k in out if k.startswith("decoder.layers.")]:
        rest = k.split(".", 3)[3]
        stacked.setdefault(f"decoder.layers.{rest}", []).append(out.pop(k))
    out.update({k: torch.stack(v) for k, v in stacked.items()})
    return out


def build_gpt(kind, tp, bf16=False):
    """megatron-core's GPTModel of the config (local spec, fp32; bf16: as training's
    Float16Module holds it) for the current parallel state."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    s = MODELS[kind]
    cfg = TransformerConfig(
        num_layers=s["num_hidden_layers"], hidden_size=s["hidden_size"],
        num_attention_heads=s["num_attention_heads"], num_query_groups=s["num_key_value_heads"],
        ffn_hidden_size=s["intermediate_size"], kv_channels=head_dim(s),
        qk_layernorm=kind == "qwen3", use_cpu_initialization=True,
        gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        normalization="RMSNorm", layernorm_epsilon=s["rms_norm_eps"], add_bias_linear=False,
        add_qkv_bias=kind == "qwen2", bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size())
    model = GPTModel(
        config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
            qk_layernorm=kind == "qwen3", normalization="RMSNorm"),
        vocab_size=padded_vocab(s["vocab_size"], tp), max_sequence_length=64,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=s["tie_word_embeddings"],
        position_embedding_type="rope", rotary_base=s["rope_theta"])
    return model.to(torch.bfloat16) if bf16 else model


def load_rank(rank, world, port, a):
    """One rank: the GPTModel at (a.tp, a.pp) loaded from ucp's torch_dist folder a.ckpt; every
    local shard against a.full (and a.bad: the reference with one element changed, which must
    be found); at world 1 also the logits against transformers' (a.tokens, a.logits)."""
    mtd.init(rank, world, port, a.tp, a.pp, 1)
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.tensor_parallel import random as mrandom
    # (tied embeddings: the last stage's copy is all-reduced on "CUDA" at construction)
    torch.Tensor.cuda = lambda self, *x, **k: self
    torch.manual_seed(999)
    model = build_gpt(a.kind, a.tp)
    tracker = pathlib.Path(a.ckpt) / "latest_checkpointed_iteration.txt"
    it = tracker.read_text().strip()
    iter_dir = pathlib.Path(a.ckpt) / (it if it == "release" else f"iter_{int(it):07d}")
    if a.legacy:
        # Megatron's legacy load: this rank's model_optim_rng.pt, GPTModel.load_state_dict. The
        # checkpoint has Transformer Engine's names (Megatron-LM's default); the local spec's
        # own sharded_state_dict_keys_map renames its norms so.
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        rank_dir = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if a.pp > 1 else "")
        legacy = torch.load(iter_dir / rank_dir / "model_optim_rng.pt", map_location="cpu",
                            weights_only=False)
        keys_map = get_gpt_layer_local_spec(
            qk_layernorm=a.kind == "qwen3",
            normalization="RMSNorm").submodules.sharded_state_dict_keys_map
        state = {}
        for k, v in legacy["model"].items():
            for local, te in keys_map.items():
                k = k.replace(te, local)
            state[k] = v
        args = legacy["args"]
        if (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) != (a.tp, a.pp) \
                or legacy.get("checkpoint_version") != 3.0 or legacy.get("iteration") != 0:
            problems_args = [f"{rank_dir}: args tp {args.tensor_model_parallel_size} pp "
                             f"{args.pipeline_model_parallel_size}, checkpoint_version "
                             f"{legacy.get('checkpoint_version')}, iteration "
                             f"{legacy.get('iteration')}"]
        else:
            problems_args = []
        res = model.load_state_dict(state, strict=False)
    else:
        sd = {"model": model.sharded_state_dict()}

        def drop_extra(d):  # a checkpoint of another framework has no _extra_state objects
            for k in list(d):
                if isinstance(d[k], dict):
                    drop_extra(d[k])
                elif str(k).endswith("_extra_state"):
                    del d[k]
        drop_extra(sd)
        loaded = dist_checkpointing.load(sd, str(iter_dir))
        res = model.load_state_dict(loaded["model"], strict=False)
        problems_args = []
    problems = problems_args + [f"not loaded: {k}" for k in res.missing_keys
                                if not k.endswith("_extra_state")]
    problems += [f"unexpected: {k}" for k in res.unexpected_keys]
    after = model.sharded_state_dict()
    apply_factories(after)
    checked = values = 0
    bad_found = []
    for sh in nested_values(after):
        if isinstance(sh, ShardedTensor) and not sh.key.endswith("_extra_state"):
            values += mtd.check_shard(sh, a.full, problems, "model")
            checked += 1
            mtd.check_shard(sh, a.bad, bad_found, "control")
    verdict = {"rank": rank, "checked": checked, "values": values, "control": len(bad_found)}
    if world == 1:
        # Megatron's own forward in float32 against transformers' logits.
        model.eval()
        mrandom.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
        b, s = TOKENS
        mask = torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None]
        with torch.no_grad():
            got = model(a.tokens, torch.arange(s).expand(b, s), attention_mask=mask)
            got = got[..., :a.logits.shape[-1]]
            diff = float((got - a.logits).abs().max())
            tol = 1e-5 * float(a.logits.abs().max())
            if not diff <= tol:
                problems.append(f"logits differ by up to {diff} (tolerance {tol})")
            # negative control: one weight changed moves the logits past the tolerance
            w = model.decoder.layers[0].mlp.linear_fc2.weight
            w[0, 0] += 0.5
            moved = model(a.tokens, torch.arange(s).expand(b, s), attention_mask=mask)
            verdict["control_logits"] = float(
                (moved[..., :a.logits.shape[-1]] - a.logits).abs().max()) > tol
        verdict.update(logits=got.numel(), max_abs_diff=diff)
    verdict.update(ok=not problems, problems=problems[:10])
    mtd.report(a, verdict)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if problems:
        sys.exit(1)


def megatron_load(ckpt, kind, tp, pp, full, tokens=None, logits=None, legacy=False):
    """Every rank's verdict of load_rank (forked from this process); `legacy`: a Megatron-LM
    legacy folder (`--format megatron`)."""
    bad = dict(full)
    key = "decoder.layers.self_attention.linear_qkv.weight"  # layer 1's
    bad[key] = full[key].clone()
    bad[key][1, 3, 5] += 1.0
    with Tmp("ucp-hf-run-") as t:
        a = argparse.Namespace(kind=kind, ckpt=str(ckpt), tp=tp, pp=pp, full=full, bad=bad,
                               tokens=tokens, logits=logits, report=str(t / "verdicts"),
                               legacy=legacy)
        ctx = mp.start_processes(load_rank, args=(tp * pp, mtd.free_port(), a), nprocs=tp * pp,
                                 join=False, start_method="fork")
        ok = mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "hf import load")
        path = t / "verdicts"
        verdicts = [json.loads(x) for x in path.read_text().splitlines()] \
            if path.exists() else []
    assert ok and len(verdicts) == tp * pp and all(v["ok"] for v in verdicts), verdicts
    assert sum(v["values"] for v in verdicts) >= MIN_VALUES, verdicts
    assert sum(v["control"] for v in verdicts) >= 1, verdicts  # the changed element is found
    if tokens is not None:
        assert verdicts[0]["logits"] >= MIN_VALUES and verdicts[0]["control_logits"], verdicts
    print(f"{kind}{' legacy' if legacy else ''} tp {tp} pp {pp}: "
          f"{sum(v['checked'] for v in verdicts)} shards, "
          f"{sum(v['values'] for v in verdicts)} values equal"
          + (f", logits within {verdicts[0]['max_abs_diff']:.2e}" if tokens is not None else ""),
          flush=True)
    return verdicts


def expected_args(cfg, tp, pp, ep=1):
    """{Megatron arg: value} that a run of transformers' config.json `cfg` at (tp, pp, ep) has,
    computed from the config alone (Megatron-LM's arguments.py names)."""
    heads, groups = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    groups = groups or heads
    rope = cfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta"))
    mt = cfg["model_type"]
    vocab = cfg["vocab_size"]
    want = dict(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
        num_query_groups=groups, group_query_attention=groups != heads,
        kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        swiglu=cfg["hidden_act"] == "silu", normalization="RMSNorm",
        norm_epsilon=cfg["rms_norm_eps"], position_embedding_type="rope",
        rotary_base=theta, untie_embeddings_and_output_weights=not cfg["tie_word_embeddings"],
        add_bias_linear=False,
        add_qkv_bias=mt == "qwen2" or (mt == "qwen2_moe" and cfg.get("qkv_bias", True))
        or (mt == "glm4_moe" and cfg.get("attention_bias", False)),
        qk_layernorm=mt in ("qwen3", "qwen3_moe") or (mt == "glm4_moe" and cfg["use_qk_norm"]),
        vocab_size=vocab,
        make_vocab_size_divisible_by=128, padded_vocab_size=padded_vocab(vocab, tp),
        max_position_embeddings=cfg["max_position_embeddings"],
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        bf16=cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16")
    if mt in ("mixtral", "qwen2_moe", "qwen3_moe"):
        n = cfg["num_hidden_layers"]
        if mt == "mixtral":
            moe = [1] * n
            want.update(moe_ffn_hidden_size=cfg["intermediate_size"])
        else:
            step, dense = cfg.get("decoder_sparse_step", 1), cfg.get("mlp_only_layers", [])
            moe = [int(i not in dense and (i + 1) % step == 0) for i in range(n)]
            want.update(moe_ffn_hidden_size=cfg["moe_intermediate_size"])
        want.update(num_experts=cfg.get("num_local_experts", cfg.get("num_experts")),
                    moe_router_topk=cfg["num_experts_per_tok"],
                    moe_layer_freq=1 if all(moe) else moe, expert_model_parallel_size=ep)
        if mt == "qwen2_moe":
            want.update(moe_shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
                        moe_shared_expert_gate=True)
    if mt == "glm4_moe":  # DeepSeek-V3's router (megatron-core's names for each setting)
        n, first = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
        moe = [int(i >= first) for i in range(n)]
        limited = cfg["n_group"] > 1 and cfg["topk_group"] < cfg["n_group"]
        want.update(
            num_experts=cfg["n_routed_experts"], moe_router_topk=cfg["num_experts_per_tok"],
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_layer_freq=1 if all(moe) else moe, expert_model_parallel_size=ep,
            moe_shared_expert_intermediate_size=cfg["moe_intermediate_size"]
            * cfg["n_shared_experts"], moe_shared_expert_gate=False,
            moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
            moe_router_topk_scaling_factor=cfg["routed_scaling_factor"],
            moe_router_num_groups=cfg["n_group"] if limited else None,
            moe_router_group_topk=cfg["topk_group"] if limited else None,
            rotary_percent=rope.get("partial_rotary_factor",
                                    cfg.get("partial_rotary_factor", 0.5)))
    return want


def check_args(args, cfg, tp, pp, what, ep=1):
    """The args Namespace against expected_args of config.json (field by field; a negative
    control: one config value changed is found)."""
    def wrong(want):
        return [f"{what}: args.{k} {getattr(args, k, '<absent>')!r}, config.json gives {v!r}"
                for k, v in want.items() if getattr(args, k, None) != v
                or type(getattr(args, k, None)) is not type(v) and not isinstance(v, float)]
    want = expected_args(cfg, tp, pp, ep)
    assert not wrong(want), wrong(want)
    assert len(want) >= 20, want
    bad = dict(want, num_query_groups=want["num_query_groups"] + 1)  # negative control
    assert len(wrong(bad)) == 1, wrong(bad)


def read_safetensors(folder):
    """{name: tensor} of every safetensors file of `folder` (the safetensors package)."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def assert_same_tensors(got, want, what):
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    n = 0
    for k in want:
        assert got[k].dtype == want[k].dtype, (what, k, got[k].dtype, want[k].dtype)
        assert torch.equal(got[k], want[k]), (what, k)
        n += want[k].numel()
    assert n >= MIN_VALUES, (what, n)


def check_model(kind):
    mtd.preload()
    with Tmp(f"ucp-hf-{kind}-") as t:
        src = t / "hf"
        sd = make_hf(src, kind)
        hf_tensors = read_safetensors(src)  # what the files hold (a tied head is not saved)
        tokens, logits = hf_logits(src)
        config = json.loads((src / "config.json").read_text())
        # the universal file and `ucp export --hf` of it: transformers' tensors bit for bit
        p = run("to-universal", src, "-o", t / "u.h5")
        assert "hf" in p.stdout, p.stdout
        run("export", t / "u.h5", "-o", t / "exp", "--hf", "-q")
        exported = read_safetensors(t / "exp")
        assert_same_tensors(exported, hf_tensors, "export --hf of the universal file")
        bad = {k: v.clone() for k, v in hf_tensors.items()}
        bad["model.layers.0.mlp.up_proj.weight"][1, 2] += 1e-3
        with contextlib.suppress(AssertionError):  # negative control
            assert_same_tensors(exported, bad, "control")
            raise RuntimeError("the export compare missed a changed element")
        import transformers
        _, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(t / "exp"), dtype=torch.float32, output_loading_info=True)
        assert not any(info.values()), info
        cfg = json.loads((t / "exp" / "config.json").read_text())
        assert cfg["architectures"] == [MODELS[kind]["arch"]], cfg
        # Megatron-core torch_dist at TP1·PP1 (logits) and TP2·PP2 (every shard)
        for tp, pp in ((1, 1), (2, 2)):
            out = t / f"td{tp}{pp}"
            run("convert", src, "-o", out, "--format", "megatron-torch-dist", "--tp", tp,
                "--pp", pp, "--dp", 1, "--names", "mcore-llama", "-q")
            full = megatron_reference(sd, kind, tp)
            megatron_load(out, kind, tp, pp, full, tokens if tp == 1 else None,
                          logits if tp == 1 else None)
            # the args Megatron starts from (--finetune): config.json's, field by field
            # (iteration 0 as Megatron-LM's read_metadata takes it: `release`)
            assert (out / "latest_checkpointed_iteration.txt").read_text() == "release"
            common = torch.load(out / "release" / "common.pt", weights_only=False)
            check_args(common["args"], config, tp, pp, f"{out} common.pt")
            assert common["iteration"] == 0 and "optimizer" not in common, sorted(common)
        # Megatron's legacy format at TP2: args in every rank file, megatron-core's GPTModel
        # loads each rank's model, every shard equal to the fused reference.
        run("convert", src, "-o", t / "legacy", "--format", "megatron", "--tp", 2, "--pp", 1,
            "--dp", 1, "--names", "mcore-llama", "-q")
        assert (t / "legacy" / "latest_checkpointed_iteration.txt").read_text() == "release"
        for r in (0, 1):
            f = t / "legacy" / "release" / f"mp_rank_{r:02d}" / "model_optim_rng.pt"
            check_args(torch.load(f, weights_only=False)["args"], config, 2, 1, str(f))
        megatron_load(t / "legacy", kind, 2, 1, megatron_reference(sd, kind, 2), legacy=True)
        run("export", t / "legacy", "-o", t / "exp4", "--hf", "-q", "--vocab-size",
            config["vocab_size"])
        assert_same_tensors(read_safetensors(t / "exp4"), hf_tensors,
                            "export --hf of the TP2 legacy output")
        # back from Megatron: the same tensors, and from the args written with them the
        # config's sizes, eps and rotary base (only the true vocabulary is given: args
        # without a NullTokenizer do not record it)
        run("export", t / "td22", "-o", t / "exp2", "--hf", "-q", "--vocab-size",
            config["vocab_size"])
        assert_same_tensors(read_safetensors(t / "exp2"), hf_tensors,
                            "export --hf of the TP2·PP2 torch_dist output")
        back = json.loads((t / "exp2" / "config.json").read_text())
        for k in ("num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                  "max_position_embeddings", "tie_word_embeddings"):
            assert back[k] == config[k], (k, back[k], config[k])
        assert back["rope_theta"] == config["rope_parameters"]["rope_theta"], back
        # reshaped again (TP2·PP2 -> TP1·PP1): the args carried and patched, still `release`
        run("convert", t / "td22", "-o", t / "again11", "--format", "megatron-torch-dist", "--tp", 1,
            "--pp", 1, "--dp", 1, "-q", "--vocab-size", config["vocab_size"])
        assert (t / "again11" / "latest_checkpointed_iteration.txt").read_text() == "release"
        check_args(torch.load(t / "again11" / "release" / "common.pt", weights_only=False)["args"],
                   config, 1, 1, "TP2·PP2 -> TP1·PP1 common.pt")
        # The same model as torch.save shards with their index (pytorch_model-*.bin, as older
        # transformers saved it): the same tensors back, bit for bit.
        names = sorted(hf_tensors)
        weight_map = {}
        (t / "bin").mkdir()
        shutil.copy(src / "config.json", t / "bin")
        for i, part in enumerate((names[:len(names) // 2], names[len(names) // 2:])):
            shard = f"pytorch_model-{i + 1:05d}-of-00002.bin"
            torch.save({n: hf_tensors[n] for n in part}, t / "bin" / shard)
            weight_map.update({n: shard for n in part})
        (t / "bin" / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}))
        run("export", t / "bin", "-o", t / "exp3", "--hf", "-q")
        assert_same_tensors(read_safetensors(t / "exp3"), hf_tensors,
                            "export --hf of the pytorch_model-*.bin folder")
        # DCP under transformers' names: torch's dcp.load
        run("convert", src, "-o", t / "dcp", "--format", "dcp", "--dp", 2, "-q")
        import torch.distributed.checkpoint as dcp
        state = {"model": {k: torch.empty_like(v) for k, v in hf_tensors.items()}}
        dcp.load(state, checkpoint_id=str(t / "dcp"))
        assert_same_tensors(state["model"], hf_tensors, "dcp.load")


def test_llama_gqa_untied():
    check_model("llama")


def test_qwen2_bias_tied():
    check_model("qwen2")


def test_qwen3_qk_norm():
    check_model("qwen3")


def load_release(model, ckpt):
    """dist_checkpointing.load of `ckpt`/release into megatron-core `model` (ucp writes no
    `_extra_state`: left out of the request and of the check); the keys not loaded or
    unexpected, as problem lines."""
    from megatron.core import dist_checkpointing
    sd = {"model": model.sharded_state_dict()}
    for k in [k for k in sd["model"] if k.endswith("_extra_state")]:
        del sd["model"][k]
    loaded = dist_checkpointing.load(sd, str(pathlib.Path(ckpt) / "release"))
    res = model.load_state_dict(loaded["model"], strict=False)
    problems = [f"not loaded: {k}" for k in res.missing_keys if not k.endswith("_extra_state")]
    return problems + [f"unexpected: {k}" for k in res.unexpected_keys]


def moe_rank(rank, world, port, a):
    """megatron-core's MoE GPTModel of a.variant (moe_hf_oracle.build: mixtral, every layer MoE;
    qwen3, QK norms and layer 0 dense; qwen2, layer 0 dense and a shared expert with its sigmoid
    gate; softmax router, top-2 of 4 experts) loaded from ucp's
    torch_dist folder a.ckpt at world 1; its fp32 forward against transformers' logits
    (a.tokens, a.logits)."""
    mtd.init(rank, world, port, 1, 1, 1)
    import mcore_cpu
    mcore_cpu.shims()
    import moe_hf_oracle
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    model = moe_hf_oracle.build(a.variant, 999)  # other values than the checkpoint's
    problems = load_release(model, a.ckpt)
    model.config.bf16 = False
    m = model.float().eval()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    for mod in m.modules():
        if hasattr(mod, "input_in_bf16"):
            mod.input_in_bf16 = mod.input_in_float16 = False
    mrandom.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    b, n = TOKENS
    mask = torch.triu(torch.ones(n, n), diagonal=1).bool()[None, None]
    with torch.no_grad():
        got = m(a.tokens, torch.arange(n).expand(b, n), attention_mask=mask)
        diff = float((got - a.logits).abs().max())
        tol = 1e-5 * float(a.logits.abs().max())
        if not diff <= tol:
            problems.append(f"logits differ by up to {diff} (tolerance {tol})")
        # negative control: expert 3 of layer 1 changed moves the logits
        m.decoder.layers[1].mlp.experts.local_experts[3].linear_fc2.weight.add_(0.5)
        moved = m(a.tokens, torch.arange(n).expand(b, n), attention_mask=mask)
        control = float((moved - a.logits).abs().max()) > tol
    mtd.report(a, {"ok": not problems, "problems": problems[:10], "logits": got.numel(),
                   "max_abs_diff": diff, "control_logits": control})
    torch.distributed.destroy_process_group()
    if problems:
        sys.exit(1)


def moe_config(variant):
    """(architecture, transformers config) of a MoE `variant` of moe_hf_oracle's sizes."""
    import transformers
    import make_moe_torch_dist as mm
    size = mm.SIZE
    common = dict(hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                  num_attention_heads=size["heads"], num_key_value_heads=size["groups"],
                  num_experts_per_tok=size["topk"], vocab_size=mm.VOCAB, rms_norm_eps=1e-5,
                  max_position_embeddings=64, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if variant == "mixtral":
        arch = "MixtralForCausalLM"
        cfg = transformers.MixtralConfig(intermediate_size=size["moe_ffn"],
                                         num_local_experts=size["experts"], **common)
    elif variant == "qwen2":  # Qwen2-MoE: layer 0 dense, a gated shared expert, no QKV bias
        arch = "Qwen2MoeForCausalLM"
        cfg = transformers.Qwen2MoeConfig(
            intermediate_size=size["ffn"], moe_intermediate_size=size["moe_ffn"],
            shared_expert_intermediate_size=size["shared_ffn"], num_experts=size["experts"],
            mlp_only_layers=[0], norm_topk_prob=True, qkv_bias=False, **common)
    else:  # Qwen3-MoE: QK norms, layer 0 dense
        arch = "Qwen3MoeForCausalLM"
        cfg = transformers.Qwen3MoeConfig(
            head_dim=size["hidden"] // size["heads"], intermediate_size=size["ffn"],
            moe_intermediate_size=size["moe_ffn"], num_experts=size["experts"],
            mlp_only_layers=[0], norm_topk_prob=True, **common)
    return arch, cfg


def moe_model(variant):
    """A random transformers MoE model of `variant` (moe_config), bf16."""
    import transformers
    arch, cfg = moe_config(variant)
    torch.manual_seed(4)
    model = getattr(transformers, arch)(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = name.endswith("norm.weight")
            p.copy_(torch.randn_like(p) * (0.3 if norm else 0.2) + (1.0 if norm else 0.0))
    return arch, model.to(torch.bfloat16)


def moe_megatron_load(folder, variant, t):
    """megatron-core's MoE GPTModel of `variant` loads ucp's torch_dist (EP 1) of the HF
    `folder` with every key; its fp32 forward gives transformers' logits within 1e-5."""
    import transformers
    import make_moe_torch_dist as mm
    arch, _ = moe_config(variant)
    model = getattr(transformers, arch).from_pretrained(str(folder), dtype=torch.float32)
    tokens = torch.randint(0, mm.VOCAB, TOKENS, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = model.eval()(tokens).logits
    run("convert", folder, "-o", t / "td", "--format", "megatron-torch-dist", "--tp", 1,
        "--pp", 1, "--dp", 1, "--names", "mcore-llama", "-q")
    a = argparse.Namespace(ckpt=str(t / "td"), tokens=tokens, logits=logits, variant=variant,
                           report=str(t / "verdicts"))
    ctx = mp.start_processes(moe_rank, args=(1, mtd.free_port(), a), nprocs=1, join=False,
                             start_method="fork")
    ok = mtd.join(ctx, time.monotonic() + mtd.DEADLINE, f"hf import {variant}")
    v = [json.loads(x) for x in (t / "verdicts").read_text().splitlines()] \
        if (t / "verdicts").exists() else []
    assert ok and len(v) == 1 and v[0]["ok"] and v[0]["control_logits"], v
    assert v[0]["logits"] >= MIN_VALUES, v
    print(f"{variant} ep 1: logits within {v[0]['max_abs_diff']:.2e}", flush=True)


def check_moe(variant):
    """A transformers MoE model (bf16, per-expert names, sharded) of moe_hf_oracle's sizes: to
    torch_dist under Megatron-core's names (router, each expert's gate / up as [gate; up], down
    as fc2) at EP 1, which megatron-core's MoE GPTModel of that variant loads with every key and
    whose fp32 forward gives transformers' logits within 1e-5; at EP 2 x DP 2 and back with
    `ucp export --hf`, transformers' tensors bit for bit."""
    import make_moe_torch_dist as mm
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    size = mm.SIZE
    with Tmp(f"ucp-hf-{variant}-") as t:
        arch, model = moe_model(variant)
        model.save_pretrained(t / "hf", max_shard_size="20KB")
        want = read_safetensors(t / "hf")
        moe_megatron_load(t / "hf", variant, t)
        run("convert", t / "hf", "-o", t / "ep2", "--format", "megatron-torch-dist", "--tp", 1,
            "--pp", 1, "--dp", 2, "--ep", 2, "--names", "mcore-llama", "-q")
        common = torch.load(t / "ep2" / "release" / "common.pt", weights_only=False)
        check_args(common["args"], json.loads((t / "hf" / "config.json").read_text()), 1, 1,
                   f"{variant} EP 2 common.pt", ep=2)
        run("export", t / "ep2", "-o", t / "exp", "--hf", "--dtype", "bf16", "-q",
            "--model-var", f"num_attention_heads={size['heads']}", "--model-var",
            f"num_query_groups={size['groups']}", "--model-var", f"moe_router_topk={size['topk']}",
            "--vocab-size", mm.VOCAB)
        assert_same_tensors(read_safetensors(t / "exp"), want, "export --hf of EP 2")
        # Megatron's legacy format at EP 2: args in every rank file, the tensors back
        run("convert", t / "hf", "-o", t / "legacy", "--format", "megatron", "--tp", 1, "--pp",
            1, "--dp", 2, "--ep", 2, "--names", "mcore-llama", "-q")
        files = sorted((t / "legacy" / "release").glob("mp_rank_*/model_optim_rng.pt"))
        assert len(files) == 2, files
        for f in files:
            check_args(torch.load(f, weights_only=False)["args"],
                       json.loads((t / "hf" / "config.json").read_text()), 1, 1, str(f), ep=2)
        run("export", t / "legacy", "-o", t / "exp5", "--hf", "--dtype", "bf16", "-q",
            "--vocab-size", mm.VOCAB)
        assert_same_tensors(read_safetensors(t / "exp5"), want, "export --hf of legacy EP 2")
        c = json.loads((t / "exp" / "config.json").read_text())
        assert c["architectures"] == [arch], c


def test_mixtral():
    check_moe("mixtral")


def test_qwen3_moe():
    check_moe("qwen3")


def test_qwen2_moe():
    check_moe("qwen2")


GLM = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
           intermediate_size=40, moe_intermediate_size=8, n_routed_experts=8, n_shared_experts=1,
           num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=2,
           routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
           vocab_size=128, rms_norm_eps=1e-5, max_position_embeddings=64,
           tie_word_embeddings=False)


def glm_rank(rank, world, port, a):
    """megatron-core's MoE GPTModel built from the args ucp wrote (a.args, common.pt's), loaded
    from ucp's torch_dist folder a.ckpt at world 1 (strict but for the _extra_state objects);
    its fp32 forward against transformers' logits (a.tokens, a.logits). Negative controls: one
    byte of a router's expert bias changed, the group limit lifted and the routed scaling
    factor left out each move the logits past the tolerance."""
    mtd.init(rank, world, port, 1, 1, 1)
    import mcore_cpu
    mcore_cpu.shims()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.transformer_config import TransformerConfig
    g = a.args
    cfg = TransformerConfig(
        num_layers=g["num_layers"], hidden_size=g["hidden_size"],
        num_attention_heads=g["num_attention_heads"], num_query_groups=g["num_query_groups"],
        kv_channels=g["kv_channels"], ffn_hidden_size=g["ffn_hidden_size"],
        gated_linear_unit=g["swiglu"], activation_func=torch.nn.functional.silu,
        normalization=g["normalization"], layernorm_epsilon=g["norm_epsilon"],
        add_bias_linear=g["add_bias_linear"], add_qkv_bias=g["add_qkv_bias"],
        qk_layernorm=g["qk_layernorm"], num_moe_experts=g["num_experts"],
        moe_ffn_hidden_size=g["moe_ffn_hidden_size"], moe_router_topk=g["moe_router_topk"],
        moe_layer_freq=g["moe_layer_freq"],
        moe_shared_expert_intermediate_size=g["moe_shared_expert_intermediate_size"],
        moe_shared_expert_gate=g["moe_shared_expert_gate"],
        moe_router_score_function=g["moe_router_score_function"],
        moe_router_enable_expert_bias=g["moe_router_enable_expert_bias"],
        moe_router_topk_scaling_factor=g["moe_router_topk_scaling_factor"],
        moe_router_num_groups=g["moe_router_num_groups"],
        moe_router_group_topk=g["moe_router_group_topk"],
        moe_router_dtype=g["moe_router_dtype"], moe_router_pre_softmax=g["moe_router_pre_softmax"],
        moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    torch.manual_seed(999)  # other values than the checkpoint's
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=g["padded_vocab_size"],
                     max_sequence_length=g["max_position_embeddings"], pre_process=True,
                     post_process=True,
                     share_embeddings_and_output_weights=not g[
                         "untie_embeddings_and_output_weights"],
                     position_embedding_type=g["position_embedding_type"],
                     rotary_percent=g["rotary_percent"], rotary_base=g["rotary_base"])
    problems = load_release(model, a.ckpt)
    m = model.eval()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    mrandom.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    b, n = TOKENS
    mask = torch.triu(torch.ones(n, n), diagonal=1).bool()[None, None]
    controls = {}
    with torch.no_grad():
        def forward():
            out = m(a.tokens, torch.arange(n).expand(b, n), attention_mask=mask)
            return out[..., :a.logits.shape[-1]]
        got = forward()
        diff = float((got - a.logits).abs().max())
        tol = 1e-5 * float(a.logits.abs().max())
        if not diff <= tol:
            problems.append(f"logits differ by up to {diff} (tolerance {tol})")
        router = m.decoder.layers[2].mlp.router  # the first MoE layer's
        if router.expert_bias is None or router.expert_bias.dtype != torch.float32:
            problems.append(f"expert bias {router.expert_bias}")
        # one byte of the expert bias: the sign of its lowest entry
        bias = router.expert_bias
        j = int(bias.argmin())
        saved = bias.clone()
        bias.view(torch.uint8)[4 * j + 3] ^= 0x80
        controls["bias_byte"] = float((forward() - a.logits).abs().max()) > tol
        bias.copy_(saved)
        cfg.moe_router_num_groups = cfg.moe_router_group_topk = None  # no group limit
        controls["groups"] = float((forward() - a.logits).abs().max()) > tol
        cfg.moe_router_num_groups, cfg.moe_router_group_topk = (
            g["moe_router_num_groups"], g["moe_router_group_topk"])
        cfg.moe_router_topk_scaling_factor = None
        controls["scaling"] = float((forward() - a.logits).abs().max()) > tol
    mtd.report(a, {"ok": not problems, "problems": problems[:10], "logits": got.numel(),
                   "max_abs_diff": diff, "controls": controls})
    torch.distributed.destroy_process_group()
    if problems:
        sys.exit(1)


def test_glm4_moe():
    """Glm4MoeForCausalLM (fp32, sharded, per-expert names): 2 dense + 2 MoE layers, 8 experts
    top-2 in 2 groups of which 1 is chosen, a random score-correction bias, routed scaling
    2.5, q/k/v biases, QK norms, partial rotary 0.5 (the config's default). ucp converts it to
    torch_dist at TP1·PP1; megatron-core builds the MoE GPTModel from the args ucp wrote
    (sigmoid router with expert bias, groups, scaling factor, rotary_percent), loads it with
    every key, its fp32 logits equal transformers' within 1e-5 (negative controls in
    glm_rank); the args equal, field by field, what config.json gives; at EP 2 and back with
    `ucp export --hf`, transformers' tensors bit for bit, and transformers' model of the
    export gives the same logits; Megatron's legacy format at TP2·PP2·EP2 likewise (args of
    every rank file, the tensors back). Settings megatron-core cannot match are refused. A bf16
    copy with a float32 bias: the bias stays float32 in torch_dist, and comes back bit for
    bit."""
    import transformers
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    cfg = transformers.Glm4MoeConfig(**GLM, rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    with Tmp("ucp-hf-glm-") as t:
        torch.manual_seed(6)
        model = transformers.Glm4MoeForCausalLM(cfg).float()
        with torch.no_grad():
            for name, p in model.named_parameters():
                norm = name.endswith("norm.weight")
                p.copy_(torch.randn_like(p) * (0.3 if norm else 0.2) + (1.0 if norm else 0.0))
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.5)
        model.save_pretrained(t / "hf", max_shard_size="20KB")
        want = read_safetensors(t / "hf")
        biases = [k for k in want if k.endswith("mlp.gate.e_score_correction_bias")]
        assert len(biases) == 2 and all(want[k].abs().min() > 0 for k in biases), biases
        assert "model.layers.3.mlp.experts.7.down_proj.weight" in want, sorted(want)[:20]
        assert "model.layers.2.mlp.shared_experts.up_proj.weight" in want
        assert "model.layers.0.self_attn.k_proj.bias" in want
        config = json.loads((t / "hf" / "config.json").read_text())
        model = transformers.Glm4MoeForCausalLM.from_pretrained(str(t / "hf"),
                                                                dtype=torch.float32)
        tokens = torch.randint(0, 128, TOKENS, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model.eval()(tokens).logits
        run("convert", t / "hf", "-o", t / "td", "--format", "megatron-torch-dist", "--tp", 1,
            "--pp", 1, "--dp", 1, "--names", "mcore-llama", "-q")
        args = torch.load(t / "td" / "release" / "common.pt", weights_only=False)["args"]
        check_args(args, config, 1, 1, "glm common.pt")
        a = argparse.Namespace(ckpt=str(t / "td"), tokens=tokens, logits=logits,
                               args=vars(args), report=str(t / "verdicts"))
        ctx = mp.start_processes(glm_rank, args=(1, mtd.free_port(), a), nprocs=1, join=False,
                                 start_method="fork")
        ok = mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "hf import glm")
        v = [json.loads(x) for x in (t / "verdicts").read_text().splitlines()] \
            if (t / "verdicts").exists() else []
        assert ok and len(v) == 1 and v[0]["ok"], v
        assert v[0]["logits"] >= MIN_VALUES and all(v[0]["controls"].values()), v
        assert len(v[0]["controls"]) == 3, v
        print(f"glm4_moe ep 1: logits within {v[0]['max_abs_diff']:.2e}", flush=True)
        run("convert", t / "hf", "-o", t / "ep2", "--format", "megatron-torch-dist", "--tp", 1,
            "--pp", 1, "--dp", 2, "--ep", 2, "--names", "mcore-llama", "-q")
        check_args(torch.load(t / "ep2" / "release" / "common.pt", weights_only=False)["args"],
                   config, 1, 1, "glm EP 2 common.pt", ep=2)
        run("export", t / "ep2", "-o", t / "exp", "--hf", "-q", "--vocab-size", 128)
        assert_same_tensors(read_safetensors(t / "exp"), want, "export --hf of GLM EP 2")
        back = transformers.AutoModelForCausalLM.from_pretrained(str(t / "exp"),
                                                                 dtype=torch.float32)
        assert type(back).__name__ == "Glm4MoeForCausalLM", type(back)
        with torch.no_grad():
            again = back.eval()(tokens).logits
        assert torch.equal(again, logits), float((again - logits).abs().max())
        # Megatron's legacy format at TP2·PP2·EP2: args in every rank file, the tensors back
        run("convert", t / "hf", "-o", t / "legacy", "--format", "megatron", "--tp", 2, "--pp",
            2, "--dp", 2, "--ep", 2, "--etp", 2, "--names", "mcore-llama", "-q")
        files = sorted((t / "legacy" / "release").glob("mp_rank_*/model_optim_rng.pt"))
        assert len(files) == 8, files
        for f in files:
            check_args(torch.load(f, weights_only=False)["args"], config, 2, 2, str(f), ep=2)
        run("export", t / "legacy", "-o", t / "exp2", "--hf", "-q", "--vocab-size", 128)
        assert_same_tensors(read_safetensors(t / "exp2"), want, "export --hf of GLM legacy")

        # What megatron-core cannot compute alike: one usage error naming the setting (also
        # through the sanitized ucp_san: the same line, no sanitizer report).
        def convert_fails(d, *needles, code=2):
            args = ("convert", d, "-o", t / f"out-{d.name}", "--format", "megatron-torch-dist",
                    "--tp", 1, "--pp", 1, "--dp", 1, "--names", "mcore-llama")
            p = run(*args, expect=code)
            one_error_line(p, *needles)
            if SAN:
                q = subprocess.run([SAN, *map(str, args)], capture_output=True, text=True)
                assert q.returncode == code and q.stderr == p.stderr, (q.returncode, q.stderr)
            assert not (t / f"out-{d.name}").exists()

        def refused(name, needles, code=2, **kw):
            d = t / name
            shutil.copytree(t / "hf", d)
            c = dict(config, **kw)
            (d / "config.json").write_text(json.dumps(c))
            convert_fails(d, "config.json", *needles, code=code)
        refused("unnormalized", ["norm_topk_prob false"], norm_topk_prob=False)
        refused("groups", ["n_group 2", "topk_group 1", "num_experts_per_tok 4"],
                num_experts_per_tok=4)
        refused("rotary", ["partial_rotary_factor 0.375", "3 rotary dims"],
                rope_parameters=dict(config["rope_parameters"], partial_rotary_factor=0.375))
        refused("uneven-groups", ["n_group 3", "8 experts"], code=3, n_group=3)
        # GLM-4.5's own files hold its multi-token-prediction layer past num_hidden_layers
        # (transformers ignores it on load): named, not dropped
        from safetensors.torch import load_file, save_file
        d = t / "mtp"
        shutil.copytree(t / "hf", d)
        index = json.loads((d / "model.safetensors.index.json").read_text())
        shard = index["weight_map"]["model.norm.weight"]
        tensors = load_file(str(d / shard))
        tensors["model.layers.4.eh_proj.weight"] = torch.zeros(32, 64)
        save_file(tensors, str(d / shard), metadata={"format": "pt"})
        index["weight_map"]["model.layers.4.eh_proj.weight"] = shard
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
        convert_fails(d, shard, "model.layers.4.eh_proj.weight", "num_nextn_predict_layers")

        # bf16 weights with the float32 score-correction bias real GLM-4.5 files keep: the
        # torch_dist router's expert_bias stays float32 (as megatron-core keeps the buffer),
        # and export --hf --dtype bf16 at EP 2 gives back every tensor and dtype bit for bit.
        model = transformers.Glm4MoeForCausalLM(cfg).to(torch.bfloat16)
        with torch.no_grad():
            for layer in model.model.layers[GLM["first_k_dense_replace"]:]:
                layer.mlp.gate.e_score_correction_bias.data = torch.randn(8) * 0.5
        model.save_pretrained(t / "bf16", max_shard_size="20KB")
        want = read_safetensors(t / "bf16")
        assert {str(v.dtype) for v in want.values()} == {"torch.bfloat16", "torch.float32"}
        run("convert", t / "bf16", "-o", t / "bf16-td", "--format", "megatron-torch-dist",
            "--tp", 1, "--pp", 1, "--dp", 2, "--ep", 2, "--names", "mcore-llama", "-q")
        from torch.distributed.checkpoint import FileSystemReader
        md = FileSystemReader(str(t / "bf16-td" / "release")).read_metadata()
        dtypes = {k: v.properties.dtype for k, v in md.state_dict_metadata.items()
                  if k.endswith(("router.expert_bias", "router.weight"))}
        assert len(dtypes) == 4 and all(
            d == (torch.float32 if k.endswith("bias") else torch.bfloat16)
            for k, d in dtypes.items()), dtypes
        run("export", t / "bf16-td", "-o", t / "bf16-exp", "--hf", "--dtype", "bf16", "-q",
            "--vocab-size", 128)
        assert_same_tensors(read_safetensors(t / "bf16-exp"), want, "export --hf of bf16 GLM")


def test_init_optimizer():
    """`--init-optimizer`: a DCP target of a transformers folder holds fresh Adam state that
    torch's own flow loads (get_state_dict of a LlamaForCausalLM and torch.optim.Adam whose
    state is filled with other values, dcp.load, set_state_dict): every exp_avg / exp_avg_sq
    zero, every step 0, torch.optim.Adam's param group (each of its keys, the defaults), the
    weights bit for bit; one real Adam step from it gives exp_avg = (1 - beta1) * grad and
    exp_avg_sq = (1 - beta2) * grad^2. Negative control: without the flag dcp.load finds no
    optimizer state. A bf16 folder: its float32 master copy (what DCP writes as the weights when
    the content has one) equals torch's upcast of the bf16 weights."""
    import transformers
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    with Tmp("ucp-hf-initopt-") as t:
        make_hf(t / "hf", "llama")
        want = read_safetensors(t / "hf")
        run("convert", t / "hf", "-o", t / "dcp", "--format", "dcp", "--dp", 2,
            "--init-optimizer", "-q")
        run("convert", t / "hf", "-o", t / "plain", "--format", "dcp", "--dp", 2, "-q")

        def loaded(ckpt, dtype=torch.float32, hf=t / "hf"):
            model = transformers.LlamaForCausalLM.from_pretrained(str(hf), dtype=dtype)
            opt = torch.optim.Adam(model.parameters(), lr=0.5, betas=(0.5, 0.5))
            msd, osd = get_state_dict(model, opt)
            for v in msd.values():
                v.fill_(3.0)
            for v in osd["state"].values():  # values the load must replace
                v["exp_avg"].fill_(7.0)
                v["exp_avg_sq"].fill_(7.0)
                v["step"].fill_(9.0)
            state = {"model": msd, "optimizer": osd}
            dcp.load(state, checkpoint_id=str(ckpt))
            return model, opt, state
        model, opt, state = loaded(t / "dcp")
        osd = state["optimizer"]
        assert sorted(osd["state"]) == sorted(want), sorted(set(osd["state"]) ^ set(want))
        zeros = 0
        for name, v in osd["state"].items():
            assert float(v["exp_avg"].abs().max()) == 0, name
            assert float(v["exp_avg_sq"].abs().max()) == 0, name
            assert float(v["step"]) == 0, (name, v["step"])
            zeros += 2 * v["exp_avg"].numel()
        assert zeros >= MIN_VALUES, zeros
        group = {k: v for k, v in osd["param_groups"][0].items() if k != "params"}
        default = {k: v for k, v in torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
                   .state_dict()["param_groups"][0].items() if k != "params"}
        assert len(osd["param_groups"]) == 1 and group == default, (group, default)
        assert_same_tensors(state["model"], want, "dcp.load of the model")
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
        tokens = torch.randint(0, 100, TOKENS, generator=torch.Generator().manual_seed(5))
        model(tokens, labels=tokens).loss.backward()
        opt.step()
        stepped = 0
        for p in model.parameters():
            st = opt.state[p]
            assert float(st["step"]) == 1, st["step"]
            assert torch.allclose(st["exp_avg"], 0.1 * p.grad, rtol=1e-6, atol=0)
            assert torch.allclose(st["exp_avg_sq"], 0.001 * p.grad * p.grad, rtol=1e-5, atol=0)
            stepped += p.numel()
        assert stepped >= MIN_VALUES, stepped
        # negative control: no optimizer state without the flag
        from torch.distributed.checkpoint.api import CheckpointException
        try:
            loaded(t / "plain")
        except (RuntimeError, CheckpointException) as e:
            assert "Missing key in checkpoint state_dict: optimizer." in str(e), e
        else:
            raise AssertionError("dcp.load found optimizer state without --init-optimizer")
        # bf16 weights: the float32 master copy is the upcast of each weight
        model = transformers.LlamaForCausalLM.from_pretrained(str(t / "hf"))
        model.to(torch.bfloat16).save_pretrained(t / "bf16", max_shard_size="20KB")
        bf16 = read_safetensors(t / "bf16")
        assert {v.dtype for v in bf16.values()} == {torch.bfloat16}
        run("convert", t / "bf16", "-o", t / "bf16-dcp", "--format", "dcp", "--dp", 2,
            "--init-optimizer", "-q")
        _, _, state = loaded(t / "bf16-dcp", hf=t / "bf16")
        assert_same_tensors(state["model"], {k: v.float() for k, v in bf16.items()},
                            "the float32 masters of a bf16 folder")


def optim_rank(rank, world, port, a):
    """One DP rank: the bf16 GPTModel of a.kind in megatron-core's DistributedDataParallel with
    its real DistributedOptimizer (mcore_cpu), loaded from ucp's torch_dist folder a.ckpt as
    training's load_checkpoint does without --no-load-optim (the optimizer's
    sharded_state_dict(is_loading=True) in the form the checkpoint's content_metadata names,
    dist_checkpointing.load, load_state_dict); what the optimizer then holds, gathered by its
    own fully_reshardable sharded_state_dict, against a.full: fp32 main params, exp_avg,
    exp_avg_sq; its Adam steps; and against a.bad (one value changed), which must differ."""
    mtd.init(rank, world, port, 1, 1, 1)
    import mcore_cpu
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    torch.Tensor.cuda = lambda self, *x, **k: self
    torch.manual_seed(999)
    models = [build_gpt(a.kind, 1, bf16=True)]
    _, opt = mcore_cpu.ddp_and_optimizer(models)
    mcore_cpu.allocate_state(opt)
    iter_dir = pathlib.Path(a.ckpt) / "release"
    content = dist_checkpointing.load_content_metadata(str(iter_dir)) or {}
    sd = mtd.model_sd(models)
    sd["optimizer"] = opt.sharded_state_dict(mtd.model_sd(models), is_loading=True,
                                             metadata=content)

    def drop_extra(d):  # --dist-ckpt-strictness log_all: no _extra_state objects
        for k in list(d):
            if isinstance(d[k], dict):
                drop_extra(d[k])
            elif str(k).endswith("_extra_state") or \
                    getattr(d[k], "key", "").endswith("_extra_state"):
                del d[k]
    drop_extra(sd)
    loaded = dist_checkpointing.load(sd, str(iter_dir))
    res = models[0].load_state_dict(loaded["model"], strict=False)
    problems = [f"not loaded: {k}" for k in res.missing_keys if not k.endswith("_extra_state")]
    opt.load_state_dict(loaded["optimizer"])
    steps = sorted(mcore_cpu.held_steps(opt))
    osd = opt.sharded_state_dict(mtd.model_sd(models), metadata={
        "distrib_optim_sharding_type": "fully_reshardable",
        "chained_optim_avoid_prefix": True})["param_state"]
    apply_factories(osd)
    values, kinds, control = 0, set(), []
    for sh in nested_values(osd):
        if isinstance(sh, ShardedTensor):
            values += mtd.check_shard(sh, a.full, problems, "optimizer")
            mtd.check_shard(sh, a.bad, control, "control")
            kinds.add(sh.key.split(".")[2])
    if steps != [0.0]:
        problems.append(f"Adam steps {steps}")
    if content.get("distrib_optim_sharding_type") != "fully_reshardable":
        problems.append(f"content_metadata {content}")
    mtd.report(a, {"rank": rank, "ok": not problems, "problems": problems[:10],
                   "values": values, "kinds": sorted(kinds), "control": control[:3]})
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    if problems:
        sys.exit(1)


def test_init_optimizer_megatron():
    """`--init-optimizer` to Megatron-core torch_dist at DP 2 (bf16 LLaMA): megatron-core's real
    DistributedOptimizer loads the optimizer state on each rank (optim_rank) and then holds,
    for every param, the float32 upcast of the bf16 weight as its main param and zero Adam
    moments (the reference: this test's own fusing of transformers' state dict, megatron_reference,
    upcast by torch), step 0; the args say the distributed optimizer. Negative control: the
    reference with one main-param value changed is found."""
    import transformers
    mtd.preload()
    with Tmp("ucp-hf-initopt-mcore-") as t:
        make_hf(t / "hf", "llama")
        model = transformers.LlamaForCausalLM.from_pretrained(str(t / "hf"))
        model.to(torch.bfloat16).save_pretrained(t / "bf16", max_shard_size="20KB")
        sd = read_safetensors(t / "bf16")
        run("convert", t / "bf16", "-o", t / "td", "--format", "megatron-torch-dist", "--tp", 1,
            "--pp", 1, "--dp", 2, "--names", "mcore-llama", "--init-optimizer",
            "--distributed-optimizer", "-q")
        args = torch.load(t / "td" / "release" / "common.pt", weights_only=False)["args"]
        assert args.use_distributed_optimizer and args.bf16, vars(args)
        ref = megatron_reference(sd, "llama", 1)
        full = dict(ref)
        for k, v in ref.items():
            full["optimizer.state.param." + k] = v.float()
            full["optimizer.state.exp_avg." + k] = torch.zeros(v.shape)
            full["optimizer.state.exp_avg_sq." + k] = torch.zeros(v.shape)
        key = "optimizer.state.param.decoder.layers.mlp.linear_fc2.weight"
        bad = dict(full, **{key: full[key].clone()})  # negative control
        bad[key][1, 3, 5] += 1.0
        a = argparse.Namespace(kind="llama", ckpt=str(t / "td"), full=full, bad=bad,
                               report=str(t / "verdicts"))
        ctx = mp.start_processes(optim_rank, args=(2, mtd.free_port(), a), nprocs=2,
                                 join=False, start_method="fork")
        ok = mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "hf init-optimizer load")
        path = t / "verdicts"
        v = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        assert ok and len(v) == 2 and all(x["ok"] for x in v), v
        assert sum(x["values"] for x in v) >= MIN_VALUES, v
        assert all(x["kinds"] == ["exp_avg", "exp_avg_sq", "param"] for x in v), v
        assert sum(len(x["control"]) for x in v) >= 1, v
        print(f"init-optimizer torch_dist dp 2: {sum(x['values'] for x in v)} values", flush=True)


def test_mistral():
    """MistralForCausalLM (LLaMA's tensors under its own config): the universal file's export
    --hf gives back transformers' tensors bit for bit (bf16, a single model.safetensors)."""
    import transformers
    with Tmp("ucp-hf-mistral-") as t:
        cfg = transformers.MistralConfig(hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=1,
                                         intermediate_size=56, vocab_size=90,
                                         max_position_embeddings=64, sliding_window=16)
        torch.manual_seed(3)
        transformers.MistralForCausalLM(cfg).to(torch.bfloat16).save_pretrained(t / "hf")
        want = read_safetensors(t / "hf")
        assert {v.dtype for v in want.values()} == {torch.bfloat16}
        run("to-universal", t / "hf", "-o", t / "u.h5", "-q")
        run("export", t / "u.h5", "-o", t / "exp", "--hf", "--dtype", "bf16", "-q")
        assert_same_tensors(read_safetensors(t / "exp"), want, "export --hf of Mistral")


def h5_atoms(h5):
    """{(param, state kind): raw bytes} of a universal file (h5py)."""
    import h5py
    import numpy as np
    out = {}
    with h5py.File(h5, "r") as f:
        for name, g in f["params"].items():
            for kind, d in g.items():
                if isinstance(d, h5py.Dataset):
                    out[(name, kind)] = (d.shape, np.ascontiguousarray(d[()]).tobytes())
    return out


def raw(t):
    """A tensor's bytes (bf16 as its bit patterns)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def test_fused_experts():
    """transformers 5's fused experts (save_pretrained(..., save_original_format=False):
    mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I], Mixtral's router as mlp.gate):
    to-universal of the fused folder equals, atom by atom (h5py, bytes), that of transformers'
    own per-expert save of the same model (negative control: one changed byte differs);
    `export --hf` of it writes the per-expert folder's tensors bit for bit (`--hf-experts fused`:
    the fused folder's); megatron-core's MoE
    GPTModel loads the Mixtral's torch_dist (fused source) and gives transformers' logits; a
    config the fused shapes disagree with is one error line naming the tensor (also under
    ucp_san)."""
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    for variant in ("mixtral", "qwen3", "qwen2"):
        with Tmp(f"ucp-hf-fused-{variant}-") as t:
            _, model = moe_model(variant)
            model.save_pretrained(t / "per", max_shard_size="20KB")
            model.save_pretrained(t / "fused", max_shard_size="20KB",
                                  save_original_format=False)
            fused = read_safetensors(t / "fused")
            assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused), sorted(fused)
            assert not any(".experts.0." in k for k in fused), sorted(fused)
            per = read_safetensors(t / "per")
            assert any(".experts.0." in k for k in per), sorted(per)
            run("to-universal", t / "per", "-o", t / "per.h5", "-q")
            run("to-universal", t / "fused", "-o", t / "fused.h5", "-q")
            want, got = h5_atoms(t / "per.h5"), h5_atoms(t / "fused.h5")
            assert sorted(want) == sorted(got), sorted(set(want) ^ set(got))[:10]
            assert len(want) == len(per), (len(want), len(per))
            assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]
            assert sum(len(v[1]) for v in want.values()) // 2 >= MIN_VALUES
            k = next(k for k in want if ".experts.3." in k[0] and ("up_proj" in k[0] or "w3" in k[0]))
            bad = bytearray(want[k][1])
            bad[5] ^= 1  # negative control
            assert (want[k][0], bytes(bad)) != got[k]
            run("export", t / "fused.h5", "-o", t / "exp", "--hf", "--dtype", "bf16", "-q")
            assert_same_tensors(read_safetensors(t / "exp"), per, "export --hf of fused")
            run("export", t / "fused.h5", "-o", t / "exp-fused", "--hf", "--hf-experts", "fused",
                "--dtype", "bf16", "-q")  # and back to the fused form: the same tensors
            assert_same_tensors(read_safetensors(t / "exp-fused"), fused,
                                "export --hf --hf-experts fused of fused")
            if variant == "mixtral":
                moe_megatron_load(t / "fused", variant, t)
            if variant == "qwen3":  # a config the fused shapes disagree with: named
                c = json.loads((t / "fused" / "config.json").read_text())
                c["moe_intermediate_size"] += 1
                (t / "fused" / "config.json").write_text(json.dumps(c))
                args = ("to-universal", t / "fused", "-o", t / "bad.h5")
                p = run(*args, expect=3)
                one_error_line(p, "model.layers.1.mlp.experts.gate_up_proj", "fused form",
                               f"intermediate size {c['moe_intermediate_size']}")
                if SAN:  # the sanitized build: the same line, no sanitizer report
                    q = subprocess.run([SAN, *map(str, args)], capture_output=True, text=True)
                    assert q.returncode == 3 and q.stderr == p.stderr, (q.returncode, q.stderr)
                assert not (t / "bad.h5").exists()
        print(f"{variant} fused: {len(want)} atoms equal the per-expert save's", flush=True)


FP8_BLOCK = 128


def fp8_quantize(w):
    """The published block scheme (DeepSeek-V3, transformers' FineGrainedFP8): per 128 x 128
    block (the edge blocks partial) scale = amax / 448, fp8 = (w / scale) as float8_e4m3fn,
    weight_scale_inv = scale (a multiplier); returns (fp8, scale)."""
    r, c = w.shape
    br, bc = -(-r // FP8_BLOCK), -(-c // FP8_BLOCK)
    scale = torch.empty(br, bc, dtype=torch.float32)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK].float()
            s = blk.abs().max() / 448.0
            scale[i, j] = s
            q[i * FP8_BLOCK:(i + 1) * FP8_BLOCK, j * FP8_BLOCK:(j + 1) * FP8_BLOCK] = \
                (blk / s).to(torch.float8_e4m3fn)
    return q, scale


def fp8_dequantize(q, scale, dtype):
    """(fp8.float() * scale expanded over the blocks).to(dtype), by torch."""
    r, c = q.shape
    full = scale.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)[:r, :c]
    return (q.float() * full).to(dtype)


def make_fp8(out):
    """A random float32 LLaMA (MODELS["fp8"]) whose linear weights of the layers are quantized
    by fp8_quantize, saved with safetensors in two shards (layer 0's scales in the other shard
    than their weights) and an index, config.json with quantization_config; returns
    ({name: tensor} saved, {"bf16" / "fp32": the dequantized state dict}, transformers' config)."""
    import transformers
    spec = dict(MODELS["fp8"])
    spec.pop("arch")
    theta = spec.pop("rope_theta")
    cfg = transformers.LlamaConfig(**spec, rope_parameters={"rope_type": "default",
                                                            "rope_theta": theta})
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            norm = n.endswith("norm.weight")
            p.copy_(torch.randn_like(p) * (0.3 if norm else 0.1) + (1.0 if norm else 0.0))
    saved, deq = {}, {"bf16": {}, "fp32": {}}
    for n, v in model.state_dict().items():
        if n.startswith("model.layers.") and n.endswith("_proj.weight"):
            q, s = fp8_quantize(v)
            saved[n], saved[n + "_scale_inv"] = q, s
            for d, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
                deq[d][n] = fp8_dequantize(q, s, dt)
        else:
            saved[n] = v.clone()
            deq["bf16"][n] = deq["fp32"][n] = v.clone()
    from safetensors.torch import save_file
    out.mkdir()
    shards = ({}, {})
    for n, v in saved.items():
        other = n.startswith("model.layers.0.") and n.endswith("_scale_inv")
        shards[1 if other or n.startswith("model.layers.1.") else 0][n] = v
    weight_map = {}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(sh, str(out / name), metadata={"format": "pt"})
        weight_map.update({n: name for n in sh})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    c = cfg.to_dict()
    c["architectures"] = ["LlamaForCausalLM"]
    c["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                "activation_scheme": "dynamic",
                                "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    (out / "config.json").write_text(json.dumps(c))
    assert weight_map["model.layers.0.self_attn.q_proj.weight"] != \
        weight_map["model.layers.0.self_attn.q_proj.weight_scale_inv"]
    return saved, deq, cfg


def test_fp8_block_scaled():
    """An FP8 block-scaled LLaMA (make_fp8: hidden 200 and ffn 300, so edge blocks are partial;
    scales in another shard than their weights): without --dequantize every target is one
    usage error naming the first FP8 weight and --dequantize; with it the universal file's
    atoms (h5py) and torch's dcp.load of the DCP target equal torch's own dequantization bit
    for bit (bf16; negative control: a flipped scale byte is seen); with --dequantize=fp32
    megatron-core loads the torch_dist output at TP1 and TP2 (every shard equal to the fused
    reference) and at TP1 its forward gives transformers' logits on the same dequantized
    weights. A missing scale,
    a scale of the wrong shape, a scale without weight, another quant_method or fmt: one
    error line naming them, nothing written (the first two also under ucp_san)."""
    mtd.preload()
    import transformers
    with Tmp("ucp-hf-fp8-") as t:
        src = t / "hf"
        saved, deq, cfg = make_fp8(src)
        first = "model.layers.0.self_attn.q_proj.weight"
        for args in (("to-universal", src, "-o", t / "no.h5"),
                     ("convert", src, "-o", t / "no", "--format", "megatron-torch-dist",
                      "--tp", 1, "--pp", 1, "--dp", 1, "--names", "mcore-llama"),
                     ("convert", src, "-o", t / "no", "--format", "dcp", "--dp", 1)):
            p = run(*args, expect=2)
            one_error_line(p, first, "FP8", "--dequantize")
            assert not (t / "no.h5").exists() and not (t / "no").exists()
        # a mistyped source after --dequantize is named as the source, not taken as the dtype
        missing = t / "no" / "such"
        p = run("to-universal", "--dequantize", missing, "-o", t / "typo.h5", expect=5)
        one_error_line(p, str(missing), "does not exist")
        assert not (t / "typo.h5").exists()
        # the universal file: torch's dequantization, bit for bit
        run("to-universal", "--dequantize", src, "-o", t / "u.h5", "-q")  # (bf16: SRC follows)
        got = h5_atoms(t / "u.h5")
        want = deq["bf16"]
        assert len(got) == len(want), (len(got), len(want))
        n = 0
        for k, v in want.items():
            kind = "fp32" if v.dtype == torch.float32 else "param"
            assert got[(k, kind)] == (tuple(v.shape), raw(v)), k
            n += v.numel() if v.dtype == torch.bfloat16 else 0
        assert n >= MIN_VALUES, n
        with h5py_attrs(t / "u.h5") as rec:  # the record keeps no quantization_config
            assert "quantization_config" not in rec and "num_hidden_layers" in rec, rec
            assert '"dequantized":"bfloat16"' in rec.replace(" ", ""), rec
        assert "quantization_config" in (src / "config.json").read_text()
        # negative control: a flipped byte of one scale (of a partial edge block) is seen
        bad = t / "bad"
        shutil.copytree(src, bad)
        from safetensors.torch import load_file, save_file
        name = "model.layers.0.mlp.down_proj.weight_scale_inv"
        shard = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
        tensors = load_file(str(bad / shard))
        tensors[name].view(torch.int32)[1, 2] ^= 1 << 20  # (its third byte)
        save_file(tensors, str(bad / shard), metadata={"format": "pt"})
        run("to-universal", bad, "-o", t / "bad.h5", "--dequantize=bf16", "-q")
        moved = h5_atoms(t / "bad.h5")
        differ = [k for k in got if got[k] != moved[k]]
        assert differ == [(name[:-len("_scale_inv")], "param")], differ
        # DCP (transformers' names, bf16): torch's dcp.load
        run("convert", src, "-o", t / "dcp", "--format", "dcp", "--dp", 2, "--dequantize", "-q")
        import torch.distributed.checkpoint as dcp
        state = {"model": {k: torch.empty_like(v) for k, v in want.items()}}
        dcp.load(state, checkpoint_id=str(t / "dcp"))
        assert_same_tensors(state["model"], want, "dcp.load of the dequantized model")
        # megatron-core on fp32 dequantized weights: transformers' logits on the same weights
        w32 = deq["fp32"]
        model = transformers.LlamaForCausalLM(cfg)
        model.load_state_dict(w32, strict=True)
        tokens = torch.randint(0, 100, TOKENS, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            logits = model.float().eval()(tokens).logits
        run("convert", src, "-o", t / "td", "--format", "megatron-torch-dist", "--tp", 1,
            "--pp", 1, "--dp", 1, "--names", "mcore-llama", "--dequantize", "fp32", "-q")
        megatron_load(t / "td", "fp8", 1, 1, megatron_reference(w32, "fp8", 1), tokens, logits)
        # at TP2 (o_proj / down_proj cut by columns: reads of parts of rows)
        run("convert", src, "-o", t / "td2", "--format", "megatron-torch-dist", "--tp", 2,
            "--pp", 1, "--dp", 1, "--names", "mcore-llama", "--dequantize", "fp32", "-q")
        megatron_load(t / "td2", "fp8", 2, 1, megatron_reference(w32, "fp8", 2))

        # malformed
        index = json.loads((src / "model.safetensors.index.json").read_text())

        def damaged(tag, tensors=None, config=None):
            d = t / tag
            shutil.copytree(src, d)
            if tensors:
                by_shard = {}
                for k, sh in index["weight_map"].items():
                    by_shard.setdefault(sh, {})[k] = saved[k]
                wm = dict(index["weight_map"])
                for k, v in tensors.items():
                    sh = wm.get(k, sorted(by_shard)[0])
                    if v is None:
                        del by_shard[sh][k], wm[k]
                    else:
                        by_shard[sh][k] = v
                        wm[k] = sh
                for sh, ts in by_shard.items():
                    save_file(ts, str(d / sh), metadata={"format": "pt"})
                (d / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {}, "weight_map": wm}))
            if config:
                c = json.loads((d / "config.json").read_text())
                c["quantization_config"].update(config)
                (d / "config.json").write_text(json.dumps(c))
            return d

        def refused(d, code, *needles, san=False):
            out = t / f"out-{d.name}"
            args = ("convert", d, "-o", out, "--format", "megatron-torch-dist", "--tp", 1,
                    "--pp", 1, "--dp", 1, "--names", "mcore-llama", "--dequantize")
            p = run(*args, expect=code)
            one_error_line(p, *needles)
            if SAN and san:  # the sanitized build: the same line, no sanitizer report
                q = subprocess.run([SAN, *map(str, args)], capture_output=True, text=True)
                assert q.returncode == code and q.stderr == p.stderr, (q.returncode, q.stderr)
            assert not out.exists(), out

        w = "model.layers.1.mlp.up_proj.weight"
        refused(damaged("noscale", {w + "_scale_inv": None}), 3, w, w + "_scale_inv",
                san=True)
        refused(damaged("badscale", {w + "_scale_inv": torch.ones(2, 2)}), 3,
                w + "_scale_inv", "[2, 2]", "[300, 200]", "makes it a float32 [3, 2]", san=True)
        refused(damaged("orphan", {"model.norm.weight_scale_inv": torch.ones(1, 1)}), 3,
                "model.norm.weight_scale_inv", "without its FP8 weight")
        refused(damaged("method", config={"quant_method": "bitsandbytes"}), 2,
                "config.json", "quant_method", "bitsandbytes")
        refused(damaged("fmt", config={"fmt": "e5m2"}), 2, "config.json", "fmt", "e5m2")


@contextlib.contextmanager
def h5py_attrs(h5):
    """config.json as the universal file's `hf` record keeps it."""
    import h5py
    with h5py.File(h5, "r") as f:
        found = []

        def visit(name, obj):
            for k, v in obj.attrs.items():
                if isinstance(v, (bytes, str)) and "num_hidden_layers" in str(v):
                    found.append(str(v if isinstance(v, str) else v.decode()))
        f.visititems(visit)
        for k, v in f.attrs.items():
            if isinstance(v, (bytes, str)) and "num_hidden_layers" in str(v):
                found.append(str(v if isinstance(v, str) else v.decode()))
        assert found, "no hf record"
        yield "\n".join(found)


def test_malformed_folders():
    """Each damage: one error line naming the file and what is wrong, exit 2 (usage) or 3
    (format), nothing under the output name."""
    with Tmp("ucp-hf-bad-") as t:
        good = t / "good"
        make_hf(good, "llama")
        index = json.loads((good / "model.safetensors.index.json").read_text())
        shards = sorted(set(index["weight_map"].values()))
        run("to-universal", good, "-o", t / "ok.h5", "-q")  # the undamaged folder converts
        n = len(index["weight_map"])
        assert n == 4 * 9 + 3, n
        # verify, inspect and layout check read it as a checkpoint
        p = run("verify", good)
        assert f"{n} atoms" in p.stdout, p.stdout
        j = json.loads(run("inspect", good, "--json").stdout)
        assert [len(c["tensors"]) for c in j["checkpoints"]] == [n], j["checkpoints"]
        j = json.loads(run("layout", "check", good, "--json").stdout)
        assert j["problems"] == 0 and len(j["params"]) == n, j
        assert {x["rule"] for x in j["params"]} >= {"qkv_colwise", "o_proj_rowwise", "lm_head"}

        from safetensors.torch import load_file, save_file
        head_shard = index["weight_map"]["lm_head.weight"]

        def damaged(name, fn):
            d = t / name
            shutil.copytree(good, d)
            fn(d)
            return d

        def refused(d, code, *needles):
            out = t / f"out-{d.name}"
            args = ("convert", d, "-o", out, "--format", "megatron-torch-dist", "--tp", 1,
                    "--pp", 1, "--dp", 1, "--names", "mcore-llama")
            p = run(*args, expect=code)
            one_error_line(p, *needles)
            if SAN:  # the sanitized build: the same line, no sanitizer report
                q = subprocess.run([SAN, *map(str, args)], capture_output=True, text=True)
                assert q.returncode == code and q.stderr == p.stderr, (q.returncode, q.stderr)
            assert not out.exists(), out
            assert not any(x.name.startswith("out-" + d.name) for x in t.iterdir())

        d = damaged("missing", lambda d: (d / shards[1]).unlink())
        refused(d, 3, "model.safetensors.index.json", shards[1], "not in the folder")
        unnamed = next(k for k, v in index["weight_map"].items() if v == shards[0])

        def drop_entry(d):
            j = dict(index, weight_map={k: v for k, v in index["weight_map"].items()
                                        if k != unnamed})
            (d / "model.safetensors.index.json").write_text(json.dumps(j))
        d = damaged("unnamed", drop_entry)
        refused(d, 3, shards[0], unnamed, "does not name")

        def cut(d):
            f = d / shards[2]
            f.write_bytes(f.read_bytes()[:40])
        d = damaged("cut", cut)
        refused(d, 3, shards[2])

        def config(**kw):
            def fn(d):
                c = json.loads((d / "config.json").read_text())
                c.update(kw)
                (d / "config.json").write_text(json.dumps(c))
            return fn
        d = damaged("ffn", config(intermediate_size=64))
        refused(d, 3, "mlp.gate_proj.weight", "[48, 32]", "intermediate_size 64")
        def escaping(d):  # a shard named outside the folder
            j = dict(index, weight_map=dict(index["weight_map"]))
            j["weight_map"][unnamed] = "../" + shards[0]
            (d / "model.safetensors.index.json").write_text(json.dumps(j))
        d = damaged("escaping", escaping)
        refused(d, 3, "model.safetensors.index.json", unnamed, "not a file name of the folder")

        def fp8(d):  # quantized weights: named, not read as something else
            tensors = load_file(str(d / head_shard))
            tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)
            save_file(tensors, str(d / head_shard), metadata={"format": "pt"})
        d = damaged("fp8", fp8)
        refused(d, 2, "lm_head.weight", "float8", "quantized")
        d = damaged("arch", config(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
        refused(d, 2, "config.json", "GPT2LMHeadModel", "LlamaForCausalLM")
        d = damaged("layers", config(num_hidden_layers=3))
        refused(d, 2, "model.layers.3.", "no place", "num_hidden_layers 3")
        p = run("layout", "check", d, expect=2)  # its layout check names the layer too
        assert "model.layers.3." in p.stderr, p.stderr
        # Settings no folder could hold: refused before the names they imply are listed.
        d = damaged("huge-layers", config(num_hidden_layers=10**12))
        refused(d, 3, "config.json", "num_hidden_layers", "not an integer in [1, 16777216]")
        d = damaged("many-layers", config(num_hidden_layers=10**6))
        refused(d, 3, "config.json", "num_hidden_layers 1000000", f"the folder's {n}")

        # A tied model's saved lm_head: a replica of the embedding, compared bit for bit.
        emb = load_file(str(good / index["weight_map"]["model.embed_tokens.weight"]))

        def tied(delta):
            def fn(d):
                config(tie_word_embeddings=True)(d)
                tensors = load_file(str(d / head_shard))
                tensors["lm_head.weight"] = emb["model.embed_tokens.weight"].clone()
                tensors["lm_head.weight"][7, 3] += delta
                save_file(tensors, str(d / head_shard), metadata={"format": "pt"})
            return fn
        d = damaged("tied", tied(0.0))
        p = run("to-universal", d, "-o", t / "tied.h5")
        assert "(1 replicas verified)" in p.stdout, p.stdout
        d = damaged("tied-differs", tied(0.5))
        refused(d, 3, "lm_head.weight", "model.embed_tokens.weight", "differ")


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
