#!/usr/bin/python3
"""Checks a ucp universal HDF5 file (schema v1, notes/ISSUE3.md) against a Megatron variant's truth.pt.

Usage:
  check_universal.py UNIVERSAL.h5 TRUTH.pt [--padding-from TOPOLOGY_DIR] [--no-align-check]
                     [--allow-extra-kinds] [--no-xxh3-verify] [-v]
  check_universal.py --self-test

TRUTH.pt is written by make_megatron_ckpts.py (DIR/<variant>/truth.pt, any --megatron-version: nothing checked
here depends on the Megatron version; truth["megatron_version"] only names it in the reference writer's
source.framework_version).  Exit 0 when the file passes;
otherwise ONE line "<h5 path>: <what is wrong>" and exit 1 (2 for usage errors).

Expectations (the schema of ISSUE3.md made explicit; names are exact):
root attrs
  ucp_format        string == "universal"
  ucp_version       int64 scalar, 1 or 2
  iteration         int64 scalar == truth iteration (100)
  consumed_samples  int64 scalar, == truth consumed_train_samples (iteration * global batch) or -1
  source            JSON object with keys framework (contains "megatron", any case), format, tp, pp, vpp,
                    dp, distributed_optimizer; with --padding-from also tp/pp/dp/distributed_optimizer equal
                    to that topology's args and vpp equal to its VPP (1 or null when there is none)
  model, optimizer, scheduler, args   JSON objects; layout  non-empty string (YAML text)
  optimizer         {"type": str, "groups": [one object per truth group, in order], "state_kinds": [...]}
                    state_kinds contains fp32, exp_avg, exp_avg_sq; each group object has wd_mult and
                    lr_mult equal to the truth group's; any of is_expert_parallel, is_decoupled_lr, max_lr,
                    min_lr, lr, bias_correction, betas, eps, weight_decay present must equal truth exactly
                    (floats bit for bit, betas as a 2-list); "key", if present, == [wd_mult, lr_mult,
                    is_expert_parallel, is_decoupled_lr]
  scheduler         keys it shares with Megatron's opt_param_scheduler state must have equal values
/params/<canonical name>   one group per truth param, no others (and none of them under /buffers)
  attrs  shape int64[] == truth shape; dtype == "bfloat16"; rule non-empty string; kind == "param";
         group int64 == truth group index; order int64 == canonical position; tied_copies JSON list
         (== ["output_layer.weight"] on embedding.word_embeddings.weight exactly when the variant is
         tied and the --padding-from source has PP > 1; [] when that source has PP == 1 or the param is
         not tied; without a source, tied variants may use either)
  datasets fp32, exp_avg, exp_avg_sq: float32, shape == truth shape (TRUE vocab rows), attr dtype
         "float32", values bit-identical to truth.  Optional "model": uint16 + attr dtype "bfloat16",
         bits == truth bf16 weights.  Optional "step": every element == iteration.  Other datasets fail
         unless --allow-extra-kinds.  "param" is accepted as another name of "model" (bf16 weights).  Every dataset: attr xxh3 (uint64) == XXH3_64bits(seed 0) of the
         dataset's stored little-endian bytes (verified through the system libxxhash.so.0, which must load;
         --no-xxh3-verify only checks presence and type); contiguous layout with an allocated offset,
         offset % 4096 == 0 (--no-align-check to skip)
  pad/<kind> (vocab params only, optional): float32 [rows, h] == the truth padding block's first rows;
         with --padding-from, required with exactly P - vocab rows (P = that topology's
         args.padded_vocab_size) for fp32/exp_avg/exp_avg_sq (absent when P == vocab); same attrs
/buffers/*, /opaque/*: every dataset carries dtype (buffers) and xxh3 (both) attrs; opaque datasets uint8
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import struct
import sys
import tempfile
from typing import Any, List, Optional

import h5py
import numpy as np
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _HERE)
sys.path.insert(0, os.path.join(_HERE, "stubs"))

import megatron_spec as S  # noqa: E402

KINDS = ("fp32", "exp_avg", "exp_avg_sq")
OPTIONAL_KINDS = ("model", "param", "step")
#: names of the optional training-dtype (bf16) weights dataset: "model" (this checker's reference writer) and
#: "param" (the state kind ucp's Megatron driver uses for the model tensors of a bf16 run)
WEIGHT_KINDS = ("model", "param")


class Bad(Exception):
    pass


# ----------------------------------------------------------------------------------------------------
# xxh3 through the system library (the reference implementation by the xxHash authors)

_XXH3 = None


def xxh3_func():
    global _XXH3
    if _XXH3 is None:
        try:
            lib = ctypes.CDLL("libxxhash.so.0")
            f = lib.XXH3_64bits
            f.restype = ctypes.c_uint64
            f.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            if f(None, 0) != 0x2D06800538D394C2:   # published XXH3_64bits("") test vector
                raise OSError("unexpected XXH3 of empty input")
            _XXH3 = f
        except (OSError, AttributeError):
            _XXH3 = False
    return _XXH3 or None


def xxh3(data: bytes) -> int:
    f = xxh3_func()
    if f is None:
        raise RuntimeError("libxxhash.so.0 (Debian's libxxhash0, installed with libxxhash-dev) "
                           "does not load: the xxh3 oracle is missing")
    buf = ctypes.create_string_buffer(data, len(data))
    return int(f(buf, len(data)))


# ----------------------------------------------------------------------------------------------------
# attribute helpers


def param_datasets(path):
    """Every dataset under /params of a universal file as (its dtype
    attribute, its bytes) by path, and each param's frozen flag."""
    out = {}
    with h5py.File(path, "r") as f:
        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                out[name] = (obj.attrs["dtype"], np.atleast_1d(obj[()]).tobytes())
        f["params"].visititems(visit)
        frozen = {k: int(g.attrs["frozen"]) for k, g in f["params"].items()}
    return out, frozen


def _str_attr(obj, name: str, where: str) -> str:
    if name not in obj.attrs:
        raise Bad(f"{where}: attribute {name!r} missing")
    v = obj.attrs[name]
    if isinstance(v, np.ndarray) and v.shape == ():
        v = v[()]
    if isinstance(v, bytes):
        v = v.decode("utf-8")
    if not isinstance(v, str):
        raise Bad(f"{where}: attribute {name!r} is {type(v).__name__}, expected a string")
    return v


def _int_attr(obj, name: str, where: str, dtype=np.int64) -> int:
    if name not in obj.attrs:
        raise Bad(f"{where}: attribute {name!r} missing")
    v = obj.attrs[name]
    arr = np.asarray(v)
    if arr.shape != () or arr.dtype != np.dtype(dtype):
        raise Bad(f"{where}: attribute {name!r} must be a scalar {np.dtype(dtype)}, got {arr.dtype}{arr.shape}")
    return int(arr)


def _json_attr(obj, name: str, where: str) -> Any:
    s = _str_attr(obj, name, where)
    try:
        return json.loads(s)
    except ValueError as e:
        raise Bad(f"{where}: attribute {name!r} is not JSON ({e})")


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


def _check_dataset_storage(ds, where: str, align: bool) -> None:
    plist = ds.id.get_create_plist()
    if plist.get_layout() != h5py.h5d.CONTIGUOUS:
        raise Bad(f"{where}: dataset layout is not contiguous")
    if ds.size == 0:
        return
    off = ds.id.get_offset()
    if off is None:
        raise Bad(f"{where}: dataset storage not allocated (no offset)")
    if align and off % 4096:
        raise Bad(f"{where}: dataset offset {off} not 4096-aligned")


def _check_xxh3(ds, where: str, verify: bool) -> None:
    if "xxh3" not in ds.attrs:
        raise Bad(f"{where}: attribute 'xxh3' missing")
    arr = np.asarray(ds.attrs["xxh3"])
    if arr.shape != () or arr.dtype != np.uint64:
        raise Bad(f"{where}: attribute 'xxh3' must be a scalar uint64, got {arr.dtype}{arr.shape}")
    if verify:
        data = ds[()]
        raw = _bits(np.asarray(data).astype(np.asarray(data).dtype.newbyteorder("<"), copy=False))
        got = xxh3(raw)
        if got != int(arr):
            raise Bad(f"{where}: xxh3 attribute {int(arr):#018x} != XXH3_64 of the data {got:#018x}")


def _expect_data(ds, want: np.ndarray, dtype_name: str, where: str) -> int:
    """Stored dtype and values of a state dataset; returns the number of values compared."""
    attr = _str_attr(ds, "dtype", where)
    if attr != dtype_name:
        raise Bad(f"{where}: attribute dtype {attr!r}, expected {dtype_name!r}")
    if ds.dtype != want.dtype:
        raise Bad(f"{where}: stored as {ds.dtype}, expected {want.dtype}")
    if tuple(ds.shape) != tuple(want.shape):
        raise Bad(f"{where}: shape {tuple(ds.shape)}, expected {tuple(want.shape)}")
    got = np.asarray(ds[()])
    if _bits(got) != _bits(want):
        uint = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
        g, wv = got.reshape(-1), want.reshape(-1)
        i = int(np.nonzero(g.view(uint[g.itemsize]) != wv.view(uint[wv.itemsize]))[0][0])
        raise Bad(f"{where}: values differ from truth (first at flat index {i}: {g[i]!r} vs {wv[i]!r})")
    return int(want.size)


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _float_eq(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b and type(a) is type(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return struct.pack("<d", float(a)) == struct.pack("<d", float(b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_float_eq(x, y) for x, y in zip(a, b))
    return a == b


# ----------------------------------------------------------------------------------------------------
# the check


def source_topology(topo_dir: str):
    """(args Namespace of rank 0) of a Megatron topology folder."""
    it = open(os.path.join(topo_dir, S.TRACKER_NAME)).read().strip()
    it_dir = os.path.join(topo_dir, "release" if it == "release" else S.iter_dir_name(int(it)))
    first = sorted(os.listdir(it_dir))[0]
    sd = torch.load(os.path.join(it_dir, first, "model_optim_rng.pt"), map_location="cpu")
    return sd["args"]


def check(h5path: str, truth: dict, padding_from: Optional[str] = None, align: bool = True,
          allow_extra_kinds: bool = False, verify_xxh3: bool = True, log=None) -> int:
    """Raises Bad at the first difference; returns the number of values compared (every
    state kind of every param of the truth, at least: fewer is a failure too)."""
    compared = 0
    cfg = truth["model_config"]
    V = cfg["vocab_size"]
    src_args = source_topology(padding_from) if padding_from else None
    with h5py.File(h5path, "r") as f:
        w = "/"
        if _str_attr(f, "ucp_format", w) != "universal":
            raise Bad("/: ucp_format != 'universal'")
        if _int_attr(f, "ucp_version", w) not in (1, 2):
            raise Bad("/: ucp_version not in (1, 2)")
        if _int_attr(f, "iteration", w) != truth["iteration"]:
            raise Bad(f"/: iteration {f.attrs['iteration']} != {truth['iteration']}")
        cs = _int_attr(f, "consumed_samples", w)
        if cs not in (-1, truth["consumed_train_samples"]):
            raise Bad(f"/: consumed_samples {cs}, expected {truth['consumed_train_samples']} or -1")
        src = _json_attr(f, "source", w)
        if not isinstance(src, dict):
            raise Bad("/: source is not a JSON object")
        for k in ("framework", "format", "tp", "pp", "vpp", "dp", "distributed_optimizer"):
            if k not in src:
                raise Bad(f"/: source JSON lacks {k!r}")
        if "megatron" not in str(src["framework"]).lower():
            raise Bad(f"/: source framework {src['framework']!r} does not name Megatron")
        if src_args is not None:
            want = {"tp": src_args.tensor_model_parallel_size, "pp": src_args.pipeline_model_parallel_size,
                    "dp": src_args.data_parallel_size,
                    "distributed_optimizer": bool(src_args.use_distributed_optimizer)}
            for k, v in want.items():
                if src[k] != v:
                    raise Bad(f"/: source {k} = {src[k]!r}, the source topology has {v!r}")
            vpp = src_args.virtual_pipeline_model_parallel_size
            if not (src["vpp"] == vpp or (vpp is None and src["vpp"] in (1, None))):
                raise Bad(f"/: source vpp = {src['vpp']!r}, the source topology has {vpp!r}")
        for k in ("model", "scheduler", "args"):
            if not isinstance(_json_attr(f, k, w), dict):
                raise Bad(f"/: {k} is not a JSON object")
        if not _str_attr(f, "layout", w).strip():
            raise Bad("/: layout is empty")
        opt = _json_attr(f, "optimizer", w)
        if not isinstance(opt, dict) or not isinstance(opt.get("type"), str):
            raise Bad("/: optimizer JSON lacks a string 'type'")
        kinds = opt.get("state_kinds")
        if not isinstance(kinds, list) or not set(KINDS) <= set(kinds):
            raise Bad(f"/: optimizer.state_kinds {kinds!r} lacks one of {list(KINDS)}")
        groups = opt.get("groups")
        if not isinstance(groups, list) or len(groups) != len(truth["groups"]):
            raise Bad(f"/: optimizer.groups has {len(groups) if isinstance(groups, list) else groups!r} "
                      f"entries, expected {len(truth['groups'])}")
        for gi, (g, tg) in enumerate(zip(groups, truth["groups"])):
            hyper = dict(tg["hyper"])
            hyper["betas"] = list(hyper["betas"])
            for k in ("wd_mult", "lr_mult"):
                if k not in g:
                    raise Bad(f"/: optimizer.groups[{gi}] lacks {k!r}")
            for k in ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "max_lr", "min_lr",
                      "lr", "bias_correction", "betas", "eps", "weight_decay"):
                if k in g and not _float_eq(g[k], hyper[k]):
                    raise Bad(f"/: optimizer.groups[{gi}].{k} = {g[k]!r}, expected {hyper[k]!r}")
            if "key" in g and not _float_eq(g["key"], list(tg["key"])):
                raise Bad(f"/: optimizer.groups[{gi}].key = {g['key']!r}, expected {list(tg['key'])!r}")
        sched = _json_attr(f, "scheduler", w)
        for k, v in truth["scheduler"].items():
            if k in sched and not _float_eq(sched[k], v):
                raise Bad(f"/: scheduler.{k} = {sched[k]!r}, expected {v!r}")

        if "params" not in f:
            raise Bad("/params: missing")
        names = list(f["params"].keys())
        order = truth["order"]
        missing = [n for n in order if n not in f["params"]]
        extra = [n for n in names if n not in truth["params"]]
        if missing:
            raise Bad(f"/params: missing {missing[:3]}{' ...' if len(missing) > 3 else ''}")
        if extra:
            raise Bad(f"/params: unexpected {extra[:3]}{' ...' if len(extra) > 3 else ''}")
        if "buffers" in f:
            dup = [n for n in f["buffers"].keys() if n in truth["params"]]
            if dup:
                raise Bad(f"/buffers/{dup[0]}: a parameter is also stored as a buffer")
        P = src_args.padded_vocab_size if src_args is not None else None
        tied_copy_expected = None
        if src_args is not None:
            tied_copy_expected = truth["tied"] and src_args.pipeline_model_parallel_size > 1
        for pos, name in enumerate(order):
            g = f["params"][name]
            wn = f"/params/{name}"
            if not isinstance(g, h5py.Group):
                raise Bad(f"{wn}: not a group")
            tp = truth["params"][name]
            shape = tuple(tp["fp32"].shape)
            sa = np.asarray(g.attrs.get("shape"))
            if "shape" not in g.attrs or sa.dtype != np.int64 or tuple(int(x) for x in sa.reshape(-1)) != shape:
                raise Bad(f"{wn}: attribute shape {g.attrs.get('shape')!r}, expected int64 {list(shape)}")
            if _str_attr(g, "dtype", wn) != "bfloat16":
                raise Bad(f"{wn}: attribute dtype {g.attrs['dtype']!r}, expected 'bfloat16'")
            if not _str_attr(g, "rule", wn).strip():
                raise Bad(f"{wn}: empty rule")
            if _str_attr(g, "kind", wn) != "param":
                raise Bad(f"{wn}: kind {g.attrs['kind']!r}, expected 'param'")
            if _int_attr(g, "group", wn) != truth["param_group"][name]:
                raise Bad(f"{wn}: group {int(g.attrs['group'])}, expected {truth['param_group'][name]}")
            if _int_attr(g, "order", wn) != pos:
                raise Bad(f"{wn}: order {int(g.attrs['order'])}, expected {pos}")
            tc = _json_attr(g, "tied_copies", wn)
            if not isinstance(tc, list) or not all(isinstance(x, str) for x in tc):
                raise Bad(f"{wn}: tied_copies is not a JSON list of strings")
            allowed = truth["tied_copies"].get(name, [])
            if tied_copy_expected is None:
                if tc and tc != allowed:
                    raise Bad(f"{wn}: tied_copies {tc}, expected [] or {allowed}")
            else:
                want = allowed if (tied_copy_expected and allowed) else []
                if tc != want:
                    raise Bad(f"{wn}: tied_copies {tc}, expected {want}")
            for k in g.keys():
                if k == "pad":
                    continue
                if k not in KINDS + OPTIONAL_KINDS and not allow_extra_kinds:
                    raise Bad(f"{wn}/{k}: unexpected dataset")
            for kind in KINDS:
                if kind not in g:
                    raise Bad(f"{wn}/{kind}: missing")
                ds = g[kind]
                compared += _expect_data(ds, _np(tp[kind]), "float32", f"{wn}/{kind}")
                _check_dataset_storage(ds, f"{wn}/{kind}", align)
                _check_xxh3(ds, f"{wn}/{kind}", verify_xxh3)
            for wk in WEIGHT_KINDS:
                if wk in g:
                    compared += _expect_data(g[wk], _np(tp["model"]), "bfloat16", f"{wn}/{wk}")
                    _check_dataset_storage(g[wk], f"{wn}/{wk}", align)
                    _check_xxh3(g[wk], f"{wn}/{wk}", verify_xxh3)
            if "step" in g:
                st = np.asarray(g["step"][()])
                if st.size == 0 or not np.all(st == truth["iteration"]):
                    raise Bad(f"{wn}/step: values {st.reshape(-1)[:4]} != iteration {truth['iteration']}")
                _check_xxh3(g["step"], f"{wn}/step", verify_xxh3)
            is_vocab = name in truth["padding"]
            if "pad" in g:
                if not is_vocab:
                    raise Bad(f"{wn}/pad: a non-vocabulary param has padding rows")
                pg = g["pad"]
                for k in pg.keys():
                    if k not in KINDS + WEIGHT_KINDS:
                        raise Bad(f"{wn}/pad/{k}: unexpected dataset")
            if is_vocab:
                rows_expected = None if P is None else P - V
                for kind in KINDS + WEIGHT_KINDS:
                    present = "pad" in g and kind in g["pad"]
                    if rows_expected is not None and kind in KINDS:
                        if rows_expected == 0 and present:
                            raise Bad(f"{wn}/pad/{kind}: source has no padding rows")
                        if rows_expected > 0 and not present:
                            raise Bad(f"{wn}/pad/{kind}: missing ({rows_expected} padding rows in the source)")
                    if not present:
                        continue
                    ds = g["pad"][kind]
                    rows = ds.shape[0] if len(ds.shape) else -1
                    if rows_expected is not None and rows != rows_expected:
                        raise Bad(f"{wn}/pad/{kind}: {rows} rows, expected {rows_expected}")
                    block = truth["padding"][name]["model" if kind in WEIGHT_KINDS else kind]
                    if rows < 0 or rows > block.shape[0]:
                        raise Bad(f"{wn}/pad/{kind}: {rows} rows, at most {block.shape[0]} possible")
                    compared += _expect_data(ds, _np(block[:rows]), "bfloat16" if kind in WEIGHT_KINDS else "float32",
                                 f"{wn}/pad/{kind}")
                    _check_dataset_storage(ds, f"{wn}/pad/{kind}", align)
                    _check_xxh3(ds, f"{wn}/pad/{kind}", verify_xxh3)
        for top in ("buffers", "opaque"):
            if top not in f:
                continue

            def visit(name, obj, top=top):
                if isinstance(obj, h5py.Dataset):
                    wn = f"/{top}/{name}"
                    if top == "opaque" and obj.dtype != np.uint8:
                        raise Bad(f"{wn}: opaque data stored as {obj.dtype}, expected uint8")
                    if top == "buffers":
                        _str_attr(obj, "dtype", wn)
                    _check_xxh3(obj, wn, verify_xxh3)
            f[top].visititems(visit)
        least = sum(int(truth["params"][n]["fp32"].numel()) for n in order) * len(KINDS)
        if compared < max(least, 1):
            raise Bad(f"/params: {compared} values compared, fewer than the truth's {least}")
        if log:
            log(f"ok: {len(order)} params, {compared} values compared, "
                f"xxh3 {'verified' if verify_xxh3 and xxh3_func() else 'present'}")
    return compared


# ----------------------------------------------------------------------------------------------------
# Reference writer (self-test; also an executable example of the schema)


def _dataset(group, name: str, data: np.ndarray, dtype_name: str):
    """Contiguous, early allocation, no fill, data written, dtype + xxh3 attrs."""
    dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
    dcpl.set_layout(h5py.h5d.CONTIGUOUS)
    dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
    dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
    space = h5py.h5s.create_simple(data.shape)
    tid = h5py.h5t.py_create(data.dtype)
    dsid = h5py.h5d.create(group.id, name.encode(), tid, space, dcpl=dcpl)
    ds = h5py.Dataset(dsid)
    if data.size:
        ds[...] = data
    ds.attrs["dtype"] = dtype_name
    ds.attrs["xxh3"] = np.uint64(xxh3(_bits(data)) if xxh3_func() else 0)
    return ds


def write_reference(truth: dict, path: str, topo_dir: str) -> None:
    """Writes the universal file a correct converter would produce from `topo_dir` (a Megatron topology
    of the truth's variant)."""
    a = source_topology(topo_dir)
    cfg = truth["model_config"]
    V = cfg["vocab_size"]
    P = a.padded_vocab_size
    with h5py.File(path, "w", alignment_threshold=1, alignment_interval=4096) as f:
        f.attrs["ucp_format"] = "universal"
        f.attrs["ucp_version"] = np.int64(1)
        f.attrs["iteration"] = np.int64(truth["iteration"])
        f.attrs["consumed_samples"] = np.int64(truth["consumed_train_samples"])
        f.attrs["source"] = json.dumps({
            "framework": "megatron-lm",
            "framework_version": f"core_v{truth.get('megatron_version', S.DEFAULT_VERSION)}.0", "format": "torch",
            "tp": a.tensor_model_parallel_size, "pp": a.pipeline_model_parallel_size,
            "vpp": a.virtual_pipeline_model_parallel_size or 1, "dp": a.data_parallel_size, "ep": 1,
            "distributed_optimizer": bool(a.use_distributed_optimizer), "dtypes": ["bfloat16"],
            "layout": "megatron-core-gpt-te"})
        f.attrs["model"] = json.dumps(cfg)
        f.attrs["layout"] = "name: megatron-core-gpt-te\n"
        groups = []
        for g in truth["groups"]:
            h = dict(g["hyper"])
            h["betas"] = list(h["betas"])
            groups.append(dict(key=list(g["key"]), **h))
        f.attrs["optimizer"] = json.dumps({"type": "adam", "groups": groups,
                                           "state_kinds": ["fp32", "exp_avg", "exp_avg_sq"]})
        f.attrs["scheduler"] = json.dumps(truth["scheduler"])
        f.attrs["args"] = json.dumps({"num_layers": cfg["num_layers"]})
        params = f.create_group("params")
        for pos, name in enumerate(truth["order"]):
            tp = truth["params"][name]
            g = params.create_group(name)
            g.attrs["shape"] = np.array(tp["fp32"].shape, dtype=np.int64)
            g.attrs["dtype"] = "bfloat16"
            g.attrs["rule"] = "rule-" + name.split(".")[-1]
            g.attrs["kind"] = "param"
            g.attrs["group"] = np.int64(truth["param_group"][name])
            g.attrs["order"] = np.int64(pos)
            tied = truth["tied_copies"].get(name, []) if a.pipeline_model_parallel_size > 1 else []
            g.attrs["tied_copies"] = json.dumps(tied)
            for kind in KINDS:
                _dataset(g, kind, _np(tp[kind]), "float32")
            if name in truth["padding"] and P > V:
                pg = g.create_group("pad")
                for kind in KINDS:
                    _dataset(pg, kind, _np(truth["padding"][name][kind][:P - V]), "float32")
        op = f.create_group("opaque")
        _dataset(op, "args", np.frombuffer(b"\x80\x02N.", dtype=np.uint8), "uint8")


def self_test() -> int:
    import make_megatron_ckpts as M

    failures: List[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        if xxh3_func() is None:
            failures.append("libxxhash.so.0 not loadable: the xxh3 oracle is missing")
        for vname, topo in (("gqa_swiglu_bias_tied", "tp2_pp2_vpp1_dp2_do"),
                            ("gqa_swiglu_bias_untied", "tp1_pp1_vpp1_dp1_nodo")):
            cfg = S.VARIANTS[vname]
            M.generate(tmp, [cfg], topo, log=lambda *_: None)
            truth = torch.load(os.path.join(tmp, vname, "truth.pt"))
            tdir = os.path.join(tmp, vname, topo)
            ref = os.path.join(tmp, f"{vname}.h5")
            write_reference(truth, ref, tdir)

            def run(path, **kw) -> Optional[str]:
                try:
                    check(path, truth, **kw)
                    return None
                except Bad as e:
                    return str(e)

            r = run(ref, padding_from=tdir)
            if r:
                failures.append(f"{vname}: reference file rejected: {r}")
            r = run(ref)
            if r:
                failures.append(f"{vname}: reference file rejected without source: {r}")

            def mutate(name: str, fn, expect_fail: bool = True, **kw):
                p = os.path.join(tmp, "mut.h5")
                shutil.copyfile(ref, p)
                with h5py.File(p, "r+", alignment_threshold=1, alignment_interval=4096) as f:
                    fn(f)
                r = run(p, **kw)
                if expect_fail and r is None:
                    failures.append(f"{vname}: mutation not detected: {name}")
                if not expect_fail and r is not None:
                    failures.append(f"{vname}: false alarm for {name}: {r}")

            emb = "embedding.word_embeddings.weight"
            l3 = "decoder.layers.3.mlp.linear_fc1.weight"

            def flip(f):
                ds = f["params"][l3]["exp_avg"]
                x = ds[()]
                x.view(np.uint32)[0, 0] ^= 1
                ds[...] = x

            mutate("one bit in exp_avg", flip, padding_from=tdir)
            mutate("one bit in exp_avg (xxh3 off)", flip, verify_xxh3=False)

            def flip_with_hash(f):
                ds = f["params"][l3]["fp32"]
                x = ds[()]
                x.view(np.uint32)[1, 2] ^= 0x80000000
                ds[...] = x
                ds.attrs["xxh3"] = np.uint64(xxh3(_bits(x)) if xxh3_func() else 0)

            mutate("sign of one fp32 value (hash updated)", flip_with_hash, verify_xxh3=False)

            def bad_hash(f):
                f["params"][l3]["fp32"].attrs["xxh3"] = np.uint64(12345)

            if xxh3_func():
                mutate("wrong xxh3", bad_hash)
                mutate("wrong xxh3 ignored with --no-xxh3-verify", bad_hash, expect_fail=False,
                       verify_xxh3=False)
            mutate("missing param", lambda f: f["params"].__delitem__(l3))
            mutate("extra param", lambda f: f["params"].create_group("decoder.layers.99.x"))
            mutate("wrong group", lambda f: f["params"][l3].attrs.__setitem__("group", np.int64(1)))
            mutate("wrong order", lambda f: f["params"][l3].attrs.__setitem__("order", np.int64(0)))
            mutate("order as int32", lambda f: f["params"][emb].attrs.__setitem__("order", np.int32(0)))
            mutate("wrong dtype attr", lambda f: f["params"][l3].attrs.__setitem__("dtype", "float16"))
            mutate("wrong shape", lambda f: f["params"][l3].attrs.__setitem__(
                "shape", np.array([1, 2], dtype=np.int64)))
            mutate("ucp_version int32", lambda f: f.attrs.__setitem__("ucp_version", np.int32(1)))
            mutate("ucp_format", lambda f: f.attrs.__setitem__("ucp_format", "universel"))
            mutate("iteration", lambda f: f.attrs.__setitem__("iteration", np.int64(99)))
            mutate("consumed -1 allowed", lambda f: f.attrs.__setitem__("consumed_samples", np.int64(-1)),
                   expect_fail=False)
            mutate("source not JSON", lambda f: f.attrs.__setitem__("source", "{tp: 2"))
            mutate("optimizer lr last bit", lambda f: f.attrs.__setitem__("optimizer", json.dumps(dict(
                json.loads(f.attrs["optimizer"]), groups=[dict(g, lr=g["lr"] * (1 + 2 ** -50)) for g in
                                                          json.loads(f.attrs["optimizer"])["groups"]]))))
            mutate("source tp", lambda f: f.attrs.__setitem__("source", json.dumps(dict(
                json.loads(f.attrs["source"]), tp=7))), padding_from=tdir)

            def drop_kind(f):
                del f["params"][l3]["exp_avg_sq"]

            mutate("missing exp_avg_sq", drop_kind)

            def extra_kind(f):
                _dataset(f["params"][l3], "momentum", np.zeros(3, np.float32), "float32")

            mutate("unknown state kind", extra_kind)
            mutate("unknown state kind allowed", extra_kind, expect_fail=False, allow_extra_kinds=True)

            def model_kind(f):
                _dataset(f["params"][l3], "model", _np(truth["params"][l3]["model"]), "bfloat16")

            mutate("correct optional bf16 model dataset", model_kind, expect_fail=False)

            def model_bad(f):
                x = _np(truth["params"][l3]["model"]).copy()
                x.reshape(-1)[3] ^= 1
                _dataset(f["params"][l3], "model", x, "bfloat16")

            mutate("wrong bf16 model dataset", model_bad)

            def param_kind(f):
                _dataset(f["params"][l3], "param", _np(truth["params"][l3]["model"]), "bfloat16")

            mutate("correct bf16 'param' dataset", param_kind, expect_fail=False)

            def param_bad(f):
                x = _np(truth["params"][l3]["model"]).copy()
                x.reshape(-1)[5] ^= 1
                _dataset(f["params"][l3], "param", x, "bfloat16")

            mutate("wrong bf16 'param' dataset", param_bad)

            def as_f64(f):
                g = f["params"][l3]
                x = g["fp32"][()].astype(np.float64)
                del g["fp32"]
                _dataset(g, "fp32", x, "float32")

            mutate("fp32 stored as float64", as_f64)

            def chunked(f):
                g = f["params"][l3]
                x = g["exp_avg"][()]
                del g["exp_avg"]
                ds = g.create_dataset("exp_avg", data=x, chunks=True)
                ds.attrs["dtype"] = "float32"
                ds.attrs["xxh3"] = np.uint64(xxh3(_bits(x)) if xxh3_func() else 0)

            mutate("chunked dataset", chunked)
            if truth["padding"]:
                P = S.padded_vocab_size(cfg, S.parse_topology(topo).tp)
                emb_name = "output_layer.weight" if not truth["tied"] else emb

                def pad_missing(f):
                    del f["params"][emb_name]["pad"]

                if P > cfg.vocab_size:
                    mutate("missing padding rows with --padding-from", pad_missing, padding_from=tdir)
                    mutate("missing padding rows allowed without source", pad_missing, expect_fail=False)

                    def pad_short(f):
                        pg = f["params"][emb_name]["pad"]
                        x = pg["fp32"][()][:-1]
                        del pg["fp32"]
                        _dataset(pg, "fp32", x, "float32")

                    mutate("padding rows count", pad_short, padding_from=tdir)

                    def pad_val(f):
                        ds = f["params"][emb_name]["pad"]["exp_avg"]
                        x = ds[()]
                        x[0, 0] += 1
                        ds[...] = x

                    mutate("padding value", pad_val, verify_xxh3=False)
            if truth["tied"]:
                def tied(f):
                    f["params"][emb].attrs["tied_copies"] = json.dumps([])

                mutate("tied_copies dropped for a PP>1 source", tied, padding_from=tdir)

                def copy_param(f):
                    src = f["params"][emb]
                    f["params"].copy(src, "output_layer.weight")

                mutate("tied copy stored as its own param", copy_param)
        # CLI
        import subprocess
        r = subprocess.run([sys.executable, __file__, os.path.join(tmp, "gqa_swiglu_bias_untied.h5"),
                            os.path.join(tmp, "gqa_swiglu_bias_untied", "truth.pt"), "--padding-from",
                            os.path.join(tmp, "gqa_swiglu_bias_untied", "tp1_pp1_vpp1_dp1_nodo")],
                           capture_output=True, text=True)
        bad = subprocess.run([sys.executable, __file__, os.path.join(tmp, "gqa_swiglu_bias_untied.h5"),
                              os.path.join(tmp, "gqa_swiglu_bias_tied", "truth.pt")], capture_output=True, text=True)
        if r.returncode != 0 or bad.returncode != 1 or len(bad.stdout.strip().splitlines()) != 1:
            failures.append(f"CLI exit codes {r.returncode}/{bad.returncode}: {r.stdout}{r.stderr}{bad.stdout}")
    for f in failures:
        print("FAIL:", f)
    print("self-test:", "FAILED" if failures else "ok")
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("universal", nargs="?")
    ap.add_argument("truth", nargs="?")
    ap.add_argument("--padding-from", help="the Megatron topology folder the universal file was made from")
    ap.add_argument("--no-align-check", action="store_true")
    ap.add_argument("--allow-extra-kinds", action="store_true")
    ap.add_argument("--no-xxh3-verify", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args(argv)
    if a.self_test:
        return self_test()
    if not a.universal or not a.truth:
        ap.print_usage()
        return 2
    truth = torch.load(a.truth, map_location="cpu")
    try:
        check(a.universal, truth, a.padding_from, align=not a.no_align_check,
              allow_extra_kinds=a.allow_extra_kinds, verify_xxh3=not a.no_xxh3_verify,
              log=print if a.verbose else None)
    except Bad as e:
        print(str(e).replace("\n", " "))
        return 1
    except (OSError, KeyError) as e:
        print(f"{a.universal}: {type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
