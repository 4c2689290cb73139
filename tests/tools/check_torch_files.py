#!/usr/bin/python3
"""Checks torch.save files written by ucp against torch itself.

Usage:
  check_torch_files.py compare ORIG.pt OURS.pt   both load with torch.load and are deeply equal
  check_torch_files.py expect SPEC.json FILE.pt  FILE loads with torch.load and matches SPEC
  check_torch_files.py zipcheck FILE.pt          FILE is a well-formed, 64-byte aligned torch zip
  check_torch_files.py --self-test               exercises passing and failing cases of all three

Exit status 0 on success.  On failure exactly one line naming the first difference is printed and the
exit status is 1 (2 for command-line errors).  Files are loaded with ``map_location='cpu'`` through a
pickle module that replaces unimportable classes (DeepSpeed, Megatron, ...) by stub classes with the
real module paths (see torchdesc.py).

compare: same container types (dict vs OrderedDict, list vs tuple, ...), same keys in the same order,
  tensors equal in type (Parameter or not), dtype, shape, requires_grad and bit-identical values (NaN
  payloads and -0.0 count), scalars equal (NaN equals NaN, -0.0 differs from 0.0), opaque objects equal
  by class and state (``__dict__`` / ``__reduce_ex__(2)``; numpy arrays by dtype, shape and bytes; BytesIO
  by value and position; attributes of dict subclasses such as a state dict's ``_metadata``).  A tensor
  object reachable at several places in ORIG must be one object in OURS and vice versa; storage sharing
  between different views is not required.

expect: SPEC is a JSON object
  {"top_type": "dict" | "OrderedDict" | "<module.Class>",            (optional)
   "exact_tensors": true,             (optional: the file holds no tensors besides those listed)
   "tensors": [{"path": [...], "dtype": "bfloat16", "shape": [2, 3],
                "values": [flat row-major numbers],                   (optional)
                "bits": [flat row-major raw element bits as unsigned ints],   (optional)
                "requires_grad": false, "is_parameter": false}],   (optional each)
   "leaves": [{"path": [...], "value": <JSON value>}]}
  Path components are dict keys (str or int) and list/tuple indices.  "values" compare exactly
  (floats: NaN matches NaN, and "nan", "inf", "-inf" strings are accepted; complex: [re, im] pairs;
  bool: true/false).  Use "bits" for float16/bfloat16 (any dtype of at most 8 bytes works).  Leaf
  values compare with exact types: null=None, true/false=bool, JSON integers=int, JSON reals=float,
  strings=str; {"float": "nan"|"inf"|"-inf"|"-0.0"} for special floats and {"bytes_hex": "00ff"} for
  bytes.

zipcheck: ``zipfile.testzip()`` finds no error; every ``data/*`` record is stored (not compressed) and
  its payload starts at a multiple of 64 bytes (local header offset + 30 + name length + extra length);
  a ``version`` record exists; torch.load works; and when every global data.pkl references is in torch's
  weights_only allow-list, ``torch.load(weights_only=True)`` works and equals the normal load.
"""

from __future__ import annotations

import argparse
import collections
import enum
import io
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import types
import zipfile
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import torchdesc  # noqa: E402


class Mismatch(Exception):
    """A check failed; the message is the one line to print."""


def _fmt(path: List[str]) -> str:
    return "root" + "".join(path) if path else "root"


def _key(k: Any) -> str:
    return f"[{k!r}]"


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


def _float_equal(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return struct.pack("<d", a) == struct.pack("<d", b)


# ----------------------------------------------------------------------------------------------------
# compare


class Comparer:
    """Deep comparison of two loaded object graphs (see module docstring)."""

    def __init__(self) -> None:
        self.a_to_b: Dict[int, Any] = {}
        self.b_to_a: Dict[int, Any] = {}
        self.visited: set = set()
        self.keep: List[Any] = []  # keeps transient objects alive so ids stay unique
        self.count = 0  # values compared: tensor elements, scalars, arrays' elements, other leaves

    def fail(self, path: List[str], message: str) -> None:
        raise Mismatch(f"at {_fmt(path)}: {message}")

    def compare(self, a: Any, b: Any, path: List[str]) -> None:
        if type(a) is not type(b):
            self.fail(path, f"type {_qualified(type(a))} != {_qualified(type(b))}")
        self.count += 1 if not isinstance(a, (torch.Tensor, np.ndarray)) else 0
        if isinstance(a, torch.Tensor):
            self._tensor(a, b, path)
            self.count += a.numel()
            return
        if isinstance(a, enum.Enum):
            if a.name != b.name or a.value != b.value:
                self.fail(path, f"enum {a!r} != {b!r}")
            return
        if a is None or isinstance(a, (bool, int, str, bytes, torch.dtype, torch.device)):
            if a != b:
                self.fail(path, f"value {a!r} != {b!r}")
            return
        if isinstance(a, float):
            if not _float_equal(a, b):
                self.fail(path, f"value {a!r} != {b!r}")
            return
        pair = (id(a), id(b))
        if pair in self.visited:
            return
        self.visited.add(pair)
        self.keep.extend((a, b))
        if isinstance(a, dict):
            self._dict(a, b, path)
            self._attributes(a, b, path)
        elif isinstance(a, (list, tuple)):
            if len(a) != len(b):
                self.fail(path, f"length {len(a)} != {len(b)}")
            for i, (x, y) in enumerate(zip(a, b)):
                self.compare(x, y, path + [f"[{i}]"])
            self._attributes(a, b, path)
        elif isinstance(a, (set, frozenset)):
            if a != b:
                self.fail(path, f"set {sorted(map(repr, a))} != {sorted(map(repr, b))}")
        elif isinstance(a, np.ndarray):
            self._ndarray(a, b, path)
            self.count += a.size
        elif isinstance(a, np.generic):
            if a.dtype != b.dtype or a.tobytes() != b.tobytes():
                self.fail(path, f"numpy scalar {a!r} != {b!r}")
        elif isinstance(a, io.BytesIO):
            if a.getvalue() != b.getvalue():
                self.fail(path, f"BytesIO content differs ({len(a.getvalue())} vs {len(b.getvalue())} bytes)")
            if a.tell() != b.tell():
                self.fail(path, f"BytesIO position {a.tell()} != {b.tell()}")
        elif isinstance(a, (type, types.FunctionType, types.BuiltinFunctionType)):
            if _qualified(a) != _qualified(b):
                self.fail(path, f"{_qualified(a)} != {_qualified(b)}")
        else:
            self._reduced(a, b, path)

    def _tensor(self, a: torch.Tensor, b: torch.Tensor, path: List[str]) -> None:
        seen_a, seen_b = self.a_to_b.get(id(a)), self.b_to_a.get(id(b))
        if seen_a is not None or seen_b is not None:
            if seen_a is not b or seen_b is not a:
                self.fail(path, "tensor object sharing differs (the same tensor object is reachable "
                                "elsewhere in one file but not in the other)")
            return
        self.a_to_b[id(a)], self.b_to_a[id(b)] = b, a
        self.keep.extend((a, b))
        if a.dtype != b.dtype:
            self.fail(path, f"dtype {a.dtype} != {b.dtype}")
        if a.shape != b.shape:
            self.fail(path, f"shape {list(a.shape)} != {list(b.shape)}")
        if a.requires_grad != b.requires_grad:
            self.fail(path, f"requires_grad {a.requires_grad} != {b.requires_grad}")
        da, db = torchdesc.tensor_bytes(a), torchdesc.tensor_bytes(b)
        if da != db:
            size = a.element_size()
            first = next(i for i in range(len(da)) if da[i] != db[i]) // size
            x, y = (t.detach().reshape(-1)[first].item() for t in (a, b))
            self.fail(path, f"values differ (first at flat index {first} of {a.numel()}: {x!r} != {y!r})")

    def _dict(self, a: dict, b: dict, path: List[str]) -> None:
        ka, kb = list(a.keys()), list(b.keys())
        if len(ka) != len(kb) or any(type(x) is not type(y) or x != y for x, y in zip(ka, kb)):
            for i, (x, y) in enumerate(zip(ka, kb)):
                if type(x) is not type(y) or x != y:
                    self.fail(path, f"key #{i} is {x!r} != {y!r}")
            extra = ka[len(kb):] or kb[len(ka):]
            self.fail(path, f"{len(ka)} keys != {len(kb)} keys (first unmatched key {extra[0]!r})")
        for k in ka:
            self.compare(a[k], b[k], path + [_key(k)])

    def _attributes(self, a: Any, b: Any, path: List[str]) -> None:
        """Instance attributes of containers (e.g. the _metadata of a state dict)."""
        va, vb = getattr(a, "__dict__", {}), getattr(b, "__dict__", {})
        if va or vb:
            self._dict(va, vb, path + [".__dict__"])

    def _ndarray(self, a: np.ndarray, b: np.ndarray, path: List[str]) -> None:
        if a.dtype != b.dtype or a.shape != b.shape:
            self.fail(path, f"ndarray {a.dtype}{list(a.shape)} != {b.dtype}{list(b.shape)}")
        if a.dtype.hasobject:
            for i, (x, y) in enumerate(zip(a.reshape(-1), b.reshape(-1))):
                self.compare(x, y, path + [f"[flat {i}]"])
        elif np.ascontiguousarray(a).tobytes() != np.ascontiguousarray(b).tobytes():
            self.fail(path, "ndarray values differ")

    def _reduced(self, a: Any, b: Any, path: List[str]) -> None:
        """Opaque objects: compare what pickle would store (``__reduce_ex__(2)``)."""
        try:
            ra, rb = a.__reduce_ex__(2), b.__reduce_ex__(2)
        except Exception as e:  # noqa: BLE001 (anything unpicklable: compare the attributes)
            if getattr(a, "__dict__", None) is None:
                self.fail(path, f"cannot compare {_qualified(type(a))}: {e}")
            self._dict(vars(a), vars(b), path + [".__dict__"])
            return
        if isinstance(ra, str) or isinstance(rb, str):  # a global reference
            if ra != rb:
                self.fail(path, f"global {ra!r} != {rb!r}")
            return
        ra, rb = tuple(ra) + (None,) * (6 - len(ra)), tuple(rb) + (None,) * (6 - len(rb))
        self.keep.extend((ra, rb))
        names = ["<reduce callable>", "<reduce args>", "<state>", "<list items>", "<dict items>"]
        for i, name in enumerate(names):
            x, y = ra[i], rb[i]
            if i >= 3:  # iterators
                x = None if x is None else list(x)
                y = None if y is None else list(y)
                self.keep.extend((x, y))
            if i == 0:
                if _qualified(x) != _qualified(y):
                    self.fail(path, f"reduced by {_qualified(x)} != {_qualified(y)}")
            elif i == 2 and isinstance(x, dict) and isinstance(y, dict):
                self._dict(x, y, path + [".__dict__"])
            else:
                self.compare(x, y, path + [name])


def compare_files(orig: str, ours: str) -> int:
    """Returns the number of values compared (every object counts one, tensors and arrays
    their elements)."""
    a = _load(orig)
    b = _load(ours)
    c = Comparer()
    c.compare(a, b, [])
    return c.count


# ----------------------------------------------------------------------------------------------------
# expect


def _resolve(root: Any, path: List[Any]) -> Any:
    obj = root
    for i, component in enumerate(path):
        kind = type(obj)
        if kind in (dict, collections.OrderedDict):
            matches = [k for k in obj if type(k) is type(component) and k == component]
            if not matches:
                raise Mismatch(f"path {path}: key {component!r} not found at {path[:i]}")
            obj = obj[matches[0]]
        elif kind in (list, tuple):
            if type(component) is not int or not -len(obj) <= component < len(obj):
                raise Mismatch(f"path {path}: index {component!r} out of range at {path[:i]} "
                               f"(length {len(obj)})")
            obj = obj[component]
        else:
            raise Mismatch(f"path {path}: {_qualified(kind)} at {path[:i]} is not a container")
    return obj


def _expected_float(value: Any) -> float:
    if isinstance(value, str):
        return float(value)  # "nan", "inf", "-inf"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Mismatch(f"spec value {value!r} is not a number")
    return float(value)


def _check_values(tensor: torch.Tensor, spec: Dict[str, Any], where: str) -> None:
    flat = tensor.detach().reshape(-1)
    values = spec["values"]
    if len(values) != flat.numel():
        raise Mismatch(f"{where}: {flat.numel()} elements, spec has {len(values)} values")
    actual = flat.tolist()
    for i, (got, want) in enumerate(zip(actual, values)):
        if tensor.dtype == torch.bool:
            ok = isinstance(want, bool) and got == want
        elif tensor.is_complex():
            ok = (isinstance(want, list) and len(want) == 2
                  and _float_equal(got.real, _expected_float(want[0]))
                  and _float_equal(got.imag, _expected_float(want[1])))
        elif tensor.is_floating_point():
            ok = _float_equal(got, _expected_float(want))
        else:
            ok = type(want) is int and got == want
        if not ok:
            raise Mismatch(f"{where}: value at flat index {i} is {got!r}, spec says {want!r}")


def _check_bits(tensor: torch.Tensor, spec: Dict[str, Any], where: str) -> None:
    size = tensor.element_size()
    if size not in (1, 2, 4, 8):
        raise Mismatch(f"{where}: 'bits' is not supported for {tensor.dtype}")
    actual = np.frombuffer(torchdesc.tensor_bytes(tensor), dtype=f"<u{size}").tolist()
    bits = spec["bits"]
    if len(bits) != len(actual):
        raise Mismatch(f"{where}: {len(actual)} elements, spec has {len(bits)} bits values")
    for i, (got, want) in enumerate(zip(actual, bits)):
        if got != want:
            raise Mismatch(f"{where}: bits at flat index {i} are {got:#x}, spec says {want:#x}")


def _expected_leaf(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"float"}:
            return float(value["float"])
        if set(value) == {"bytes_hex"}:
            return bytes.fromhex(value["bytes_hex"])
        raise Mismatch(f"unsupported leaf value spec {value!r}")
    return value


def expect_file(spec_path: str, file: str) -> None:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    root = _load(file)
    if "top_type" in spec and torchdesc.top_type_name(root) != spec["top_type"]:
        raise Mismatch(f"top-level type {torchdesc.top_type_name(root)} != spec {spec['top_type']}")
    for t in spec.get("tensors", []):
        where = f"tensor {t['path']}"
        tensor = _resolve(root, t["path"])
        if not isinstance(tensor, torch.Tensor):
            raise Mismatch(f"{where}: is a {_qualified(type(tensor))}, not a tensor")
        if torchdesc.dtype_name(tensor.dtype) != t["dtype"]:
            raise Mismatch(f"{where}: dtype {torchdesc.dtype_name(tensor.dtype)} != spec {t['dtype']}")
        if list(tensor.shape) != t["shape"]:
            raise Mismatch(f"{where}: shape {list(tensor.shape)} != spec {t['shape']}")
        for field, actual in (("requires_grad", bool(tensor.requires_grad)),
                              ("is_parameter", isinstance(tensor, torch.nn.Parameter))):
            if field in t and actual != t[field]:
                raise Mismatch(f"{where}: {field} {actual} != spec {t[field]}")
        if "bits" in t:
            _check_bits(tensor, t, where)
        if "values" in t:
            _check_values(tensor, t, where)
    if spec.get("exact_tensors"):
        listed = [t["path"] for t in spec.get("tensors", [])]
        for where, obj in torchdesc.walk(root):
            if isinstance(obj, torch.Tensor) and where not in listed:
                raise Mismatch(f"tensor {where} is not in the spec")
    for leaf in spec.get("leaves", []):
        got = _resolve(root, leaf["path"])
        want = _expected_leaf(leaf["value"])
        ok = type(got) is type(want) and (_float_equal(got, want) if isinstance(got, float) else got == want)
        if not ok:
            raise Mismatch(f"leaf {leaf['path']}: {got!r} ({type(got).__name__}) != spec {want!r} "
                           f"({type(want).__name__})")


# ----------------------------------------------------------------------------------------------------
# zipcheck


def _load(path: str, **kwargs: Any) -> Any:
    try:
        if kwargs.get("weights_only"):
            return torch.load(path, map_location="cpu", weights_only=True)
        return torchdesc.load(path)
    except Mismatch:
        raise
    except Exception as e:  # noqa: BLE001 (any failure to load is the finding)
        mode = " (weights_only=True)" if kwargs.get("weights_only") else ""
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise Mismatch(f"{path}: torch.load{mode} failed: {type(e).__name__}: {first_line}")


def zipcheck(path: str, like: Optional[str] = None) -> bool:
    """Raises Mismatch on the first problem; returns whether a weights_only load was checked too.

    With ``like`` (the torch-written file ours copies), the weights_only load is checked only when
    torch's own file loads with weights_only in this torch (torch 1.13's weights-only unpickler
    lacks opcodes such as BINFLOAT that CPython's pickler writes for floats)."""
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise Mismatch(f"{path}: not a zip file: {e}")
    with zf, open(path, "rb") as f:
        try:
            bad = zf.testzip()
        except Exception as e:  # noqa: BLE001
            raise Mismatch(f"{path}: zipfile.testzip failed: {type(e).__name__}: {e}")
        if bad is not None:
            raise Mismatch(f"{path}: zipfile.testzip reports a bad record: {bad}")
        infos = zf.infolist()
        prefix = infos[0].filename.split("/", 1)[0]
        names = [i.filename for i in infos]
        for required in ("data.pkl", "version"):
            if f"{prefix}/{required}" not in names:
                raise Mismatch(f"{path}: no {prefix}/{required} record")
        for info in infos:
            if not info.filename.startswith(prefix + "/"):
                raise Mismatch(f"{path}: record {info.filename} is outside {prefix}/")
            if not info.filename.startswith(f"{prefix}/data/"):
                continue
            if info.compress_type != zipfile.ZIP_STORED:
                raise Mismatch(f"{path}: record {info.filename} is compressed (method {info.compress_type})")
            f.seek(info.header_offset)
            header = f.read(30)
            if header[:4] != b"PK\x03\x04":
                raise Mismatch(f"{path}: no local header at offset {info.header_offset} for {info.filename}")
            name_len, extra_len = struct.unpack("<HH", header[26:30])
            offset = info.header_offset + 30 + name_len + extra_len
            if offset % torchdesc.ZIP_ALIGNMENT:
                raise Mismatch(f"{path}: record {info.filename} data starts at {offset}, "
                               "not a multiple of 64")
        globals_ = torchdesc.pickle_globals(zf.read(f"{prefix}/data.pkl"))
    loaded = _load(path)
    from torch._weights_only_unpickler import _get_allowed_globals
    allowed = _get_allowed_globals()
    if like is not None and all(g in allowed for g in globals_):
        try:
            _load(like, weights_only=True)
        except Exception:  # noqa: BLE001  (torch cannot: nothing to compare with)
            return False
    if all(g in allowed for g in globals_):
        safe = _load(path, weights_only=True)
        try:
            Comparer().compare(loaded, safe, [])
        except Mismatch as e:
            raise Mismatch(f"{path}: weights_only load differs from normal load {e}")
        return True
    return False


# ----------------------------------------------------------------------------------------------------
# Self-test


def _expect_failure(func: Any, *args: Any, contains: str) -> str:
    try:
        func(*args)
    except Mismatch as e:
        message = str(e)
        if contains not in message:
            raise AssertionError(f"{func.__name__}{args}: message {message!r} lacks {contains!r}")
        if "\n" in message:
            raise AssertionError(f"multi-line message {message!r}")
        return message
    raise AssertionError(f"{func.__name__}{args} passed but should fail (expected {contains!r})")


def _reference_object() -> Any:
    g = torch.Generator().manual_seed(0)
    shared = torch.randn(3, generator=g)
    base = torch.randn(10, generator=g)
    model = collections.OrderedDict([("w", torch.randn(2, 3, generator=g).to(torch.bfloat16)),
                                     ("b", torch.tensor([float("nan"), -0.0, 1.0]))])
    model._metadata = collections.OrderedDict([("", {"version": 1})])  # type: ignore[attr-defined]
    return {
        "model": model,
        "view": base[2:6],
        "shared": [shared, shared],
        "param": torch.nn.Parameter(torch.ones(2)),
        "grad": torch.zeros(2).requires_grad_(True),
        "args": argparse.Namespace(lr=0.1, name="x", dtype=torch.float16),
        "np": np.arange(4, dtype=np.uint32),
        "buf": io.BytesIO(b"abc"),
        "nested": {0: (1, 2.5, None, True, b"\x00"), 1: [float("nan"), -0.0]},
        "set": {1, 2},
    }


def _save(obj: Any, path: str, **kwargs: Any) -> str:
    torch.save(obj, path, **kwargs)
    return path


def self_test() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        p = lambda name: os.path.join(tmp, name)  # noqa: E731
        orig = _save(_reference_object(), p("orig.pt"))

        # compare: passing cases
        compare_files(orig, orig)
        compare_files(orig, _save(_reference_object(), p("same.pt")))
        compact = _reference_object()
        compact["view"] = compact["view"].clone()  # compact storage: allowed
        compare_files(orig, _save(compact, p("compact.pt")))
        compare_files(orig, _save(_reference_object(), p("legacy.pt"), _use_new_zipfile_serialization=False))
        compare_files(orig, _save(_reference_object(), p("proto4.pt"), pickle_protocol=4))

        # compare: failing cases, each must name the place
        def variant(name: str, change: Any) -> str:
            obj = _reference_object()
            change(obj)
            return _save(obj, p(name + ".pt"))

        cases = [
            ("bitflip", lambda o: o["model"]["w"].view(torch.int16)[0, 0].add_(1), "['model']['w']"),
            ("dtype", lambda o: o["model"].__setitem__("w", o["model"]["w"].float()), "dtype"),
            ("shape", lambda o: o.__setitem__("view", o["view"][:3]), "shape"),
            ("negzero", lambda o: o["model"]["b"].__setitem__(1, 0.0), "['model']['b']"),
            ("odict", lambda o: o.__setitem__("model", dict(o["model"])), "type collections.OrderedDict"),
            ("tuple", lambda o: o.__setitem__("shared", tuple(o["shared"])), "['shared']"),
            ("order", lambda o: o["model"].move_to_end("w"), "key #0"),
            ("extra", lambda o: o.__setitem__("more", 1), "first unmatched key 'more'"),
            ("unshared", lambda o: o["shared"].__setitem__(1, o["shared"][1].clone()), "sharing"),
            ("param", lambda o: o.__setitem__("param", o["param"].data), "['param']"),
            ("rgrad", lambda o: o["grad"].requires_grad_(False), "requires_grad"),
            ("ns", lambda o: setattr(o["args"], "lr", 0.2), "['args'].__dict__['lr']"),
            ("nsdtype", lambda o: setattr(o["args"], "dtype", torch.bfloat16), "torch.float16"),
            ("np", lambda o: o["np"].__setitem__(0, 7), "ndarray values"),
            ("buf", lambda o: o.__setitem__("buf", io.BytesIO(b"abd")), "BytesIO"),
            ("scalar", lambda o: o["nested"].__setitem__(0, (1, 2.5, None, 1, b"\x00")), "['nested'][0][3]"),
            ("float", lambda o: o["nested"][1].__setitem__(1, 0.0), "['nested'][1][1]"),
            ("metadata", lambda o: o["model"]._metadata.__setitem__("", {"version": 2}), "_metadata"),
            ("set", lambda o: o.__setitem__("set", {1, 3}), "['set']"),
        ]
        for name, change, contains in cases:
            _expect_failure(compare_files, orig, variant(name, change), contains=contains)

        # expect
        spec = {
            "top_type": "dict", "exact_tensors": False,
            "tensors": [
                {"path": ["model", "b"], "dtype": "float32", "shape": [3], "values": ["nan", -0.0, 1.0]},
                {"path": ["model", "w"], "dtype": "bfloat16", "shape": [2, 3],
                 "bits": np.frombuffer(torchdesc.tensor_bytes(_reference_object()["model"]["w"]),
                                       dtype="<u2").tolist()},
                {"path": ["param"], "dtype": "float32", "shape": [2], "values": [1, 1], "is_parameter": True,
                 "requires_grad": True},
                {"path": ["grad"], "dtype": "float32", "shape": [2], "values": [0.0, 0.0],
                 "requires_grad": True, "is_parameter": False},
            ],
            "leaves": [{"path": ["nested", 0, 0], "value": 1}, {"path": ["nested", 0, 1], "value": 2.5},
                       {"path": ["nested", 0, 2], "value": None}, {"path": ["nested", 0, 3], "value": True},
                       {"path": ["nested", 0, 4], "value": {"bytes_hex": "00"}},
                       {"path": ["nested", 1, 0], "value": {"float": "nan"}},
                       {"path": ["nested", 1, 1], "value": {"float": "-0.0"}}],
        }

        def spec_file(name: str, s: Dict[str, Any]) -> str:
            with open(p(name), "w", encoding="utf-8") as f:
                json.dump(s, f)
            return p(name)

        expect_file(spec_file("ok.json", spec), orig)
        bad_specs = [
            (lambda s: s["tensors"][0]["values"].__setitem__(1, 0.0), "flat index 1"),
            (lambda s: s["tensors"][1]["bits"].__setitem__(5, 0), "bits at flat index 5"),
            (lambda s: s["tensors"][1].__setitem__("dtype", "float16"), "dtype"),
            (lambda s: s["tensors"][2].__setitem__("is_parameter", False), "is_parameter"),
            (lambda s: s["tensors"][3].__setitem__("path", ["grad", 0]), "not a container"),
            (lambda s: s["leaves"][0].__setitem__("value", 1.0), "['nested', 0, 0]"),
            (lambda s: s["leaves"][3].__setitem__("value", 1), "['nested', 0, 3]"),
            (lambda s: s["leaves"][6].__setitem__("value", 0.0), "['nested', 1, 1]"),
            (lambda s: s.__setitem__("top_type", "OrderedDict"), "top-level"),
            (lambda s: s.__setitem__("exact_tensors", True), "not in the spec"),
            (lambda s: s["tensors"].append({"path": ["missing"], "dtype": "float32", "shape": []}),
             "'missing'"),
        ]
        for i, (change, contains) in enumerate(bad_specs):
            s = json.loads(json.dumps(spec))
            change(s)
            _expect_failure(expect_file, spec_file(f"bad{i}.json", s), orig, contains=contains)

        # zipcheck
        if zipcheck(orig):  # has Namespace etc.: weights_only is skipped
            raise AssertionError("zipcheck tried weights_only on a file with argparse.Namespace")
        plain = _save({"a": torch.arange(5), "b": collections.OrderedDict(w=torch.ones(2, 2))}, p("plain.pt"))
        if not zipcheck(plain):  # weights_only load happens and must agree
            raise AssertionError("zipcheck skipped the weights_only load of a plain tensor dict")
        for name, method in (("stored", zipfile.ZIP_STORED), ("deflated", zipfile.ZIP_DEFLATED)):
            with zipfile.ZipFile(plain) as zin, zipfile.ZipFile(p(name + ".pt"), "w") as zout:
                for info in zin.infolist():
                    zout.writestr(zipfile.ZipInfo(info.filename), zin.read(info.filename),
                                  compress_type=method)
        _expect_failure(zipcheck, p("stored.pt"), contains="not a multiple of 64")
        _expect_failure(zipcheck, p("deflated.pt"), contains="compressed")
        with open(plain, "rb") as f:  # flip one payload byte: the CRC no longer matches
            data = bytearray(f.read())
        with zipfile.ZipFile(plain) as zf:
            info = zf.getinfo("plain/data/0")
        name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
        data[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
        with open(p("badcrc.pt"), "wb") as f:
            f.write(data)
        _expect_failure(zipcheck, p("badcrc.pt"), contains="plain/data/0")
        with open(p("notzip.pt"), "wb") as f:
            f.write(b"not a zip")
        _expect_failure(zipcheck, p("notzip.pt"), contains="not a zip")

        # the command line: exit codes and one-line output
        script = os.path.abspath(__file__)
        ok = subprocess.run([sys.executable, script, "compare", orig, orig], capture_output=True, text=True)
        bad = subprocess.run([sys.executable, script, "compare", orig, p("bitflip.pt")], capture_output=True,
                             text=True)
        if ok.returncode != 0 or bad.returncode != 1 or len(bad.stdout.strip().splitlines()) != 1:
            raise AssertionError(f"CLI: ok rc={ok.returncode} {ok.stdout!r}{ok.stderr!r}; "
                                 f"bad rc={bad.returncode} {bad.stdout!r}{bad.stderr!r}")
    print(f"check_torch_files self-test OK ({len(cases)} compare, {len(bad_specs)} expect and 4 zipcheck "
          "failure cases detected)")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--self-test", action="store_true", help="run the self-test")
    sub = parser.add_subparsers(dest="command")
    c = sub.add_parser("compare", help="ORIG.pt and OURS.pt load to equal objects")
    c.add_argument("orig")
    c.add_argument("ours")
    e = sub.add_parser("expect", help="FILE.pt matches SPEC.json")
    e.add_argument("spec")
    e.add_argument("file")
    z = sub.add_parser("zipcheck", help="FILE.pt is a well-formed aligned torch zip")
    z.add_argument("file")
    z.add_argument("--like", help="the torch-written file FILE copies (see zipcheck)")
    args = parser.parse_args(argv)
    if args.self_test:
        self_test()
        return 0
    if args.command is None:
        parser.error("a sub-command or --self-test is required")
    try:
        if args.command == "compare":
            print(f"compare: OK ({compare_files(args.orig, args.ours)} values)")
            return 0
        elif args.command == "expect":
            expect_file(args.spec, args.file)
        elif zipcheck(args.file, args.like):
            print("zipcheck: OK (torch.load and torch.load(weights_only=True))")
            return 0
    except Mismatch as e:
        print(f"{args.command}: {e}")
        return 1
    print(f"{args.command}: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
