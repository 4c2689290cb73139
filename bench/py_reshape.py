#!/usr/bin/python3
"""Python baseline for bench/megatron_bench.py: the same reshape as ucp, done the
way Python tools do it with torch.load / torch.save.

  py_reshape.py VARIANT_DIR SRC_TOPOLOGY TARGET_TOPOLOGY OUT_DIR [--scale bench4g|none]

Loads every rank file of VARIANT_DIR/SRC_TOPOLOGY (torch.load), reassembles the
full tensors of every parameter and state kind (the generator's independent
reassembly: TP merge, distributed-optimizer world tensors), and writes
TARGET_TOPOLOGY with torch.save (the generator's own writer). Padding rows the
source lacks are zeros, as in ucp.
"""
import argparse
import os
import sys

import torch

TOOLS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "tools")
sys.path.insert(0, TOOLS)
sys.path.insert(0, os.path.join(TOOLS, "stubs"))
import make_megatron_ckpts as G  # noqa: E402
import megatron_spec as S  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant_dir")
    ap.add_argument("src")
    ap.add_argument("target")
    ap.add_argument("out")
    ap.add_argument("--scale", default="bench4g")
    ap.add_argument("--variant", default="gqa_swiglu_bias_untied")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = S.with_version(S.VARIANTS[a.variant], "0.13")
    if a.scale != "none":
        cfg = S.scaled_config(cfg, G.SCALE_PRESETS[a.scale])
    full = G.reassemble(cfg, os.path.join(a.variant_dir, a.src))
    truth = G.Truth(cfg, cache=True)
    v = cfg.vocab_size
    for name, kinds in full.items():
        if "#copy" in name:
            continue
        spec = truth.specs[name]
        for kind, t in kinds.items():
            if spec.vocab:
                truth._full[(name, kind)] = t[:v]
                pad = torch.zeros((S.pad_rows(cfg),) + tuple(t.shape[1:]), dtype=t.dtype)
                pad[: t.shape[0] - v] = t[v:]
                truth._pad[(name, kind)] = pad
            else:
                truth._full[(name, kind)] = t
    del full
    G.write_topology(truth, S.parse_topology(a.target), a.out)


if __name__ == "__main__":
    main()
