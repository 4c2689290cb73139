#!/usr/bin/python3
"""Dumps the Megatron-LM 23.06 fixture (shared/fixtures/megatron-23.06) into
raw little-endian tensor files plus index.json, for megatron_fixture_test.cc.

  dump_megatron_fixture.py --fixtures <megatron-23.06 folder> --out <folder>

index.json:
  {"reference": [{"name": <canonical legacy name>, "shape": [...], "file": "r3.bin"}],
   "checkpoints": [{"dir": "synth_tp2", "variables": {...}, "tp": 2, "pp": 1,
                    "ranks": [{"dir": "mp_rank_01", "tp_rank": 1, "pp_rank": 0,
                               "tensors": [{"path": ["language_model", "encoder", "layers.0.x"],
                                            "shape": [...], "file": "t7.bin"}]}]}]}

The reference tensors are keyed by Megatron's converter message names
("transformer layer 0/qkv weight"); they are mapped to state-dict names here
the way Megatron 23.06's tools/checkpoint/saver_megatron.py assigns them.
Ranks come from the directory names (mp_rank_TT or mp_rank_TT_PPP). The
pickles reference megatron.* classes, which are stubbed.
"""
import argparse
import importlib.abc
import importlib.machinery
import json
import os
import re
import sys
import types

import torch


class _Meta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return name


class _Stub(metaclass=_Meta):
    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        self.__dict__["state"] = state


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _Meta(name, (_Stub,), {})
        setattr(self, name, cls)
        return cls


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] == "megatron":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Module(spec.name)

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())

LAYER_NAMES = {  # converter message -> legacy module path (Megatron 23.06)
    "input layernorm weight": "input_layernorm.weight",
    "input layernorm bias": "input_layernorm.bias",
    "post layernorm weight": "post_attention_layernorm.weight",
    "post layernorm bias": "post_attention_layernorm.bias",
    "qkv weight": "self_attention.query_key_value.weight",
    "qkv bias": "self_attention.query_key_value.bias",
    "dense weight": "self_attention.dense.weight",
    "dense bias": "self_attention.dense.bias",
    "mlp l0 weight": "mlp.dense_h_to_4h.weight",
    "mlp l0 bias": "mlp.dense_h_to_4h.bias",
    "mlp l1 weight": "mlp.dense_4h_to_h.weight",
    "mlp l1 bias": "mlp.dense_4h_to_h.bias",
}


def canonical(message):
    if message == "embeddings/word embeddings":
        return "language_model.embedding.word_embeddings.weight"
    if message == "embeddings/position embeddings":
        return "language_model.embedding.position_embeddings.weight"
    m = re.fullmatch(r"final layernorm/(weight|bias)", message)
    if m:
        return "language_model.encoder.final_layernorm." + m.group(1)
    m = re.fullmatch(r"transformer layer (\d+)/(.*)", message)
    if m:
        return f"language_model.encoder.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"
    raise SystemExit(f"unknown reference tensor {message!r}")


class Writer:
    def __init__(self, out):
        self.out = out
        self.count = 0

    def tensor(self, t):
        t = t.detach().contiguous().to(torch.float32)
        name = f"t{self.count}.bin"
        self.count += 1
        with open(os.path.join(self.out, name), "wb") as f:
            f.write(t.numpy().astype("<f4").tobytes())
        return name


def walk(obj, path, out):
    if isinstance(obj, dict):
        for k, v in obj.items():
            walk(v, path + [k], out)
    elif isinstance(obj, torch.Tensor):
        out.append((path, obj))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    w = Writer(args.out)
    index = {"reference": [], "checkpoints": []}
    ref = torch.load(os.path.join(args.fixtures, "synth_full_reference.pt"), map_location="cpu")
    for message, t in ref.items():
        index["reference"].append(dict(name=canonical(message), shape=list(t.shape),
                                       file=w.tensor(t)))
    for ckpt in ("synth_tp2", "from_tp2_to_tp1_pp2"):
        root = os.path.join(args.fixtures, ckpt)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt")) as f:
            it = f.read().strip()
        iter_dir = os.path.join(root, "release" if it == "release" else f"iter_{int(it):07d}")
        entry = dict(dir=ckpt, ranks=[])
        for d in sorted(os.listdir(iter_dir)):
            m = re.fullmatch(r"mp_rank_(\d\d)(?:_(\d\d\d))?", d)
            sd = torch.load(os.path.join(iter_dir, d, "model_optim_rng.pt"), map_location="cpu")
            a = sd["args"]
            tensors = []
            walk(sd["model"], [], tensors)
            entry["ranks"].append(dict(
                dir=d, tp_rank=int(m.group(1)), pp_rank=int(m.group(2) or 0),
                tensors=[dict(path=p, shape=list(t.shape), file=w.tensor(t)) for p, t in tensors]))
            entry["tp"] = a.tensor_model_parallel_size
            entry["pp"] = a.pipeline_model_parallel_size
            assert a.tokenizer_type == "NullTokenizer", a.tokenizer_type
            entry["variables"] = dict(
                num_layers=a.num_layers, hidden_size=a.hidden_size,
                num_attention_heads=a.num_attention_heads,
                num_query_groups=getattr(a, "num_query_groups", None) or a.num_attention_heads,
                ffn_hidden_size=a.ffn_hidden_size,
                # NullTokenizer: vocab_size ids plus the end-of-document id.
                vocab_size=a.vocab_size + 1,
                padded_vocab_size=a.padded_vocab_size,
                make_vocab_size_divisible_by=a.make_vocab_size_divisible_by,
                swiglu=int(bool(getattr(a, "swiglu", False))),
                tied=int(not a.untie_embeddings_and_output_weights),
                add_bias_linear=int(getattr(a, "add_bias_linear", True)))
        index["checkpoints"].append(entry)
    with open(os.path.join(args.out, "index.json"), "w") as f:
        json.dump(index, f, indent=1)


if __name__ == "__main__":
    main()
