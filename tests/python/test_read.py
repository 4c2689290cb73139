"""ucp.open / Checkpoint.read / read_into against independent readers.

Oracles: the tensors torch saved (dcp.save) and torch's own dcp_to_torch_save
of the DCP fixture; h5py on the universal file; DeepSpeed's own truth files
(safe_get_full_fp32_param / optimizer state, taken in the training process).
Each check counts what it compared and has a negative control (one changed
byte fails it).
"""

import os
import pathlib
import shutil
import sys
import threading
import time

import h5py
import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import ucp
from conftest import Compared, bits_equal, negative_control, torch_to_numpy

ROWS, COLS = 4096, 256  # the big tensor: 4 MiB of fp32


def _state_dict():
    g = torch.Generator().manual_seed(41)
    return {
        "big.weight": torch.randn(ROWS, COLS, generator=g),
        "small.weight": torch.randn(64, 96, generator=g).to(torch.bfloat16),
        "counts": torch.arange(1000, dtype=torch.int64) * 7,
        "vec": torch.randn(1000, generator=g, dtype=torch.float64),
        "scales.fp8": torch.randn(32, 16, generator=g).to(torch.float8_e4m3fn),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A DCP checkpoint torch wrote (single process) and its state dict."""
    root = tmp_path_factory.mktemp("dcp")
    sd = _state_dict()
    path = root / "step-3"
    dcp.save({k: v.clone() for k, v in sd.items()}, checkpoint_id=str(path))
    return path, sd


@pytest.fixture(scope="module")
def universal(saved, tmp_path_factory):
    """The universal file of the DCP checkpoint (ucp.to_universal)."""
    out = tmp_path_factory.mktemp("u") / "model.ucp.h5"
    summary = ucp.to_universal(saved[0], out)
    assert out.is_file() and summary, summary
    return out


def test_dcp_values_equal_torch(saved):
    path, sd = saved
    c = Compared()
    with ucp.open(path) as ckpt:
        assert ckpt.format == "dcp"
        assert ckpt.iteration == 3
        names = {p.name: p for p in ckpt.params()}
        assert set(names) == set(sd), sorted(names)
        for name, tensor in sd.items():
            p = names[name]
            assert p.shape == tuple(tensor.shape)
            assert p.dtype == str(tensor.dtype).removeprefix("torch.")
            got = ckpt.read(name)
            c.equal(got, torch_to_numpy(tensor), name)
        assert ckpt.read("small.weight").dtype.name == "bfloat16"
        assert ckpt.read("scales.fp8").dtype.name == "float8_e4m3fn"
    assert c.tensors == 5 and c.elements >= ROWS * COLS
    negative_control(torch_to_numpy(sd["vec"]))


def test_dcp_changed_byte_in_file_is_seen(saved, tmp_path):
    """Negative control through the file: one byte of `vec` flipped in a copy
    of the .distcp file makes ucp's read differ from torch's tensor."""
    path, sd = saved
    copy = tmp_path / "step-3"
    shutil.copytree(path, copy)
    want = torch_to_numpy(sd["vec"])
    (data,) = [f for f in copy.iterdir() if f.suffix == ".distcp"]
    raw = bytearray(data.read_bytes())
    at = raw.find(want.tobytes())
    assert at > 0, "vec's bytes are not stored verbatim"
    raw[at + 100] ^= 0x10
    data.write_bytes(bytes(raw))
    with ucp.open(copy) as ckpt:
        got = ckpt.read("vec")
    assert not bits_equal(got, want)
    assert int((got != want).sum()) == 1


def test_universal_values_equal_h5py(universal, saved):
    c = Compared()
    with ucp.open(universal) as ckpt, h5py.File(universal, "r") as f:
        assert ckpt.format == "universal"
        assert ckpt.iteration == 3
        for p in ckpt.params():
            for state in p.states:
                ds = f["params"][p.name][state]
                want = ds[()]
                got = ckpt.read(p.name, state)
                # h5py reads bf16 as its stored uint16 (exact bits).
                if got.dtype.name == "bfloat16":
                    assert ds.attrs["dtype"] in (b"bfloat16", "bfloat16")
                    got = got.view(np.uint16)
                c.equal(got, np.asarray(want), f"{p.name}/{state}")
    assert c.tensors >= 4 and c.elements >= ROWS * COLS
    negative_control(np.asarray(want))


def test_dcp_fixture_equals_torch_dcp_to_torch_save(fixtures):
    """torch 2.6's DCP save (DTensor shards of 2 ranks, Adam state) read by
    ucp equals torch's own dcp_to_torch_save of it."""
    base = fixtures / "dcp-torch-2.6" / "dtensor_shard0_w2"
    ref = torch.load(base / "reference_full.pt", weights_only=False)
    c = Compared()
    with ucp.open(base / "ckpt") as ckpt:
        params = {p.name: p for p in ckpt.params()}
        for fqn, tensor in ref["model"].items():
            c.equal(ckpt.read(fqn), torch_to_numpy(tensor), fqn)
            for kind in ("exp_avg", "exp_avg_sq"):
                want = ref["optimizer"]["state"][fqn][kind]
                assert kind in params[fqn].states, params[fqn]
                c.equal(ckpt.read(fqn, kind), torch_to_numpy(want), f"{fqn} {kind}")
    assert c.tensors >= 3 * 10, c.tensors
    negative_control(torch_to_numpy(want))


def test_deepspeed_fixture_equals_deepspeed_truth(fixtures):
    """DeepSpeed 0.14.5 ZeRO-1 bf16 on 2 ranks: fp32 masters, both Adam
    moments and the bf16 module params equal what DeepSpeed reported in the
    training process (safe_get_full_fp32_param / _optimizer_state)."""
    base = fixtures / "deepspeed-0.14.5" / "ds0145_z1_bf16_w2_mlp"
    master = torch.load(base / "reference_fp32_master.pt")
    moments = torch.load(base / "reference_optim_state.pt")
    module = torch.load(base / "reference_module_params.pt")
    c = Compared()
    with ucp.open(base) as ckpt:
        assert ckpt.format == "deepspeed"
        assert ckpt.topology["dp"] == 2
        for name, want in master.items():
            c.equal(ckpt.read(name, "fp32"), torch_to_numpy(want), name)
            for kind in ("exp_avg", "exp_avg_sq"):
                c.equal(ckpt.read(name, kind),
                        torch_to_numpy(moments[f"{name}::{kind}"]), f"{name} {kind}")
            # The training-dtype weight, upcast as the truth file holds it.
            got = ckpt.read(name, "param", dtype=np.float32)
            c.equal(got, torch_to_numpy(module[name]), f"{name} param")
    assert c.tensors == 4 * len(master) and len(master) == 4
    negative_control(torch_to_numpy(module[name]))


def _rchar():
    """(rchar of this process so far, the bytes this reading of /proc/self/io
    adds to it): the kernel counts the read after it formats the numbers."""
    text = pathlib.Path("/proc/self/io").read_bytes()
    fields = dict(line.split(b": ") for line in text.splitlines())
    return int(fields[b"rchar"]), len(text)


@pytest.mark.parametrize("which", ["dcp", "universal"])
def test_regions_equal_slices_and_read_only_their_bytes(which, saved, universal):
    """A TP8 layout's slices (dim 0 and dim 1) of a TP1 tensor, and a few
    other regions: equal to the whole tensor's slices, each read with at
    most 1.05 x its bytes (the executor's count and the kernel's rchar)."""
    path = saved[0] if which == "dcp" else universal
    with ucp.open(path, threads=1) as ckpt:
        whole = ckpt.read("big.weight")
        regions = [(slice(r * ROWS // 8, (r + 1) * ROWS // 8),) for r in range(8)]
        regions += [(slice(None), slice(r * COLS // 8, (r + 1) * COLS // 8))
                    for r in (0, 5)]
        regions += [(slice(100, 900), slice(17, 250)), (7,), (-1, slice(3, 9)),
                    (Ellipsis, slice(0, 128)), (slice(4000, None),)]
        compared = 0
        for index in regions:
            want = whole[index]
            before_exec = ckpt.bytes_read
            before_rchar, own = _rchar()
            got = ckpt.read("big.weight", index=index)
            rchar = _rchar()[0] - before_rchar - own
            executor = ckpt.bytes_read - before_exec
            assert bits_equal(got, want), index
            compared += got.size
            assert executor <= 1.05 * want.nbytes, (index, executor, want.nbytes)
            assert rchar <= 1.05 * want.nbytes, (index, rchar, want.nbytes)
            assert executor >= want.nbytes, (index, executor)
        assert compared >= ROWS * COLS + 800 * 233
        with pytest.raises(ucp.UsageError, match="step 2"):
            ckpt.read("big.weight", index=(slice(0, 10, 2),))
        with pytest.raises(IndexError):
            ckpt.read("big.weight", index=(ROWS,))


def test_read_into_cpu_tensor(saved):
    path, sd = saved
    c = Compared()
    with ucp.open(path) as ckpt:
        t = torch.empty(ROWS // 8, COLS)
        assert ckpt.read_into("big.weight", t, index=(slice(ROWS // 8, ROWS // 4),)) is t
        c.equal(t.numpy(), sd["big.weight"][ROWS // 8:ROWS // 4].numpy(), "rows")
        # In place: the tensor's own memory, not a copy.
        ptr = t.data_ptr()
        ckpt.read_into("big.weight", t, index=(slice(0, ROWS // 8),))
        assert t.data_ptr() == ptr
        c.equal(t.numpy(), sd["big.weight"][: ROWS // 8].numpy(), "rows 0")
        # bf16 into bf16, and fp32 into a bf16 tensor (converted like torch's
        # round to nearest even).
        b = torch.empty(64, 96, dtype=torch.bfloat16)
        ckpt.read_into("small.weight", b)
        c.equal(torch_to_numpy(b), torch_to_numpy(sd["small.weight"]), "bf16")
        v = torch.empty(1000, dtype=torch.float32)
        ckpt.read_into("vec", v)
        c.equal(v.numpy(), sd["vec"].to(torch.float32).numpy(), "fp64->fp32")
        # A non-contiguous tensor (a transposed view) through a host buffer.
        nt = torch.empty(96, 64, dtype=torch.bfloat16).t()
        ckpt.read_into("small.weight", nt)
        c.equal(torch_to_numpy(nt), torch_to_numpy(sd["small.weight"]), "strided")
        with pytest.raises(ucp.UsageError, match="shape"):
            ckpt.read_into("big.weight", torch.empty(3, 3))
    assert c.tensors == 5
    negative_control(sd["vec"].numpy())


def test_read_into_pinned_tensor(saved):
    if not torch.cuda.is_available():
        pytest.skip("pinned memory needs a CUDA device")
    path, sd = saved
    with ucp.open(path) as ckpt:
        t = torch.empty(ROWS, COLS).pin_memory()
        ckpt.read_into("big.weight", t)
        assert bits_equal(t.numpy(), sd["big.weight"].numpy())


def test_read_into_cuda_tensor(saved):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    path, sd = saved
    with ucp.open(path) as ckpt:
        t = torch.empty(ROWS // 8, COLS, device="cuda")
        ckpt.read_into("big.weight", t, index=(slice(0, ROWS // 8),))
        assert bits_equal(t.cpu().numpy(), sd["big.weight"][: ROWS // 8].numpy())


class _Opaque:
    """Stands in for any class a Megatron pickle names (its args, enums)."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        self.state = state

    def __call__(self, *args, **kwargs):
        return _Opaque()


class _PermissiveModule:
    """A pickle module for torch.load that keeps torch's own classes and
    makes every other global an _Opaque (Megatron is not installed)."""

    import pickle as _pickle

    class Unpickler(_pickle.Unpickler):
        def find_class(self, module, name):
            if module.split(".")[0] in ("torch", "collections", "builtins",
                                         "numpy", "_codecs", "argparse"):
                return super().find_class(module, name)
            return _Opaque

    load = _pickle.load
    __name__ = "pickle"


def _flat_tensors(obj, prefix=""):
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_tensors(v, f"{prefix}{k}."))
    elif isinstance(obj, torch.Tensor):
        out[prefix[:-1]] = obj
    return out


def test_megatron_legacy_fixture_equals_torch_load(fixtures):
    """Megatron-LM 23.06's TP1 PP2 save: each stage's rank file loaded by
    torch (stage 1's local layer 0 is global layer 1) against ucp's read of
    the whole checkpoint (vocabulary padding rows left out by ucp)."""
    base = fixtures / "megatron-23.06" / "from_tp2_to_tp1_pp2"
    c = Compared()
    with ucp.open(base) as ckpt:
        assert ckpt.format == "megatron" and ckpt.topology["pp"] == 2
        params = {p.name: p for p in ckpt.params()}
        for stage in range(2):
            sd = torch.load(base / "iter_0000010" / f"mp_rank_00_00{stage}" /
                            "model_optim_rng.pt", pickle_module=_PermissiveModule,
                            weights_only=False, map_location="cpu")
            for key, tensor in _flat_tensors(sd["model"]).items():
                if "_extra_state" in key:
                    continue
                name = key.replace("encoder.layers.0.", f"encoder.layers.{stage}.")
                if name not in params and stage == 1 and "word_embeddings" in name:
                    continue  # the tied output copy on the last stage
                want = torch_to_numpy(tensor)
                rows = params[name].shape[0] if params[name].shape else None
                if rows is not None and rows < want.shape[0]:
                    want = want[:rows]  # the vocabulary's padding rows
                c.equal(ckpt.read(name), want, name)
    assert c.tensors == len(params) and c.tensors >= 20, (c.tensors, len(params))
    negative_control(want)


def test_torch_dist_fixture_equals_torch_dcp_load(fixtures):
    """Megatron-core's torch_dist save (TP2, bf16, layers stacked in one
    tensor per weight): torch's dcp.load of each stacked weight, layer by
    layer, against ucp's per-layer params."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = fixtures / "megatron-core-torch-dist" / "tp2pp1dp1" / "ckpt"
    reader = FileSystemReader(str(path / "iter_0000010"))
    meta = reader.read_metadata()
    keys = {k: v for k, v in meta.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata) and not k.startswith("optimizer")
            and "_extra_state" not in k}
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in keys.items()}
    dcp.load(sd, storage_reader=reader,
             planner=DefaultLoadPlanner(allow_partial_load=True))
    c = Compared()
    with ucp.open(path) as ckpt:
        names = {p.name for p in ckpt.params()}
        for key, tensor in sd.items():
            if key.startswith("decoder.layers."):
                for layer in range(tensor.shape[0]):
                    name = key.replace("decoder.layers.", f"decoder.layers.{layer}.")
                    c.equal(ckpt.read(name), torch_to_numpy(tensor[layer]), name)
            else:
                c.equal(ckpt.read(key), torch_to_numpy(tensor), key)
    assert c.tensors == len(names) and c.tensors >= 20, (c.tensors, len(names))
    negative_control(torch_to_numpy(tensor[0]))


def test_hf_folder_equals_safetensors(tmp_path):
    """A transformers LLaMA folder (config.json + model.safetensors, bf16)
    read by ucp equals safetensors' own load of the file."""
    import json

    from safetensors.torch import load_file, save_file

    g = torch.Generator().manual_seed(3)
    h, ffn, vocab, kv = 16, 32, 64, 8
    sd = {"model.embed_tokens.weight": torch.randn(vocab, h, generator=g),
          "model.norm.weight": torch.randn(h, generator=g),
          "lm_head.weight": torch.randn(vocab, h, generator=g)}
    for proj, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)),
                        ("self_attn.v_proj", (kv, h)), ("self_attn.o_proj", (h, h)),
                        ("mlp.gate_proj", (ffn, h)), ("mlp.up_proj", (ffn, h)),
                        ("mlp.down_proj", (h, ffn)), ("input_layernorm", (h,)),
                        ("post_attention_layernorm", (h,))):
        sd[f"model.layers.0.{proj}.weight"] = torch.randn(*shape, generator=g)
    sd = {k: v.to(torch.bfloat16) for k, v in sd.items()}
    save_file(sd, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": ffn, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": vocab,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    want = load_file(str(tmp_path / "model.safetensors"))
    c = Compared()
    with ucp.open(tmp_path) as ckpt:
        assert ckpt.format == "hf"
        names = {p.name for p in ckpt.params()}
        assert names == set(want), sorted(names ^ set(want))
        for name, tensor in want.items():
            c.equal(ckpt.read(name), torch_to_numpy(tensor), name)
    assert c.tensors == len(sd) == 12
    negative_control(torch_to_numpy(tensor))


def test_open_save_folder_with_source_options(saved):
    """A save folder of step-N checkpoints: the newest, or the one the
    format's option names (ucp formats: dcp's --checkpoint); options the
    format does not take are usage errors naming them."""
    path, sd = saved
    with ucp.open(path.parent) as newest, \
            ucp.open(path.parent, format="dcp", checkpoint="step-3") as named:
        assert newest.iteration == named.iteration == 3
        assert bits_equal(named.read("vec"), torch_to_numpy(sd["vec"]))
    with pytest.raises(ucp.UsageError, match="--bogus is not an option of format 'dcp'"):
        ucp.open(path.parent, bogus=1)
    with pytest.raises(ucp.UsageError, match="no checkpoint step-9|step-9"):
        ucp.open(path.parent, checkpoint="step-9")
    ckpt = ucp.open(path)
    ckpt.close()
    with pytest.raises(ucp.UsageError, match="closed"):
        ckpt.read("vec")


def test_mindspore_file_equals_mindspore_load(tmp_path):
    """A MindSpore .ckpt (fp32, fp16, bf16) written by mindspore.save_checkpoint:
    ucp's reads equal mindspore.load_checkpoint's values."""
    os.environ.setdefault("GLOG_v", "3")
    import mindspore as ms

    rng = np.random.default_rng(5)
    items = [{"name": f"net.layer{i}.weight",
              "data": ms.Tensor(rng.standard_normal((24, 8)).astype(np.float32))}
             for i in range(3)]
    items.append({"name": "net.emb", "data": ms.Tensor(
        rng.standard_normal((10, 8)).astype(np.float16))})
    items.append({"name": "net.bf", "data": ms.Tensor(
        rng.standard_normal((6, 4)).astype(np.float32), dtype=ms.bfloat16)})
    ms.save_checkpoint(items, str(tmp_path / "net.ckpt"))
    loaded = ms.load_checkpoint(str(tmp_path / "net.ckpt"))
    c = Compared()
    with ucp.open(tmp_path / "net.ckpt") as ckpt:
        assert ckpt.format == "mindspore"
        assert {p.name for p in ckpt.params()} == set(loaded)
        for name, param in loaded.items():
            if param.dtype == ms.bfloat16:
                # bf16 bits through float32 (MindSpore's asnumpy has no bf16).
                want = param.float().asnumpy()
                got = ckpt.read(name, dtype=np.float32)
            else:
                want, got = param.asnumpy(), ckpt.read(name)
            c.equal(got, want, name)
    assert c.tensors == 5
    negative_control(want)


def test_read_releases_the_gil(tmp_path):
    """A read runs without the GIL: a Python thread stamping the time as it
    counts keeps stamping while one long read (a 256 MiB tensor) is in the
    engine. Held, the thread could run only at the call's edges (a switch
    interval, 5 ms, on either side), never inside."""
    n = 64 << 20
    path = tmp_path / "big"
    dcp.save({"w": torch.arange(n, dtype=torch.float32)}, checkpoint_id=str(path))
    ckpt = ucp.open(path, threads=1)
    ckpt.read("w", index=(slice(0, 1024),))  # the file in the page cache

    stamps = []
    stop = threading.Event()

    def count():
        i = 0
        while not stop.is_set():
            i += 1
            if i % 500 == 0:
                stamps.append(time.perf_counter())

    thread = threading.Thread(target=count)
    thread.start()
    try:
        time.sleep(0.05)
        t0 = time.perf_counter()
        out = ckpt.read("w")
        t1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    assert out.shape == (n,) and out[12345] == 12345.0 and out[-1] == n - 1
    # Held, the thread runs at most a switch interval after the main thread
    # lets the GIL go at a bytecode boundary: before the call enters the
    # engine, or after it returns (checked: a 180 ms bytes() copy, which holds
    # the GIL, leaves no stamp inside these edges).
    edge = 2 * sys.getswitchinterval() + 0.002
    assert t1 - t0 > 2 * edge + 0.01, f"the read took {t1 - t0:.3f} s: too short to tell"
    inside = [s for s in stamps if t0 + edge < s < t1 - edge]
    assert len(inside) >= 3, (
        f"{len(inside)} of the thread's stamps inside the {t1 - t0:.3f} s read: the GIL was held")


def test_deepspeed_universal_folder_equals_torch_load(fixtures, tmp_path):
    """A DeepSpeed universal folder (ucp's writer of DeepSpeed's layout, from a
    real DeepSpeed save): each state ucp.open reads equals what torch.load
    finds in that param's file (zero/<param>/<state>.pt: {'param': tensor});
    a value changed in one file is read changed."""
    src = fixtures / "deepspeed-0.14.5" / "ds0145_z1_fp32_w2_mlp"
    out = tmp_path / "universal"
    ucp.convert(src, out, format="deepspeed-universal")
    ckpt = ucp.open(out)
    assert ckpt.format == "deepspeed-universal" and ckpt.iteration == 2
    zero = out / "global_step2_universal" / "zero"
    seen = Compared()
    for param in ckpt.params():
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            want = torch.load(zero / param.name / f"{state}.pt", weights_only=False)["param"]
            seen.equal(ckpt.read(param.name, state), torch_to_numpy(want),
                       f"{param.name} {state}")
    assert seen.tensors == 12 and seen.elements == 3 * (13 * 7 + 13 + 5 * 13 + 5), vars(seen)
    f = zero / "fc1.bias" / "exp_avg.pt"
    obj = torch.load(f, weights_only=False)
    before = torch_to_numpy(obj["param"]).copy()
    obj["param"][4] += 1
    torch.save(obj, f)
    got = ucp.open(out).read("fc1.bias", "exp_avg")
    assert not bits_equal(got, before) and bits_equal(got, torch_to_numpy(obj["param"]))


def test_megatron_fsdp_equals_torch_dcp(tmp_path):
    """A Megatron-FSDP save (megatron-core's Megatron-FSDP on CPU shims,
    tests/tools/megatron_fsdp.py; fsdp_dtensor DCP of module-path keys): each
    param's fp32 main weight and Adam moments read by ucp.open equal torch's
    dcp_to_torch_save of the folder, under the names without the wrappers'
    "module." prefixes, SwiGLU's fc1 as [weight_w; weight_v]."""
    import subprocess
    import sys

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tools = pathlib.Path(__file__).parents[1] / "tools"
    out = tmp_path / "fsdp"
    p = subprocess.run([sys.executable, str(tools / "megatron_fsdp.py"), "save", "--out",
                        str(out), "--dp", "1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    iter_dir = next(out.glob("iter_*"))
    dcp_to_torch_save(str(iter_dir), str(tmp_path / "whole.pt"))
    whole = torch.load(tmp_path / "whole.pt", weights_only=False)

    def flat(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif torch.is_tensor(v):
                yield f"{prefix}{k}", v

    def strip(n):
        return n.replace("module.", "")

    want = {}
    for k, v in flat(whole):
        if k.startswith("model."):
            want[(strip(k[len("model."):]), "fp32")] = v
        elif k.startswith("optimizer.state."):
            name, kind = k[len("optimizer.state."):].rsplit(".", 1)
            if kind in ("exp_avg", "exp_avg_sq"):
                want[(strip(name), kind)] = v
    for key in [k for k in want if k[0].endswith("_w")]:
        base = key[0][:-2]
        want[(base, key[1])] = torch.cat([want.pop(key), want.pop((base + "_v", key[1]))])

    ckpt = ucp.open(out)
    assert ckpt.format == "megatron-fsdp"
    seen = Compared()
    cut = set()
    for param in ckpt.params():
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            w = want.pop((param.name, state))
            if tuple(w.shape) != param.shape:  # the vocabulary's padding rows are not the model's
                assert w.shape[1:] == param.shape[1:] and w.shape[0] > param.shape[0], param.name
                cut.add(param.name)
                w = w[:param.shape[0]]
            seen.equal(ckpt.read(param.name, state), torch_to_numpy(w), f"{param.name} {state}")
    assert cut <= {"embedding.word_embeddings.weight", "output_layer.weight"}, cut
    assert not want, sorted(want)[:5]  # every tensor torch found was read
    assert seen.tensors == 3 * len(ckpt.params()) >= 3 * 20, vars(seen)
    negative_control(ckpt.read("output_layer.weight", "exp_avg"))
