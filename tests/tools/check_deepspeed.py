"""Oracle checks for ucp's DeepSpeed driver, written from the format spec
(../shared/reference/deepspeed.md) and DeepSpeed's own files, never from ucp.

  check_deepspeed.py universal H5 FIXTURE [--min-values N]
      the universal file's atoms equal DeepSpeed's in-memory references taken
      at training time (reference_fp32_master.pt, reference_optim_state.pt,
      reference_module_params.pt) bit for bit, at least N values compared.
  check_deepspeed.py export DIR FIXTURE [--dtype fp32|bf16] [--format safetensors|torch]
      every exported tensor (safetensors parsed by hand, from the spec) equals
      the reference master weights (rounded to bf16 with torch for bf16).
  check_deepspeed.py native DIR FIXTURE --dp N --stage S
      the rank files ucp wrote load with torch.load, carry the keys, classes and
      flat layouts DeepSpeed writes for that world size and stage (computed here
      from the spec), and hold the reference values; when N and S are the
      fixture's own, every tensor equals DeepSpeed's file.
  check_deepspeed.py dsuniversal DIR FIXTURE
      a DeepSpeed universal folder (the layout DeepSpeed's ds_to_universal
      writes; the folders checked here are ucp's, DeepSpeed's own are read in
      tests/cli/test_deepspeed_real.py): zero/<param>/{fp32,exp_avg,exp_avg_sq,step}.pt
      hold the references.
Exit status 0 when every check holds; the first failure is printed.
"""
import argparse
import importlib.util
import json
import math
import os
import struct
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# DeepSpeed's classes for torch.load: the stand-ins where DeepSpeed is not installed (Debian's
# python); the real ones in the tests' venv (whose tests import this module beside the real
# DeepSpeed, which the stand-ins must not shadow).
if importlib.util.find_spec("deepspeed") is None:
    sys.path.insert(0, os.path.join(HERE, "stubs"))


class Bad(Exception):
    pass


def load(path):
    return torch.load(path, map_location="cpu")


def same(a, b, what):
    if a is None or b is None:
        raise Bad(f"{what}: missing ({a is None}, {b is None})")
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        raise Bad(f"{what}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}")
    ab = a.contiguous().reshape(-1)
    bb = b.contiguous().reshape(-1)
    if a.dtype != torch.bool:
        ab, bb = ab.view(torch.uint8), bb.view(torch.uint8)
    if not torch.equal(ab, bb):
        raise Bad(f"{what}: values differ")


def references(fixture):
    meta = json.load(open(os.path.join(fixture, "meta.json")))
    master = load(os.path.join(fixture, "reference_fp32_master.pt"))
    optim = load(os.path.join(fixture, "reference_optim_state.pt"))
    module = load(os.path.join(fixture, "reference_module_params.pt"))
    # ZeRO 0 fp32 keeps no separate master: the module params are the master,
    # and DeepSpeed's API cannot report the optimizer state; its own file has it.
    for n, t in module.items():
        if master.get(n) is None:
            master[n] = t
    # A frozen param (requires_grad=False) has no moments.
    frozen = set(meta.get("frozen", []))
    if any(v is None for k, v in optim.items() if k.split("::")[0] not in frozen):
        m = load(os.path.join(fixture, meta["tag"], "mp_rank_00_model_states.pt"))
        for i, n in enumerate(meta["param_shapes"]):
            for k in ("exp_avg", "exp_avg_sq"):
                if optim.get(f"{n}::{k}") is None:
                    optim[f"{n}::{k}"] = m["optimizer"]["state"][i][k]
    return meta, master, optim, module


def cmd_universal(h5path, fixture, min_values=0):
    import h5py
    import numpy as np
    meta, master, optim, module = references(fixture)
    frozen = set(meta.get("frozen", []))
    compared = 0

    def check(a, b, what):
        nonlocal compared
        same(a, b, what)
        compared += b.numel()

    with h5py.File(h5path, "r") as f:
        if f.attrs["ucp_version"] != 2:
            raise Bad("ucp_version != 2")
        src = json.loads(f.attrs["source"])
        if src["framework"] != "deepspeed":
            raise Bad(f"source attribute {src}")
        if f.attrs["iteration"] != meta["steps"]:
            raise Bad(f"iteration {f.attrs['iteration']}")
        names = list(meta["param_shapes"])
        if sorted(f["params"].keys()) != sorted(names):
            raise Bad(f"params {sorted(f['params'].keys())} vs {sorted(names)}")
        for n in names:
            g = f["params"][n]
            if list(g.attrs["shape"]) != meta["param_shapes"][n]:
                raise Bad(f"{n}: shape {list(g.attrs['shape'])}")
            if n in frozen:
                # Frozen (requires_grad=False): no master, no moments; its weights below.
                if int(g.attrs["frozen"]) != 1 or "param" not in g:
                    raise Bad(f"{n}: frozen {g.attrs['frozen']}, atoms {list(g)}")
            else:
                check(torch.from_numpy(g["fp32"][()]), master[n], f"{n}/fp32")
            for k in ("exp_avg", "exp_avg_sq"):
                ref = optim.get(f"{n}::{k}")
                if ref is None:
                    continue
                check(torch.from_numpy(g[k][()]), ref, f"{n}/{k}")
            if "param" in g:  # training-dtype weights
                raw = g["param"][()]
                # bf16 / fp16 are their bits as uint16 (engine/atoms/README.md)
                if g["param"].attrs["dtype"] == "bfloat16":
                    t = torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16).float()
                elif g["param"].attrs["dtype"] == "float16":
                    t = torch.from_numpy(raw.astype(np.int16)).view(torch.float16).float()
                else:
                    t = torch.from_numpy(raw).float()
                check(t, module[n], f"{n}/param")
            if "step" in g:
                # The optimizer's own step where the maker saw it (DeepSpeed
                # 0.19's FP16_UnfusedOptimizer counts one more), else the
                # training steps.
                want = meta.get("adam_steps", {}).get(n, meta["steps"])
                if float(g["step"][()]) != float(want):
                    raise Bad(f"{n}/step = {g['step'][()]}, expected {want}")
        # The param groups (params, lr, weight decay, betas, eps) and the tied params as
        # the engine held them (deepspeed_real.py's optimizer_facts, tied).
        facts = meta.get("optimizer_facts")
        if facts is not None:
            groups = json.loads(f.attrs["optimizer"])["groups"]
            if len(groups) != len(facts["groups"]):
                raise Bad(f"{len(groups)} param groups, expected {len(facts['groups'])}")
            for i, (g, want) in enumerate(zip(groups, facts["groups"])):
                for k, v in want.items():
                    got = sorted(g.get(k, [])) if k == "params" else g.get(k)
                    compared += 1
                    if got != v:
                        raise Bad(f"param group {i} {k}: {got!r}, expected {v!r}")
        if meta.get("tied"):
            shared = json.loads(f.attrs["training"]).get("shared")
            if shared != meta["tied"]:
                raise Bad(f"shared params {shared}, expected {meta['tied']}")
    if compared < min_values:
        raise Bad(f"{compared} values compared, expected at least {min_values}")
    print(f"universal ok: {h5path} ({compared} values)")


ST_DTYPES = {"F32": (torch.float32, 4), "BF16": (torch.bfloat16, 2), "F16": (torch.float16, 2),
             "F64": (torch.float64, 8), "I64": (torch.int64, 8)}


def read_safetensors(path):
    """A safetensors file parsed from the format spec: u64 LE header size,
    JSON header, then raw little-endian data."""
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    if n % 8 != 0:
        raise Bad(f"{path}: header size {n} not a multiple of 8")
    base = 8 + n
    out = {}
    end_max = 0
    for name, e in header.items():
        if name == "__metadata__":
            if e.get("format") != "pt":
                raise Bad(f"{path}: metadata {e}")
            continue
        dt, size = ST_DTYPES[e["dtype"]]
        b, en = e["data_offsets"]
        numel = math.prod(e["shape"])
        if en - b != numel * size:
            raise Bad(f"{path}: {name} offsets {b, en} for {numel} elements")
        buf = bytearray(data[base + b:base + en])
        t = torch.frombuffer(buf, dtype=dt) if numel else torch.empty(0, dtype=dt)
        out[name] = t.reshape(e["shape"])
        end_max = max(end_max, en)
    if base + end_max != len(data):
        raise Bad(f"{path}: {len(data) - base - end_max} bytes after the last tensor")
    return out


def read_export(d, fmt):
    stem, ext = ("model", ".safetensors") if fmt == "safetensors" else ("pytorch_model", ".bin")
    single = os.path.join(d, stem + ext)
    index = os.path.join(d, stem + ext + ".index.json")
    files = [single] if os.path.exists(single) else []
    if os.path.exists(index):
        idx = json.load(open(index))
        files = sorted({os.path.join(d, f) for f in idx["weight_map"].values()})
    if not files:
        raise Bad(f"{d}: no {stem}{ext} nor index")
    sd = {}
    for f in files:
        part = read_safetensors(f) if fmt == "safetensors" else load(f)
        for k, v in part.items():
            if k in sd:
                raise Bad(f"{k} in two shards")
            sd[k] = v
    if os.path.exists(index):
        idx = json.load(open(index))
        total = sum(t.numel() * t.element_size() for t in sd.values())
        if idx["metadata"]["total_size"] != total:
            raise Bad(f"index total_size {idx['metadata']['total_size']} != {total}")
        if set(idx["weight_map"]) != set(sd):
            raise Bad("index weight_map does not list exactly the tensors")
        for k, f in idx["weight_map"].items():
            part = read_safetensors(os.path.join(d, f)) if fmt == "safetensors" else load(os.path.join(d, f))
            if k not in part:
                raise Bad(f"weight_map says {k} is in {f}")
    return sd


def cmd_export(d, fixture, dtype, fmt):
    meta, master, optim, module = references(fixture)
    sd = read_export(d, fmt)
    if set(sd) != set(meta["param_shapes"]):
        raise Bad(f"exported {sorted(sd)}")
    for n, ref in master.items():
        want = ref if dtype == "fp32" else ref.to(torch.bfloat16)
        same(sd[n], want, f"export {n}")
    print(f"export ok: {d}")


def flat_layout(shapes, W):
    """ZeRO 1/2 flat group layout from the spec: per-rank windows."""
    N = sum(math.prod(s) for s in shapes.values())
    A = 2 * W
    Np = -(-N // A) * A
    ps = Np // W
    return N, Np, ps


def cmd_native(d, fixture, dp, stage):
    meta, master, optim, module = references(fixture)
    tag = open(os.path.join(d, "latest")).read()
    tdir = os.path.join(d, tag)
    bf16 = meta["dtype"] == "bf16"
    shapes = meta["param_shapes"]
    names = list(shapes)
    files = sorted(os.listdir(tdir))
    prefix = "bf16_" if bf16 else ""
    if stage == 3:
        want = [f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(dp)]
    else:
        want = ["mp_rank_00_model_states.pt"]
    if stage >= 1 or bf16:
        want += [f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(dp)]
    if sorted(want) != files:
        raise Bad(f"files {files}, expected {sorted(want)}")
    m = load(os.path.join(tdir, want[0]))
    if m["dp_world_size"] != dp or m["mp_world_size"] != 1:
        raise Bad(f"dp_world_size {m['dp_world_size']}")
    if list(m["module"]) != names:
        raise Bad(f"module keys {list(m['module'])}")
    cfg = m.get("ds_config")
    if isinstance(cfg, dict) and cfg.get("zero_optimization", {}).get("stage", stage) != stage:
        raise Bad(f"ds_config says stage {cfg['zero_optimization']['stage']}, files are stage {stage}")
    for n in names:
        t = m["module"][n]
        if stage == 3:
            if t.numel() != 0:
                raise Bad(f"ZeRO-3 module {n} is not a placeholder")
        else:
            same(t.float(), module[n], f"module {n}")
    if stage == 0 and not bf16:
        opt = m["optimizer"]
        for i, n in enumerate(names):
            same(opt["state"][i]["exp_avg"], optim[f"{n}::exp_avg"], f"state[{i}] exp_avg")
            same(opt["state"][i]["exp_avg_sq"], optim[f"{n}::exp_avg_sq"], f"state[{i}] exp_avg_sq")
        print(f"native ok: {d}")
        return
    if m["param_shapes"] is None or list(m["param_shapes"][0]) != names:
        raise Bad(f"param_shapes {m['param_shapes']}")
    full = {n: master[n].flatten() for n in names}
    mom = {k: {n: optim[f"{n}::{k}"].flatten() for n in names} for k in ("exp_avg", "exp_avg_sq")}
    for r in range(dp):
        o = load(os.path.join(tdir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        osd = o["optimizer_state_dict"]
        if stage == 3:
            if type(osd["zero_stage"]).__name__ != "ZeroStageEnum" or int(osd["zero_stage"]) != 3:
                raise Bad(f"zero_stage {osd['zero_stage']!r}")
            if osd["partition_count"] != dp:
                raise Bad("partition_count")
            flat = osd["fp32_flat_groups"][0]
            st = osd["optimizer_state_dict"]["state"][0]
            off = 0
            for n in names:
                num = full[n].numel()
                p = -(-num // dp)
                lo, hi = min(num, r * p), min(num, (r + 1) * p)
                same(flat[off:off + hi - lo], full[n][lo:hi], f"rank {r} fp32 {n}")
                for k in ("exp_avg", "exp_avg_sq"):
                    same(st[k][off:off + hi - lo], mom[k][n][lo:hi], f"rank {r} {k} {n}")
                if hi - lo < p and not torch.all(flat[off + hi - lo:off + p] == 0):
                    raise Bad("padding not zero")
                off += p
            if flat.numel() != off:
                raise Bad(f"flat group of {flat.numel()}, expected {off}")
            continue
        N, Np, ps = flat_layout(shapes, dp)
        lo, hi = min(N, r * ps), min(N, (r + 1) * ps)
        fp32 = osd["single_partition_of_fp32_groups"][0]
        bf16opt = stage == 0
        if bf16opt:
            if "zero_stage" in osd or fp32.numel() != ps:
                raise Bad("BF16_Optimizer layout")
            pad = Np - N if r == dp - 1 else 0
        else:
            if type(osd["zero_stage"]).__name__ != "ZeroStageEnum" or int(osd["zero_stage"]) != stage:
                raise Bad(f"zero_stage {osd['zero_stage']!r}")
            if fp32.numel() != hi - lo:
                raise Bad(f"rank {r}: fp32 partition {fp32.numel()}, expected {hi - lo}")
            pad = ps - (hi - lo)
        if osd["group_paddings"] != [pad] or osd["partition_count"] != [dp]:
            raise Bad(f"rank {r}: group_paddings {osd['group_paddings']} (want {[pad]}), "
                      f"partition_count {osd['partition_count']}")
        st = osd["base_optimizer_state"]["state"][0]
        if osd["base_optimizer_state"]["param_groups"][0]["params"] != [0]:
            raise Bad("param_groups params")
        if float(st["step"]) != float(meta["steps"]):
            raise Bad(f"step {st['step']}")
        cat = torch.cat([full[n] for n in names])
        same(fp32[:hi - lo], cat[lo:hi], f"rank {r} fp32 partition")
        for k in ("exp_avg", "exp_avg_sq"):
            catk = torch.cat([mom[k][n] for n in names])
            if st[k].numel() != ps:
                raise Bad(f"{k} of {st[k].numel()} elements, expected {ps}")
            same(st[k][:hi - lo], catk[lo:hi], f"rank {r} {k}")
            if not torch.all(st[k][hi - lo:] == 0):
                raise Bad(f"{k} padding not zero")
        # param_slice_mappings from the spec.
        o_ = 0
        mapping = osd["param_slice_mappings"][0]
        want_map = {}
        for n in names:
            num = full[n].numel()
            b, e = max(o_, r * ps), min(o_ + num, (r + 1) * ps)
            if b < e:
                want_map[n] = (e - b, b - r * ps)
            o_ += num
        got = {n: (a.numel, a.start) for n, a in mapping.items()}
        if got != want_map or type(next(iter(mapping.values()))).__name__ != "fragment_address":
            raise Bad(f"rank {r}: param_slice_mappings {got}, expected {want_map}")
    # Same world size and stage as the fixture: every tensor as DeepSpeed wrote it.
    if dp == meta["world_size"] and stage == meta["zero_stage"]:
        src = os.path.join(fixture, meta["tag"])
        for f in files:
            a, b = load(os.path.join(tdir, f)), load(os.path.join(src, f))
            # ZeRO-3's per-param padding elements hold leftovers of no param
            # (DeepSpeed never reads them): compared above without them.
            compare_tree(a, b, f, skip={"fp32_flat_groups"} if stage == 3 else set())
    print(f"native ok: {d}")


def compare_tree(a, b, where, skip=frozenset()):
    if isinstance(b, torch.Tensor):
        if not isinstance(a, torch.Tensor):
            raise Bad(f"{where}: not a tensor")
        same(a, b, where)
    elif isinstance(b, dict):
        if not isinstance(a, dict) or list(a) != list(b):
            raise Bad(f"{where}: keys {list(a) if isinstance(a, dict) else a!r} vs {list(b)}")
        for k in b:
            if k not in skip:
                compare_tree(a[k], b[k], f"{where}.{k}", skip)
    elif isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise Bad(f"{where}: length {len(a)} vs {len(b)}")
        for i, (x, y) in enumerate(zip(a, b)):
            compare_tree(x, y, f"{where}[{i}]", skip)
    elif hasattr(b, "__dict__") and not isinstance(b, type):
        if type(a).__name__ != type(b).__name__ or vars(a) != vars(b):
            raise Bad(f"{where}: {a!r} vs {b!r}")
    elif a != b and not (isinstance(b, float) and math.isnan(b)):
        raise Bad(f"{where}: {a!r} vs {b!r}")


def cmd_dsuniversal(d, fixture):
    meta, master, optim, module = references(fixture)
    name = open(os.path.join(d, "latest_universal")).read()
    z = os.path.join(d, name, "zero")
    # ds_to_universal's forms: {'param': t, 'cat_dim': ...}, and from a
    # ZeRO-3 checkpoint the tensor alone (DeepSpeed 0.14's ZeRO-3 load reads
    # only that).
    def state(path):
        x = load(path)
        if meta["zero_stage"] == 3:
            if not isinstance(x, torch.Tensor):
                raise Bad(f"{path}: {type(x).__name__}, a ZeRO-3 folder holds the tensor alone")
            return x
        if not isinstance(x, dict) or "param" not in x:
            raise Bad(f"{path}: {type(x).__name__}, expected {{'param': ..., 'cat_dim': ...}}")
        return x["param"]

    for n in meta["param_shapes"]:
        same(state(os.path.join(z, n, "fp32.pt")), master[n], f"{n}/fp32.pt")
        for k in ("exp_avg", "exp_avg_sq"):
            same(state(os.path.join(z, n, f"{k}.pt")), optim[f"{n}::{k}"], f"{n}/{k}.pt")
        step = load(os.path.join(z, n, "step.pt"))
        if float(step) != float(meta["steps"]):
            raise Bad(f"{n}/step.pt = {step}")
    o = load(os.path.join(z, "optimizer_state.pt"))
    if "param_groups" not in o or o["param_groups"][0]["lr"] != meta["lr"]:
        raise Bad(f"optimizer_state.pt: {list(o)}")
    print(f"deepspeed universal ok: {d}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("universal"); u.add_argument("h5"); u.add_argument("fixture")
    u.add_argument("--min-values", type=int, default=0)
    e = sub.add_parser("export"); e.add_argument("dir"); e.add_argument("fixture")
    e.add_argument("--dtype", default="fp32"); e.add_argument("--format", default="safetensors")
    n = sub.add_parser("native"); n.add_argument("dir"); n.add_argument("fixture")
    n.add_argument("--dp", type=int, required=True); n.add_argument("--stage", type=int, required=True)
    v = sub.add_parser("dsuniversal"); v.add_argument("dir"); v.add_argument("fixture")
    a = ap.parse_args()
    try:
        if a.cmd == "universal":
            cmd_universal(a.h5, a.fixture, a.min_values)
        elif a.cmd == "export":
            cmd_export(a.dir, a.fixture, a.dtype, a.format)
        elif a.cmd == "native":
            cmd_native(a.dir, a.fixture, a.dp, a.stage)
        else:
            cmd_dsuniversal(a.dir, a.fixture)
    except Bad as ex:
        print(f"FAIL: {ex}")
        sys.exit(1)


if __name__ == "__main__":
    main()
