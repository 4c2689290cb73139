#!/usr/bin/python3
"""Independent generator of Megatron-DeepSpeed checkpoints with tensor and
pipeline parallelism, written from ../shared/reference/deepspeed.md (sections
1.2-1.3 file names and rank math, 2 model states, 3 pipeline layer files,
4 ZeRO / BF16_Optimizer files, 7.1 Megatron-DeepSpeed's TP rules), never
from ucp. No real Megatron-DeepSpeed run is possible here.

A tiny GPT (hidden 8, 2 heads, ffn 16 or SwiGLU 2x16, vocab 30 padded to a
multiple of 4*tp, tied embeddings) is trained "once": every case of one model
holds the same full tensors, sliced for its (tp, pp, dp):

  pipe_*   GPTModelPipe (PipelineModule): `layer_{idx:02d}-model_{tp:02d}-
           model_states.pt` with layer-local keys (idx 0 is the bf16 cast,
           idx 1 the tied embedding, 2.. the transformer layers, then a
           transpose, the final norm, the tied head without a file),
           `mp_rank_{pp*TP+tp:02d}_model_states.pt` with module None, and the
           optimizer files of each mp rank. The last stage holds the tied
           embedding again (its optimizer has a copy).
  nopipe_* GPTModel (--no-pipeline-parallel): `mp_rank_{tp:02d}` with the
           module's legacy names (language_model.encoder.layers.N...).

Each case folder holds `latest`, the tag folder and truth.pt:
  atoms:  {name: {state kind: full tensor (true vocab rows)}}
  export: {name: fp32 full tensor}
  pad:    {name: {state kind: the padding rows beyond the true vocabulary}}
  vocab:  {"true": 30, "padded": rows of the padded embedding}
"""
import argparse
import os
import sys
from argparse import Namespace
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))
from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

STEP = 3
H, HEADS, FFN, VOCAB, DIV = 8, 2, 16, 30, 4
HYPER = [dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd, amsgrad=False,
              foreach=None, maximize=False, capturable=False) for wd in (0.1, 0.0)]


def ucp_patterns(pipe, tp, swiglu):
    """The parameter patterns of universal_checkpoint_info as Megatron-DeepSpeed's
    UniversalCheckpointInfo makes them (../shared/reference/deepspeed.md 7.1), for this
    model's names (DeepSpeed's ds_to_universal asserts that every pattern matches some
    param): the vocabulary (padding rows cut), pipeline-replicated (the tied embedding),
    and at TP > 1 the TP-replicated params and those split on dim 1; SwiGLU's two sub-params
    of dense_h_to_4h."""
    pre = r"\d+." if pipe else r"language_model.encoder.layers.\d+."
    vocab = (r"tied_modules.embed.word_embeddings.weight" if pipe
             else r"language_model.embedding.word_embeddings.weight")
    info = {"vocabulary_parameter_patterns": [vocab],
            "pipeline_replicated_parameter_patterns": [vocab]}
    if tp > 1:
        final = ([r"\d+.weight", r"\d+.bias"] if pipe else
                 [r"language_model.encoder.final_layernorm.weight",
                  r"language_model.encoder.final_layernorm.bias"])
        info["tp_replicated_parameter_patterns"] = [
            pre + n for n in ("input_layernorm.weight", "input_layernorm.bias",
                              "post_attention_layernorm.weight", "post_attention_layernorm.bias",
                              "self_attention.dense.bias", "mlp.dense_4h_to_h.bias")] + final
        info["parameter_with_row_parallelism_patterns"] = [
            pre + "mlp.dense_4h_to_h.weight", pre + "self_attention.dense.weight"]
    if swiglu:
        info["parameter_with_2_sub_params_cat_dim_0"] = [
            pre + "mlp.dense_h_to_4h.weight", pre + "mlp.dense_h_to_4h.bias"]
    return info


def padded_vocab(tp):
    m = DIV * tp
    return -(-VOCAB // m) * m


def model_params(layers, swiglu):
    """[(pipe name, legacy name, full shape, split)] in module order; split is
    None (replicated), ('dim', d), ('swiglu',) or ('vocab',)."""
    f1 = 2 * FFN if swiglu else FFN
    out = [("tied_modules.embed.word_embeddings.weight",
            "language_model.embedding.word_embeddings.weight", (VOCAB, H), ("vocab",))]
    for i in range(layers):
        idx = 2 + i
        lp = f"language_model.encoder.layers.{i}."
        for suffix, shape, split in [
                ("input_layernorm.weight", (H,), None), ("input_layernorm.bias", (H,), None),
                ("self_attention.query_key_value.weight", (3 * H, H), ("dim", 0)),
                ("self_attention.query_key_value.bias", (3 * H,), ("dim", 0)),
                ("self_attention.dense.weight", (H, H), ("dim", 1)),
                ("self_attention.dense.bias", (H,), None),
                ("post_attention_layernorm.weight", (H,), None),
                ("post_attention_layernorm.bias", (H,), None),
                ("mlp.dense_h_to_4h.weight", (f1, H), ("swiglu",) if swiglu else ("dim", 0)),
                ("mlp.dense_h_to_4h.bias", (f1,), ("swiglu",) if swiglu else ("dim", 0)),
                ("mlp.dense_4h_to_h.weight", (H, FFN), ("dim", 1)),
                ("mlp.dense_4h_to_h.bias", (H,), None)]:
            out.append((f"{idx}.{suffix}", lp + suffix, shape, split))
    norm = 2 + layers + 1  # after the transpose function
    for k in ("weight", "bias"):
        out.append((f"{norm}.{k}", f"language_model.encoder.final_layernorm.{k}", (H,), None))
    return out


def make_full(layers, swiglu, tp):
    """Full tensors per pipe name and state kind; the embedding carries its
    padding rows for `tp` (seeded by row, so the first VOCAB rows agree for
    every tp)."""
    g = torch.Generator().manual_seed(1234 + layers + 10 * swiglu)
    full = {}
    for name, _, shape, split in model_params(layers, swiglu):
        st = {"fp32": torch.randn(shape, generator=g),
              "exp_avg": torch.randn(shape, generator=g) * 1e-2,
              "exp_avg_sq": torch.rand(shape, generator=g) * 1e-4}
        if split == ("vocab",):
            gp = torch.Generator().manual_seed(99)
            rows = padded_vocab(tp) - VOCAB
            extra = {k: torch.randn((rows, H), generator=gp) for k in st}
            st = {k: torch.cat([v, extra[k]]) for k, v in st.items()}
        full[name] = st
    return full


def local_slice(t, split, tp, r):
    if split is None:
        return t.clone()
    if split == ("vocab",):
        return t.chunk(tp, 0)[r].clone()
    if split == ("swiglu",):
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]]).clone()
    return t.chunk(tp, split[1])[r].clone()


def stage_of(name, layers, pp):
    """Stage of a pipe name: layers spread evenly ('type:transformer'), the
    embedding on stage 0 (and its tied copy on the last), the norm last."""
    head = name.split(".")[0]
    if head == "tied_modules":
        return [0] if pp == 1 else [0, pp - 1]
    idx = int(head)
    if idx >= 2 + layers:
        return [pp - 1]
    return [(idx - 2) * pp // layers]


def flat_partitions(names, local, world, r, bf16_opt):
    """One group's flat fp32 partition of rank r, moments, padding and
    fragment map (reference 4.2 / 4.3)."""
    numel = {n: local[n]["fp32"].numel() for n in names}
    N = sum(numel.values())
    A = 2 * world
    Np = -(-N // A) * A
    ps = Np // world
    cat = {k: torch.cat([local[n][k].flatten() for n in names] + [torch.zeros(Np - N)])
           for k in ("fp32", "exp_avg", "exp_avg_sq")}
    if bf16_opt:
        pad = Np - N if r == world - 1 else 0
        fp32 = cat["fp32"][r * ps:(r + 1) * ps].clone()
    else:
        pad = ps if N <= r * ps else ((r + 1) * ps - N if N < (r + 1) * ps else 0)
        fp32 = cat["fp32"][r * ps:(r + 1) * ps - pad].clone()
    m, o = OrderedDict(), 0
    for n in names:
        b, e = max(o, r * ps), min(o + numel[n], (r + 1) * ps)
        if b < e:
            m[n] = fragment_address(numel=e - b, start=b - r * ps)
        o += numel[n]
    moments = {k: cat[k][r * ps:(r + 1) * ps].clone() for k in ("exp_avg", "exp_avg_sq")}
    return fp32, moments, pad, m


def write_case(out, *, pipe, tp, pp, dp, layers, swiglu, dtype, stage):
    """stage 0 = BF16_Optimizer (bf16 + pipeline) or FP16_Optimizer (fp16,
    in the model states: flat fp32 masters per group, no param_shapes, no
    shared_params, no optimizer files), 1 or 2 = ZeRO."""
    lp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    full = make_full(layers, swiglu, tp)
    params = model_params(layers, swiglu)
    split = {p[0]: p[3] for p in params}
    legacy = {p[0]: p[1] for p in params}
    tag = f"global_step{STEP}"
    tdir = os.path.join(out, tag)
    os.makedirs(tdir)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(STEP))
    bf16_opt = stage == 0 and dtype == "bf16"
    fp16_opt = stage == 0 and dtype == "fp16"
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": dtype == "fp16"},
           "pipeline": {"activation_checkpoint_interval": 0}}
    args = Namespace(num_layers=layers, hidden_size=H, num_attention_heads=HEADS,
                     num_key_value_heads=HEADS, ffn_hidden_size=FFN, swiglu=swiglu,
                     make_vocab_size_divisible_by=DIV, padded_vocab_size=padded_vocab(tp),
                     tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                     untie_embeddings_and_output_weights=False, iteration=STEP,
                     bf16=dtype == "bf16", deepspeed=True, no_pipeline_parallel=not pipe)
    info = {"universal_checkpoint_version": 0.2, "original_vocab_size": VOCAB,
            "padded_vocab_size": padded_vocab(tp), **ucp_patterns(pipe, tp, swiglu)}
    step = torch.tensor(float(STEP))
    stages = range(pp) if pipe else [0]
    for p in stages:
        names = [n for n, *_ in params if (p in stage_of(n, layers, pp) if pipe else True)]
        # Megatron-DeepSpeed param groups: weight decay (matrices) / none.
        groups = [[n for n in names if len(full[n]["fp32"].shape) > 1],
                  [n for n in names if len(full[n]["fp32"].shape) == 1]]
        for t in range(tp):
            mp = p * tp + t
            local = {n: {k: local_slice(v, split[n], tp, t) for k, v in full[n].items()}
                     for n in names}
            key = (lambda n: n) if pipe else (lambda n: legacy[n])
            shapes = [OrderedDict((key(n), local[n]["fp32"].shape) for n in g) for g in groups]
            module = None
            if not pipe:
                module = OrderedDict((key(n), local[n]["fp32"].to(lp)) for n in names)
            optimizer = None
            if fp16_opt:  # FP16_Optimizer.state_dict() (fused_optimizer.py)
                cat = [{k: torch.cat([local[n][k].flatten() for n in g])
                        for k in ("fp32", "exp_avg", "exp_avg_sq")} for g in groups]
                optimizer = OrderedDict([
                    ("dynamic_loss_scale", True), ("cur_scale", 4096.0), ("cur_iter", STEP),
                    ("last_overflow_iter", -1), ("scale_factor", 2.0), ("scale_window", 1000),
                    ("optimizer_state_dict", {
                        "state": {gi: {"step": step.clone(), "exp_avg": c["exp_avg"],
                                       "exp_avg_sq": c["exp_avg_sq"]}
                                  for gi, c in enumerate(cat)},
                        "param_groups": [dict(HYPER[gi], params=[gi])
                                         for gi in range(len(groups))]}),
                    ("fp32_groups_flat", [c["fp32"] for c in cat]), ("clip_grad", 1.0)])
                shapes = None
            states = OrderedDict([
                ("module", module), ("buffer_names", []), ("optimizer", optimizer),
                ("param_shapes", shapes), ("frozen_param_shapes", None),
                ("shared_params", None if fp16_opt else {}), ("frozen_param_fragments", None),
                ("lr_scheduler", {"num_steps": STEP}), ("data_sampler", None),
                ("random_ltd", None), ("sparse_tensor_module_names", set()),
                ("skipped_steps", 0), ("global_steps", STEP), ("global_samples", STEP * dp),
                ("dp_world_size", dp), ("mp_world_size", tp * (pp if pipe else 1)),
                ("ds_config", cfg), ("ds_version", "0.14.5"),
                ("args", args), ("checkpoint_version", 3.0), ("iteration", STEP),
                ("tokens", STEP * 64), ("universal_checkpoint_info", info)])
            torch.save(states, os.path.join(tdir, f"mp_rank_{mp:02d}_model_states.pt"))
            # Layer files: written by each stage for its own layers (the tied
            # head on the last stage is a function: no file).
            if pipe:
                by_idx = OrderedDict()
                for n in names:
                    head, rest = n.split(".", 1)
                    if head == "tied_modules":
                        if p != 0:
                            continue
                        idx, rest = 1, rest.split(".", 1)[1]
                    else:
                        idx = int(head)
                    by_idx.setdefault(idx, OrderedDict())[rest] = local[n]["fp32"].to(lp)
                for idx, sd in by_idx.items():
                    torch.save(sd, os.path.join(tdir, f"layer_{idx:02d}-model_{t:02d}-model_states.pt"))
            prefix = "bf16_" if dtype == "bf16" else ""
            for r in range(0 if fp16_opt else dp):
                fp32s, state, pads, maps = [], {}, [], []
                for gi, g in enumerate(groups):
                    fp32, moments, pad, m = flat_partitions(g, local, dp, r, bf16_opt)
                    fp32s.append(fp32)
                    state[gi] = dict(step=step.clone(), **moments)
                    pads.append(pad)
                    maps.append(OrderedDict((key(n), v) for n, v in m.items()))
                base = {"state": state,
                        "param_groups": [dict(HYPER[gi], params=[gi]) for gi in range(len(groups))]}
                items = []
                if not bf16_opt:
                    items += [("loss_scaler", LossScaler(1.0)), ("dynamic_loss_scale", False),
                              ("overflow", False)]
                items += [("clip_grad", 1.0), ("base_optimizer_state", base),
                          ("single_partition_of_fp32_groups", fp32s)]
                if not bf16_opt:
                    items += [("zero_stage", ZeroStageEnum(stage))]
                items += [("group_paddings", pads), ("partition_count", [dp] * len(groups)),
                          ("ds_version", "0.14.5"), ("param_slice_mappings", maps)]
                torch.save({"optimizer_state_dict": OrderedDict(items), "ds_config": cfg,
                            "ds_version": "0.14.5"},
                           os.path.join(tdir, f"{prefix}zero_pp_rank_{r}_mp_rank_{mp:02d}_optim_states.pt"))
    # Truth: full tensors at the true vocabulary size.
    atoms, export, pad = {}, {}, {}
    for n, *_ in params:
        name = n if pipe else legacy[n]
        st = {k: v[:VOCAB].clone() if split[n] == ("vocab",) else v for k, v in full[n].items()}
        if split[n] == ("vocab",):
            pad[name] = {k: v[VOCAB:].clone() for k, v in full[n].items()}
            if dtype != "fp32":
                pad[name]["param"] = pad[name]["fp32"].to(lp)
        atoms[name] = dict(st, step=step.clone())
        if dtype != "fp32":
            atoms[name]["param"] = st["fp32"].to(lp)
        export[name] = st["fp32"]
    torch.save({"atoms": atoms, "export": export, "pad": pad,
                "vocab": {"true": VOCAB, "padded": padded_vocab(tp)}},
               os.path.join(out, "truth.pt"))


CASES = {
    # BF16_Optimizer (ZeRO 0 + bf16 + pipeline): Megatron-DeepSpeed's usual run.
    "pipe_bf16opt_tp2_pp2_dp2": dict(pipe=True, tp=2, pp=2, dp=2, layers=2, swiglu=False,
                                     dtype="bf16", stage=0),
    "pipe_z1_tp2_pp1_dp3_swiglu": dict(pipe=True, tp=2, pp=1, dp=3, layers=2, swiglu=True,
                                       dtype="bf16", stage=1),
    "pipe_z1_tp1_pp2_dp2": dict(pipe=True, tp=1, pp=2, dp=2, layers=2, swiglu=False,
                                dtype="fp32", stage=1),
    "pipe_z1_tp4_pp2_dp1": dict(pipe=True, tp=4, pp=2, dp=1, layers=2, swiglu=False,
                                dtype="bf16", stage=1),
    "nopipe_z2_tp2_dp2": dict(pipe=False, tp=2, pp=1, dp=2, layers=2, swiglu=False,
                              dtype="fp32", stage=2),
    "nopipe_z1_tp2_dp3_swiglu": dict(pipe=False, tp=2, pp=1, dp=3, layers=2, swiglu=True,
                                     dtype="bf16", stage=1),
    # FP16_Optimizer (ZeRO 0 + fp16), the other usual run, with and without pipeline.
    "nopipe_fp16opt_tp2_dp2": dict(pipe=False, tp=2, pp=1, dp=2, layers=2, swiglu=False,
                                   dtype="fp16", stage=0),
    "pipe_fp16opt_tp2_pp2_dp2": dict(pipe=True, tp=2, pp=2, dp=2, layers=2, swiglu=False,
                                     dtype="fp16", stage=0),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    a = ap.parse_args()
    for name, kw in CASES.items():
        if a.only and name not in a.only:
            continue
        write_case(os.path.join(a.out, name), **kw)
    print(f"{len(a.only or CASES)} Megatron-DeepSpeed checkpoints in {a.out}")


if __name__ == "__main__":
    main()
