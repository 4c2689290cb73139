#!/usr/bin/python3
"""A large DeepSpeed ZeRO-2 bf16 world-2 checkpoint for scale runs, written
one rank file at a time so that memory stays near the largest file, not the
model (tests/tools/make_deepspeed_ckpts.py holds the whole model: fine up to
a few GiB). Layout as DeepSpeed 0.14.5 writes it (one optimizer group of
square layers; reference/deepspeed.md 4.2): mp_rank_00_model_states.pt with
the bf16 module and param_shapes, and per rank the flat fp32 partition,
exp_avg, exp_avg_sq, padding and param_slice_mappings. Values are random:
this is for timing, not for truth.

  bench/make_big_deepspeed.py --out DIR --gib 16
"""
import argparse
import os
import sys
from collections import OrderedDict

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "tools", "stubs"))
from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: E402
from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: E402
from deepspeed.utils.tensor_fragment import fragment_address  # noqa: E402

SIDE = 4096
STEP = 10
WORLD = 2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gib", type=float, default=16.0)
    a = ap.parse_args()
    # 14 bytes per parameter over all files (bf16 weights + fp32 master + 2 moments).
    layers = max(1, round(a.gib * 2**30 / 14 / (SIDE * SIDE)))
    names = [f"layers.{i}.weight" for i in range(layers)]
    per = SIDE * SIDE
    N = per * layers
    Np = -(-N // (2 * WORLD)) * (2 * WORLD)
    ps = Np // WORLD
    tag = f"global_step{STEP}"
    tdir = os.path.join(a.out, tag)
    os.makedirs(tdir)
    with open(os.path.join(a.out, "latest"), "w") as f:
        f.write(tag)
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
           "bf16": {"enabled": True}}
    g = torch.Generator().manual_seed(7)
    module = OrderedDict((n, torch.randn((SIDE, SIDE), generator=g).to(torch.bfloat16))
                         for n in names)
    torch.save(OrderedDict([
        ("module", module), ("buffer_names", []), ("optimizer", None),
        ("param_shapes", [OrderedDict((n, torch.Size((SIDE, SIDE))) for n in names)]),
        ("frozen_param_shapes", OrderedDict()), ("shared_params", {}),
        ("frozen_param_fragments", OrderedDict()), ("lr_scheduler", None),
        ("data_sampler", None), ("random_ltd", None), ("sparse_tensor_module_names", set()),
        ("skipped_steps", 0), ("global_steps", STEP), ("global_samples", STEP * WORLD),
        ("dp_world_size", WORLD), ("mp_world_size", 1), ("ds_config", cfg),
        ("ds_version", "0.14.5")]), os.path.join(tdir, "mp_rank_00_model_states.pt"))
    del module
    hyper = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, amsgrad=False,
                 foreach=None, maximize=False, capturable=False)
    for r in range(WORLD):
        real = max(0, min(N, (r + 1) * ps) - r * ps)
        m, o = OrderedDict(), 0
        for n in names:
            b, e = max(o, r * ps), min(o + per, (r + 1) * ps)
            if b < e:
                m[n] = fragment_address(numel=e - b, start=b - r * ps)
            o += per
        state = {0: {"step": torch.tensor(float(STEP)),
                     "exp_avg": torch.randn(ps, generator=g) * 1e-2,
                     "exp_avg_sq": torch.rand(ps, generator=g) * 1e-4}}
        osd = OrderedDict([
            ("loss_scaler", LossScaler(1.0)), ("dynamic_loss_scale", False), ("overflow", False),
            ("clip_grad", 1.0),
            ("base_optimizer_state", {"state": state, "param_groups": [dict(hyper, params=[0])]}),
            ("single_partition_of_fp32_groups", [torch.randn(real, generator=g)]),
            ("zero_stage", ZeroStageEnum(2)), ("group_paddings", [ps - real]),
            ("partition_count", [WORLD]), ("ds_version", "0.14.5"),
            ("param_slice_mappings", [m])])
        torch.save({"optimizer_state_dict": osd, "ds_config": cfg, "ds_version": "0.14.5"},
                   os.path.join(tdir, f"bf16_zero_pp_rank_{r}_mp_rank_00_optim_states.pt"))
        del state, osd
    print(f"{layers} layers of {SIDE}x{SIDE} in {a.out}")


if __name__ == "__main__":
    main()
