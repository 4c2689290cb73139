#!/usr/bin/python3
"""Independent oracle: Megatron-core legacy (``--ckpt-format torch``) checkpoints for many topologies, all cut
from ONE set of full (unsharded) tensors.  Emulates Megatron-core v0.13.0 (default) or v0.8.0.

Usage:
  make_megatron_ckpts.py --out DIR [--megatron-version {0.13,0.8}] [--variant NAME ...]
                         [--topologies all|quick|tp2_pp2_vpp1_dp2_do,...] [--quick]
                         [--scale hidden=2048,ffn=5504,layers=4,vocab=32000,heads=16,groups=8,kv=128 |
                          --scale bench4g] [--no-truth] [--ddp-bucket-size N]
  make_megatron_ckpts.py --diff-versions V013_TOPOLOGY_DIR V08_TOPOLOGY_DIR
  make_megatron_ckpts.py --self-test

  --topologies all    the full grid (megatron_spec.grid_candidates: TP {1,2,4} x PP {1,2,4} x VPP {1,2} (PP > 1)
                      x distributed optimizer with DP {1,2,4} / without with DP {1,2}: 75 per variant, all
                      runnable by v0.13; v0.8 loses the tied PP > 1 distributed-optimizer topologies that
                      hit its bucket bug (mha_gelu_nobias_tied tp4_pp4_vpp2 dp1/2/4), listed as skipped)
  --topologies quick  (or --quick) 12 representative topologies per variant (megatron_spec.QUICK_TOPOLOGIES)

Writes, per variant:
  DIR/<variant>/truth.pt     {"params": OrderedDict(canonical -> {"fp32","exp_avg","exp_avg_sq": fp32 full
                             tensors at the TRUE vocab size, "model": bf16 = fp32 rounded}), "padding":
                             {canonical -> {kind: [pad_rows, h] block}}, "order": [...], "groups": [...],
                             "param_group": {canonical: group index}, "model_config": {...}, "iteration",
                             "megatron_version", ...}
  DIR/<variant>/truth.json   the same without tensors: shapes, dtypes, groups and sha256 of every tensor
  DIR/<variant>/<topology>/latest_checkpointed_iteration.txt, iter_0000100/mp_rank_TT[_PPP]/
                             model_optim_rng.pt [+ distrib_optim.pt]
  DIR/<variant>/manifest.json  megatron version, generated topologies and the ones that version cannot
                             produce (with the reason)

What a rank file holds (sources cited in megatron_spec.py and below):
  model_optim_rng.pt = {args, checkpoint_version: 3.0, iteration, model | model0..model{V-1}, optimizer,
  opt_param_scheduler, [v0.13: rerun_state_machine], rng_state, num_floating_point_operations_so_far}
  (megatron/training/checkpointing.py:generate_state_dict + save_checkpoint; written by DP rank 0 of every
  (TP, PP) pair (v0.13: expert-DP rank 0, the same ranks with EP 1); with --use-distributed-optimizer also
  distrib_optim.pt from distrib_optimizer.py:DistributedOptimizer.save_parameter_state /
  get_parameter_state_dp_zero, written before model_optim_rng.pt).  The per-version differences are listed
  in megatron_spec's module docstring.

Differences from a real run that do not change tensor values: tensors are CPU tensors (real files say
'cuda:N'); the rng states are deterministic fakes with the real structure; num_floating_point_operations_so_far
is computed with the TP=1 padded vocabulary for every topology (see megatron_spec.flops_so_far); the v0.8 TE
`_extra_state` bytes are torch.save(None) as written by this machine's torch.
Vocab padding rows: a fixed deterministic block of pad_rows(cfg) rows (126 for the default variants:
256 - 130); a topology with padded vocabulary P holds the block's first P - 130 rows below the true rows.

The test corpus dimensions are the defaults of megatron_spec.ModelConfig: num_layers 8, hidden 8,
heads 8, query groups 4 (GQA variants), kv_channels 2, ffn 16, vocab 130 padded to 160/192/256 for TP
1/2/4 (make_vocab_size_divisible_by 32), seq 16, global batch 16, micro batch 1.  Hidden/ffn/kv are
small to keep the full grid (225 topologies, ~2,400 rank files) under 150 MB (v0.13: 130 MB of rank files,
~8 s): each model_optim_rng.pt carries ~32 KB of realistic args + rng state regardless of the model size.
Every divisibility constraint still bites (TP 4: 1 query group, 4 fc1 rows per GLU half, 4 proj columns
per rank; all 1-D params are smaller than the 64-element DistOpt alignment).
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
import struct
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "stubs"))

import megatron_spec as S  # noqa: E402
import megatron.core.rerun_state_machine  # noqa: E402,F401  (tests/tools/stubs: pickled enums)
import megatron.core.transformer.enums  # noqa: E402,F401
from megatron.core.enums import ModelType  # noqa: E402

KINDS = ("fp32", "exp_avg", "exp_avg_sq")

#: --scale presets.  bench4g: TP2 PP2 DP2 distributed optimizer -> ~4 GiB on disk.
SCALE_PRESETS = {
    "bench4g": {"hidden": 2048, "ffn": 5632, "layers": 4, "vocab": 32000, "heads": 16, "groups": 8, "kv": 128},
}


# ----------------------------------------------------------------------------------------------------
# Full tensors


def _seed(*parts: object) -> int:
    h = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _randn(shape: Tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float32)


def _values(cfg: S.ModelConfig, name: str, kind: str, shape: Tuple[int, ...], tag: str) -> torch.Tensor:
    """Deterministic fp32 values of one (param, state kind); tag 'full' or 'pad'."""
    x = _randn(shape, _seed(cfg.name, name, kind, tag))
    if kind == "fp32":
        if name.endswith("layer_norm_weight") or name.endswith("final_layernorm.weight"):
            return x.mul_(0.05).add_(1.0)
        return x.mul_(0.02)
    if kind == "exp_avg":
        return x.mul_(1e-3)
    if kind == "exp_avg_sq":
        return x.mul_(1e-3).square_()     # >= 0
    raise ValueError(kind)


class Truth:
    """Full tensors of a variant.  cache=True keeps everything (small corpus, truth.pt); cache=False
    regenerates a tensor on every request (streaming mode for --scale)."""

    def __init__(self, cfg: S.ModelConfig, cache: bool = True):
        self.cfg = cfg
        self.cache = cache
        self.specs = collections.OrderedDict((p.name, p) for p in S.canonical_params(cfg))
        self._full: Dict[Tuple[str, str], torch.Tensor] = {}
        self._pad: Dict[Tuple[str, str], torch.Tensor] = {}

    def full(self, name: str, kind: str) -> torch.Tensor:
        if kind == "model":
            return self.full(name, "fp32").to(torch.bfloat16)
        k = (name, kind)
        if k in self._full:
            return self._full[k]
        t = _values(self.cfg, name, kind, self.specs[name].shape, "full")
        if self.cache:
            self._full[k] = t
        return t

    def pad(self, name: str, kind: str) -> torch.Tensor:
        if kind == "model":
            return self.pad(name, "fp32").to(torch.bfloat16)
        k = (name, kind)
        if k in self._pad:
            return self._pad[k]
        spec = self.specs[name]
        t = _values(self.cfg, name, kind, (S.pad_rows(self.cfg),) + tuple(spec.shape[1:]), "pad")
        if self.cache:
            self._pad[k] = t
        return t

    def local(self, spec: S.ParamSpec, kind: str, tp: int, rank: int) -> torch.Tensor:
        """The TP-local tensor of `spec` (canonical) for `kind` (fp32 / exp_avg / exp_avg_sq / model)."""
        src_kind = "fp32" if kind == "model" else kind
        shape = S.local_shape(spec, self.cfg, tp)
        out = torch.empty(shape, dtype=torch.float32)
        full = self.full(spec.name, src_kind)
        for pc in S.shard_pieces(spec, self.cfg, tp, rank):
            src = full if pc.src == "full" else self.pad(spec.name, src_kind)
            out.narrow(pc.dim, pc.local_start, pc.local_end - pc.local_start).copy_(
                src.narrow(pc.dim, pc.src_start, pc.src_end - pc.src_start))
        return out.to(torch.bfloat16) if kind == "model" else out


# ----------------------------------------------------------------------------------------------------
# Rank files


def te_extra_state(cfg: S.ModelConfig):
    """A TE module's '_extra_state' without FP8 (megatron_spec.te_extra_state_kind):
    v0.8 / TE 1.9: TE:module/base.py:TransformerEngineBaseModule.get_extra_state: state = None;
    io.BytesIO(); torch.save(state, buf); returned without seek (position at the end).
    v0.13 / TE 2.5: the same method returns torch.empty(0, dtype=torch.uint8)."""
    kind = S.te_extra_state_kind(cfg)
    if kind == "empty_uint8":
        return torch.empty(0, dtype=torch.uint8)
    buf = io.BytesIO()
    torch.save(None, buf)
    return buf


def te_op_extra_state() -> torch.Tensor:
    """v0.13 final norm '_extra_state' (TE:ops/op.py:BasicOperation.get_extra_state without quantizers):
    torch.frombuffer(bytearray(pickle.dumps({})), dtype=torch.uint8)."""
    return torch.frombuffer(bytearray(S.te_op_extra_state_bytes()), dtype=torch.uint8)


def extra_state_bytes(x) -> bytes:
    """The serialized bytes of an _extra_state object (BytesIO content, uint8 tensor bytes)."""
    if isinstance(x, io.BytesIO):
        return x.getvalue()
    return x.numpy().tobytes()


def _resolve(v):
    """megatron_spec placeholders -> real objects (torch dtype, stub enums)."""
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__torch_dtype__":
        return getattr(torch, v[1])
    if isinstance(v, tuple) and len(v) == 2 and v[0] == "__model_type__":
        return ModelType[v[1]]
    if isinstance(v, tuple) and len(v) == 3 and v[0] == "__enum__":
        mod, cls = v[1].rsplit(".", 1)
        return getattr(sys.modules[mod], cls)[v[2]]
    if isinstance(v, dict):
        return {k: _resolve(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_resolve(x) for x in v]
    return v


def make_args(cfg: S.ModelConfig, t: S.Topology, tp_rank: int, pp_rank: int) -> argparse.Namespace:
    ns = argparse.Namespace()
    for k, v in S.args_items(cfg, t, tp_rank, pp_rank):
        setattr(ns, k, _resolve(v))
    return ns


def make_rng_state(cfg: S.ModelConfig, t: S.Topology, tp_rank: int, pp_rank: int) -> list:
    """checkpointing.py:get_rng_state: [ {random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state,
    rng_tracker_states} ] (one entry: no --data-parallel-random-init).  Python/numpy/torch-CPU states are
    real states of generators seeded as initialize.py:_set_random_seed does; CUDA states (torch >= 2.1:
    16 bytes = uint64 seed + int64 philox offset, CPU ByteTensor) are built from the tracker seeds with
    fixed fake offsets."""
    seeds = S.rng_seeds(cfg, t, tp_rank, pp_rank)
    seed = seeds["seed"]
    g = torch.Generator()
    g.manual_seed(seed)
    torch.rand(7, generator=g)   # "used" a little

    def cuda_state(s: int, offset: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(struct.pack("<Qq", s, offset)), dtype=torch.uint8).clone()

    it = cfg.iteration
    tracker = collections.OrderedDict()
    tracker["data-parallel-rng"] = cuda_state(seeds["data-parallel-rng"], 4 * it * 2)
    tracker["model-parallel-rng"] = cuda_state(seeds["model-parallel-rng"], 4 * it * 6)
    tracker["expert-parallel-rng"] = cuda_state(seeds["expert-parallel-rng"], 0)
    return [{
        "random_rng_state": random.Random(seed).getstate(),
        "np_rng_state": np.random.RandomState(seed).get_state(),
        "torch_rng_state": g.get_state(),
        "cuda_rng_state": cuda_state(seed, 4 * it * 8),
        "rng_tracker_states": dict(tracker),
    }]


def build_model_chunk(truth: Truth, t: S.Topology, tp_rank: int, pp_rank: int, vp: int,
                      layout: Optional[S.BufferLayout]) -> "collections.OrderedDict":
    """GPTModel.state_dict() of one chunk (keep_vars=False: params detached).  With the distributed
    optimizer the params are views into the chunk's bf16 param buffer (param_and_grad_buffer.py:
    ParamAndGradBuffer.__init__ remaps param.data to self.param_data, zero-initialised), so every tensor
    of the chunk shares one storage at its buffer offset."""
    cfg = truth.cfg
    sd = collections.OrderedDict()
    sd._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
        (p, {"version": 1}) for p in S.module_paths(cfg, t, pp_rank, vp))
    buf = None
    if layout is not None:
        buf = torch.zeros(layout.numel, dtype=torch.bfloat16)
    for e in S.chunk_entries(cfg, t, pp_rank, vp):
        if e.kind == "extra_te":
            sd[e.key] = te_extra_state(cfg)
        elif e.kind == "extra_te_op":
            sd[e.key] = te_op_extra_state()
        elif e.kind == "extra_none":
            sd[e.key] = None
        else:
            local = truth.local(e.param, "model", t.tp, tp_rank)
            if buf is not None:
                s, en, _ = layout.index[e.key]
                view = buf[s:en].view(local.shape)
                view.copy_(local)
                local = view
            sd[e.key] = local
    return sd


def build_rank(truth: Truth, t: S.Topology, tp_rank: int, pp_rank: int):
    """(model_optim_rng state dict, distrib_optim state dict or None) of rank (tp_rank, pp_rank)."""
    cfg = truth.cfg
    layouts = [S.chunk_buffer_layout(cfg, t, pp_rank, vp) for vp in range(t.vpp)]
    sd: dict = {}
    sd["args"] = make_args(cfg, t, tp_rank, pp_rank)
    sd["checkpoint_version"] = 3.0
    sd["iteration"] = cfg.iteration
    chunks = [build_model_chunk(truth, t, tp_rank, pp_rank, vp, layouts[vp] if t.distopt else None)
              for vp in range(t.vpp)]
    if t.vpp == 1:
        sd["model"] = chunks[0]
    else:
        for vp, c in enumerate(chunks):
            sd[f"model{vp}"] = c
    groups = S.param_groups(cfg, t, pp_rank)
    distrib = None
    if not t.distopt:
        # optimizer.py:Float16OptimizerWithFloat16Params.state_dict: {'optimizer': inner.state_dict(),
        # 'fp32_from_fp16_params': fp32_from_float16_groups} (no grad_scaler in bf16 without
        # --loss-scale).  Inner state ids: torch Optimizer.state_dict numbers params sequentially over
        # param_groups; 'state' follows self.state insertion order = FusedAdam.step order (ascending ids).
        state = {}
        pgs = []
        fp32_groups = []
        pid = 0
        for key, members in groups:
            ids = []
            fp32_list = []
            for _vp, e in members:
                state[pid] = {"exp_avg": truth.local(e.param, "exp_avg", t.tp, tp_rank),
                              "exp_avg_sq": truth.local(e.param, "exp_avg_sq", t.tp, tp_rank)}
                fp32_list.append(truth.local(e.param, "fp32", t.tp, tp_rank))
                ids.append(pid)
                pid += 1
            g = dict(S.group_hyperparams(cfg, key, with_step=True))
            g["params"] = ids
            pgs.append(g)
            fp32_groups.append(fp32_list)
        sd["optimizer"] = {"optimizer": {"state": state, "param_groups": pgs},
                           "fp32_from_fp16_params": fp32_groups}
    else:
        # distrib_optimizer.py:DistributedOptimizer.state_dict: {'optimizer': inner state dict without
        # 'state', param groups without 'params'} (DP rank 0's groups: 'step' only where non-empty there).
        steps = S.groups_with_step_on_dp0(cfg, t, pp_rank, layouts)
        pgs = [dict(S.group_hyperparams(cfg, key, with_step=has)) for (key, _m), has in zip(groups, steps)]
        sd["optimizer"] = {"optimizer": {"param_groups": pgs}}
        distrib = {"buckets_coalesced": True}
        for vp in range(t.vpp):
            lay = layouts[vp]
            world = {k: torch.zeros(lay.numel_unpadded, dtype=torch.float32)
                     for k in ("param", "exp_avg", "exp_avg_sq")}
            for e in S.chunk_params(cfg, t, pp_rank, vp):
                off = lay.world_offset(e.key)
                for wk, kind in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                    loc = truth.local(e.param, kind, t.tp, tp_rank).reshape(-1)
                    world[wk][off:off + loc.numel()].copy_(loc)
            world["numel_unpadded"] = lay.numel_unpadded
            distrib[vp] = {(torch.bfloat16, torch.float32): world}
    sd["opt_param_scheduler"] = S.scheduler_state(cfg)
    if cfg.v013:
        sd["rerun_state_machine"] = _resolve(S.rerun_state(cfg))
    sd["rng_state"] = make_rng_state(cfg, t, tp_rank, pp_rank)
    sd["num_floating_point_operations_so_far"] = S.flops_so_far(cfg)
    if list(sd) != S.top_level_keys(cfg, t):
        raise AssertionError(f"top-level keys {list(sd)} != {S.top_level_keys(cfg, t)}")
    return sd, distrib


def write_topology(truth: Truth, t: S.Topology, out_dir: str) -> int:
    """Writes one topology folder; returns bytes written."""
    cfg = truth.cfg
    problem = S.topology_problem(cfg, t)
    if problem:
        raise S.MegatronVersionError(f"{cfg.name} {t.name}: {problem}")
    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    it_dir = os.path.join(out_dir, S.iter_dir_name(cfg.iteration))
    total = 0
    for tp_rank, pp_rank, rd in t.rank_dirs():
        d = os.path.join(it_dir, rd)
        os.makedirs(d, exist_ok=True)
        sd, distrib = build_rank(truth, t, tp_rank, pp_rank)
        if distrib is not None:
            # save_checkpoint writes distrib_optim.pt (save_parameter_state) before model_optim_rng.pt
            p = os.path.join(d, "distrib_optim.pt")
            torch.save(distrib, p)
            total += os.path.getsize(p)
            del distrib
        p = os.path.join(d, "model_optim_rng.pt")
        torch.save(sd, p)
        total += os.path.getsize(p)
        del sd
    with open(os.path.join(out_dir, S.TRACKER_NAME), "w") as f:   # written last, by rank 0
        f.write(str(cfg.iteration))
    return total


def check_topologies(cfg: S.ModelConfig, topos: List[S.Topology]) -> List[Tuple[S.Topology, str]]:
    """Topologies cfg.megatron_version cannot produce (argument / schedule checks, v0.8's DistOpt bucket
    quirk)."""
    bad = []
    for t in topos:
        problem = S.topology_problem(cfg, t)
        if problem is None:
            try:
                for p in range(t.pp):
                    for vp in range(t.vpp):
                        S.chunk_buffer_layout(cfg, t, p, vp)
            except S.MegatronVersionError as e:
                problem = str(e)
        if problem:
            bad.append((t, problem))
    return bad


# ----------------------------------------------------------------------------------------------------
# truth files


def sha256_tensor(t: torch.Tensor) -> str:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        b = t.view(torch.int16).numpy().tobytes()
    else:
        b = t.numpy().tobytes()
    return hashlib.sha256(b).hexdigest()


def truth_meta(truth: Truth) -> dict:
    cfg = truth.cfg
    keys = S.canonical_groups(cfg)
    gindex = {k: i for i, k in enumerate(keys)}
    groups = []
    for k in keys:
        hp = collections.OrderedDict(S.group_hyperparams(cfg, k, with_step=True))
        hp["betas"] = list(hp["betas"])
        groups.append({"key": list(k), "hyper": hp})
    return {
        "megatron_version": cfg.megatron_version,
        "order": list(truth.specs),
        "groups": groups,
        "param_group": {n: gindex[S.group_key(p)] for n, p in truth.specs.items()},
        "model_config": cfg.to_json(),
        "iteration": cfg.iteration,
        "consumed_train_samples": cfg.iteration * cfg.global_batch_size,
        "scheduler": S.scheduler_state(cfg),
        "num_floating_point_operations_so_far": S.flops_so_far(cfg),
        "pad_rows": S.pad_rows(cfg),
        "vocab_params": [n for n, p in truth.specs.items() if p.vocab],
        "tied": cfg.tied,
        "tied_copies": {"embedding.word_embeddings.weight": ["output_layer.weight"]} if cfg.tied else {},
        "state_kinds": list(KINDS),
        "padded_vocab_size": {str(tp): S.padded_vocab_size(cfg, tp) for tp in (1, 2, 4, 8)},
    }


def write_truth(truth: Truth, vdir: str, write_pt: bool) -> None:
    meta = truth_meta(truth)
    js = dict(meta)
    js["params"] = collections.OrderedDict()
    js["padding"] = {}
    pt_params = collections.OrderedDict()
    pt_pad = {}
    for name, spec in truth.specs.items():
        ent = {"shape": list(spec.shape), "split": spec.split, "vocab": spec.vocab, "glu": spec.glu,
               "group": meta["param_group"][name], "dtypes": {}, "sha256": {}}
        tens = {}
        for kind in KINDS + ("model",):
            x = truth.full(name, kind)
            ent["dtypes"][kind] = str(x.dtype).replace("torch.", "")
            ent["sha256"][kind] = sha256_tensor(x)
            if write_pt:
                tens[kind] = x
        js["params"][name] = ent
        if write_pt:
            pt_params[name] = tens
        if spec.vocab:
            pe = {}
            ptp = {}
            for kind in KINDS + ("model",):
                x = truth.pad(name, kind)
                pe[kind] = {"shape": list(x.shape), "sha256": sha256_tensor(x)}
                if write_pt:
                    ptp[kind] = x
            js["padding"][name] = pe
            if write_pt:
                pt_pad[name] = ptp
    with open(os.path.join(vdir, "truth.json"), "w") as f:
        json.dump(js, f, indent=1)
    if write_pt:
        obj = dict(meta)
        obj["params"] = pt_params
        obj["padding"] = pt_pad
        # serialized _extra_state of TE modules / (v0.13) of the TE-op final norm, for opaque checks
        obj["te_extra_state_bytes"] = extra_state_bytes(te_extra_state(truth.cfg))
        if truth.cfg.v013:
            obj["te_op_extra_state_bytes"] = extra_state_bytes(te_op_extra_state())
        torch.save(obj, os.path.join(vdir, "truth.pt"))


# ----------------------------------------------------------------------------------------------------
# Reassembly (independent of megatron_spec's slicing helpers: converter-style cat logic)


def load(path: str):
    return torch.load(path, map_location="cpu")


def _tensor_entries(chunk: dict) -> List[Tuple[str, torch.Tensor]]:
    """Parameter entries of a model chunk: tensors except TE '_extra_state' (uint8 tensors with TE 2.x)."""
    return [(k, v) for k, v in chunk.items()
            if isinstance(v, torch.Tensor) and not k.endswith("._extra_state")]


def reassemble(cfg: S.ModelConfig, topo_dir: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """Reads a topology folder back into full tensors {canonical: {kind: tensor incl. padding rows}}.

    Independent path: layer offsets from the file's args, groups re-derived from the model dict key order
    (first appearance of (no-wd?) over tensor entries), TP merge like tools/checkpoint (cat; GLU halves;
    replicated must agree), DistOpt offsets from the model tensors' storage offsets (the param buffer
    views, which must run in reversed key order) minus the bucket-end padding of a shared-embedding
    bucket at the start of the buffer; a shared embedding at the END of the buffer (first stage) sits in
    the world tensors right after the 64-aligned end of the other params (both versions: v0.13 stores it
    at the lcm(dp,128)-padded bucket start, v0.8 only ran when that start was already aligned);
    alignment gaps of the world tensors must be zero."""
    with open(os.path.join(topo_dir, S.TRACKER_NAME)) as f:
        it = int(f.read().strip())
    it_dir = os.path.join(topo_dir, f"iter_{it:07d}")
    rank_dirs = sorted(os.listdir(it_dir))
    pieces: Dict[str, Dict[str, Dict[int, torch.Tensor]]] = collections.defaultdict(
        lambda: collections.defaultdict(dict))
    args0 = None
    for rd in rank_dirs:
        parts = rd.split("_")
        tp_rank = int(parts[2])
        sd = load(os.path.join(it_dir, rd, "model_optim_rng.pt"))
        a = sd["args"]
        args0 = args0 or a
        tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
        vpp = a.virtual_pipeline_model_parallel_size or 1
        pp_rank = int(parts[3]) if pp > 1 else 0
        L = a.num_layers
        chunks = [sd["model"]] if vpp == 1 else [sd[f"model{v}"] for v in range(vpp)]
        per_layer = L // pp // vpp

        def canon(key: str, v: int) -> str:
            if key.startswith("decoder.layers."):
                rest = key[len("decoder.layers."):]
                idx, tail = rest.split(".", 1)
                g = (v * (L // vpp) + pp_rank * per_layer) if vpp > 1 else pp_rank * per_layer
                return f"decoder.layers.{g + int(idx)}.{tail}"
            if key == "output_layer.weight" and not a.untie_embeddings_and_output_weights:
                return "embedding.word_embeddings.weight#copy"
            return key

        named = []   # (canonical, tensor, chunk)
        for v, ch in enumerate(chunks):
            for k, x in _tensor_entries(ch):
                named.append((canon(k, v), k, x, v))
        for cn, _k, x, _v in named:
            pieces[cn]["model"][tp_rank] = x
        # group order: first appearance of the wd key over the tensor entries
        keys = []
        members: Dict[bool, list] = {}
        for cn, k, x, v in named:
            nowd = k.endswith(".bias") or x.dim() == 1
            if nowd not in members:
                keys.append(nowd)
                members[nowd] = []
            members[nowd].append((cn, k, x, v))
        opt = sd["optimizer"]
        if not a.use_distributed_optimizer:
            st = opt["optimizer"]["state"]
            pg = opt["optimizer"]["param_groups"]
            fp = opt["fp32_from_fp16_params"]
            if len(pg) != len(keys):
                raise AssertionError(f"{rd}: {len(pg)} param groups, expected {len(keys)}")
            for gi, nowd in enumerate(keys):
                if pg[gi]["wd_mult"] != (0.0 if nowd else 1.0):
                    raise AssertionError(f"{rd}: group {gi} wd_mult {pg[gi]['wd_mult']}")
                for j, (cn, k, x, v) in enumerate(members[nowd]):
                    pid = pg[gi]["params"][j]
                    pieces[cn]["fp32"][tp_rank] = fp[gi][j]
                    pieces[cn]["exp_avg"][tp_rank] = st[pid]["exp_avg"]
                    pieces[cn]["exp_avg_sq"][tp_rank] = st[pid]["exp_avg_sq"]
        else:
            dist = load(os.path.join(it_dir, rd, "distrib_optim.pt"))
            if dist.get("buckets_coalesced") is not True:
                raise AssertionError(f"{rd}: buckets_coalesced missing")
            for v, ch in enumerate(chunks):
                w = dist[v][(torch.bfloat16, torch.float32)]
                ents = [(canon(k, v), k, x) for k, x in _tensor_entries(ch)]
                # buffer order = descending storage offset is reversed named_parameters order
                starts = [x.storage_offset() for _c, _k, x in ents]
                if starts != sorted(starts, reverse=True):
                    raise AssertionError(f"{rd} chunk {v}: model views not in reversed buffer order")
                # bucket gaps: a shared-embedding param sits in its own bucket (first or last in buffer)
                total = w["numel_unpadded"]
                if w["param"].numel() != total:
                    raise AssertionError(f"{rd}: world tensor length {w['param'].numel()} != {total}")
                # world offset = storage offset - bucket-end padding of earlier buckets.  Only a
                # shared-embedding param (tied, PP > 1) has its own bucket: first in the buffer on the
                # last stage (later params shift by its bucket padding), last in the buffer on the first
                # stage (world offset = 64-aligned end of the other params; its storage offset must be
                # the lcm(dp,128)-padded bucket start, which v0.8 only reached when no padding was needed).
                dp = a.data_parallel_size
                D = math.lcm(dp, 128)
                tied_pp = (not a.untie_embeddings_and_output_weights) and pp > 1
                shift = {k: 0 for _c, k, _x in ents}
                for c, k, x in ents:
                    if not tied_pp or k not in ("output_layer.weight", "embedding.word_embeddings.weight"):
                        continue
                    if x.storage_offset() == 0:
                        for _c2, k2, _x2 in ents:
                            if k2 != k:
                                shift[k2] = (-x.numel()) % D
                world_off = {k: x.storage_offset() - shift[k] for _c, k, x in ents}
                if tied_pp:
                    for c, k, x in ents:
                        if k == "embedding.word_embeddings.weight" and x.storage_offset() != 0:
                            others_end = max(y.storage_offset() + y.numel() for _c2, k2, y in ents if k2 != k)
                            aligned = -(-others_end // 64) * 64
                            if x.storage_offset() != -(-aligned // D) * D:
                                raise AssertionError(f"{rd}: shared {k} at {x.storage_offset()}, expected the "
                                                     f"padded bucket start {-(-aligned // D) * D}")
                            world_off[k] = aligned
                covered = torch.zeros(total, dtype=torch.bool)
                for c, k, x in ents:
                    off = world_off[k]
                    n = x.numel()
                    covered[off:off + n] = True
                    for wk, kind in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                        pieces[c][kind][tp_rank] = w[wk][off:off + n].view(x.shape)
                for wk in ("param", "exp_avg", "exp_avg_sq"):
                    if bool((w[wk][~covered] != 0).any()):
                        raise AssertionError(f"{rd} chunk {v}: non-zero {wk} in alignment gaps")
    # merge TP
    out: Dict[str, Dict[str, torch.Tensor]] = {}
    tp = args0.tensor_model_parallel_size
    specs = {p.name: p for p in S.canonical_params(cfg)}
    for cn, kinds in pieces.items():
        base = cn.replace("#copy", "")
        spec = specs[base]
        merged = {}
        for kind, by_rank in kinds.items():
            if sorted(by_rank) != list(range(tp)):
                raise AssertionError(f"{cn} {kind}: TP ranks {sorted(by_rank)}")
            xs = [by_rank[r] for r in range(tp)]
            if spec.split == "replicated":
                for r in range(1, tp):
                    if not _bits_equal(xs[r], xs[0]):
                        raise AssertionError(f"{cn} {kind}: replicated copy differs on TP rank {r}")
                merged[kind] = xs[0]
            elif spec.split == "dim1":
                merged[kind] = torch.cat(xs, dim=1)
            elif spec.glu:
                halves = [torch.chunk(x, 2, dim=0) for x in xs]
                merged[kind] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
            else:
                merged[kind] = torch.cat(xs, dim=0)
        out[cn] = merged
    return out


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bfloat16:
        return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def verify_topology(truth: Truth, t: S.Topology, topo_dir: str) -> None:
    """Reassembled shards of `topo_dir` == truth (incl. padding rows and the tied copy)."""
    cfg = truth.cfg
    full = reassemble(cfg, topo_dir)
    expect = set(truth.specs)
    if cfg.tied and t.pp > 1:
        expect.add("embedding.word_embeddings.weight#copy")
    if set(full) != expect:
        raise AssertionError(f"{t.name}: params {sorted(set(full) ^ expect)} differ")
    P = S.padded_vocab_size(cfg, t.tp)
    for cn, kinds in full.items():
        name = cn.replace("#copy", "")
        spec = truth.specs[name]
        for kind in KINDS + ("model",):
            got = kinds[kind]
            want = truth.full(name, kind)
            if spec.vocab:
                want = torch.cat([want, truth.pad(name, kind)[:P - cfg.vocab_size]], dim=0)
            if not _bits_equal(got, want):
                raise AssertionError(f"{t.name}: {cn} {kind} differs from truth")


# ----------------------------------------------------------------------------------------------------
# Layout invariants


def check_layout_invariants(cfg: S.ModelConfig, t: S.Topology) -> None:
    for p in range(t.pp):
        for vp in range(t.vpp):
            lay = S.chunk_buffer_layout(cfg, t, p, vp)
            params = S.chunk_params(cfg, t, p, vp)
            if lay.order != [e.key for e in reversed(params)]:
                raise AssertionError("buffer order is not reversed named_parameters order")
            prev_end = 0
            for key in lay.order:
                s, e, b = lay.index[key]
                if t.distopt and s % 64:
                    raise AssertionError(f"{key} start {s} not 64-aligned")
                if not t.distopt and s != prev_end:
                    raise AssertionError(f"{key}: gap without distributed optimizer")
                if s < prev_end:
                    raise AssertionError(f"{key} overlaps")
                prev_end = e
            for i, (bs, be, u) in enumerate(lay.buckets):
                if t.distopt and (bs % math.lcm(t.dp, 128) or be % math.lcm(t.dp, 128)):
                    raise AssertionError(f"bucket {i} [{bs},{be}) not lcm(dp,128)-aligned")
                if not (0 < u <= be - bs):
                    raise AssertionError(f"bucket {i} unpadded {u}")
                if i and bs != lay.buckets[i - 1][1]:
                    raise AssertionError("buckets not contiguous")
            for key in lay.order:
                s, e, b = lay.index[key]
                if not (lay.buckets[b][0] <= s and e <= lay.buckets[b][0] + lay.buckets[b][2]):
                    raise AssertionError(f"{key} [{s},{e}) outside the unpadded part of bucket {b}")
            shared = [e.key for e in params if e.shared_embedding]
            if t.distopt:
                for key in shared:
                    b = lay.index[key][2]
                    if [k for k in lay.order if lay.index[k][2] == b] != [key]:
                        raise AssertionError(f"{key} does not have its own bucket")
                    if lay.index[key][0] != lay.buckets[b][0]:
                        raise AssertionError(f"{key} does not start at its bucket start")
            elif len(lay.buckets) != 1:
                raise AssertionError("more than one bucket without overlap_grad_reduce")


# ----------------------------------------------------------------------------------------------------
# main


def generate(out: str, variants: List[S.ModelConfig], topo_spec: str, write_truth_pt: bool = True,
             cache: bool = True, log=print) -> Dict[str, dict]:
    report = {}
    for cfg in variants:
        t0 = time.time()
        vdir = os.path.join(out, cfg.name)
        os.makedirs(vdir, exist_ok=True)
        truth = Truth(cfg, cache=cache)
        if topo_spec in S.GRIDS or topo_spec == "all":
            cands = S.grid_candidates("full" if topo_spec == "all" else topo_spec)
            bad = check_topologies(cfg, cands)
            skipped = [(b.name, why) for b, why in bad]
            topos = [x for x in cands if x not in {b for b, _ in bad}]
        else:
            topos = [S.parse_topology(x) for x in topo_spec.split(",") if x.strip()]
            skipped = []
            bad = check_topologies(cfg, topos)
            if bad:
                raise SystemExit(f"{cfg.name}: Megatron v{cfg.megatron_version} cannot produce " +
                                 "; ".join(f"{b.name} ({why})" for b, why in bad))
        write_truth(truth, vdir, write_truth_pt)
        total = 0
        for t in topos:
            total += write_topology(truth, t, os.path.join(vdir, t.name))
        dt = time.time() - t0
        report[cfg.name] = {"topologies": [t.name for t in topos], "skipped": skipped, "bytes": total,
                            "seconds": round(dt, 2)}
        manifest = {"variant": cfg.name, "megatron_version": cfg.megatron_version,
                    "grid": topo_spec if topo_spec in S.GRIDS + ("all",) else "explicit",
                    "model_config": cfg.to_json(),
                    "topologies": [t.name for t in topos],
                    "skipped": [{"topology": n, "reason": why} for n, why in skipped]}
        mpath = os.path.join(vdir, "manifest.json")
        if topo_spec not in S.GRIDS + ("all",) and os.path.exists(mpath):   # accumulate explicit lists
            old = json.load(open(mpath))
            manifest["topologies"] = sorted(set(old.get("topologies", [])) | set(manifest["topologies"]))
            manifest["skipped"] = old.get("skipped", [])
            manifest["grid"] = old.get("grid", "explicit")
        with open(mpath, "w") as f:
            json.dump(manifest, f, indent=1)
        log(f"{cfg.name}: {len(topos)} topologies, {total / 1e6:.1f} MB rank files, {dt:.1f} s"
            + (f"; skipped (v{cfg.megatron_version} cannot produce): {', '.join(n for n, _ in skipped)}"
               if skipped else ""))
    return report


def _version_differences(d13: str, d08: str) -> List[str]:
    """Every difference between the v0.13 and v0.8 files of one topology folder, as readable lines
    (asserted by self_test, printed by --diff-versions).  Values are compared with
    compare_megatron_ckpt.deep_diff (types, key order, tensor bits)."""
    import compare_megatron_ckpt as C

    def diff(x, y) -> Optional[str]:
        try:
            C.deep_diff(x, y, [])
            return None
        except C.Diff as e:
            return str(e)

    out = []
    it = S.iter_dir_name(S.ModelConfig("x").iteration)
    for rd in sorted(os.listdir(os.path.join(d13, it))):
        f13, f08 = sorted(os.listdir(os.path.join(d13, it, rd))), sorted(os.listdir(os.path.join(d08, it, rd)))
        if f13 != f08:
            out.append(f"{rd}: files {f13} vs {f08}")
        for fname in f13:
            if fname not in f08:
                continue
            a, b = load(os.path.join(d13, it, rd, fname)), load(os.path.join(d08, it, rd, fname))
            if fname == "distrib_optim.pt":
                r = diff(a, b)
                if r:
                    out.append(f"{rd}/{fname}: {r}")
                continue
            ka, kb = list(a), list(b)
            if ka != kb:
                out.append(f"{rd}: top-level keys +{[k for k in ka if k not in kb]} "
                           f"-{[k for k in kb if k not in ka]}")
            for k in ka:
                if k not in b:
                    continue
                if k == "args":
                    va, vb = vars(a[k]), vars(b[k])
                    add = [x for x in va if x not in vb]
                    rem = [x for x in vb if x not in va]
                    chg = [x for x in va if x in vb and diff(va[x], vb[x])]
                    out.append(f"{rd}: args +{len(add)} -{len(rem)} fields, {len(chg)} changed: {chg}")
                elif k.startswith("model"):
                    ea = [x for x in a[k] if x not in b[k]]
                    eb = [x for x in b[k] if x not in a[k]]
                    if ea or eb:
                        out.append(f"{rd}: {k} keys +{ea} -{eb}")
                    common = [x for x in a[k] if x in b[k]]
                    if [x for x in ka if x in common] != [x for x in kb if x in common]:
                        out.append(f"{rd}: {k} key order of common keys differs")
                    enc = sorted({f"{type(b[k][x]).__name__}->{type(a[k][x]).__name__}"
                                  + (f"[{a[k][x].numel()}]" if isinstance(a[k][x], torch.Tensor) else "")
                                  for x in common if x.endswith("_extra_state") and diff(a[k][x], b[k][x])})
                    if enc:
                        out.append(f"{rd}: {k} _extra_state {enc}")
                    for x in common:
                        if not x.endswith("_extra_state") and diff(a[k][x], b[k][x]):
                            out.append(f"{rd}: {k}[{x}] differs")
                else:
                    r = diff(a[k], b[k])
                    if r:
                        out.append(f"{rd}: {k}{r}")
    return out


def self_test() -> int:
    failures = []

    def expect_fail(what, fn):
        try:
            fn()
        except AssertionError:
            return
        failures.append(f"mutation not detected: {what}")

    with tempfile.TemporaryDirectory() as tmp:
        chosen = {
            "gqa_swiglu_bias_untied": ["tp2_pp2_vpp1_dp2_do", "tp4_pp1_vpp1_dp1_nodo", "tp2_pp4_vpp2_dp4_do"],
            "gqa_swiglu_bias_tied": ["tp2_pp2_vpp2_dp1_nodo", "tp1_pp4_vpp1_dp4_do", "tp4_pp2_vpp1_dp2_do"],
            # tp4_pp4_vpp2_dp1_do: the v0.8 bucket bug topology, fine with v0.13
            "mha_gelu_nobias_tied": ["tp1_pp1_vpp1_dp1_do", "tp2_pp4_vpp2_dp2_do", "tp4_pp4_vpp2_dp1_do"],
        }
        for version in S.VERSIONS:
            vout = os.path.join(tmp, version)
            for vname, tl in chosen.items():
                cfg = S.with_version(S.VARIANTS[vname], version)
                if version == "0.8":
                    tl = [x for x in tl if x != "tp4_pp4_vpp2_dp1_do"]
                generate(vout, [cfg], ",".join(tl), log=lambda *_: None)
                truth = Truth(cfg)
                tr = torch.load(os.path.join(vout, vname, "truth.pt"))
                if tr["megatron_version"] != version:
                    failures.append(f"{version} {vname}: truth megatron_version {tr['megatron_version']}")
                for n in tr["order"]:
                    for k in KINDS + ("model",):
                        if not _bits_equal(tr["params"][n][k], truth.full(n, k)):
                            failures.append(f"{vname}: truth.pt {n} {k} not deterministic")
                js = json.load(open(os.path.join(vout, vname, "truth.json")))
                for n in tr["order"]:
                    if js["params"][n]["sha256"]["fp32"] != sha256_tensor(tr["params"][n]["fp32"]):
                        failures.append(f"{vname}: truth.json sha256 of {n}")
                for name in tl:
                    t = S.parse_topology(name)
                    check_layout_invariants(cfg, t)
                    try:
                        verify_topology(truth, t, os.path.join(vout, vname, name))
                    except AssertionError as e:
                        failures.append(f"{version} {vname} {name}: {e}")
                    # every file loads; file set exact
                    it_dir = os.path.join(vout, vname, name, "iter_0000100")
                    want = sorted(d for _t, _p, d in t.rank_dirs())
                    if sorted(os.listdir(it_dir)) != want:
                        failures.append(f"{vname} {name}: rank dirs {sorted(os.listdir(it_dir))}")
                    for d in want:
                        files = sorted(os.listdir(os.path.join(it_dir, d)))
                        exp = sorted(["model_optim_rng.pt"] + (["distrib_optim.pt"] if t.distopt else []))
                        if files != exp:
                            failures.append(f"{vname} {name} {d}: files {files}")
                        sd = load(os.path.join(it_dir, d, "model_optim_rng.pt"))
                        mk = ["model"] if t.vpp == 1 else [f"model{i}" for i in range(t.vpp)]
                        exp_keys = ["args", "checkpoint_version", "iteration"] + mk + [
                            "optimizer", "opt_param_scheduler"] + (
                            ["rerun_state_machine"] if version == "0.13" else []) + [
                            "rng_state", "num_floating_point_operations_so_far"]
                        if list(sd) != exp_keys:
                            failures.append(f"{version} {vname} {name} {d}: top keys {list(sd)}")
                        # version-specific encodings
                        a = sd["args"]
                        if (version == "0.13") != hasattr(a, "attention_backend"):
                            failures.append(f"{version} {d}: args.attention_backend presence")
                        if len(vars(a)) != (513 if version == "0.13" else 338):
                            failures.append(f"{version} {d}: {len(vars(a))} args fields")
                        if a.overlap_p2p_comm != (t.vpp > 1):
                            failures.append(f"{version} {d}: args.overlap_p2p_comm {a.overlap_p2p_comm}")
                        for m in mk:
                            for k, x in sd[m].items():
                                if not k.endswith("_extra_state"):
                                    continue
                                if k == "output_layer._extra_state":
                                    ok = x is None
                                elif k == "decoder.final_layernorm._extra_state":
                                    ok = (version == "0.13" and x.dtype == torch.uint8
                                          and x.numpy().tobytes() == pickle.dumps({}, protocol=4))
                                elif version == "0.13":
                                    ok = isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.numel() == 0
                                else:
                                    ok = isinstance(x, io.BytesIO) and x.getvalue() == extra_state_bytes(
                                        te_extra_state(cfg))
                                if not ok:
                                    failures.append(f"{version} {d} {m}[{k}] = {x!r}")
                            if (version == "0.13" and "decoder.final_layernorm.weight" in sd[m]) != (
                                    "decoder.final_layernorm._extra_state" in sd[m]):
                                failures.append(f"{version} {d} {m}: final_layernorm._extra_state presence")
                        if version == "0.13":
                            r = sd["rerun_state_machine"]
                            if (type(r["mode"]).__name__, r["mode"].value, r["sharded"]["state"].name,
                                    r["sharded"]["current_iteration"]) != ("RerunMode", "disabled",
                                                                           "NOT_RUNNING_YET", 100):
                                failures.append(f"{d}: rerun_state_machine {r}")
        # v0.13 vs v0.8 of the same topology differ exactly where the versions differ
        vname, name = "gqa_swiglu_bias_tied", "tp2_pp2_vpp2_dp1_nodo"
        diff = _version_differences(os.path.join(tmp, "0.13", vname, name), os.path.join(tmp, "0.8", vname, name))
        allowed = ("top-level keys +['rerun_state_machine'] -[]",
                   "args +182 -7 fields, 3 changed: ['apply_rope_fusion', 'add_qkv_bias', "
                   "'inference_batch_times_seqlen_threshold']",
                   "_extra_state ['BytesIO->Tensor[0]']", "keys +['decoder.final_layernorm._extra_state'] -[]",
                   "num_floating_point_operations_so_far<root>: 1454899200.0 expected, got 1769472000.0")
        unexpected = [x for x in diff if not any(x.endswith(al) for al in allowed)]
        if unexpected or len(diff) != 22:
            failures.append(f"v0.13 vs v0.8 differences: {unexpected or diff}")
        # the reassembly check must catch corruption: flip one value in a written shard
        vout = os.path.join(tmp, "0.13")
        vname, name = "gqa_swiglu_bias_untied", "tp2_pp2_vpp1_dp2_do"
        cfg = S.VARIANTS[vname]
        truth = Truth(cfg)
        t = S.parse_topology(name)
        p = os.path.join(vout, vname, name, "iter_0000100", "mp_rank_01_001", "distrib_optim.pt")
        dist = torch.load(p)
        dist[0][(torch.bfloat16, torch.float32)]["exp_avg"][5] += 1.0
        torch.save(dist, p)
        expect_fail("corrupted exp_avg in distrib_optim.pt",
                    lambda: verify_topology(truth, t, os.path.join(vout, vname, name)))
        p = os.path.join(vout, vname, "tp4_pp1_vpp1_dp1_nodo", "iter_0000100", "mp_rank_03", "model_optim_rng.pt")
        sd = torch.load(p)
        sd["model"]["decoder.layers.3.mlp.linear_fc1.weight"][0, 0] += 1
        torch.save(sd, p)
        expect_fail("corrupted bf16 weight", lambda: verify_topology(
            truth, S.parse_topology("tp4_pp1_vpp1_dp1_nodo"), os.path.join(vout, vname, "tp4_pp1_vpp1_dp1_nodo")))
        # the v0.13 shared-embedding placement is checked: move the first-stage embedding view by 64
        vname, name = "mha_gelu_nobias_tied", "tp4_pp4_vpp2_dp1_do"
        tdir = os.path.join(vout, vname, name)
        p = os.path.join(tdir, "iter_0000100", "mp_rank_00_000", "model_optim_rng.pt")
        sd = torch.load(p)
        emb = sd["model0"]["embedding.word_embeddings.weight"]
        sd["model0"]["embedding.word_embeddings.weight"] = emb.new_empty(0).set_(
            emb.untyped_storage() if hasattr(emb, "untyped_storage") else emb.storage(),
            emb.storage_offset() - 64, emb.shape, emb.stride())
        torch.save(sd, p)
        expect_fail("shared embedding at the unpadded start", lambda: verify_topology(
            Truth(S.VARIANTS[vname]), S.parse_topology(name), tdir))
        # a wrong layout must trip the invariant checker
        bad_t = S.Topology(2, 2, 1, 2, True)
        orig = S.chunk_buffer_layout

        def shifted(*a, **k):
            lay = orig(*a, **k)
            key = lay.order[1]
            s, e, b = lay.index[key]
            lay.index[key] = (s + 1, e + 1, b)
            return lay
        S.chunk_buffer_layout = shifted
        try:
            expect_fail("misaligned param start", lambda: check_layout_invariants(cfg, bad_t))
        finally:
            S.chunk_buffer_layout = orig
        # the v0.8 straddle quirk is detected; v0.13 places the shared param at the padded bucket start
        try:
            S.buffer_layout([("emb", 100, True), ("w", 30, False)], 1, True, version="0.8")
            failures.append("v0.8 shared-embedding straddle not detected")
        except S.MegatronVersionError:
            pass
        lay = S.buffer_layout([("emb", 100, True), ("w", 30, False)], 1, True, version="0.13")
        if (lay.index != {"w": (0, 30, 0), "emb": (128, 228, 1)} or lay.buckets != [(0, 128, 64), (128, 256, 100)]
                or lay.world_offset("emb") != 64 or lay.numel_unpadded != 164):
            failures.append(f"v0.13 shared-embedding layout {lay.index} {lay.buckets}")
        # worked example of megatron.md §1.6: dp=4, reversed params A:100, B:50 (both versions)
        for version in S.VERSIONS:
            lay = S.buffer_layout([("B", 50, False), ("A", 100, False)], 4, True, version=version)
            if lay.index["A"][:2] != (0, 100) or lay.index["B"][:2] != (128, 178) or lay.buckets != [(0, 256, 178)]:
                failures.append(f"worked example layout {version} {lay.index} {lay.buckets}")
        # every topology of the full grid is producible by v0.13; v0.8 loses exactly its bucket-bug ones
        for vname in S.VARIANTS:
            c13 = S.VARIANTS[vname]
            if check_topologies(c13, S.grid_candidates("full")) or len(S.all_topologies(c13)) != 75:
                failures.append(f"{vname}: v0.13 cannot produce the whole grid")
            c08 = S.with_version(c13, "0.8")
            bad = check_topologies(c08, S.grid_candidates("full"))
            if any("bucket" not in why and "straddles" not in why for _t, why in bad):
                failures.append(f"{vname}: v0.8 loses topologies for other reasons: {bad}")
            if S.all_topologies(c13, "quick") != [S.parse_topology(x) for x in S.QUICK_TOPOLOGIES]:
                failures.append("quick grid not runnable")
        # padded vocab sizes of the corpus
        c = S.VARIANTS["gqa_swiglu_bias_tied"]
        if [S.padded_vocab_size(c, x) for x in (1, 2, 4)] != [160, 192, 256] or S.pad_rows(c) != 126:
            failures.append("padded vocab sizes")
        # legacy splitting reproduces the real Megatron 23.06 fixtures bit for bit
        fx = os.environ.get("UCP_FIXTURES", "/work/shared/fixtures")
        if not os.path.isdir(os.path.join(fx, "megatron-23.06")):
            print(f"note: {fx}/megatron-23.06 not found; legacy fixture check skipped")
        else:
            try:
                verify_legacy_fixtures(os.path.join(fx, "megatron-23.06"))
            except AssertionError as e:
                failures.append(f"legacy fixtures: {e}")
    for f in failures:
        print("FAIL:", f)
    print("self-test:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def legacy_rank_model(ref: Dict[str, torch.Tensor], cfg: S.LegacyConfig, tp: int, pp: int, tp_rank: int,
                      pp_rank: int) -> dict:
    """A legacy GPT rank's `model` built from converter-keyed full tensors (nesting and _metadata as the
    legacy modules' state_dict_for_save_checkpoint produce)."""
    root: dict = {}
    n_local = cfg.num_layers // pp
    for path, key, split in S.legacy_model_layout(cfg, tp, pp, pp_rank):
        full = ref[key]
        if split == "dim0":
            x = torch.chunk(full, tp, dim=0)[tp_rank].clone()
        elif split == "dim1":
            x = torch.chunk(full, tp, dim=1)[tp_rank].clone()
        else:
            x = full.clone()
        d = root
        for i, comp in enumerate(path[:-1]):
            if comp not in d:
                leaf_level = i == len(path) - 2
                if leaf_level:
                    nd = collections.OrderedDict()
                    nd._metadata = collections.OrderedDict(  # type: ignore[attr-defined]
                        (p, {"version": 1}) for p in S.legacy_module_metadata(path, n_local, pp_rank == pp - 1))
                else:
                    nd = {}
                d[comp] = nd
            d = d[comp]
        d[path[-1]] = x
    return root


def _deep_equal(a, b, where="") -> Optional[str]:
    if type(a) is not type(b):
        return f"{where}: type {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)} vs {list(b)}"
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return f"{where}: _metadata differs"
        for k in a:
            r = _deep_equal(a[k], b[k], f"{where}/{k}")
            if r:
                return r
        return None
    if isinstance(a, torch.Tensor):
        if not _bits_equal(a, b):
            return f"{where}: tensor differs"
        return None
    return None if a == b else f"{where}: {a!r} vs {b!r}"


def verify_legacy_fixtures(fx: str) -> None:
    """synth_tp2 (TP2) and from_tp2_to_tp1_pp2 (TP1 PP2) from synth_full_reference.pt, bit for bit."""
    ref = torch.load(os.path.join(fx, "synth_full_reference.pt"), map_location="cpu")
    lcfg = S.LegacyConfig(num_layers=2, hidden_size=16, padded_vocab=ref["embeddings/word embeddings"].shape[0])
    for sub, tp, pp in (("synth_tp2", 2, 1), ("from_tp2_to_tp1_pp2", 1, 2)):
        it = int(open(os.path.join(fx, sub, S.TRACKER_NAME)).read().strip())
        for pp_rank in range(pp):
            for tp_rank in range(tp):
                f = os.path.join(fx, sub, S.iter_dir_name(it), S.rank_dir_name(tp_rank, pp_rank, pp),
                                 "model_optim_rng.pt")
                sd = torch.load(f, map_location="cpu")
                got = legacy_rank_model(ref, lcfg, tp, pp, tp_rank, pp_rank)
                r = _deep_equal(got, sd["model"], f"{sub}/{os.path.basename(os.path.dirname(f))}/model")
                if r:
                    raise AssertionError(r)
                if sd["checkpoint_version"] != 3.0 or sd["iteration"] != it:
                    raise AssertionError(f"{f}: checkpoint_version/iteration")
                a = sd["args"]
                if (a.tensor_model_parallel_size, a.pipeline_model_parallel_size) != (tp, pp):
                    raise AssertionError(f"{f}: args TP/PP")


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--variant", action="append", help="variant name (repeatable); default: all")
    ap.add_argument("--megatron-version", choices=S.VERSIONS, default=S.DEFAULT_VERSION,
                    help="Megatron-core version whose files are emulated (default %(default)s)")
    ap.add_argument("--topologies", default="all",
                    help="all (full grid), quick (12 per variant) or a comma list like tp2_pp2_vpp1_dp2_do")
    ap.add_argument("--quick", action="store_true", help="same as --topologies quick")
    ap.add_argument("--scale", help="preset (bench4g) or k=v list: hidden,ffn,layers,vocab,heads,groups,kv,seq")
    ap.add_argument("--no-truth", action="store_true", help="do not write truth.pt (truth.json still written)")
    ap.add_argument("--ddp-bucket-size", type=int,
                    help="emulate --overlap-grad-reduce --ddp-bucket-size N (several distributed-optimizer "
                         "buckets on the first pipeline stage's first chunk); default: neither")
    ap.add_argument("--diff-versions", nargs=2, metavar=("V013_TOPOLOGY_DIR", "V08_TOPOLOGY_DIR"),
                    help="print every difference between a v0.13 and a v0.8 folder of the same topology")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test()
    if a.diff_versions:
        for line in _version_differences(*a.diff_versions):
            print(line)
        return 0
    if not a.out:
        ap.error("--out is required")
    names = a.variant or list(S.VARIANTS)
    for n in names:
        if n not in S.VARIANTS:
            ap.error(f"unknown variant {n} (known: {', '.join(S.VARIANTS)})")
    cfgs = [S.with_version(S.VARIANTS[n], a.megatron_version) for n in names]
    if a.ddp_bucket_size is not None:
        if a.ddp_bucket_size < 1:
            ap.error("--ddp-bucket-size must be >= 1")
        cfgs = [dataclasses.replace(c, ddp_bucket_size=a.ddp_bucket_size) for c in cfgs]
    topo_spec = "quick" if a.quick else a.topologies
    cache = True
    if a.scale:
        ov = SCALE_PRESETS.get(a.scale)
        if ov is None:
            ov = dict(kv.split("=", 1) for kv in a.scale.split(","))
        cfgs = [S.scaled_config(c, ov) for c in cfgs]
        cache = False
    t0 = time.time()
    generate(a.out, cfgs, topo_spec, write_truth_pt=not a.no_truth and cache, cache=cache)
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
