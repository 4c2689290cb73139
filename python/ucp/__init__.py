"""ucp: universal checkpoint reshaping, in-process (docs/python.md).

    import ucp
    ckpt = ucp.open("/ckpt/gpt/iter_0000100")        # any readable format
    for p in ckpt.params():
        print(p.name, p.shape, p.dtype, p.states)
    w = ckpt.read("embedding.word_embeddings.weight", index=(slice(0, 1024),))
    ucp.convert("/ckpt/gpt", "/ckpt/gpt-tp4", tp=4, pp=1, dp=2)
    r = ucp.resume("/ckpt/gpt", tp=2, pp=2, dp=4, distributed_optimizer=True)

The engine runs in this process (the compiled module ``ucp._ucp``) with the
GIL released while it reads and writes. Failures raise ``ucp.Error``
subclasses carrying the ``ucp`` command's one-line message and exit code:
``FormatError`` (3), ``LayoutError`` (4), ``UsageError`` (2), ``IoError``
(5), ``InternalError`` (70).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Sequence

import numpy as np

from . import _ucp
from ._ucp import (  # noqa: F401  (re-exported)
    Error,
    FormatError,
    InternalError,
    IoError,
    LayoutError,
    UsageError,
)

__all__ = [
    "Checkpoint",
    "Error",
    "FormatError",
    "InternalError",
    "IoError",
    "LayoutError",
    "Param",
    "ResumeResult",
    "SkippedCheckpoint",
    "UsageError",
    "convert",
    "diff",
    "export",
    "open",
    "reshape",
    "resume",
    "to_universal",
]

__version__ = "0.1.0"

_NUMPY_NAMES = {
    "float64", "float32", "float16", "int64", "int32", "int16", "int8",
    "uint8", "uint16", "uint32", "uint64", "complex64", "complex128",
}
_ML_DTYPES = {
    "bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
    "float8_e5m2fnuz",
}


def _numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of an engine dtype name (bf16 / fp8: ml_dtypes)."""
    if name in _NUMPY_NAMES:
        return np.dtype(name)
    if name == "bool":
        return np.dtype(np.bool_)
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    raise UsageError(f"dtype {name} has no numpy type")


def _engine_dtype(dtype: Any) -> str:
    """The engine's name of a numpy dtype or a torch dtype (torch.bfloat16)."""
    text = str(dtype)
    if text.startswith("torch."):
        return text[len("torch."):]
    return np.dtype(dtype).name


@dataclasses.dataclass(frozen=True)
class Param:
    """One param of a checkpoint: its canonical name, whole shape, training
    dtype, the state kinds it holds ("param", "fp32", "exp_avg", ...), its
    kind ("param" or "buffer") and whether it is frozen."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    states: tuple[str, ...]
    kind: str = "param"
    frozen: bool = False
    #: Each state's stored shape and dtype (a scalar step is 0-d).
    state_shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)
    state_dtypes: Mapping[str, str] = dataclasses.field(
        default_factory=dict, repr=False, compare=False)


def _region(index: Any, shape: Sequence[int]) -> tuple[list[int], list[int], tuple[int, ...]]:
    """(offset, size, result shape) of numpy-style basic index `index`:
    slices of step 1, ints (that dim dropped), one Ellipsis. Raises
    UsageError for anything else, IndexError for an int out of range."""
    if index is None:
        return [0] * len(shape), list(shape), tuple(shape)
    if not isinstance(index, tuple):
        index = (index,)
    if sum(1 for i in index if i is Ellipsis) > 1:
        raise UsageError("index: at most one Ellipsis")
    if Ellipsis in index:
        at = index.index(Ellipsis)
        fill = len(shape) - (len(index) - 1)
        index = index[:at] + (slice(None),) * max(fill, 0) + index[at + 1:]
    if len(index) > len(shape):
        raise UsageError(f"index {index!r}: {len(index)} indices for a "
                         f"tensor of rank {len(shape)}")
    index = index + (slice(None),) * (len(shape) - len(index))
    offset, size, out = [], [], []
    for i, (ix, n) in enumerate(zip(index, shape)):
        if isinstance(ix, slice):
            start, stop, step = ix.indices(n)
            if step != 1:
                raise UsageError(f"index dim {i}: step {step} (only step 1 "
                                 "regions are read)")
            length = max(stop - start, 0)
            offset.append(start if length else 0)
            size.append(length)
            out.append(length)
        elif isinstance(ix, (int, np.integer)) and not isinstance(ix, bool):
            k = int(ix)
            if k < -n or k >= n:
                raise IndexError(f"index {k} is out of bounds for dim {i} "
                                 f"of size {n}")
            offset.append(k % n)
            size.append(1)
        else:
            raise UsageError(f"index dim {i}: {ix!r} (use slices and ints)")
    return offset, size, tuple(out)


class Checkpoint:
    """A checkpoint opened with ucp.open: read-only, any readable format or
    a universal file. Reading takes the executor's threads and memory budget
    given to open()."""

    def __init__(self, impl: Any):
        self._live = impl
        self._params: dict[str, Param] | None = None

    @property
    def _impl(self) -> Any:
        if self._live is None:
            raise UsageError("the checkpoint is closed")
        return self._live

    @property
    def format(self) -> str:
        """The format's name (ucp formats), or "universal"."""
        return self._impl.format

    @property
    def path(self) -> str:
        return self._impl.path

    @property
    def iteration(self) -> int:
        return self._impl.iteration

    @property
    def topology(self) -> dict[str, Any]:
        """The layout as saved: tp, pp, vpp, dp and the format's settings."""
        return json.loads(self._impl.topology_json)

    @property
    def bytes_read(self) -> int:
        """Source bytes the reads so far have read (the executor's count)."""
        return self._impl.bytes_read

    def params(self) -> list[Param]:
        """Every param (and buffer) in canonical order."""
        return list(self._by_name().values())

    def _by_name(self) -> dict[str, Param]:
        if self._params is None:
            self._params = {
                p.name: Param(
                    p.name, tuple(p.shape), p.dtype, tuple(p.states), p.kind,
                    p.frozen,
                    dict(zip(p.states, (tuple(s) for s in p.state_shapes))),
                    dict(zip(p.states, p.state_dtypes)))
                for p in self._impl.params()
            }
        return self._params

    def __contains__(self, name: str) -> bool:
        return name in self._by_name()

    def _state(self, name: str, state: str) -> tuple[tuple[int, ...], str, str]:
        """(shape, dtype, state kind) of the state's dataset: "param" is the
        fp32 state where the param has no other (an fp32 model)."""
        p = self._by_name().get(name)
        if p is None:
            raise UsageError(f"{self.path}: no param {name}")
        if state == "param" and state not in p.states and "fp32" in p.states:
            # An fp32 model keeps its weights as the fp32 state only.
            return p.state_shapes["fp32"], p.state_dtypes["fp32"], "fp32"
        if state not in p.states:
            raise UsageError(f"{self.path} > param {name}: no state {state} "
                             f"(it has: {', '.join(p.states)})")
        return p.state_shapes[state], p.state_dtypes[state], state

    def read(self, name: str, state: str = "param", index: Any = None,
             dtype: Any = None) -> np.ndarray:
        """The tensor `name` (state kind `state`: "param", the weight in its
        training dtype, or its fp32 master where it has no other; "fp32",
        "exp_avg", "exp_avg_sq", "step", ...) as a numpy array, or its
        region `index` (a tuple of slices of step 1 and ints), reading only
        that region's bytes. bfloat16 / float8 come as ml_dtypes types;
        `dtype` converts (e.g. np.float32)."""
        shape, stored, state = self._state(name, state)
        offset, size, out_shape = _region(index, shape)
        try:
            out = np.empty(size, dtype=_numpy_dtype(stored)
                           if dtype is None else np.dtype(dtype))
            engine_dtype = _engine_dtype(out.dtype)
        except TypeError as e:
            raise UsageError(f"dtype {dtype!r}: {e}") from None
        if not out.dtype.isnative:
            raise UsageError(f"dtype {dtype!r}: not in this machine's byte "
                             "order (read natively, then .byteswap())")
        self._impl.read(name, state, offset, size, engine_dtype,
                        out.ctypes.data, out.nbytes)
        return out.reshape(out_shape)

    def read_into(self, name: str, tensor: Any, state: str = "param",
                  index: Any = None) -> Any:
        """Fills the preallocated torch tensor `tensor` (of the region's
        shape; any dtype the engine converts to) with the tensor `name` or
        its region `index`, reading only that region's bytes. A contiguous
        CPU (or pinned) tensor is written in place through its data pointer;
        a CUDA or non-contiguous one through a host buffer and
        tensor.copy_. Returns `tensor`."""
        shape, _, state = self._state(name, state)
        offset, size, out_shape = _region(index, shape)
        if tuple(tensor.shape) != out_shape:
            raise UsageError(f"{self.path} > param {name} > {state}: the "
                             f"tensor's shape {tuple(tensor.shape)} is not "
                             f"the region's {out_shape}")
        engine_dtype = _engine_dtype(tensor.dtype)
        if tensor.device.type == "cpu" and tensor.is_contiguous():
            self._impl.read(name, state, offset, size, engine_dtype,
                            tensor.data_ptr(),
                            tensor.numel() * tensor.element_size())
            return tensor
        pin = tensor.device.type == "cuda"
        host = tensor.new_empty(tuple(tensor.shape), device="cpu",
                                pin_memory=pin)
        self._impl.read(name, state, offset, size, engine_dtype,
                        host.data_ptr(), host.numel() * host.element_size())
        tensor.copy_(host)
        return tensor

    def close(self) -> None:
        """Releases the files (the object is unusable afterwards)."""
        self._live = None

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._live is None:
            return "<ucp.Checkpoint closed>"
        return (f"<ucp.Checkpoint {self.format} {self.path!r} "
                f"iteration {self.iteration}>")


def open(path: str | os.PathLike, format: str | None = None, *,
         layout: str | None = None, vocab_size: int | None = None,
         threads: int = 0, memory: str = "2G", **options: Any) -> Checkpoint:
    """Opens a checkpoint of any readable format (detected, or `format`: a
    name of `ucp formats`) or a universal file. `options`: the format's
    source options (`ucp formats --json`), e.g. tag="global_step2" or
    iteration=100; `layout`: a layout descriptor's name or YAML file;
    `vocab_size`: the tokenizer's true vocabulary size, when the checkpoint
    lacks it (padding rows beyond it are left out).
    `threads` / `memory`: the reads' executor (0: all cores; a budget such as
    "512M")."""
    values = []
    for key, value in options.items():
        name = key.replace("_", "-")
        if value is None or value is False:
            continue
        values.append((name, "true" if value is True else str(value)))
    impl = _ucp.Checkpoint(os.fspath(path), format or "", values,
                           layout or "", vocab_size or 0, threads, memory)
    return Checkpoint(impl)


# --- commands ---------------------------------------------------------------

def _flags(options: Mapping[str, Any]) -> list[str]:
    """Keyword arguments as the command's flags: tp=2 -> --tp 2,
    distributed_optimizer=True -> --distributed-optimizer (False / None:
    left out), a list -> the flag repeated, a dict (model_var) -> NAME=N
    values."""
    args: list[str] = []
    for key, value in options.items():
        if key in ("from_", "source_format"):
            key = "from"
        flag = "--" + key.rstrip("_").replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            args.append(flag)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                args += [flag, f"{k}={v}"]
        elif isinstance(value, (list, tuple)):
            for v in value:
                args += [flag, str(v)]
        else:
            args += [flag, os.fspath(value) if isinstance(value, os.PathLike)
                     else str(value)]
    return args


def _command(command: str, args: list[str],
             progress: Any = None) -> tuple[int, dict[str, Any]]:
    """Runs `ucp COMMAND ARGS --json` in-process: (exit code, its JSON
    document).
    `progress`: None / False quiet, True ucp's bar on stderr, a callable
    progress(label, done, total) called from the engine's threads (at most
    every 100 ms per stage, and at each stage's end)."""
    callback = None
    if progress is None or progress is False:
        args = args + ["--quiet"]
    elif progress is True:
        args = args + ["--progress"]
    elif callable(progress):
        args, callback = args + ["--quiet"], progress
    else:
        raise UsageError("progress: True (ucp's bar on stderr), a callable "
                         "(label, done, total), or None / False")
    rc, doc = _ucp.run_command(command, args + ["--json"], callback)
    return rc, json.loads(doc) if doc is not None else {}


def _run(command: str, args: list[str], progress: Any = None) -> dict[str, Any]:
    """_command's document; an exit code other than 0 raises ucp.Error."""
    rc, result = _command(command, args, progress)
    if rc != 0:
        raise Error(f"ucp {command} exited with {rc}")
    return result


def to_universal(src: str | os.PathLike, dst: str | os.PathLike, *,
                 progress: Any = None, **options: Any) -> dict[str, Any]:
    """`ucp to-universal SRC -o DST`: one universal HDF5 file. `options` are
    the command's flags as keyword arguments (from_="deepspeed", tag=...,
    layout=..., threads=, memory=, no_sync=True). Returns its --json
    summary."""
    return _run("to-universal", [os.fspath(src), "-o", os.fspath(dst)]
                + _flags(options), progress)


def reshape(src: str | os.PathLike, dst: str | os.PathLike,
            format: str | None = None, names: str | None = None, *,
            progress: Any = None, **topology_and_options: Any) -> dict[str, Any]:
    """`ucp reshape FILE -o DST`: a universal file to a checkpoint for the
    layout given as keyword arguments (tp=, pp=, vpp=, dp=, ep=, etp=) with
    the target format's options (distributed_optimizer=True, zero_stage=2,
    ...). Returns the --json summary."""
    return _run("reshape", [os.fspath(src), "-o", os.fspath(dst)]
                + _flags({"format": format, "names": names,
                          **topology_and_options}), progress)


def convert(src: str | os.PathLike, dst: str | os.PathLike,
            format: str | None = None, names: str | None = None,
            progress: Any = None, **topology_and_options: Any) -> dict[str, Any]:
    """`ucp convert SRC -o DST`: a checkpoint to another layout / format in
    one streaming step; keyword arguments as for reshape, plus the source's
    options (from_=, tag=, layout=, ...). Returns the --json summary."""
    return _run("convert", [os.fspath(src), "-o", os.fspath(dst)]
                + _flags({"format": format, "names": names,
                          **topology_and_options}), progress)


def export(src: str | os.PathLike, dst: str | os.PathLike,
           format: str | None = None, *, progress: Any = None,
           **options: Any) -> dict[str, Any]:
    """`ucp export SRC -o DST`: the consolidated model (Hugging Face files;
    format "safetensors" or "torch"; dtype="bf16", max_shard_size="2GB",
    hf=True, ...). Returns the --json summary."""
    return _run("export", [os.fspath(src), "-o", os.fspath(dst)]
                + _flags({"format": format, **options}), progress)


@dataclasses.dataclass(frozen=True)
class SkippedCheckpoint:
    """A newer checkpoint ucp.resume did not take, and why."""

    name: str
    iteration: int
    reason: str


@dataclasses.dataclass(frozen=True)
class ResumeResult:
    """What ucp.resume chose: the folder to load (`load_dir`), the
    checkpoint's iteration, consumed samples (None if unknown), the newer
    checkpoints skipped (newest first) and the data-skip steps (None if
    unknown)."""

    load_dir: str
    iteration: int
    consumed_samples: int | None
    skipped: tuple[SkippedCheckpoint, ...]
    data_skip_steps: int | None
    checkpoint: str
    format: str
    reshaped: bool
    summary: dict[str, Any]


def resume(save_dir: str | os.PathLike, output: str | os.PathLike | None = None,
           *, progress: Any = None,
           **topology_and_options: Any) -> ResumeResult:
    """`ucp resume SAVE_DIR`: the newest complete and intact checkpoint of
    the save folder, reshaped into a load folder (`output`, default
    SAVE_DIR/ucp-resume/...) when the layout given as keyword arguments
    (tp=, pp=, dp=, ..., distributed_optimizer=True, format=) differs;
    global_batch_size= gives data_skip_steps. Call it before the framework
    loads `load_dir`."""
    args = [os.fspath(save_dir)]
    if output is not None:
        args += ["-o", os.fspath(output)]
    j = _run("resume", args + _flags(topology_and_options), progress)
    samples = j.get("consumed_samples")
    return ResumeResult(
        load_dir=j["load"],
        iteration=j["iteration"],
        consumed_samples=None if samples is None or samples < 0 else samples,
        skipped=tuple(SkippedCheckpoint(s["name"], s["iteration"], s["reason"])
                      for s in j.get("skipped", [])),
        data_skip_steps=j.get("data_skip_steps"),
        checkpoint=j["checkpoint"],
        format=j["format"],
        reshaped=j["reshaped"],
        summary=j,
    )


def diff(a: str | os.PathLike, b: str | os.PathLike, atol: float = 0,
         rtol: float = 0, names: str | None = None, *, progress: Any = None,
         **options: Any) -> dict[str, Any]:
    """`ucp diff A B` (issue 41): the two checkpoints, in any formats and
    layouts, compared param by param and state by state (exact unless
    atol / rtol; `names`: a name map both sides are viewed under). Returns
    the command's --json report with "equal" set (exit code 0: equal,
    1: different; errors raise as for the other commands)."""
    if "diff" not in _ucp.commands():
        raise NotImplementedError("ucp.diff: this build has no `ucp diff`")
    rc, result = _command("diff", [os.fspath(a), os.fspath(b)] + _flags(
        {"atol": repr(float(atol)), "rtol": repr(float(rtol)), "names": names,
         **options}), progress)
    result.setdefault("equal", rc == 0)
    return result
