#!/usr/bin/python3
"""Malformed DeepSpeed checkpoints for the sanitized reader test: real
DeepSpeed 0.14.5 fixtures with one entry broken each (wrong types, shapes,
sizes, counts, classes), saved with torch.save so the containers stay valid
and the damage reaches ucp's DeepSpeed reader. Writes OUT/<case>/ and
OUT/manifest.json ([{"case", "what", "file"}]); every case must be refused
with a ucp error naming "file", the one file damaged (never a crash)."""
import argparse
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools",
                                "stubs"))

TAG = "global_step2"


def model_name(stage, rank=0):
    return (f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt" if stage == 3
            else "mp_rank_00_model_states.pt")


def optim_name(bf16, rank):
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def cases():
    # (base fixture, stage, bf16, file ("model" | "optim0" | "optim1"), what, mutate(obj))
    z2 = ("ds0145_z2_fp32_w2_mlp", 2, False)
    z3 = ("ds0145_z3_bf16_w2_mlp", 3, True)
    z0 = ("ds0145_z0_fp32_w2_mlp", 0, False)
    bf = ("ds0145_z0_bf16_w2_mlp", 0, True)

    def setk(path, value):
        def f(o):
            d = o
            for k in path[:-1]:
                d = d[k]
            d[path[-1]] = value
        return f

    def delk(path):
        def f(o):
            d = o
            for k in path[:-1]:
                d = d[k]
            del d[path[-1]]
        return f

    osd = "optimizer_state_dict"
    yield z2, "model", "module is None", setk(["module"], None)
    yield z2, "model", "module is a list", setk(["module"], [1, 2])
    yield z2, "model", "module key not a str", setk(["module"], {1: torch.zeros(2)})
    yield z2, "model", "param_shapes not a list", setk(["param_shapes"], "x")
    yield z2, "model", "negative shape", setk(["param_shapes", 0, "fc1.weight"], (-1, 7))
    yield z2, "model", "shape of the wrong size", setk(["param_shapes", 0, "fc1.weight"], (13, 7, 2))
    yield z2, "model", "param missing from param_shapes", delk(["param_shapes", 0, "fc2.bias"])
    yield z2, "model", "dp_world_size 0", setk(["dp_world_size"], 0)
    yield z2, "model", "dp_world_size a str", setk(["dp_world_size"], "2")
    yield z2, "model", "dp_world_size 3", setk(["dp_world_size"], 3)
    yield z2, "model", "mp_world_size 2", setk(["mp_world_size"], 2)
    yield z2, "model", "buffer_names an int", setk(["buffer_names"], 5)
    yield z2, "model", "shared param to nothing", setk(["shared_params"], {"a": "nosuch"})
    yield z2, "model", "frozen param without fragment", setk(["frozen_param_shapes"], {"x": torch.Size([2])})
    yield z2, "optim0", "optimizer_state_dict None", setk([osd], None)
    yield z2, "optim0", "no base_optimizer_state", delk([osd, "base_optimizer_state"])
    yield z2, "optim0", "state a list", setk([osd, "base_optimizer_state", "state"], [])
    yield z2, "optim1", "exp_avg too short", setk([osd, "base_optimizer_state", "state", 0, "exp_avg"], torch.zeros(3))
    yield z2, "optim1", "exp_avg int64", setk([osd, "base_optimizer_state", "state", 0, "exp_avg"],
                                           torch.zeros(88, dtype=torch.int64))
    yield z2, "optim0", "no fp32 partitions", setk([osd, "single_partition_of_fp32_groups"], [])
    yield z2, "optim0", "fp32 partition a str", setk([osd, "single_partition_of_fp32_groups"], ["x"])
    yield z2, "optim1", "partition_count a str", setk([osd, "partition_count"], ["a"])
    yield z2, "optim1", "partition_count 3", setk([osd, "partition_count"], [3])
    yield z2, "optim0", "zero_stage a str", setk([osd, "zero_stage"], "gradients")
    yield z2, "optim0", "zero_stage 9", setk([osd, "zero_stage"], 9)
    yield z2, "optim0", "no param_groups", delk([osd, "base_optimizer_state", "param_groups"])
    yield z2, "optim1", "step a 1-d tensor", setk([osd, "base_optimizer_state", "state", 0, "step"], torch.zeros(2))
    yield z3, "optim1", "flat group too short", setk([osd, "fp32_flat_groups"], [torch.zeros(5)])
    yield z3, "optim0", "partition_count 4", setk([osd, "partition_count"], 4)
    yield z3, "optim0", "sub-group id out of range", setk([osd, osd, "param_groups", 0, "params"], [7])
    yield z3, "optim1", "exp_avg too long", setk([osd, osd, "state", 0, "exp_avg"], torch.zeros(200))
    yield z3, "model", "param_shapes empty", setk(["param_shapes"], [])
    yield z0, "model", "optimizer params beyond the module", setk(["optimizer", "param_groups", 0, "params"],
                                                                  [0, 1, 2, 3, 4, 5])
    yield z0, "model", "optimizer state a list", setk(["optimizer", "state"], [])
    yield z0, "model", "exp_avg of the wrong shape", setk(["optimizer", "state", 0, "exp_avg"], torch.zeros(3))
    yield bf, "optim1", "BF16 partition too short", setk([osd, "single_partition_of_fp32_groups"],
                                                         [torch.zeros(10)])
    # ZeRO 0 with fp16: the fp32 fixture's model states turned into what
    # FP16_Optimizer (fused) / FP16_UnfusedOptimizer save (fp16_states).
    f16 = ("ds0145_z0_fp32_w2_mlp", 0, False, "fused")
    unf = ("ds0145_z0_fp32_w2_mlp", 0, False, "unfused")
    opt = ["optimizer", osd]
    yield f16, "model", "flat master too short", setk(["optimizer", "fp32_groups_flat"],
                                                      [torch.zeros(40)])
    yield f16, "model", "flat master too long", setk(["optimizer", "fp32_groups_flat"],
                                                     [torch.zeros(400)])
    yield f16, "model", "flat master float16", setk(["optimizer", "fp32_groups_flat"],
                                                    [torch.zeros(174, dtype=torch.float16)])
    yield f16, "model", "flat masters a str", setk(["optimizer", "fp32_groups_flat"], "x")
    yield f16, "model", "two ids for one flat group", setk(opt + ["param_groups", 0, "params"], [0, 1])
    yield f16, "model", "exp_avg shorter than the master", setk(opt + ["state", 0, "exp_avg"],
                                                                torch.zeros(7))
    yield f16, "model", "module weight of another step", setk(["module", "fc2.weight"],
                                                              torch.ones(5, 13, dtype=torch.float16))
    yield f16, "model", "no optimizer_state_dict", delk(["optimizer", osd])
    yield unf, "model", "unfused master of another shape", setk(["optimizer", "fp32_groups", 0, 1],
                                                                torch.zeros(2, 2))
    yield unf, "model", "unfused group a tensor", setk(["optimizer", "fp32_groups", 0],
                                                       torch.zeros(3))
    yield unf, "model", "unfused state of another length", setk(opt + ["state", 2, "exp_avg_sq"],
                                                                torch.zeros(3))


def fp16_states(obj, kind):
    """ZeRO 0 fp32 model states -> ZeRO 0 fp16: the module in fp16 (the
    masters rounded), the torch optimizer wrapped as FP16_Optimizer (one flat
    fp32 master per group, the inner state flat too) or FP16_UnfusedOptimizer
    (a master per param), no param_shapes, no shared_params."""
    opt = obj["optimizer"]
    names = list(obj["module"].keys())
    masters = [obj["module"][n].clone() for n in names]
    obj["module"] = type(obj["module"])((n, m.half()) for n, m in zip(names, masters))
    out = {"dynamic_loss_scale": True, "cur_scale": 1024.0, "cur_iter": 2,
           "last_overflow_iter": -1, "scale_factor": 2.0, "scale_window": 1000}
    if kind == "fused":
        state = opt["state"]
        inner = {"state": {0: {"step": state[0]["step"],
                               **{k: torch.cat([state[i][k].flatten() for i in range(len(names))])
                                  for k in ("exp_avg", "exp_avg_sq")}}},
                 "param_groups": [dict(opt["param_groups"][0], params=[0])]}
        out.update(optimizer_state_dict=inner,
                   fp32_groups_flat=[torch.cat([m.flatten() for m in masters])], clip_grad=1.0)
    else:
        out.update(optimizer_state_dict=opt, fp32_groups=[masters])
    obj.update(optimizer=out, param_shapes=None, shared_params=None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    manifest = []
    for i, item in enumerate(cases()):
        (base, stage, bf16, *fp16), which, what, mutate = item
        case = f"case{i:02d}"
        dst = os.path.join(a.out, case)
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(os.path.join(a.fixtures, "deepspeed-0.14.5", base), dst)
        name = model_name(stage) if which == "model" else optim_name(bf16, int(which[-1]))
        path = os.path.join(dst, TAG, name)
        obj = torch.load(path)
        if fp16:
            fp16_states(obj, fp16[0])
        mutate(obj)
        torch.save(obj, path)
        # "file": the damaged file, relative to OUT; the error must name it.
        manifest.append({"case": case, "what": f"{base}/{name}: {what}",
                         "file": f"{case}/{TAG}/{name}"})
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"{len(manifest)} malformed DeepSpeed checkpoints in {a.out}")


if __name__ == "__main__":
    main()
