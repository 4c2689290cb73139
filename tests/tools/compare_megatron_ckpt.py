#!/usr/bin/python3
"""Compares two Megatron-LM legacy (``--ckpt-format torch``) checkpoint folders (any Megatron-core version:
v0.13 and v0.8 files as written by make_megatron_ckpts.py, see megatron_spec's version notes).

Usage:
  compare_megatron_ckpt.py EXPECTED_DIR ACTUAL_DIR [--ignore-rng] [--ignore-rerun-state]
                           [--args-fields f1,f2,...] [--check-metadata] [--loose-optimizer-order]
  compare_megatron_ckpt.py --batch PAIRS_FILE [same options]
  compare_megatron_ckpt.py --self-test

--batch: PAIRS_FILE holds one pair per line, "EXPECTED_DIR<TAB>ACTUAL_DIR" (blank lines and lines starting
with '#' are skipped); every pair is compared in this one process (importing torch costs 1-2 s) and one line
per pair is printed, "OK <ACTUAL_DIR>" or "DIFF <ACTUAL_DIR>: <difference>"; exit 0 when all pairs are equal.

Exit 0 when equal.  Otherwise prints ONE line "<file>: <key path>: <difference>" and exits 1 (2 for
usage errors).  Both folders are checkpoint roots (the folder holding latest_checkpointed_iteration.txt).

What must match:
  - tracker file content; the iteration folder it names; the set of entries at the root and in the
    iteration folder (rank folders); the set of files in each rank folder;
  - per model_optim_rng.pt: the top-level keys (same order; v0.13 files have 'rerun_state_machine', v0.8
    files do not); `args`: the listed fields (default: megatron_spec.LOAD_RELEVANT_ARGS; a field missing
    on one side is a difference); checkpoint_version, iteration, opt_param_scheduler,
    num_floating_point_operations_so_far and any other top-level value deeply equal; `rng_state` deeply
    equal unless --ignore-rng; `rerun_state_machine` (v0.13: enums, iteration counter) deeply equal unless
    --ignore-rerun-state;
  - model / model{i}: identical key ORDER, for tensors identical dtype, shape and bytes; TE
    `_extra_state` by type and content (v0.8: io.BytesIO content; v0.13: torch.uint8 tensors, empty for TE
    modules, pickle.dumps({}) for the final norm); None as None.  The state dict's `_metadata` only with
    --check-metadata;
  - optimizer: deep equality (param_groups incl. 'params' id lists, every hyper-parameter with its exact
    type and float bits, which keys exist (e.g. 'step'), state ids and tensors, fp32_from_fp16_params);
    dict key order inside the optimizer (e.g. a param group's keys: wd_mult, ..., weight_decay, step,
    params) is compared too, unless --loose-optimizer-order;
  - distrib_optim.pt: deep equality (buckets_coalesced, buffer indices, (dtype, dtype) keys, world
    tensors bit-identical, numel_unpadded).
Deep equality: same Python types (dict vs OrderedDict, list vs tuple, int vs float, enum classes by
module and name), tensors bitwise (NaN payloads and -0.0 count), floats bitwise, numpy arrays by
dtype/shape/bytes, io.BytesIO by content, enum members by identity.
Honesty: a folder pair comparing no tensor value is a difference ("no tensor values compared"; --batch
prints each pair's count), and on the first model_optim_rng.pt of each pair the model comparison runs
again on the actual model with one value changed in memory (oracle_checks.perturbed), which must report
a difference ("negative control").
Files are read with torch.load(map_location='cpu'); Megatron classes come from tests/tools/stubs.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import struct
import sys
import tempfile
from typing import Any, List, Optional, Sequence

import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "stubs"))

import megatron_spec as S  # noqa: E402
import megatron.core.rerun_state_machine  # noqa: E402,F401  (stubs: classes pickled by v0.13 files)
import megatron.core.transformer.enums  # noqa: E402,F401

TRACKER = S.TRACKER_NAME


class Diff(Exception):
    """A difference: str(self) is the one-line report."""


def _fmt(path: Sequence[Any]) -> str:
    out = ""
    for p in path:
        out += f"[{p!r}]"
    return out or "<root>"


def _tensor_bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    size = t.element_size()
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
        size = t.element_size()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


# Tensor and numpy elements deep_diff compared (compare_dirs: a pair comparing none fails).
_COMPARED = [0]


def deep_diff(a: Any, b: Any, path: List[Any], strict_order: bool = True) -> None:
    """Raises Diff at the first difference between expected `a` and actual `b` (counts the
    tensor elements compared in _COMPARED)."""
    if type(a) is not type(b):
        raise Diff(f"{_fmt(path)}: type {type(a).__module__}.{type(a).__qualname__} expected, got "
                   f"{type(b).__module__}.{type(b).__qualname__}")
    if isinstance(a, dict):
        ka, kb = list(a.keys()), list(b.keys())
        if set(ka) != set(kb):
            missing = [k for k in ka if k not in b]
            extra = [k for k in kb if k not in a]
            raise Diff(f"{_fmt(path)}: keys differ (missing {missing[:5]!r}, unexpected {extra[:5]!r})")
        if strict_order and ka != kb:
            i = next(i for i, (x, y) in enumerate(zip(ka, kb)) if x != y)
            raise Diff(f"{_fmt(path)}: key order differs at position {i}: expected {ka[i]!r}, got {kb[i]!r}")
        for k in ka:
            deep_diff(a[k], b[k], path + [k], strict_order)
        return
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            raise Diff(f"{_fmt(path)}: length {len(a)} expected, got {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            deep_diff(x, y, path + [i], strict_order)
        return
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype:
            raise Diff(f"{_fmt(path)}: dtype {a.dtype} expected, got {b.dtype}")
        if tuple(a.shape) != tuple(b.shape):
            raise Diff(f"{_fmt(path)}: shape {tuple(a.shape)} expected, got {tuple(b.shape)}")
        ba, bb = _tensor_bits(a).reshape(-1), _tensor_bits(b).reshape(-1)
        if not torch.equal(ba, bb):
            idx = int((ba != bb).nonzero()[0])
            raise Diff(f"{_fmt(path)}: tensor values differ (first at flat index {idx}: "
                       f"{a.reshape(-1)[idx].item()!r} expected, got {b.reshape(-1)[idx].item()!r})")
        _COMPARED[0] += a.numel()
        return
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
            raise Diff(f"{_fmt(path)}: numpy array differs ({a.dtype}{a.shape} vs {b.dtype}{b.shape})")
        _COMPARED[0] += a.size
        return
    if isinstance(a, io.BytesIO):
        if a.getvalue() != b.getvalue():
            raise Diff(f"{_fmt(path)}: BytesIO content differs ({len(a.getvalue())} vs {len(b.getvalue())} bytes)")
        return
    if isinstance(a, float):
        if struct.pack("<d", a) != struct.pack("<d", b):
            raise Diff(f"{_fmt(path)}: {a!r} expected, got {b!r}")
        return
    if isinstance(a, argparse.Namespace):
        deep_diff(vars(a), vars(b), path + ["<vars>"], strict_order)
        return
    if a != b:
        raise Diff(f"{_fmt(path)}: {a!r} expected, got {b!r}")


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - report any load failure as a difference
        raise Diff(f"cannot torch.load: {type(e).__name__}: {e}")


def compare_args(a: argparse.Namespace, b: argparse.Namespace, fields: Sequence[str]) -> None:
    if not isinstance(b, argparse.Namespace):
        raise Diff(f"['args']: argparse.Namespace expected, got {type(b).__name__}")
    for f in fields:
        ha, hb = hasattr(a, f), hasattr(b, f)
        if ha != hb:
            raise Diff(f"['args'].{f}: {'missing' if ha else 'unexpected'} in actual")
        if ha:
            try:
                deep_diff(getattr(a, f), getattr(b, f), ["args", f])
            except Diff as e:
                raise Diff(f"['args'].{f}: {getattr(a, f)!r} expected, got {getattr(b, f)!r}") from e


def compare_model(a: Any, b: Any, key: str, check_metadata: bool) -> None:
    if type(a) is not type(b):
        raise Diff(f"[{key!r}]: type {type(a).__name__} expected, got {type(b).__name__}")
    ka, kb = list(a.keys()), list(b.keys())
    if ka != kb:
        if set(ka) != set(kb):
            missing = [k for k in ka if k not in b]
            extra = [k for k in kb if k not in a]
            raise Diff(f"[{key!r}]: keys differ (missing {missing[:5]!r}, unexpected {extra[:5]!r})")
        i = next(i for i, (x, y) in enumerate(zip(ka, kb)) if x != y)
        raise Diff(f"[{key!r}]: key order differs at position {i}: expected {ka[i]!r}, got {kb[i]!r}")
    for k in ka:
        deep_diff(a[k], b[k], [key, k])
    if check_metadata:
        ma, mb = getattr(a, "_metadata", None), getattr(b, "_metadata", None)
        deep_diff(ma, mb, [key, "<_metadata>"])


def compare_rank_file(exp_path: str, act_path: str, args_fields: Sequence[str], ignore_rng: bool,
                      check_metadata: bool, strict_order: bool, ignore_rerun: bool = False) -> None:
    ea, aa = _load(exp_path), None
    try:
        aa = torch.load(act_path, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise Diff(f"cannot torch.load: {type(e).__name__}: {e}")
    if type(ea) is not type(aa):
        raise Diff(f"<root>: type {type(ea).__name__} expected, got {type(aa).__name__}")
    ke, ka = list(ea.keys()), list(aa.keys())
    if ke != ka:
        raise Diff(f"<root>: top-level keys {ke} expected, got {ka}")
    for k in ke:
        if k == "args":
            compare_args(ea[k], aa[k], args_fields)
        elif k == "model" or (k.startswith("model") and k[5:].isdigit()):
            compare_model(ea[k], aa[k], k, check_metadata)
        elif k == "rng_state":
            if not ignore_rng:
                deep_diff(ea[k], aa[k], [k])
        elif k == "rerun_state_machine":
            if not ignore_rerun:
                deep_diff(ea[k], aa[k], [k])
        elif k == "optimizer":
            deep_diff(ea[k], aa[k], [k], strict_order)
        else:
            deep_diff(ea[k], aa[k], [k])
    return ea, aa


def negative_control(ea: Any, aa: Any) -> None:
    """compare_model on a copy of the actual file's first model with one value changed must
    report a difference (the comparison can fail); raises Diff if it does not."""
    import oracle_checks
    key = next((k for k in ea if k == "model" or (k.startswith("model") and k[5:].isdigit())),
               None)
    if key is None or not any(isinstance(v, torch.Tensor) and v.numel() for v in aa[key].values()):
        return
    bad, where = oracle_checks.perturbed(aa[key])
    try:
        compare_model(ea[key], bad, key, False)
    except Diff:
        return
    raise Diff(f"negative control: [{key!r}] {where} changed and no difference was found")


def compare_dirs(expected: str, actual: str, args_fields: Sequence[str] = S.LOAD_RELEVANT_ARGS,
                 ignore_rng: bool = False, check_metadata: bool = False, strict_order: bool = True,
                 ignore_rerun: bool = False) -> int:
    """Raises Diff (message prefixed with the file) at the first difference; returns the number
    of tensor elements compared (none compared is a Diff too)."""
    start = _COMPARED[0]
    def rel(p: str) -> str:
        return os.path.relpath(p, actual)

    te, ta = os.path.join(expected, TRACKER), os.path.join(actual, TRACKER)
    if not os.path.isfile(ta):
        raise Diff(f"{TRACKER}: missing in actual")
    xe, xa = open(te, "rb").read(), open(ta, "rb").read()
    if xe != xa:
        raise Diff(f"{TRACKER}: content {xe!r} expected, got {xa!r}")
    se, sa = sorted(os.listdir(expected)), sorted(os.listdir(actual))
    if se != sa:
        raise Diff(f".: entries {se} expected, got {sa}")
    text = xe.decode().strip()
    it_name = "release" if text == "release" else S.iter_dir_name(int(text))
    ie, ia = os.path.join(expected, it_name), os.path.join(actual, it_name)
    if not os.path.isdir(ia):
        raise Diff(f"{it_name}: missing in actual")
    re_, ra = sorted(os.listdir(ie)), sorted(os.listdir(ia))
    if re_ != ra:
        raise Diff(f"{it_name}: rank folders {re_} expected, got {ra}")
    controlled = False
    for rd in re_:
        fe, fa = sorted(os.listdir(os.path.join(ie, rd))), sorted(os.listdir(os.path.join(ia, rd)))
        if fe != fa:
            raise Diff(f"{it_name}/{rd}: files {fe} expected, got {fa}")
        for f in fe:
            pe, pa = os.path.join(ie, rd, f), os.path.join(ia, rd, f)
            try:
                if f == "model_optim_rng.pt":
                    ea, aa = compare_rank_file(pe, pa, args_fields, ignore_rng, check_metadata,
                                               strict_order, ignore_rerun)
                    if not controlled:  # once per folder, on data already loaded
                        negative_control(ea, aa)
                        controlled = True
                elif f.endswith(".pt"):
                    deep_diff(_load(pe), _load(pa), [], strict_order=True)
                else:
                    if open(pe, "rb").read() != open(pa, "rb").read():
                        raise Diff("content differs")
            except Diff as e:
                raise Diff(f"{rel(pa)}: {e}") from None
    if _COMPARED[0] == start:
        raise Diff(f"{it_name}: no tensor values compared")
    return _COMPARED[0] - start


def run_batch(pairs_file: str, fields: Sequence[str], ignore_rng: bool, check_metadata: bool,
              strict_order: bool, ignore_rerun: bool, out=None) -> int:
    """Compares every pair of PAIRS_FILE; one line per pair; 0 if all are equal, 1 otherwise."""
    out = out or sys.stdout
    bad = 0
    n = 0
    with open(pairs_file) as f:
        lines = [ln.rstrip("\n") for ln in f]
    for ln in lines:
        if not ln.strip() or ln.lstrip().startswith("#"):
            continue
        parts = ln.split("\t")
        if len(parts) != 2:
            print(f"BAD LINE {ln!r}: expected EXPECTED<TAB>ACTUAL", file=out)
            bad += 1
            continue
        n += 1
        try:
            count = compare_dirs(parts[0], parts[1], fields, ignore_rng, check_metadata, strict_order,
                                 ignore_rerun)
            print(f"OK {parts[1]} ({count} tensor values compared)", file=out)
        except Diff as e:
            bad += 1
            print(f"DIFF {parts[1]}: " + str(e).replace("\n", " "), file=out)
    print(f"{n - bad} of {n} pairs equal" if n else "no pairs", file=out)
    return 1 if bad or not n else 0


# ----------------------------------------------------------------------------------------------------
# self-test


def self_test() -> int:
    import make_megatron_ckpts as M

    failures: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = S.VARIANTS["gqa_swiglu_bias_tied"]
        M.generate(os.path.join(tmp, "exp"), [cfg], "tp2_pp2_vpp1_dp2_do,tp2_pp2_vpp2_dp1_nodo",
                   log=lambda *_: None)
        M.generate(os.path.join(tmp, "gen2"), [cfg], "tp2_pp2_vpp1_dp2_do,tp2_pp2_vpp2_dp1_nodo",
                   log=lambda *_: None)

        def run(expected, actual, **kw) -> Optional[str]:
            try:
                compare_dirs(expected, actual, **kw)
                return None
            except Diff as e:
                return str(e)

        for topo in ("tp2_pp2_vpp1_dp2_do", "tp2_pp2_vpp2_dp1_nodo"):
            e = os.path.join(tmp, "exp", cfg.name, topo)
            r = run(e, os.path.join(tmp, "gen2", cfg.name, topo), check_metadata=True, strict_order=True)
            if r:
                failures.append(f"independent regeneration differs: {r}")
        # v0.8 files: regeneration equal, and different from the v0.13 files of the same topology
        cfg08 = S.with_version(cfg, "0.8")
        for d in ("exp08", "gen08"):
            M.generate(os.path.join(tmp, d), [cfg08], "tp2_pp2_vpp2_dp1_nodo", log=lambda *_: None)
        e08 = os.path.join(tmp, "exp08", cfg.name, "tp2_pp2_vpp2_dp1_nodo")
        r = run(e08, os.path.join(tmp, "gen08", cfg.name, "tp2_pp2_vpp2_dp1_nodo"), check_metadata=True)
        if r:
            failures.append(f"independent v0.8 regeneration differs: {r}")
        r = run(os.path.join(tmp, "exp", cfg.name, "tp2_pp2_vpp2_dp1_nodo"), e08)
        if r is None or "top-level keys" not in r:
            failures.append(f"v0.13 vs v0.8 files: {r}")

        def mutate(topo: str, rank: str, fname: str, fn, name: str, expect_fail: bool = True,
                   raw: bool = False, **kw):
            e = os.path.join(tmp, "exp", cfg.name, topo)
            a = os.path.join(tmp, "act")
            if os.path.exists(a):
                shutil.rmtree(a)
            shutil.copytree(e, a)
            p = os.path.join(a, "iter_0000100", rank, fname)
            if not raw:
                obj = torch.load(p)
                obj = fn(obj) or obj
                torch.save(obj, p)
            else:
                fn(p)
            r = run(e, a, **kw)
            if expect_fail and r is None:
                failures.append(f"mutation not detected: {name}")
            elif not expect_fail and r is not None:
                failures.append(f"false difference for {name}: {r}")
            elif r is not None and "\n" in r:
                failures.append(f"report not one line: {name}")
            return r

        nodo, do = "tp2_pp2_vpp2_dp1_nodo", "tp2_pp2_vpp1_dp2_do"
        r0 = "mp_rank_00_000"
        r1 = "mp_rank_01_001"

        def flip_model(sd):
            t = sd["model0"]["decoder.layers.0.mlp.linear_fc1.weight"]
            t.view(torch.int16)[0, 0] ^= 1

        mutate(nodo, r0, "model_optim_rng.pt", flip_model, "one bf16 bit in a model tensor")

        def reorder(sd):
            m = sd["model1"]
            items = list(m.items())
            items[1], items[2] = items[2], items[1]
            new = type(m)(items)
            new._metadata = m._metadata
            sd["model1"] = new

        mutate(nodo, r1, "model_optim_rng.pt", reorder, "model key order")

        def drop_extra(sd):
            del sd["model0"]["decoder.layers.0.self_attention.core_attention._extra_state"]

        mutate(nodo, r0, "model_optim_rng.pt", drop_extra, "missing _extra_state")

        def extra_bytes(sd):
            sd["model0"]["decoder.layers.0.self_attention.linear_proj._extra_state"] = torch.tensor(
                [0x80], dtype=torch.uint8)

        mutate(nodo, r0, "model_optim_rng.pt", extra_bytes, "_extra_state content")

        def extra_type(sd):
            sd["model0"]["decoder.layers.0.self_attention.linear_proj._extra_state"] = io.BytesIO(b"")

        mutate(nodo, r0, "model_optim_rng.pt", extra_type, "_extra_state as io.BytesIO")

        def norm_extra(sd):
            sd["model1"]["decoder.final_layernorm._extra_state"] = torch.frombuffer(
                bytearray(b"\x80\x02}q\x00."), dtype=torch.uint8)

        mutate(nodo, r1, "model_optim_rng.pt", norm_extra, "final norm _extra_state pickle protocol")

        def rerun_iter(sd):
            sd["rerun_state_machine"]["sharded"]["current_iteration"] = 99

        mutate(nodo, r0, "model_optim_rng.pt", rerun_iter, "rerun_state_machine current_iteration")
        mutate(nodo, r0, "model_optim_rng.pt", rerun_iter, "rerun state with --ignore-rerun-state",
               expect_fail=False, ignore_rerun=True)

        def rerun_mode(sd):
            sd["rerun_state_machine"]["mode"] = type(sd["rerun_state_machine"]["mode"])("validate_results")

        mutate(nodo, r0, "model_optim_rng.pt", rerun_mode, "rerun_state_machine mode enum")

        def rerun_missing(sd):
            del sd["rerun_state_machine"]

        mutate(nodo, r0, "model_optim_rng.pt", rerun_missing, "missing rerun_state_machine", ignore_rerun=True)

        def backend(sd):
            sd["args"].attention_backend = type(sd["args"].attention_backend)["flash"]

        mutate(nodo, r0, "model_optim_rng.pt", backend, "args enum field", args_fields=["attention_backend"])

        def meta(sd):
            sd["model0"]._metadata["decoder"] = {"version": 2}

        mutate(nodo, r0, "model_optim_rng.pt", meta, "_metadata with --check-metadata", check_metadata=True)
        mutate(nodo, r0, "model_optim_rng.pt", meta, "_metadata ignored by default", expect_fail=False)

        def args_tp(sd):
            sd["args"].tensor_model_parallel_size = 4

        mutate(nodo, r0, "model_optim_rng.pt", args_tp, "args.tensor_model_parallel_size")

        def args_other(sd):
            sd["args"].log_interval = 77

        mutate(nodo, r0, "model_optim_rng.pt", args_other, "unlisted args field", expect_fail=False)
        mutate(nodo, r0, "model_optim_rng.pt", args_other, "listed args field",
               args_fields=["log_interval"])

        def args_missing(sd):
            del sd["args"].padded_vocab_size

        mutate(nodo, r0, "model_optim_rng.pt", args_missing, "missing args field")

        def step(sd):
            sd["optimizer"]["optimizer"]["param_groups"][1]["step"] = 99

        mutate(nodo, r0, "model_optim_rng.pt", step, "param group step")

        def step_type(sd):
            sd["optimizer"]["optimizer"]["param_groups"][0]["lr"] = float(
                sd["optimizer"]["optimizer"]["param_groups"][0]["lr"]) * (1 + 2 ** -50)

        mutate(nodo, r0, "model_optim_rng.pt", step_type, "lr last bit")

        def ids(sd):
            p = sd["optimizer"]["optimizer"]["param_groups"][0]["params"]
            p[0], p[1] = p[1], p[0]

        mutate(nodo, r0, "model_optim_rng.pt", ids, "param id list")

        def state(sd):
            sd["optimizer"]["optimizer"]["state"][3]["exp_avg_sq"][0] += 1e-9

        mutate(nodo, r0, "model_optim_rng.pt", state, "exp_avg_sq value")

        def fp32(sd):
            sd["optimizer"]["fp32_from_fp16_params"][1][0][0] *= -1

        mutate(nodo, r0, "model_optim_rng.pt", fp32, "fp32_from_fp16_params value")

        def group_order(sd):
            g = sd["optimizer"]["optimizer"]["param_groups"][0]
            items = list(g.items())
            items[0], items[1] = items[1], items[0]
            sd["optimizer"]["optimizer"]["param_groups"][0] = dict(items)

        mutate(nodo, r0, "model_optim_rng.pt", group_order, "param group key order (default)")
        mutate(nodo, r0, "model_optim_rng.pt", group_order, "param group key order (--loose-optimizer-order)",
               expect_fail=False, strict_order=False)

        def rng(sd):
            sd["rng_state"][0]["cuda_rng_state"][0] ^= 1

        mutate(nodo, r0, "model_optim_rng.pt", rng, "rng_state")
        mutate(nodo, r0, "model_optim_rng.pt", rng, "rng_state with --ignore-rng", expect_fail=False,
               ignore_rng=True)

        def sched(sd):
            sd["opt_param_scheduler"]["num_steps"] += 1

        mutate(nodo, r0, "model_optim_rng.pt", sched, "opt_param_scheduler")

        def flops(sd):
            sd["num_floating_point_operations_so_far"] = int(sd["num_floating_point_operations_so_far"])

        mutate(nodo, r0, "model_optim_rng.pt", flops, "flops int vs float")

        def ver(sd):
            sd["checkpoint_version"] = 2.0

        mutate(nodo, r0, "model_optim_rng.pt", ver, "checkpoint_version")

        def extra_key(sd):
            sd["modelopt_state"] = {}

        mutate(nodo, r0, "model_optim_rng.pt", extra_key, "extra top-level key")

        def world(d):
            d[0][(torch.bfloat16, torch.float32)]["exp_avg"][7] = 5.0

        mutate(do, r1, "distrib_optim.pt", world, "distrib_optim exp_avg value")

        def numel(d):
            d[0][(torch.bfloat16, torch.float32)]["numel_unpadded"] += 1

        mutate(do, r0, "distrib_optim.pt", numel, "numel_unpadded")

        def dtkey(d):
            v = d[0].pop((torch.bfloat16, torch.float32))
            d[0][(torch.bfloat16, torch.bfloat16)] = v

        mutate(do, r0, "distrib_optim.pt", dtkey, "buffer dtype key")

        def do_step(sd):
            del sd["optimizer"]["optimizer"]["param_groups"][0]["step"]

        mutate(do, r0, "model_optim_rng.pt", do_step, "missing step with distributed optimizer")
        mutate(do, r0, "model_optim_rng.pt", lambda p: os.remove(p), "missing rank file", raw=True)
        mutate(do, r0, "model_optim_rng.pt", lambda p: open(p, "wb").write(b"garbage"), "unreadable file",
               raw=True)

        def tracker(_p):
            a = os.path.join(tmp, "act")
            open(os.path.join(a, TRACKER), "w").write("101")

        mutate(do, r0, "x.txt", tracker, "tracker content", raw=True)

        def extra_dir(_p):
            os.makedirs(os.path.join(tmp, "act", "iter_0000100", "mp_rank_00_002"))

        mutate(do, r0, "x.txt", extra_dir, "extra rank folder", raw=True)
        # a different topology of the same model is a difference
        r = run(os.path.join(tmp, "exp", cfg.name, nodo), os.path.join(tmp, "exp", cfg.name, do))
        if r is None:
            failures.append("different topologies compare equal")
        # CLI exit codes
        import subprocess
        e = os.path.join(tmp, "exp", cfg.name, nodo)
        ok = subprocess.run([sys.executable, __file__, e, e], capture_output=True, text=True)
        bad = subprocess.run([sys.executable, __file__, e, os.path.join(tmp, "exp", cfg.name, do)],
                             capture_output=True, text=True)
        if ok.returncode != 0 or bad.returncode != 1 or len(bad.stdout.strip().splitlines()) != 1:
            failures.append(f"CLI exit codes {ok.returncode}/{bad.returncode}: {ok.stdout}{ok.stderr}{bad.stdout}")
        # batch mode: one line per pair, failure of any pair fails the batch
        pf = os.path.join(tmp, "pairs.txt")
        with open(pf, "w") as f:
            f.write(f"# comment\n{e}\t{e}\n\n{e}\t{os.path.join(tmp, 'exp', cfg.name, do)}\n")
        import io as _io
        buf = _io.StringIO()
        rc = run_batch(pf, S.LOAD_RELEVANT_ARGS, False, False, True, False, out=buf)
        lines = buf.getvalue().splitlines()
        if rc != 1 or len(lines) != 3 or not lines[0].startswith("OK ") or not lines[1].startswith("DIFF "):
            failures.append(f"batch mode: rc {rc}, output {lines}")
        with open(pf, "w") as f:
            f.write(f"{e}\t{e}\n")
        buf = _io.StringIO()
        if run_batch(pf, S.LOAD_RELEVANT_ARGS, False, False, True, False, out=buf) != 0:
            failures.append(f"batch mode of an equal pair: {buf.getvalue()}")
    for f in failures:
        print("FAIL:", f)
    print("self-test:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("expected", nargs="?")
    ap.add_argument("actual", nargs="?")
    ap.add_argument("--ignore-rng", action="store_true")
    ap.add_argument("--ignore-rerun-state", action="store_true",
                    help="do not compare the v0.13 'rerun_state_machine' entries (key presence still counts)")
    ap.add_argument("--args-fields", help="comma list of args fields to compare (default: load-relevant set)")
    ap.add_argument("--check-metadata", action="store_true", help="also compare model state dicts' _metadata")
    ap.add_argument("--loose-optimizer-order", action="store_true",
                    help="ignore dict key order inside `optimizer` (keys and values still compared)")
    ap.add_argument("--batch", metavar="PAIRS_FILE", help="compare many pairs (see the module docstring)")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test()
    if a.batch:
        fields = S.LOAD_RELEVANT_ARGS if a.args_fields is None else [f for f in a.args_fields.split(",") if f]
        return run_batch(a.batch, fields, a.ignore_rng, a.check_metadata, not a.loose_optimizer_order,
                         a.ignore_rerun_state)
    if not a.expected or not a.actual:
        ap.print_usage()
        return 2
    fields = S.LOAD_RELEVANT_ARGS if a.args_fields is None else [f for f in a.args_fields.split(",") if f]
    try:
        compare_dirs(a.expected, a.actual, fields, a.ignore_rng, a.check_metadata, not a.loose_optimizer_order,
                     a.ignore_rerun_state)
    except Diff as e:
        print(str(e).replace("\n", " "))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
