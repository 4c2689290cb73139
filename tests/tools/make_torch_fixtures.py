#!/usr/bin/python3
"""Writes small torch.save files plus their Description JSON (see notes/HELPERS.md).

Usage:
  make_torch_fixtures.py --out DIR [--only NAME ...]   writes DIR/<name>.pt + DIR/<name>.expected.json
                                                       (+ DIR/index.json when all are generated)
  make_torch_fixtures.py --list                        prints the fixture names and what each covers
  make_torch_fixtures.py --self-test                   generates into a temp dir and checks everything

Every file is verified while it is generated; a failed check aborts with an error:
  * the description computed through torch.load (torchdesc.describe) must equal the one computed
    without torch (torchdesc.describe_raw: own unpickler + bytes gathered from the records);
  * it must also match the description of the in-memory object that was saved (paths, dtypes, shapes,
    strides, offsets, requires_grad, Parameter-ness, sha256, leaves, object classes, storage sizes,
    device tags) and storage sharing must be preserved (same storage in memory <=> same storage_key);
  * per-file facts (archive prefix, LONG_BINPUT, STACK_GLOBAL, deflated/unaligned records, ...).
--self-test additionally regenerates everything to check determinism and checks that the comparison
itself detects altered descriptions.

Output is deterministic (fixed seeds, fixed zip timestamps) except the storage keys of the legacy-format
files, which torch derives from memory addresses.

Classes from Megatron and DeepSpeed are defined in memory (modules registered in ``sys.modules`` only
when the real package is not importable) so that the pickles reference their real module paths.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import enum
import importlib.util
import io
import math
import os
import pickletools
import random
import struct
import sys
import tempfile
import time
import types
import zipfile
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchdesc  # noqa: E402

# ----------------------------------------------------------------------------------------------------
# In-memory stand-ins for framework classes (pickled by their real module paths)


def _install_module(name: str, **attrs: Any) -> types.ModuleType:
    """Registers (or extends) module `name` and its parents in sys.modules."""
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sub = ".".join(parts[:i])
        if sub not in sys.modules:
            module = types.ModuleType(sub)
            module.__path__ = []  # a package, so children import
            sys.modules[sub] = module
            if i > 1:
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
    module = sys.modules[name]
    for key, value in attrs.items():
        value.__module__, value.__qualname__ = name, key
        setattr(module, key, value)
    return module


def _install_framework_stand_ins() -> None:
    """Defines megatron.core.enums.ModelType and the DeepSpeed classes met in checkpoints."""
    if importlib.util.find_spec("megatron") is None and "megatron.core.enums" not in sys.modules:
        class ModelType(enum.Enum):
            encoder_or_decoder = 1
            encoder_and_decoder = 2
            retro_encoder = 3
            retro_decoder = 4
        _install_module("megatron.core.enums", ModelType=ModelType)

    if importlib.util.find_spec("deepspeed") is None and "deepspeed.runtime.zero.config" not in sys.modules:
        class ZeroStageEnum(int, enum.Enum):
            disabled = 0
            optimizer_states = 1
            gradients = 2
            weights = 3
            max_stage = 3

        class LossScaler:
            def __init__(self, scale: float) -> None:
                self.cur_scale = scale
                self.dynamic = False

        @dataclasses.dataclass
        class fragment_address:  # noqa: N801 (DeepSpeed's name)
            numel: int
            start: int

        _install_module("deepspeed.runtime.zero.config", ZeroStageEnum=ZeroStageEnum)
        _install_module("deepspeed.runtime.fp16.loss_scaler", LossScaler=LossScaler)
        _install_module("deepspeed.utils.tensor_fragment", fragment_address=fragment_address)


# ----------------------------------------------------------------------------------------------------
# Fake device tags: storages whose data_ptr is listed here are tagged e.g. 'cuda:0' by torch.save.

_FAKE_LOCATIONS: Dict[int, str] = {}


def _fake_location_tag(storage: Any) -> Optional[str]:
    return _FAKE_LOCATIONS.get(storage.data_ptr()) if _FAKE_LOCATIONS else None


def _no_restore(storage: Any, location: str) -> None:
    return None  # never claims a storage: loading falls through to torch's own deserializers


torch.serialization.register_package(1, _fake_location_tag, _no_restore)

# ----------------------------------------------------------------------------------------------------
# Fixture definitions


@dataclasses.dataclass
class Fixture:
    name: str
    covers: str
    build: Callable[[], Any]
    write: str = "save"  # save | legacy | protocol4 | buffer | rezip_deflated | rezip_stored | fake_cuda
    check: Optional[Callable[[str, Dict[str, Any]], None]] = None


def _seed(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def build_dtypes() -> Any:
    g = _seed(1)
    inf, nan = math.inf, math.nan
    d = collections.OrderedDict()
    d["float64"] = torch.tensor([0.0, -0.0, 1.5, -2.25, inf, -inf, nan, 5e-324, 1.7976931348623157e308],
                                dtype=torch.float64)
    d["float32"] = torch.randn(3, 4, generator=g)
    d["float32_special"] = torch.tensor([-0.0, inf, -inf, nan, 1e-45, 3.4028234663852886e38])
    d["float16"] = torch.tensor([0.0, -0.0, 1.0, 65504.0, 6e-8, inf, nan, -2.5], dtype=torch.float16)
    d["bfloat16"] = torch.randn(2, 3, generator=g).to(torch.bfloat16)
    d["bfloat16_special"] = torch.tensor([-0.0, inf, -inf, nan, 1e-40, 3.0e38], dtype=torch.bfloat16)
    d["int64"] = torch.tensor([-(2 ** 63), 2 ** 63 - 1, 0, -1, 123456789012], dtype=torch.int64)
    d["int32"] = torch.tensor([[-(2 ** 31), 2 ** 31 - 1], [7, -7]], dtype=torch.int32)
    d["int16"] = torch.tensor([-(2 ** 15), 2 ** 15 - 1, 3], dtype=torch.int16)
    d["int8"] = torch.tensor([-128, 127, 0, -1], dtype=torch.int8)
    d["uint8"] = torch.tensor([0, 255, 128, 1], dtype=torch.uint8)
    d["bool"] = torch.tensor([[True, False, True], [False, False, True]])
    d["complex64"] = torch.tensor([1 + 2j, -0.5 - 0j, complex(nan, inf)], dtype=torch.complex64)
    d["complex128"] = torch.tensor([[3 - 4j, 1e-300 + 1e300j]], dtype=torch.complex128)
    d["scalar_float32"] = torch.tensor(3.5)
    d["scalar_int64"] = torch.tensor(-7)
    d["scalar_bfloat16"] = torch.tensor(-1.25, dtype=torch.bfloat16)
    d["scalar_bool"] = torch.tensor(True)
    d["empty_float32_0x4"] = torch.zeros(0, 4)
    d["empty_int64_0"] = torch.zeros(0, dtype=torch.int64)
    d["empty_bfloat16_3x0"] = torch.zeros(3, 0, dtype=torch.bfloat16)
    d["empty_complex64_0"] = torch.zeros(0, dtype=torch.complex64)
    return d


def build_views() -> Any:
    g = _seed(2)
    base = torch.randn(24, generator=g)
    matrix = base[:12].view(3, 4)
    bf = torch.randn(4, 6, generator=g).to(torch.bfloat16)
    half = torch.randn(10, generator=g).to(torch.float16)
    alias = base[4:8]
    d = collections.OrderedDict()
    d["base"] = base
    d["row1"] = base[4:8]                     # offset 4
    d["block"] = base[2:14].view(3, 4)        # offset 2, view
    d["transposed"] = matrix.t()              # stride (1, 4)
    d["every_other"] = base[1::2]             # stride 2, offset 1
    d["expanded"] = base[5:6].view(1, 1).expand(4, 3)  # stride (0, 0)
    d["column"] = matrix[:, 2]                # stride 4, offset 2
    d["bf16_base"] = bf
    d["bf16_rows"] = bf[1:3]                  # offset 6
    d["bf16_column"] = bf[:, 2]               # stride 6, offset 2
    d["bf16_transposed"] = bf.t()
    d["bf16_step2"] = bf.view(-1)[3::2]
    d["fp16_step3"] = half[1::3]              # fp16 view without its base
    d["fp16_view"] = half[2:8].view(2, 3)
    d["alias_a"] = alias                      # the same tensor object twice
    d["alias_b"] = alias
    d["alias_in_list"] = [alias, base[4:8]]   # same object, then a distinct view of the same elements
    return d


def build_lonely_view() -> Any:
    g = _seed(3)
    big = torch.randn(100, generator=g)
    bf = torch.randn(40, generator=g).to(torch.bfloat16)
    return {"tail_view": big[90:], "matrix_view": big[10:30].view(4, 5),
            "bf16_middle": bf[17:23], "fp32_scalar_view": big[42]}


def build_params() -> Any:
    g = _seed(4)
    linear = nn.Linear(3, 2)
    norm = nn.BatchNorm1d(3)
    base = torch.randn(8, generator=g)
    leaf = torch.randn(2, 2, generator=g).requires_grad_(True)
    d = collections.OrderedDict()
    d["param"] = nn.Parameter(torch.randn(2, 3, generator=g))
    d["param_frozen"] = nn.Parameter(torch.randn(3, generator=g), requires_grad=False)
    d["param_bf16"] = nn.Parameter(torch.randn(2, 2, generator=g).to(torch.bfloat16))
    d["param_view_base"] = base
    d["param_view"] = nn.Parameter(base[2:6])  # a Parameter over part of another tensor's storage
    d["tensor_requires_grad"] = leaf
    d["linear_state_dict"] = linear.state_dict()
    d["linear_params_keep_vars"] = linear.state_dict(keep_vars=True)
    d["batchnorm_state_dict"] = norm.state_dict()
    return d


def build_fake_cuda() -> Any:
    g = _seed(5)
    w = torch.randn(4, 4, generator=g)
    bf = torch.randn(6, generator=g).to(torch.bfloat16)
    other = torch.arange(5, dtype=torch.int64)
    _FAKE_LOCATIONS.update({w.data_ptr(): "cuda:0", bf.data_ptr(): "cuda:0", other.data_ptr(): "cuda:1"})
    return {"weight": w, "weight_rows": w[1:3], "bf16": bf, "step": other, "cpu_tensor": torch.ones(2)}


# --- Megatron ---------------------------------------------------------------------------------------


class _CoreAttention(nn.Module):
    """Carries Transformer-Engine-style ``_extra_state`` (an io.BytesIO)."""

    def get_extra_state(self) -> Any:
        state = io.BytesIO()
        torch.save({"fp8_meta": None, "amax_history_len": 16}, state)  # TE < 2.0 does exactly this
        return state

    def set_extra_state(self, state: Any) -> None:
        pass


class _SelfAttention(nn.Module):
    def __init__(self, hidden: int, tp: int) -> None:
        super().__init__()
        self.query_key_value = nn.Linear(hidden, 3 * hidden // tp)
        self.core_attention = _CoreAttention()
        self.dense = nn.Linear(hidden // tp, hidden)


class _MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, tp: int) -> None:
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, ffn // tp)
        self.dense_4h_to_h = nn.Linear(ffn // tp, hidden)


class _Layer(nn.Module):
    def __init__(self, hidden: int, ffn: int, tp: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = _SelfAttention(hidden, tp)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.mlp = _MLP(hidden, ffn, tp)


class _Encoder(nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, tp: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer(hidden, ffn, tp) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)


class _Embedding(nn.Module):
    def __init__(self, vocab: int, seq: int, hidden: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)


class _LanguageModel(nn.Module):
    def __init__(self, vocab: int, seq: int, layers: int, hidden: int, ffn: int, tp: int) -> None:
        super().__init__()
        self.embedding = _Embedding(vocab // tp, seq, hidden)
        self.encoder = _Encoder(layers, hidden, ffn, tp)


class _GPT(nn.Module):
    def __init__(self, **kw: int) -> None:
        super().__init__()
        self.language_model = _LanguageModel(**kw)


def _megatron_args(model_type: Any) -> argparse.Namespace:
    return argparse.Namespace(
        num_layers=2, hidden_size=16, ffn_hidden_size=64, num_attention_heads=4, kv_channels=4,
        max_position_embeddings=8, seq_length=8, padded_vocab_size=64, make_vocab_size_divisible_by=32,
        tensor_model_parallel_size=2, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, data_parallel_size=1, world_size=2, rank=0,
        micro_batch_size=2, global_batch_size=4, train_iters=100, lr=3e-4, min_lr=3e-5,
        lr_decay_style="cosine", weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
        clip_grad=1.0, bf16=True, fp16=False, params_dtype=torch.bfloat16, model_type=model_type,
        tokenizer_type="NullTokenizer", vocab_size=63, data_path=["1.0", "/data/corpus_text_document"],
        split="969,30,1", save="/checkpoints/gpt", load=None, position_embedding_type="learned_absolute",
        untie_embeddings_and_output_weights=False, add_bias_linear=True, swiglu=False,
        use_distributed_optimizer=False, transformer_impl="local", consumed_train_samples=40,
        consumed_valid_samples=0, init_method_std=0.02, hidden_dropout=0.1, attention_dropout=0.1,
        seed=1234, iteration=10, rampup_batch_size=None, exit_interval=None)


def build_megatron_rank() -> Any:
    from megatron.core.enums import ModelType  # the in-memory stand-in unless Megatron is installed
    g = _seed(6)
    tp = 2
    model = _GPT(vocab=64, seq=8, layers=2, hidden=16, ffn=64, tp=tp)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model = model.to(torch.bfloat16)
    state = model.state_dict()  # OrderedDict with a _metadata attribute, incl. ..._extra_state (BytesIO)

    params = [(n, p) for n, p in model.named_parameters()]
    decay = [i for i, (n, _) in enumerate(params) if not n.endswith("bias") and "layernorm" not in n]
    no_decay = [i for i, (n, _) in enumerate(params) if i not in decay]
    groups = [decay, no_decay]
    masters = []
    for group in groups:  # fp32 master copies: views into one flat buffer per group
        flat = torch.cat([params[i][1].detach().float().reshape(-1) for i in group])
        views, offset = [], 0
        for i in group:
            shape = params[i][1].shape
            n = math.prod(shape)
            views.append(flat[offset:offset + n].view(shape))
            offset += n
        masters.append(views)
    order = decay + no_decay
    opt_state = {}
    for sid, i in enumerate(order):
        shape = params[i][1].shape
        opt_state[sid] = {
            "exp_avg": torch.randn(shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(shape, generator=g) * 1e-6,
            "step": torch.tensor(10.0) if sid % 2 == 0 else 10,  # torch Adam: tensor; older: int
        }
    base_group = {"lr": 2.9e-4, "betas": (0.9, 0.95), "eps": 1e-8, "amsgrad": False, "maximize": False,
                  "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                  "lr_mult": 1.0}
    param_groups = [dict(base_group, weight_decay=0.1, wd_mult=1.0, params=list(range(len(decay)))),
                    dict(base_group, weight_decay=0.0, wd_mult=0.0,
                         params=list(range(len(decay), len(order))))]

    random.seed(1234)
    np.random.seed(1234)
    torch.manual_seed(1234)
    cuda_rng = torch.tensor(list(range(16)), dtype=torch.uint8)  # stand-in for torch.cuda.get_rng_state()
    rng = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": cuda_rng,
        "rng_tracker_states": {"model-parallel-rng": cuda_rng.flip(0).clone()},
    }
    return {
        "args": _megatron_args(ModelType.encoder_or_decoder),
        "checkpoint_version": 3.0,
        "iteration": 10,
        "model": state,
        "optimizer": {
            "optimizer": {"state": opt_state, "param_groups": param_groups},
            "fp32_from_fp16_params": masters,
        },
        "opt_param_scheduler": {
            "max_lr": 3e-4, "lr_warmup_steps": 2, "num_steps": 40, "lr_decay_style": "cosine",
            "lr_decay_steps": 100, "min_lr": 3e-5, "start_wd": 0.1, "end_wd": 0.1,
            "wd_incr_style": "constant", "wd_incr_steps": 100,
        },
        "rng_state": [rng],
        "num_floating_point_operations_so_far": 123456789,
    }


# --- DeepSpeed --------------------------------------------------------------------------------------

_DS_CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
_DS_SHAPES = collections.OrderedDict([("fc1.weight", (5, 3)), ("fc1.bias", (5,)),
                                      ("fc2.weight", (2, 5)), ("fc2.bias", (2,))])


def build_deepspeed_model_states() -> Any:
    g = _seed(7)
    numel = sum(math.prod(s) for s in _DS_SHAPES.values())
    flat = torch.randn(numel, generator=g).to(torch.bfloat16)  # module params: views of one buffer
    module, offset = collections.OrderedDict(), 0
    for name, shape in _DS_SHAPES.items():
        module[name] = flat[offset:offset + math.prod(shape)].view(shape)
        offset += math.prod(shape)
    return {
        "module": module, "buffer_names": [], "optimizer": None,
        "param_shapes": [collections.OrderedDict((n, torch.Size(s)) for n, s in _DS_SHAPES.items())],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": None, "data_sampler": None, "random_ltd": None,
        "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 2, "global_samples": 8,
        "dp_world_size": 2, "mp_world_size": 1, "ds_config": _DS_CONFIG, "ds_version": "0.14.5",
    }


def build_deepspeed_optim_states() -> Any:
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    g = _seed(8)
    numel = sum(math.prod(s) for s in _DS_SHAPES.values())  # 32 -> rank 0 holds 16
    part = 16
    mappings, offset = collections.OrderedDict(), 0
    for name, shape in _DS_SHAPES.items():
        n = math.prod(shape)
        lo, hi = max(offset, 0), min(offset + n, part)
        if lo < hi:
            mappings[name] = fragment_address(numel=hi - lo, start=lo)
        offset += n
    assert offset == numel
    return {
        "optimizer_state_dict": {
            "loss_scaler": LossScaler(1.0), "dynamic_loss_scale": False, "overflow": False,
            "clip_grad": 0.0,
            "base_optimizer_state": {
                "state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.randn(part, generator=g),
                              "exp_avg_sq": torch.rand(part, generator=g)}},
                "param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                  "amsgrad": False, "foreach": None, "maximize": False,
                                  "capturable": False, "params": [0]}]},
            "single_partition_of_fp32_groups": [torch.randn(part, generator=g)],
            "zero_stage": ZeroStageEnum.gradients, "group_paddings": [0], "partition_count": [2],
            "ds_version": "0.14.5", "param_slice_mappings": [mappings],
        },
        "ds_config": _DS_CONFIG, "ds_version": "0.14.5",
    }


# --- containers, scalars, objects -------------------------------------------------------------------


def build_nested() -> Any:
    g = _seed(9)
    t = torch.randn(2, 2, generator=g)
    shared_list = [1, "shared"]
    inner = collections.OrderedDict([("b", 2), ("a", [torch.arange(3, dtype=torch.int32)])])
    return {
        "list": [t, 1, 2.5, "str", None, True, False],
        "tuple": (torch.ones(3, dtype=torch.float16), (3, 4), ()),
        "dict_int_keys": {0: torch.zeros(1), 1: "one", -5: "minus five", 2 ** 40: "big key"},
        "same_tensor_twice": [t, t],
        "same_list_twice": [shared_list, shared_list],
        "ordered_in_plain": inner,
        "empty": {"dict": {}, "list": [], "tuple": (), "od": collections.OrderedDict()},
        "bytes": b"\x00\x01\xff",
        "bytes_empty": b"",
        "bytes_long": bytes(range(256)) * 2,
        "floats": [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, 1.7976931348623157e308, 0.1],
        "ints": [0, -1, 255, 256, 65535, 65536, 2 ** 31 - 1, 2 ** 31, -(2 ** 31) - 1, 2 ** 40,
                 2 ** 63 - 1, 2 ** 63, -(2 ** 63), 2 ** 100, -(2 ** 100)],
        "strings": ["", "h\u00e9llo \u2713", "tab\tnew\nline", "\U0001F600", "x" * 300],
        "bools": (True, False),
        "none": None,
        "objects": [torch.Size([2, 3]), torch.float32, torch.bfloat16, torch.int64, {1, 2, 3},
                    frozenset({"a"}), np.arange(6, dtype=np.float32).reshape(2, 3),
                    np.float64(1.5), io.BytesIO(b"payload"), argparse.Namespace(a=1, b=[torch.ones(1)]),
                    types.SimpleNamespace(x=1), torch.device("cpu"), collections.Counter("aab")],
    }


def build_many_tensors() -> Any:
    _seed(10)
    d = {f"t{i:03d}": torch.tensor([float(i), i + 0.5]) for i in range(320)}
    d["again"] = [d["t300"], d["t310"]]  # memo references > 255: LONG_BINGET
    return d


def build_small_mixed() -> Any:
    """Content shared by the container-variant files (protocol 4, dotted name, buffer, re-zipped)."""
    g = _seed(11)
    base = torch.randn(12, generator=g)
    return collections.OrderedDict([
        ("weight", torch.randn(3, 4, generator=g)),
        ("bf16", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("view", base[3:9].view(2, 3)),
        ("base", base),
        ("step", torch.tensor(7)),
        ("args", argparse.Namespace(lr=0.1, name="small", dtype=torch.float16)),
        ("meta", {"epoch": 3, "tags": ("a", "b"), "raw": b"\x01\x02"}),
    ])


def build_legacy_views() -> Any:
    d = build_views()
    d["param"] = nn.Parameter(torch.randn(2, 2, generator=_seed(12)))
    d["args"] = argparse.Namespace(lr=0.5)
    return d


# --- per-file checks --------------------------------------------------------------------------------


def _opcodes(desc_path: str) -> set:
    archive = torchdesc.inspect_archive(desc_path)
    return {op.name for op, _, _ in pickletools.genops(archive.pickle)}


def _local_data_offsets(path: str) -> Dict[str, int]:
    offsets = {}
    with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
        for info in zf.infolist():
            f.seek(info.header_offset)
            header = f.read(30)
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            offsets[info.filename] = info.header_offset + 30 + name_len + extra_len
    return offsets


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_aligned(path: str, desc: Dict[str, Any]) -> None:
    offsets = _local_data_offsets(path)
    bad = [n for n, o in offsets.items() if "/data/" in n and o % torchdesc.ZIP_ALIGNMENT]
    _expect(not bad, f"records not 64-byte aligned: {bad}")
    _expect(desc["records"][-1] == "version" and desc["records"][0] == "data.pkl",
            f"unexpected record order {desc['records']}")


def check_many(path: str, desc: Dict[str, Any]) -> None:
    check_aligned(path, desc)
    _expect({"LONG_BINPUT", "LONG_BINGET"} <= _opcodes(path), "memo did not exceed 255 entries")
    _expect(len(desc["tensors"]) > 300, "fewer than 300 tensors")


def check_protocol4(path: str, desc: Dict[str, Any]) -> None:
    check_aligned(path, desc)
    ops = _opcodes(path)
    _expect({"FRAME", "MEMOIZE", "STACK_GLOBAL", "SHORT_BINUNICODE"} <= ops,
            f"not a protocol-4 pickle: {ops}")


def check_prefix(expected: str) -> Callable[[str, Dict[str, Any]], None]:
    def check(path: str, desc: Dict[str, Any]) -> None:
        check_aligned(path, desc)
        _expect(desc["archive_name"] == expected, f"archive_name {desc['archive_name']!r} != {expected!r}")
    return check


def check_deflated(path: str, desc: Dict[str, Any]) -> None:
    with zipfile.ZipFile(path) as zf:
        methods = {i.filename: i.compress_type for i in zf.infolist()}
    _expect(any(m == zipfile.ZIP_DEFLATED for n, m in methods.items() if "/data/" in n),
            f"no deflated data record: {methods}")


def check_unaligned(path: str, desc: Dict[str, Any]) -> None:
    offsets = _local_data_offsets(path)
    _expect(any(o % torchdesc.ZIP_ALIGNMENT for n, o in offsets.items() if "/data/" in n),
            "all data records happen to be aligned")


def check_fake_cuda(path: str, desc: Dict[str, Any]) -> None:
    check_aligned(path, desc)
    devices = {t["path"][0]: t["device"] for t in desc["tensors"]}
    _expect(devices == {"weight": "cuda:0", "weight_rows": "cuda:0", "bf16": "cuda:0", "step": "cuda:1",
                        "cpu_tensor": "cpu"}, f"device tags {devices}")


def check_legacy(path: str, desc: Dict[str, Any]) -> None:
    _expect(desc["format"] == "legacy" and "records" not in desc, "not a legacy file")


def check_megatron(path: str, desc: Dict[str, Any]) -> None:
    check_aligned(path, desc)
    for name in ("argparse.Namespace", "megatron.core.enums.ModelType", "torch.bfloat16", "_io.BytesIO",
                 "numpy.core.multiarray._reconstruct", "__builtin__.getattr", "torch.BFloat16Storage"):
        _expect(name in desc["globals"], f"{name} not referenced")
    with zipfile.ZipFile(path) as zf:
        data = zf.read(f"{desc['archive_name']}/data.pkl")
    _expect(b"_metadata" in data, "state dict _metadata attribute missing")


FIXTURES: List[Fixture] = [
    Fixture("dtypes", "every dtype torch 1.13 saves (float64/32/16, bfloat16, int64/32/16/8, uint8, bool, "
            "complex64/128) with special values (nan, +-inf, -0.0, subnormals, extremes), 0-d and empty "
            "tensors", build_dtypes, check=check_aligned),
    Fixture("views", "views sharing storages in fp32/bf16/fp16: slices with offsets, view(), transposes, "
            "step-2/3 slices, a column, stride-0 expand, the same tensor object twice", build_views,
            check=check_aligned),
    Fixture("lonely_view", "views saved without their base: the whole storage is written (fp32, bf16, "
            "0-d view)", build_lonely_view, check=check_aligned),
    Fixture("params", "nn.Parameter requires_grad True/False, bf16 Parameter, a Parameter viewing another "
            "tensor's storage, a plain tensor with requires_grad, Linear/BatchNorm state dicts (also "
            "keep_vars=True)", build_params, check=check_aligned),
    Fixture("fake_cuda", "storages tagged 'cuda:0'/'cuda:1' as if saved from a GPU (loads with "
            "map_location='cpu')", build_fake_cuda, write="fake_cuda", check=check_fake_cuda),
    Fixture("megatron_rank", "Megatron model_optim_rng.pt: args Namespace (bf16 dtype, ModelType enum), "
            "checkpoint_version 3.0, bf16 state dict with _metadata and BytesIO _extra_state, optimizer "
            "(int-keyed state, tensor and int step, param_groups, fp32_from_fp16_params views), "
            "opt_param_scheduler, rng_state (random/numpy/torch/cuda)", build_megatron_rank,
            check=check_megatron),
    Fixture("deepspeed_model_states", "DeepSpeed mp_rank_00_model_states.pt style: module params as views "
            "of one bf16 buffer, param_shapes with torch.Size, set()", build_deepspeed_model_states,
            check=check_aligned),
    Fixture("deepspeed_optim_states", "DeepSpeed ZeRO-2 optim states style: LossScaler object, "
            "ZeroStageEnum (getattr form), fragment_address dataclasses", build_deepspeed_optim_states,
            check=check_aligned),
    Fixture("nested", "list, tuple, int-keyed dict (incl. negative and 2**40 keys), shared tensor and "
            "shared list, empty containers, bytes, None, bools, float specials, ints up to 2**100, "
            "unicode, objects (Size, dtypes, set, frozenset, numpy, BytesIO, Namespace, ...)",
            build_nested, check=check_aligned),
    Fixture("many_tensors", "320 tensors: pickle memo > 255 (LONG_BINPUT/LONG_BINGET), 320 records",
            build_many_tensors, check=check_many),
    Fixture("protocol4", "torch.save(pickle_protocol=4): FRAME, MEMOIZE, SHORT_BINUNICODE, STACK_GLOBAL",
            build_small_mixed, write="protocol4", check=check_protocol4),
    Fixture("model.v1", "dotted file name: archive prefix 'model.v1'", build_small_mixed,
            check=check_prefix("model.v1")),
    Fixture("buffer_saved", "saved to io.BytesIO then written to disk: archive prefix 'archive'",
            build_small_mixed, write="buffer", check=check_prefix("archive")),
    Fixture("rezip_deflated", "re-zipped by Python zipfile with ZIP_DEFLATED records (loads in torch; no "
            "alignment)", build_small_mixed, write="rezip_deflated", check=check_deflated),
    Fixture("rezip_stored", "re-zipped by Python zipfile, ZIP_STORED, data not 64-byte aligned",
            build_small_mixed, write="rezip_stored", check=check_unaligned),
    Fixture("legacy_dtypes", "legacy (_use_new_zipfile_serialization=False) stream with every dtype, 0-d "
            "and empty tensors", build_dtypes, write="legacy", check=check_legacy),
    Fixture("legacy_views", "legacy stream with views, shared storages, a Parameter, a Namespace",
            build_legacy_views, write="legacy", check=check_legacy),
]
FIXTURES_BY_NAME = {f.name: f for f in FIXTURES}

# ----------------------------------------------------------------------------------------------------
# Writing and verification

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def _rezip(src: str, dst: str, method: int) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            entry = zipfile.ZipInfo(info.filename, date_time=_ZIP_TIME)
            entry.compress_type = method
            zout.writestr(entry, zin.read(info.filename))


def write_fixture(fixture: Fixture, obj: Any, path: str) -> None:
    """Saves `obj` to `path` the way `fixture.write` says."""
    kind = fixture.write
    if kind in ("save", "fake_cuda"):
        try:
            torch.save(obj, path)
        finally:
            _FAKE_LOCATIONS.clear()
    elif kind == "legacy":
        torch.save(obj, path, _use_new_zipfile_serialization=False)
    elif kind == "protocol4":
        torch.save(obj, path, pickle_protocol=4)
    elif kind == "buffer":
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        with open(path, "wb") as f:
            f.write(buffer.getvalue())
    elif kind in ("rezip_deflated", "rezip_stored"):
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, os.path.basename(path))  # same basename -> same archive prefix
            torch.save(obj, src)
            _rezip(src, path, zipfile.ZIP_DEFLATED if kind == "rezip_deflated" else zipfile.ZIP_STORED)
    else:
        raise ValueError(f"unknown write kind {kind}")


def _storage_identity(t: torch.Tensor) -> int:
    return t.storage()._storage._cdata


def describe_memory(obj: Any, devices: Dict[int, str]) -> Dict[str, Any]:
    """Description of an in-memory object (no storage keys: identities are checked separately)."""
    tensors, leaves, objects = [], [], []
    for where, value in torchdesc.walk(obj):
        if isinstance(value, torch.Tensor):
            tensors.append({
                "path": where, "dtype": torchdesc.dtype_name(value.dtype), "shape": list(value.shape),
                "stride": list(value.stride()), "storage_offset": value.storage_offset(),
                "storage_nbytes": value.storage().nbytes(),
                "device": devices.get(value.storage().data_ptr(), "cpu"),
                "requires_grad": bool(value.requires_grad),
                "is_parameter": isinstance(value, nn.Parameter),
                "sha256": torchdesc.sha256_hex(torchdesc.tensor_bytes(value)),
                "_storage": _storage_identity(value),
            })
        elif type(value) in torchdesc.LEAF_TYPES:
            leaves.append({"path": where, "type": torchdesc.LEAF_TYPES[type(value)], "repr": repr(value)})
        else:
            objects.append({"path": where, "class": torchdesc.class_name(value)})
    return {"top_type": torchdesc.top_type_name(obj), "tensors": tensors, "leaves": leaves, "objects": objects}


def verify(path: str, desc: Dict[str, Any], memory: Dict[str, Any]) -> None:
    """Raises AssertionError if the file's description disagrees with the raw reader or the source."""
    raw = torchdesc.describe_raw(path)
    diff = torchdesc.first_difference(desc, raw)
    _expect(diff is None, f"torch.load and raw descriptions differ: {diff}")
    file_tensors = [{k: v for k, v in t.items() if k != "storage_key"} for t in desc["tensors"]]
    mem_tensors = [{k: v for k, v in t.items() if k != "_storage"} for t in memory["tensors"]]
    diff = torchdesc.first_difference(dict(memory, tensors=mem_tensors), dict(desc, tensors=file_tensors),
                                      ("top_type", "tensors", "leaves", "objects"))
    _expect(diff is None, f"file differs from the saved object: {diff}")
    by_identity: Dict[int, str] = {}
    by_key: Dict[str, int] = {}
    for mem, ours in zip(memory["tensors"], desc["tensors"]):
        key, ident = ours["storage_key"], mem["_storage"]
        _expect(by_identity.setdefault(ident, key) == key and by_key.setdefault(key, ident) == ident,
                f"storage sharing not preserved at {ours['path']}")


def generate(out: str, names: List[str], *, write_index: bool) -> Dict[str, Dict[str, Any]]:
    """Writes and verifies the fixtures `names` into `out`; returns their descriptions."""
    os.makedirs(out, exist_ok=True)
    descriptions = {}
    for name in names:
        fixture = FIXTURES_BY_NAME[name]
        path = os.path.join(out, f"{name}.pt")
        try:
            obj = fixture.build()
            devices = dict(_FAKE_LOCATIONS)
            memory = describe_memory(obj, devices)
            write_fixture(fixture, obj, path)
            desc = torchdesc.describe(path)
            verify(path, desc, memory)
            if fixture.check:
                fixture.check(path, desc)
        except Exception as e:
            raise RuntimeError(f"fixture {name}: {type(e).__name__}: {e}") from e
        torchdesc.write_json(desc, os.path.join(out, f"{name}.expected.json"))
        descriptions[name] = desc
    if write_index:
        torchdesc.write_json({f.name: {"file": f"{f.name}.pt", "expected": f"{f.name}.expected.json",
                                       "covers": f.covers} for f in FIXTURES},
                             os.path.join(out, "index.json"))
    return descriptions


# ----------------------------------------------------------------------------------------------------
# Self-test


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def self_test() -> None:
    start = time.time()
    names = [f.name for f in FIXTURES]
    with tempfile.TemporaryDirectory() as tmp:
        first, second = os.path.join(tmp, "a"), os.path.join(tmp, "b")
        descs = generate(first, names, write_index=True)
        generate(second, names, write_index=True)
        total = 0
        for name in names:  # determinism (legacy files embed memory addresses as storage keys)
            a, b = (_read(os.path.join(d, f"{name}.pt")) for d in (first, second))
            total += len(a)
            if not name.startswith("legacy"):
                _expect(a == b, f"{name}.pt is not deterministic")
                ja, jb = (_read(os.path.join(d, f"{name}.expected.json")) for d in (first, second))
                _expect(ja == jb, f"{name}.expected.json is not deterministic")
        _expect(total < 5 * 1024 * 1024, f"fixtures too large: {total} bytes")

        # The comparison must detect altered descriptions.
        views = descs["views"]
        for field, mutate in [
            ("sha256", lambda t: t.update(sha256="0" * 64)),
            ("stride", lambda t: t.update(stride=t["stride"][::-1] + [1])),
            ("storage_offset", lambda t: t.update(storage_offset=t["storage_offset"] + 1)),
            ("dtype", lambda t: t.update(dtype="float16")),
            ("path", lambda t: t.update(path=t["path"] + [0])),
        ]:
            altered = {**views, "tensors": [dict(t) for t in views["tensors"]]}
            mutate(altered["tensors"][2])
            _expect(torchdesc.first_difference(views, altered) is not None, f"altered {field} not detected")
        altered = dict(views, tensors=views["tensors"][:-1])
        _expect(torchdesc.first_difference(views, altered) is not None, "missing tensor not detected")

        # verify() must reject a file whose content differs from the saved object.
        fixture = FIXTURES_BY_NAME["views"]
        obj = fixture.build()
        memory = describe_memory(obj, {})
        obj["row1"].mul_(2)
        path = os.path.join(tmp, "tampered.pt")
        torch.save(obj, path)
        try:
            verify(path, torchdesc.describe(path), memory)
        except AssertionError:
            pass
        else:
            raise AssertionError("verify() accepted a file whose values differ from the described object")

        # The cuda-tagged file needs map_location: a plain torch.load must fail without CUDA.
        if not torch.cuda.is_available():
            try:
                torch.load(os.path.join(first, "fake_cuda.pt"))
            except RuntimeError:
                pass
            else:
                raise AssertionError("fake_cuda.pt loaded without map_location on a machine without CUDA")
    print(f"make_torch_fixtures self-test OK ({len(names)} fixtures, {total} bytes, "
          f"{time.time() - start:.1f} s)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="output folder")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="generate only these fixtures")
    parser.add_argument("--list", action="store_true", help="list fixture names and what they cover")
    parser.add_argument("--self-test", action="store_true", help="generate into a temp dir and check")
    args = parser.parse_args(argv)
    _install_framework_stand_ins()
    if args.list:
        for f in FIXTURES:
            print(f"{f.name}: {f.covers}")
        return 0
    if args.self_test:
        self_test()
        return 0
    if not args.out:
        parser.error("--out is required")
    names = args.only or [f.name for f in FIXTURES]
    unknown = [n for n in names if n not in FIXTURES_BY_NAME]
    if unknown:
        parser.error(f"unknown fixture(s) {unknown}; known: {sorted(FIXTURES_BY_NAME)}")
    generate(args.out, names, write_index=not args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
