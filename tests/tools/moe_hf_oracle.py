"""The oracle of `ucp export --hf` for mixture-of-experts models (the tests' PyPI environment:
run with its python): the real megatron-core 0.16 builds a MoE GPTModel on CPU (world 1, gloo)
and gives its logits; the real transformers loads ucp's export and must give the same.

  moe_hf_oracle.py make DIR [--variant mixtral|qwen3|qwen2|glm|deepseek] [--seed S]
                       [--truth SAVE/truth.pt]
      DIR/dcp/        the model's weights (bf16, as training holds them) as a PyTorch DCP
                      checkpoint saved by torch.distributed.checkpoint, under the canonical
                      names of the universal file (global layer and expert indices,
                      decoder.layers.<l>.mlp.experts.<e>.linear_fc1.weight [gate; up]), taken
                      from megatron-core's own sharded_state_dict (make_moe_torch_dist.py's
                      local_pieces / assemble: the same names its truth.pt has)
      DIR/logits.pt   {"tokens": [2, 16] int64, "logits": megatron-core's forward in float32}
      --truth: the model's weights are those of make_moe_torch_dist.py's truth.pt (a torch_dist
      save at any TP / EP / PP, same variant: mixtral, deepseek), set through megatron-core's
      own sharded state dict, so DIR's logits are those of that save's model (the oracle of
      `ucp export SAVE --hf` once ucp reads MoE torch_dist saves)
  moe_hf_oracle.py check DIR HF    transformers' AutoModelForCausalLM.from_pretrained(HF):
                      no missing, unexpected or mismatched key, logits equal to DIR's within
                      1e-5 of their largest magnitude; prints one JSON verdict, exits 1 if not

The models (make_moe_torch_dist.py's sizes: 2 layers, hidden 16, 4 heads in 2 query groups, 4
experts of ffn 8, top-2, SwiGLU, RMSNorm, RoPE, untied, vocabulary 128, each expert made
distinct so that a swapped expert shows):
  mixtral:  every layer MoE, softmax router (top-k of the logits, softmax over them: Mixtral's
            softmax, top-k, renormalize) -> MixtralForCausalLM
  qwen3:    mixtral's with QK layer norms (qk_layernorm: RMSNorm over each head's dim, before
            the rotary embedding) and layer 0 dense (ffn 24) -> Qwen3MoeForCausalLM
            (q_norm / k_norm, mlp_only_layers [0])
  qwen2:    layer 0 dense (ffn 24), layer 1 MoE with a shared expert (ffn 16) and its sigmoid
            gate, softmax router -> Qwen2MoeForCausalLM (mlp_only_layers [0], norm_topk_prob)
  glm:      DeepSeek-V3's MoE block with GQA attention: layer 0 dense, layer 1 MoE with a shared
            expert (ffn 16 = 2 experts' ffn, no gate), the sigmoid router with its expert bias
            (made uneven so that it steers the choice) -> Glm4MoeForCausalLM
            (first_k_dense_replace 1, n_shared_experts 2, e_score_correction_bias, n_group 1);
            DeepseekV3ForCausalLM computes the same MoE block but has MLA attention
  deepseek: make_moe_torch_dist.py's deepseek (sigmoid router with an expert bias, shared expert
            with a gate): no transformers model computes it (none gates the shared expert of a
            sigmoid router), the export refuses it
"""
import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import time
import warnings

import torch
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_moe_torch_dist as mm  # noqa: E402
import megatron_torch_dist as mtd  # noqa: E402

TOKENS = (2, 16)
VARIANTS = ("mixtral", "qwen3", "qwen2", "glm", "deepseek")


def build(variant, seed):
    """megatron-core's GPTModel of `variant` (bf16, as make_moe_torch_dist.build makes it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    a = argparse.Namespace(variant="mixtral" if variant in ("mixtral", "qwen3") else "deepseek",
                           tp=1, pp=1, ep=1, etp=1, seed=seed)
    # (the allgather dispatcher: the alltoall one's CPU path waits on a CUDA event; the
    # dispatcher moves tokens, the math is the same)
    cfg = dataclasses.replace(mm.config(a), moe_token_dispatcher_type="allgather")
    if variant == "qwen2":
        cfg = dataclasses.replace(cfg, moe_router_score_function="softmax",
                                  moe_router_enable_expert_bias=False)
    if variant == "qwen3":
        cfg = dataclasses.replace(cfg, qk_layernorm=True, moe_layer_freq=[0, 1])
    if variant == "glm":
        cfg = dataclasses.replace(cfg, moe_shared_expert_gate=False)
    spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    torch.manual_seed(seed)
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=mm.VOCAB,
                     max_sequence_length=64, pre_process=True, post_process=True,
                     share_embeddings_and_output_weights=False, position_embedding_type="rope")
    bias = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    model = model.to(torch.bfloat16)
    for n, b in bias.items():
        model.get_buffer(n).data = b + 0.01 * torch.arange(b.numel())  # a bias that matters
    mm.distinct_experts(model, seed)
    with torch.no_grad():  # norms that differ from ones (a misplaced one shows)
        for n, p in model.named_parameters():
            if n.endswith(("q_layernorm.weight", "k_layernorm.weight")):
                p.add_(0.25 * torch.arange(p.numel()).to(p.dtype) * (1 if "q_" in n else -1))
    return model


def load_truth(model, truth):
    """Sets every weight of the world-1 `model` from a make_moe_torch_dist.py truth (its
    "model": global tensors by canonical name), through megatron-core's own sharded state dict
    (the SwiGLU factories' gate / up chunks are views of fc1): each ShardedTensor's truth name
    (make_moe_torch_dist.truth_name), every truth tensor used once."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    sd = model.sharded_state_dict()
    apply_factories(sd)
    used = set()
    with torch.no_grad():
        for sh in nested_values(sd):
            if not isinstance(sh, ShardedTensor):
                continue
            n = sh.prepend_axis_num
            name = mm.truth_name(sh.key, sh.global_offset[:n])
            src = truth[name][tuple(slice(o, o + s) for o, s in
                                    zip(sh.global_offset[n:], sh.local_shape))]
            sh.data.copy_(src.reshape(sh.data.shape))
            used.add(name)
    missing = sorted(set(truth) - used)
    assert not missing, f"truth tensors the model has no place for: {missing}"


def make_rank(rank, world, port, a):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    mtd.cpu_shims()
    import mcore_cpu
    mcore_cpu.shims()
    import torch.distributed.checkpoint as dcp
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom
    parallel_state.initialize_model_parallel(1, 1)
    model = build(a.variant, a.seed)
    if a.truth:
        load_truth(model, torch.load(a.truth, weights_only=False)["model"])
    pieces, _ = mm.local_pieces(model.sharded_state_dict())
    full = mm.assemble([pieces])
    out = pathlib.Path(a.out)
    dcp.save({n: t.contiguous() for n, t in full.items()}, checkpoint_id=str(out / "dcp"))
    # Megatron's own forward in float32 (hf_rank's way: the bf16 flags off, no CUDA RNG).
    model.config.bf16 = False
    m = model.float().eval()
    # megatron-core 0.16 without Transformer Engine leaves the router's GEMM name undefined.
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    for mod in m.modules():
        if hasattr(mod, "input_in_bf16"):
            mod.input_in_bf16 = mod.input_in_float16 = False
    mrandom.get_cuda_rng_tracker().fork = lambda *x, **k: contextlib.nullcontext()
    g = torch.Generator().manual_seed(5)
    b, s = TOKENS
    tokens = torch.randint(0, mm.VOCAB, TOKENS, generator=g)
    with torch.no_grad():
        logits = m(tokens, torch.arange(s).expand(b, s),
                   attention_mask=torch.triu(torch.ones(s, s), diagonal=1).bool()[None, None])
    torch.save({"tokens": tokens, "logits": logits.float(), "names": sorted(full)},
               out / "logits.pt")
    torch.distributed.destroy_process_group()


def make(out, variant="mixtral", seed=3, truth=None):
    """Makes DIR (see the module's doc) in a forked process; True when it succeeded. truth: a
    make_moe_torch_dist.py truth.pt of the same variant whose weights the model takes (its
    torch_dist save then holds the model whose logits DIR has)."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mtd.preload()
    import megatron.core.transformer.moe.moe_layer  # noqa: F401 (once, before forking)
    a = argparse.Namespace(out=str(out), variant=variant, seed=seed,
                           truth=str(truth) if truth else None)
    ctx = mp.start_processes(make_rank, args=(1, mtd.free_port(), a), nprocs=1, join=False,
                             start_method="fork")
    return mtd.join(ctx, time.monotonic() + mtd.DEADLINE, "moe_hf_oracle make")


def check(src, hf):
    """The verdict of transformers' load of `hf` against the logits of `src` (a dict: ok,
    problems, architecture, compared, max_abs_logit, max_abs_diff)."""
    import transformers
    want = torch.load(pathlib.Path(src) / "logits.pt")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(hf), dtype=torch.float32, output_loading_info=True)
    with torch.no_grad():
        got = model.eval()(want["tokens"]).logits
    logits = want["logits"]
    problems = [f"{k}: {sorted(v)}" for k, v in info.items() if v]
    verdict = {"architecture": type(model).__name__, "compared": 0,
               "max_abs_logit": float(logits.abs().max())}
    if got.shape != logits.shape:
        problems.append(f"logits {tuple(got.shape)}, Megatron's {tuple(logits.shape)}")
    else:
        diff = float((got - logits).abs().max())
        verdict.update(compared=got.numel(), max_abs_diff=diff)
        if not diff <= 1e-5 * float(logits.abs().max()):
            problems.append(f"logits differ by up to {diff}")
    verdict.update(ok=not problems, problems=problems)
    return verdict


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("mode", choices=("make", "check"))
    ap.add_argument("dir")
    ap.add_argument("hf", nargs="?")
    ap.add_argument("--variant", choices=VARIANTS, default="mixtral")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--truth", help="make: the weights of a make_moe_torch_dist.py truth.pt")
    a = ap.parse_args()
    if a.mode == "make":
        sys.exit(0 if make(a.dir, a.variant, a.seed, a.truth) else 1)
    v = check(a.dir, a.hf)
    print(json.dumps(v))
    sys.exit(0 if v["ok"] else 1)


if __name__ == "__main__":
    main()
