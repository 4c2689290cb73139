#!/usr/bin/python3
"""Independent generator of DeepSpeed checkpoints, written from DeepSpeed's
save code as ../shared/reference/deepspeed.md transcribes it (never from ucp),
for the cases the real fixtures lack: a frozen param, a shared (tied) param,
buffers (float and int), two optimizer groups, worlds 3 and 8, ZeRO 1/2/3,
BF16_Optimizer and FP16_Optimizer (fused and unfused), fp32, bf16 and fp16.
Each case folder holds `latest`, the tag folder and truth.pt:
  atoms:   {name: {state kind: tensor}} what the universal file must hold
  export:  {name: fp32 tensor} what `ucp export` must write
  frozen_flags: {name: 0|1}; param_is_stored: {"name/param": bool}
Classes come from tests/tools/stubs (the real module paths).
"""
import argparse
import os
import sys
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs"))
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

STEP = 5
# Model: module state-dict order. embed.weight is shared with head.weight
# (named_parameters dedups: head.weight is the alias).
PARAMS = OrderedDict([
    ("embed.weight", (11, 6)),
    ("block.norm.weight", (6,)),   # frozen
    ("block.fc.weight", (7, 6)),
    ("block.fc.bias", (7,)),
])
FROZEN = {"block.norm.weight"}
GROUPS = [["embed.weight", "block.fc.weight"], ["block.fc.bias"]]  # trainable
BUFFERS = OrderedDict([("block.running", torch.float32), ("block.count", torch.int64)])
MODULE_ORDER = ["embed.weight", "block.norm.weight", "block.fc.weight", "block.fc.bias",
                "block.running", "block.count", "head.weight"]
HYPER = [dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=False,
              foreach=None, maximize=False, capturable=False),
         dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, amsgrad=False,
              foreach=None, maximize=False, capturable=False)]


def make_state(seed, lp):
    g = torch.Generator().manual_seed(seed)
    st = {}
    for n, shape in PARAMS.items():
        master = torch.randn(shape, generator=g)
        st[n] = {"fp32": master, "lp": master.to(lp)}
        if n not in FROZEN:
            st[n]["exp_avg"] = torch.randn(shape, generator=g) * 1e-2
            st[n]["exp_avg_sq"] = torch.rand(shape, generator=g) * 1e-4
    bufs = {"block.running": torch.randn(5, generator=g),
            "block.count": torch.tensor(42, dtype=torch.int64)}
    return st, bufs


def numel(n):
    r = 1
    for d in PARAMS[n]:
        r *= d
    return r


def sub_groups(world, size):
    """ZeRO-3 sub-groups (stage3.py): per param group, a sub-group closes when
    its partitions (ceil(n / world) each) reach `size`, or at the group's end.
    Returns [(group index, [names])]."""
    out = []
    for gi, g in enumerate(GROUPS):
        cur, total = [], 0
        for k, n in enumerate(g):
            cur.append(n)
            total += -(-numel(n) // world)
            if total >= size or k + 1 == len(g):
                out.append((gi, cur))
                cur, total = [], 0
    return out


def fp16_optimizer(st, step, unfused):
    """ZeRO 0 with fp16: the model states' `optimizer`, FP16_Optimizer.state_dict()
    (fused_optimizer.py: one flat fp32 master per param group, the params
    flattened back to back with no padding, the inner FusedAdam over the flat
    masters) or FP16_UnfusedOptimizer.state_dict() (unfused_optimizer.py:
    fp32_groups, one fp32 master per param, torch Adam over them). The dynamic
    loss scaler's fields are inlined."""
    d = OrderedDict([("dynamic_loss_scale", True), ("cur_scale", 2.0**12), ("cur_iter", STEP),
                     ("last_overflow_iter", -1), ("scale_factor", 2.0), ("scale_window", 1000)])
    state, groups, masters, pid = {}, [], [], 0
    for gi, g in enumerate(GROUPS):
        if unfused:
            ids = []
            for n in g:
                state[pid] = {"step": step.clone(), "exp_avg": st[n]["exp_avg"].clone(),
                              "exp_avg_sq": st[n]["exp_avg_sq"].clone()}
                ids.append(pid)
                pid += 1
            groups.append(dict(HYPER[gi], params=ids))
            masters.append([st[n]["fp32"].clone().requires_grad_(True) for n in g])
        else:
            cat = {k: torch.cat([st[n][k].flatten() for n in g])
                   for k in ("fp32", "exp_avg", "exp_avg_sq")}
            state[gi] = {"step": STEP, "exp_avg": cat["exp_avg"], "exp_avg_sq": cat["exp_avg_sq"]}
            groups.append(dict(HYPER[gi], step=STEP, params=[gi]))
            masters.append(cat["fp32"].requires_grad_(True))
    d["optimizer_state_dict"] = {"state": state, "param_groups": groups}
    d["fp32_groups" if unfused else "fp32_groups_flat"] = masters
    if not unfused:
        d["clip_grad"] = 1.0
    return d


def write_case(out, stage, world, dtype, truth=True, sub_group_size=None, int_step=None,
               unfused=False):
    lp = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype, torch.float32)
    fp16 = dtype == "fp16"
    # ZeRO 0 with fp16: no optimizer files, FP16_Optimizer in the model states.
    fp16_opt = stage == 0 and fp16

    def scaler():
        # fp16 runs scale the loss dynamically; fp32 / bf16 keep a static 1.0.
        if fp16:
            s = DynamicLossScaler(init_scale=2.0**12)
            s.cur_iter = STEP
            return s
        return LossScaler(1.0)
    st, bufs = make_state(1000 * stage + 10 * world + (dtype == "bf16"), lp)
    tag = f"global_step{STEP}"
    tdir = os.path.join(out, tag)
    os.makedirs(tdir)
    with open(os.path.join(out, "latest"), "w") as f:
        f.write(tag)
    bf16_opt = stage == 0  # BF16_Optimizer (bf16 only)
    subs = sub_groups(world, sub_group_size or 10**9)
    zero_cfg = {"stage": stage}
    if sub_group_size:
        zero_cfg["sub_group_size"] = sub_group_size
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero_cfg,
           "bf16": {"enabled": dtype == "bf16"}, "fp16": {"enabled": fp16}}
    trainable = [n for g in GROUPS for n in g]

    def model_states(rank):
        module = OrderedDict()
        for k in MODULE_ORDER:
            if k == "head.weight":
                module[k] = module["embed.weight"]  # the same tensor
            elif k in BUFFERS:
                module[k] = bufs[k].clone()
            elif stage == 3:
                module[k] = torch.empty(0, dtype=lp)
            else:
                module[k] = st[k]["lp"].clone() if k not in FROZEN else st[k]["lp"].clone()
        if stage == 3:
            # ZeRO-3 param_shapes: one dict per sub-group.
            shapes = [OrderedDict((n, torch.Size(PARAMS[n])) for n in g) for _, g in subs]
        else:
            shapes = [OrderedDict((n, torch.Size(PARAMS[n])) for n in g) for g in GROUPS]
        frozen_shapes = OrderedDict((n, torch.Size(PARAMS[n])) for n in FROZEN) if stage >= 2 else None
        if stage == 2:
            frags = OrderedDict((n, st[n]["lp"].clone()) for n in FROZEN)
        elif stage == 3:
            frags = OrderedDict()
            for n in FROZEN:
                p = -(-numel(n) // world)
                flat = torch.zeros(p * world, dtype=lp)
                flat[:numel(n)] = st[n]["lp"].flatten()
                frags[n] = flat[rank * p:(rank + 1) * p].clone()
        else:
            frags = None
        if fp16_opt:
            shapes = None
        optimizer = fp16_optimizer(st, torch.tensor(float(STEP)), unfused) if fp16_opt else None
        return OrderedDict([
            ("module", module), ("buffer_names", list(BUFFERS)), ("optimizer", optimizer),
            ("param_shapes", shapes), ("frozen_param_shapes", frozen_shapes),
            # ZeRO 0 without bf16 saves no shared_params (engine.py:
            # zero_optimizer_state is False).
            ("shared_params", None if fp16_opt else
             {"head.weight": "embed.weight"} if rank == 0 else {}),
            ("frozen_param_fragments", frags), ("lr_scheduler", {"last_epoch": STEP}),
            ("data_sampler", None), ("random_ltd", None), ("sparse_tensor_module_names", set()),
            ("skipped_steps", 0), ("global_steps", STEP), ("global_samples", STEP * world),
            ("dp_world_size", world), ("mp_world_size", 1), ("ds_config", cfg),
            ("ds_version", "0.14.5"), ("iteration", STEP)])

    if stage == 3:
        for r in range(world):
            torch.save(model_states(r), os.path.join(tdir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"))
    else:
        torch.save(model_states(0), os.path.join(tdir, "mp_rank_00_model_states.pt"))

    prefix = "bf16_" if dtype == "bf16" else ""
    # torch.optim.Adam keeps a 0-d float tensor; FusedAdam a Python int (which
    # can differ from global_steps after skipped fp16 steps).
    step = torch.tensor(float(STEP)) if int_step is None else int_step
    hyper = [dict(h) for h in HYPER]
    if int_step is not None:
        for h in hyper:
            h["step"] = int_step
    for r in range(0 if fp16_opt else world):
        if stage == 3:
            flats, state = [], {}
            for si, (gi, g) in enumerate(subs):
                parts = {k: [] for k in ("fp32", "exp_avg", "exp_avg_sq")}
                for n in g:
                    p = -(-numel(n) // world)
                    for k in parts:
                        flat = torch.zeros(p * world)
                        flat[:numel(n)] = st[n][k].flatten()
                        parts[k].append(flat[r * p:(r + 1) * p])
                flats.append(torch.cat(parts["fp32"]))
                state[si] = {"step": step.clone() if int_step is None else step, "exp_avg": torch.cat(parts["exp_avg"]),
                             "exp_avg_sq": torch.cat(parts["exp_avg_sq"])}
            osd = OrderedDict([
                ("zero_stage", ZeroStageEnum.weights), ("loss_scaler", scaler()),
                ("dynamic_loss_scale", fp16), ("overflow", False), ("partition_count", world),
                ("optimizer_state_dict", {"state": state, "param_groups": [
                    dict(hyper[gi], params=[si for si, (g2, _) in enumerate(subs) if g2 == gi])
                    for gi in range(len(GROUPS))]}),
                ("fp32_flat_groups", flats)])
        else:
            fp32s, state, pads, maps = [], {}, [], []
            for gi, g in enumerate(GROUPS):
                N = sum(numel(n) for n in g)
                A = 2 * world
                Np = -(-N // A) * A
                ps = Np // world
                cat = {k: torch.cat([st[n][k].flatten() for n in g] + [torch.zeros(Np - N)])
                       for k in ("fp32", "exp_avg", "exp_avg_sq")}
                if bf16_opt:
                    pad = Np - N if r == world - 1 else 0
                    fp32s.append(cat["fp32"][r * ps:(r + 1) * ps].clone())
                else:
                    pad = ps if N <= r * ps else ((r + 1) * ps - N if N < (r + 1) * ps else 0)
                    fp32s.append(cat["fp32"][r * ps:(r + 1) * ps - pad].clone())
                pads.append(pad)
                state[gi] = {"step": step.clone() if int_step is None else step, "exp_avg": cat["exp_avg"][r * ps:(r + 1) * ps].clone(),
                             "exp_avg_sq": cat["exp_avg_sq"][r * ps:(r + 1) * ps].clone()}
                m, o = OrderedDict(), 0
                for n in g:
                    b, e = max(o, r * ps), min(o + numel(n), (r + 1) * ps)
                    if b < e:
                        m[n] = fragment_address(numel=e - b, start=b - r * ps)
                    o += numel(n)
                maps.append(m)
            base = {"state": state, "param_groups": [dict(hyper[gi], params=[gi])
                                                     for gi in range(len(GROUPS))]}
            items = []
            if not bf16_opt:
                items += [("loss_scaler", scaler()), ("dynamic_loss_scale", fp16),
                          ("overflow", False)]
            items += [("clip_grad", 1.0), ("base_optimizer_state", base),
                      ("single_partition_of_fp32_groups", fp32s)]
            if not bf16_opt:
                items += [("zero_stage", ZeroStageEnum(stage))]
            items += [("group_paddings", pads), ("partition_count", [world] * len(GROUPS)),
                      ("ds_version", "0.14.5"), ("param_slice_mappings", maps)]
            osd = OrderedDict(items)
        torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.14.5"},
                   os.path.join(tdir, f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))

    if not truth:
        return
    # Truth.
    atoms, export, stored = {}, {}, {}
    for n in PARAMS:
        if n in FROZEN:
            atoms[n] = {"param": st[n]["lp"]}
            export[n] = st[n]["lp"].float()
            stored[f"{n}/param"] = True
            continue
        atoms[n] = {"fp32": st[n]["fp32"], "exp_avg": st[n]["exp_avg"],
                    "exp_avg_sq": st[n]["exp_avg_sq"]}
        if int_step is None and not (fp16_opt and not unfused):
            atoms[n]["step"] = step.clone()
        if dtype != "fp32" and stage < 3:
            atoms[n]["param"] = st[n]["lp"]
        export[n] = st[n]["fp32"]
    for n, t in bufs.items():
        atoms[n] = {"param": t}
        export[n] = t.float() if t.is_floating_point() else t
        stored[f"{n}/param"] = True
    flags = {n: int(n in FROZEN) for n in list(PARAMS) + list(BUFFERS)}
    torch.save({"atoms": atoms, "export": export, "frozen_flags": flags, "param_is_stored": stored,
                "groups": GROUPS},
               os.path.join(out, "truth.pt"))


def use_bench_model(gib):
    """A model of about `gib` GiB of checkpoint (ZeRO-2 bf16: 14 bytes per
    parameter over all files): square layers, no frozen / shared entries."""
    global PARAMS, FROZEN, GROUPS, BUFFERS, MODULE_ORDER
    per = 4096 * 4096
    n = max(1, round(gib * 2**30 / 14 / per))
    PARAMS = OrderedDict((f"layers.{i}.weight", (4096, 4096)) for i in range(n))
    PARAMS.update((f"layers.{i}.bias", (4096,)) for i in range(n))
    FROZEN = set()
    GROUPS = [[f"layers.{i}.weight" for i in range(n)], [f"layers.{i}.bias" for i in range(n)]]
    MODULE_ORDER = [k for i in range(n) for k in (f"layers.{i}.weight", f"layers.{i}.bias")]
    MODULE_ORDER += ["block.running", "block.count", "head.weight"]
    PARAMS["embed.weight"] = (11, 6)
    GROUPS[0].insert(0, "embed.weight")
    MODULE_ORDER.insert(0, "embed.weight")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--bench-gib", type=float, default=0,
                    help="one ZeRO-2 bf16 world-2 checkpoint of about this size (bench/)")
    a = ap.parse_args()
    if a.bench_gib > 0:
        use_bench_model(a.bench_gib)
        write_case(os.path.join(a.out, "z2_bf16_w2"), 2, 2, "bf16", truth=False)
        print(f"bench checkpoint in {a.out}/z2_bf16_w2")
        return
    cases = [(1, 3, "fp32"), (1, 8, "bf16"), (2, 3, "bf16"), (2, 8, "fp32"),
             (3, 3, "fp32"), (3, 8, "bf16"), (0, 3, "bf16"), (0, 8, "bf16"),
             (1, 3, "fp16"), (2, 8, "fp16"), (3, 3, "fp16")]
    for stage, world, dtype in cases:
        write_case(os.path.join(a.out, f"z{stage}_{dtype}_w{world}"), stage, world, dtype)
    # ZeRO-3 with several sub-groups per param group (a small sub_group_size).
    write_case(os.path.join(a.out, "z3_fp32_w3_subgroups"), 3, 3, "fp32", sub_group_size=20)
    cases.append((3, 3, "fp32"))
    # ZeRO 0 fp16: FP16_Optimizer (flat masters, FusedAdam's int step) and
    # FP16_UnfusedOptimizer (a master per param, torch Adam).
    write_case(os.path.join(a.out, "z0_fp16_w3"), 0, 3, "fp16")
    write_case(os.path.join(a.out, "z0_fp16_w2_unfused"), 0, 2, "fp16", unfused=True)
    cases += [(0, 3, "fp16"), (0, 2, "fp16")]
    # FusedAdam-style int step (7, while global_steps is 5).
    write_case(os.path.join(a.out, "z2_fp32_w3_intstep"), 2, 3, "fp32", int_step=7)
    cases.append((2, 3, "fp32"))
    print(f"{len(cases)} DeepSpeed checkpoints in {a.out}")


if __name__ == "__main__":
    main()
