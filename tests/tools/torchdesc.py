"""Description JSON of torch.save files: the Python side of the contract in notes/HELPERS.md.

A *description* of a ``.pt`` file lists every tensor, scalar leaf and opaque object reachable from the
loaded root (traversal rule below), the archive layout (zip prefix and record names) and the globals
the pickle references.  It is what the C++ tests compare their reader against.

Two independent ways to compute one are provided:

* :func:`describe` loads the file with ``torch.load(map_location='cpu')`` and takes ``storage_key``,
  ``storage_nbytes`` and ``device`` from the pickle's persistent ids (recorded while torch loads).
* :func:`describe_raw` never calls ``torch.load``: it unpickles ``data.pkl`` (or the legacy object
  pickle) with placeholders for storages and tensors and gathers tensor bytes straight from the zip
  records / legacy storage blobs with numpy.  It also handles dtypes torch 1.13 does not know
  (uint16/32/64, float8_*).  Tools use it as a cross-check of :func:`describe` and as the structure
  oracle for files torch 1.13 cannot load.

Traversal rule (identical on the C++ side): start at the root; descend into containers whose type is
exactly ``dict`` or ``collections.OrderedDict`` (component = key, which must be ``str`` or ``int``),
exactly ``list`` or exactly ``tuple`` (component = index).  Everything else is a leaf: tensors (incl.
``nn.Parameter``) go to ``tensors``; ``None/bool/int/float/str/bytes`` (exact types) go to ``leaves``;
anything else goes to ``objects`` with ``type(obj).__module__ + "." + type(obj).__qualname__``, except
``torch.dtype`` values whose class is their global name (``"torch.bfloat16"``).  Lists are in
depth-first pre-order.

Classes Python cannot import (DeepSpeed, Megatron, ...) load as *stub classes* created on the fly with
the right ``__module__``/``__qualname__`` (see :func:`stub_class`), so the reported class names are the
real module paths.  Everything here is read-only with respect to the input files.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import pickle
import pickletools
import struct
import sys
import types
import zipfile
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import torch

# ----------------------------------------------------------------------------------------------------
# dtype tables (names as in the Description JSON: torch dtype name without the "torch." prefix)

#: Element size in bytes of every dtype a torch.save file may contain (incl. 2.x-only ones).
DTYPE_SIZES: Dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}

#: dtype of the typed storage classes pickled as ``GLOBAL 'torch <Name>'``.
STORAGE_CLASS_DTYPES: Dict[str, str] = {
    "DoubleStorage": "float64", "FloatStorage": "float32", "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16", "LongStorage": "int64", "IntStorage": "int32",
    "ShortStorage": "int16", "CharStorage": "int8", "ByteStorage": "uint8", "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128", "ComplexFloatStorage": "complex64",
    "UntypedStorage": "uint8",  # numel in the persistent id is then the byte count
}

LEAF_TYPES: Dict[type, str] = {
    type(None): "NoneType", bool: "bool", int: "int", float: "float", str: "str", bytes: "bytes",
}

ZIP_ALIGNMENT = 64


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).replace("torch.", "", 1)


# ----------------------------------------------------------------------------------------------------
# Stub classes for globals Python cannot import


class _StubMeta(type):
    """Metaclass of stub classes: unknown class attributes are enum-like members.

    Python 3.11 pickles an ``enum.Enum`` member as ``getattr(EnumClass, 'name')``; with a stub class that
    call returns a (cached) stub instance whose ``_stub_member`` is the name.
    """

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        members = type.__getattribute__(cls, "_stub_members")
        if name not in members:
            member = object.__new__(cls)
            member.__dict__["_stub_member"] = name
            members[name] = member
        return members[name]

    def __repr__(cls) -> str:
        return f"<stub class {cls.__module__}.{cls.__qualname__}>"


class StubObject(metaclass=_StubMeta):
    """Base of the stand-ins for unimportable classes.

    Accepts every way pickle builds an object: ``cls(*args)`` (REDUCE), ``cls.__new__(cls, *args)``
    (NEWOBJ), BUILD with a dict or any other state, SETITEMS and APPENDS.  Equality is class + state.
    """

    _stub_members: Dict[str, Any] = {}

    def __new__(cls, *args: Any, **kwargs: Any) -> "StubObject":
        obj = object.__new__(cls)
        if args:
            obj.__dict__["_stub_args"] = args
        if kwargs:
            obj.__dict__["_stub_kwargs"] = kwargs
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2 and (
                state[0] is None or isinstance(state[0], dict)) and isinstance(state[1], dict):
            state, slots = state  # (dict state, slot state) as object.__reduce_ex__ produces
            self.__dict__.update(slots)
        if isinstance(state, dict):
            self.__dict__.update(state)
        elif state is not None:
            self.__dict__["_stub_state"] = state

    def __setitem__(self, key: Any, value: Any) -> None:
        self.__dict__.setdefault("_stub_items", {})[key] = value

    def append(self, value: Any) -> None:
        self.__dict__.setdefault("_stub_list", []).append(value)

    def extend(self, values: Any) -> None:
        self.__dict__.setdefault("_stub_list", []).extend(values)

    def __eq__(self, other: Any) -> bool:
        return type(self) is type(other) and self.__dict__ == other.__dict__

    def __hash__(self) -> int:
        return hash((type(self).__module__, type(self).__qualname__,
                     self.__dict__.get("_stub_member"), repr(self.__dict__.get("_stub_args"))))

    def __repr__(self) -> str:
        cls = type(self)
        return f"<stub {cls.__module__}.{cls.__qualname__} {self.__dict__!r}>"


#: Packages whose globals are always resolved for real (Python 2 names included).
_REAL_PACKAGES = frozenset(sys.stdlib_module_names) | {"torch", "numpy", "__builtin__", "copy_reg"}

_STUB_CLASSES: Dict[Tuple[str, str], type] = {}


def stub_class(module: str, qualname: str) -> type:
    """Returns the (cached) stub class standing in for ``module.qualname``."""
    key = (module, qualname)
    if key not in _STUB_CLASSES:
        cls = _StubMeta(qualname.rsplit(".", 1)[-1], (StubObject,),
                        {"__module__": module, "__qualname__": qualname, "_stub_members": {}})
        _STUB_CLASSES[key] = cls
    return _STUB_CLASSES[key]


class TolerantUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that replaces unimportable globals by :func:`stub_class` stand-ins."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            # A name missing from torch, numpy or the standard library is a real incompatibility (e.g.
            # torch 1.13 lacks torch.uint16 and _rebuild_tensor_v3): never paper over it with a stub.
            if module.split(".", 1)[0] in _REAL_PACKAGES:
                raise
            return stub_class(module, name)


# ----------------------------------------------------------------------------------------------------
# Loading through torch.load while recording the persistent ids


@dataclasses.dataclass(frozen=True)
class StorageRef:
    """What a persistent id ``('storage', type, key, location, numel)`` says about one storage."""
    key: str
    location: str
    dtype: str  # dtype of the storage type (UntypedStorage: uint8)
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclasses.dataclass(frozen=True)
class TensorRef:
    """The arguments of one ``_rebuild_tensor*`` call."""
    storage: StorageRef
    storage_offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]


def _decode(s: Any) -> str:
    return s.decode("ascii") if isinstance(s, bytes) else str(s)


def _storage_dtype_of(storage_type: Any) -> str:
    """dtype name of a storage type object as torch's unpickler hands it to persistent_load."""
    dtype = getattr(storage_type, "dtype", None)  # torch.serialization.StorageType, typed classes
    if isinstance(dtype, torch.dtype):
        return dtype_name(dtype)
    name = getattr(storage_type, "__name__", "")
    if name in STORAGE_CLASS_DTYPES:
        return STORAGE_CLASS_DTYPES[name]
    raise ValueError(f"unknown storage type in persistent id: {storage_type!r}")


class Recorder:
    """Collects, while torch.load runs, which storage each tensor object was rebuilt from."""

    def __init__(self) -> None:
        self.storages: Dict[int, StorageRef] = {}
        self.tensors: Dict[int, TensorRef] = {}
        self._keep: List[Any] = []  # keeps recorded objects alive so their id() stays unique

    def wrap_persistent_load(self, persistent_load: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def recording_persistent_load(saved_id: Any) -> Any:
            result = persistent_load(saved_id)
            if isinstance(saved_id, tuple) and _decode(saved_id[0]) == "storage":
                storage_type, key, location, numel = saved_id[1:5]
                if len(saved_id) > 5 and saved_id[5] is not None:
                    raise NotImplementedError(f"legacy storage view metadata is not supported: {saved_id!r}")
                self.storages[id(result)] = StorageRef(
                    _decode(key), _decode(location), _storage_dtype_of(storage_type), int(numel))
                self._keep.append(result)
            return result
        return recording_persistent_load

    def rebuild_wrapper(self, name: str) -> Optional[Callable[..., Any]]:
        """A recording wrapper of ``torch._utils.<name>``, or None if `name` is not a rebuild function."""
        real = getattr(torch._utils, name, None)
        if real is None:
            return None
        if name in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            def rebuild(storage: Any, storage_offset: int, size: Any, stride: Any, *rest: Any) -> Any:
                tensor = real(storage, storage_offset, size, stride, *rest)
                if id(storage) not in self.storages:
                    raise ValueError("tensor rebuilt from a storage that did not come from a persistent id")
                self.tensors[id(tensor)] = TensorRef(self.storages[id(storage)], int(storage_offset),
                                                     tuple(size), tuple(stride))
                self._keep.append(tensor)
                return tensor
            return rebuild
        if name in ("_rebuild_parameter", "_rebuild_parameter_with_state"):
            def rebuild_parameter(data: Any, *rest: Any) -> Any:
                param = real(data, *rest)
                self.tensors[id(param)] = self.tensors[id(data)]
                self._keep.append(param)
                return param
            return rebuild_parameter
        return None


def make_pickle_module(recorder: Optional[Recorder] = None) -> types.ModuleType:
    """A ``pickle_module`` for ``torch.load``: stub-tolerant, optionally recording into `recorder`."""

    class Unpickler(TolerantUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if recorder is not None and module == "torch._utils":
                wrapper = recorder.rebuild_wrapper(name)
                if wrapper is not None:
                    return wrapper
            return super().find_class(module, name)

        def load(self) -> Any:
            if recorder is not None:
                persistent_load = getattr(self, "persistent_load", None)
                if persistent_load is not None:
                    self.persistent_load = recorder.wrap_persistent_load(persistent_load)
            return super().load()

    module = types.ModuleType("ucp_tolerant_pickle")
    module.__dict__.update({k: v for k, v in vars(pickle).items() if not k.startswith("__")})
    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    module.load = lambda f, **kw: Unpickler(f, **kw).load()  # type: ignore[attr-defined]
    module.loads = lambda b, **kw: Unpickler(io.BytesIO(b), **kw).load()  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def _torch_pickle_module(module: types.ModuleType) -> Iterator[None]:
    """Makes ``torch.load`` unpickle with `module`.

    torch 1.13.0a0 as packaged by Debian ignores ``torch.load(pickle_module=...)`` (its ``load`` does
    ``else: pickle_module = pickle``; fixed in 1.13.1), so the module global ``torch.serialization.pickle``
    is swapped for the duration of the call instead (and ``pickle_module`` is passed as well, for
    torch versions that honour it).
    """
    saved = torch.serialization.pickle
    torch.serialization.pickle = module
    try:
        yield
    finally:
        torch.serialization.pickle = saved


def load(path: str, recorder: Optional[Recorder] = None) -> Any:
    """``torch.load(path, map_location='cpu')`` with stub classes for unimportable globals."""
    module = make_pickle_module(recorder)
    with _torch_pickle_module(module):
        return torch.load(path, map_location="cpu", pickle_module=module)


# ----------------------------------------------------------------------------------------------------
# Archive inspection and pickle globals


@dataclasses.dataclass
class Archive:
    """Container-level facts of a torch.save file."""
    format: str                      # "zip" | "legacy"
    pickle: bytes                    # data.pkl, or the legacy object pickle
    archive_name: Optional[str] = None
    records: Optional[List[str]] = None  # zip: names without the prefix, central-directory order
    legacy_spans: Optional[List[Tuple[int, int]]] = None  # legacy: [start, end) of the 5 pickles


def is_zip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PK\x03\x04"


def _pickle_end(data: bytes, start: int) -> int:
    """End offset of the pickle starting at `start`."""
    stream = io.BytesIO(data)
    stream.seek(start)
    for op, _, _ in pickletools.genops(stream):
        if op.name == "STOP":
            return stream.tell()
    raise ValueError("pickle without STOP")


def inspect_archive(path: str) -> Archive:
    """Reads the container of `path`: zip layout or the legacy 5-pickle stream."""
    if is_zip(path):
        with zipfile.ZipFile(path) as zf:
            names = [info.filename for info in zf.infolist()]
            prefix = names[0].split("/", 1)[0]
            for name in names:
                if not name.startswith(prefix + "/"):
                    raise ValueError(f"{path}: record {name!r} is outside the archive folder {prefix!r}")
            records = [name[len(prefix) + 1:] for name in names]
            return Archive("zip", zf.read(f"{prefix}/data.pkl"), prefix, records)
    with open(path, "rb") as f:
        data = f.read()
    spans, pos = [], 0
    for _ in range(5):  # magic, protocol version, sys_info, object, storage keys
        end = _pickle_end(data, pos)
        spans.append((pos, end))
        pos = end
    start, end = spans[3]
    return Archive("legacy", data[start:end], legacy_spans=spans)


def pickle_globals(data: bytes) -> List[str]:
    """Sorted unique ``module.name`` of every GLOBAL / STACK_GLOBAL opcode in the pickle `data`.

    Names are as written in the pickle (protocol 2 keeps ``__builtin__``).  STACK_GLOBAL operands are
    resolved by following string pushes and the memo.
    """
    found = set()
    memo: Dict[int, Any] = {}
    recent: List[Any] = []  # values pushed by the last opcodes (None = not a string)
    for op, arg, _ in pickletools.genops(data):
        name = op.name
        if name == "GLOBAL":
            found.add(arg.replace(" ", ".", 1))
            recent.append(None)
        elif name == "STACK_GLOBAL":
            module, qualname = recent[-2], recent[-1]
            if not isinstance(module, str) or not isinstance(qualname, str):
                raise ValueError("STACK_GLOBAL operands are not plain strings")
            found.add(f"{module}.{qualname}")
            recent.append(None)
        elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING",
                      "BINSTRING", "SHORT_BINSTRING"):
            recent.append(arg)
        elif name in ("MEMOIZE", "BINPUT", "LONG_BINPUT", "PUT"):
            memo[len(memo) if name == "MEMOIZE" else int(arg)] = recent[-1] if recent else None
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            recent.append(memo.get(int(arg)))
        elif name not in ("FRAME", "PROTO"):
            recent.append(None)
        del recent[:-4]
    return sorted(found)


# ----------------------------------------------------------------------------------------------------
# Traversal and description


def walk(obj: Any, path: Optional[List[Any]] = None) -> Iterator[Tuple[List[Any], Any]]:
    """Yields ``(path, leaf)`` in depth-first pre-order following the traversal rule."""
    path = [] if path is None else path
    kind = type(obj)
    if kind is dict or kind is collections.OrderedDict:
        for key, value in obj.items():
            if type(key) not in (str, int):
                raise ValueError(f"dict key {key!r} of type {type(key).__name__} at path {path} "
                                 "cannot be a path component")
            yield from walk(value, path + [key])
    elif kind is list or kind is tuple:
        for index, value in enumerate(obj):
            yield from walk(value, path + [index])
    else:
        yield path, obj


def class_name(obj: Any) -> str:
    """Class of an ``objects`` entry: module + qualname, or the global name of a dtype."""
    if isinstance(obj, (torch.dtype, RawDType)):
        return str(obj)
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """Contiguous row-major little-endian bytes of `tensor` (any dtype, 0-d, empty)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def top_type_name(root: Any) -> str:
    """Returns "dict", "OrderedDict" or the class name of the loaded root object ("torch.Tensor"
    for a tensor, however it was rebuilt)."""
    kind = type(root)
    if kind is dict:
        return "dict"
    if kind is collections.OrderedDict:
        return "OrderedDict"
    if isinstance(root, RawTensor):
        return "torch.Tensor"
    return class_name(root)


def _leaf_entry(path: List[Any], obj: Any) -> Dict[str, Any]:
    return {"path": path, "type": LEAF_TYPES[type(obj)], "repr": repr(obj)}


def _archive_fields(path: str, archive: Archive) -> Dict[str, Any]:
    fields: Dict[str, Any] = {"file": os.path.basename(path), "format": archive.format}
    if archive.format == "zip":
        fields["archive_name"] = archive.archive_name
        fields["records"] = archive.records
    return fields


def describe(path: str) -> Dict[str, Any]:
    """Description JSON of `path` computed through ``torch.load`` (see module docstring)."""
    archive = inspect_archive(path)
    recorder = Recorder()
    root = load(path, recorder)
    tensors, leaves, objects = [], [], []
    for where, obj in walk(root):
        if isinstance(obj, torch.Tensor):
            ref = recorder.tensors.get(id(obj))
            if ref is None:
                raise ValueError(f"{path}: tensor at {where} was not rebuilt from a storage persistent id")
            if (ref.storage_offset != obj.storage_offset() or ref.size != tuple(obj.shape)
                    or ref.stride != tuple(obj.stride())):
                raise ValueError(f"{path}: tensor at {where} differs from its rebuild arguments")
            tensors.append({
                "path": where, "dtype": dtype_name(obj.dtype), "shape": list(obj.shape),
                "stride": list(obj.stride()), "storage_offset": obj.storage_offset(),
                "storage_key": ref.storage.key, "storage_nbytes": ref.storage.nbytes,
                "device": ref.storage.location, "requires_grad": bool(obj.requires_grad),
                "is_parameter": isinstance(obj, torch.nn.Parameter),
                "sha256": sha256_hex(tensor_bytes(obj)),
            })
        elif type(obj) in LEAF_TYPES:
            leaves.append(_leaf_entry(where, obj))
        else:
            objects.append({"path": where, "class": class_name(obj)})
    desc = _archive_fields(path, archive)
    desc.update({"oracle": "torch.load", "top_type": top_type_name(root), "tensors": tensors,
                 "leaves": leaves, "objects": objects, "globals": pickle_globals(archive.pickle)})
    return desc


# ----------------------------------------------------------------------------------------------------
# Raw description (no torch.load)


@dataclasses.dataclass(frozen=True)
class RawDType:
    """A dtype referenced by a pickle, known by name only (also for dtypes torch 1.13 lacks)."""
    name: str

    def __str__(self) -> str:
        return f"torch.{self.name}"


@dataclasses.dataclass(frozen=True)
class RawStorageType:
    name: str


@dataclasses.dataclass(frozen=True, eq=False)
class RawStorage:
    ref: StorageRef


@dataclasses.dataclass(frozen=True, eq=False)
class RawTensor:
    """A tensor as the pickle describes it."""
    storage: RawStorage
    storage_offset: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    requires_grad: bool
    dtype: str
    is_parameter: bool = False


def _raw_rebuild_v2(storage: RawStorage, storage_offset: int, size: Any, stride: Any,
                    requires_grad: bool = False, *_: Any) -> RawTensor:
    return RawTensor(storage, int(storage_offset), tuple(size), tuple(stride), bool(requires_grad),
                     storage.ref.dtype)


def _raw_rebuild_v3(storage: RawStorage, storage_offset: int, size: Any, stride: Any,
                    requires_grad: bool, _hooks: Any, dtype: Any, *_: Any) -> RawTensor:
    name = dtype.name if isinstance(dtype, RawDType) else dtype_name(dtype)
    return RawTensor(storage, int(storage_offset), tuple(size), tuple(stride), bool(requires_grad), name)


def _raw_rebuild_parameter(data: RawTensor, requires_grad: bool, *_: Any) -> RawTensor:
    return dataclasses.replace(data, requires_grad=bool(requires_grad), is_parameter=True)


class RawUnpickler(TolerantUnpickler):
    """Unpickles a torch pickle without torch: storages, tensors and dtypes become placeholders."""

    _TORCH_UTILS = {
        "_rebuild_tensor": _raw_rebuild_v2, "_rebuild_tensor_v2": _raw_rebuild_v2,
        "_rebuild_tensor_v3": _raw_rebuild_v3, "_rebuild_parameter": _raw_rebuild_parameter,
        "_rebuild_parameter_with_state": _raw_rebuild_parameter,
    }

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self.storage_refs: Dict[str, StorageRef] = {}
        self.globals_seen: set = set()  # every (raw) global the pickle asked for
        self._storages: Dict[str, RawStorage] = {}

    def find_class(self, module: str, name: str) -> Any:
        self.globals_seen.add(f"{module}.{name}")
        if module == "torch._utils" and name in self._TORCH_UTILS:
            return self._TORCH_UTILS[name]
        if module in ("torch", "torch.storage") and name in STORAGE_CLASS_DTYPES:
            return RawStorageType(name)
        if module == "torch" and name in DTYPE_SIZES:
            return RawDType(name)
        if module == "torch._utils" or (module == "torch._tensor" and name.startswith("_rebuild")):
            raise NotImplementedError(f"raw reader does not support {module}.{name}")
        return super().find_class(module, name)

    def persistent_load(self, saved_id: Any) -> RawStorage:
        if not (isinstance(saved_id, tuple) and _decode(saved_id[0]) == "storage"):
            raise ValueError(f"unexpected persistent id {saved_id!r}")
        storage_type, key, location, numel = saved_id[1:5]
        if len(saved_id) > 5 and saved_id[5] is not None:
            raise NotImplementedError(f"legacy storage view metadata is not supported: {saved_id!r}")
        if not isinstance(storage_type, RawStorageType):
            raise ValueError(f"unexpected storage type {storage_type!r}")
        ref = StorageRef(_decode(key), _decode(location), STORAGE_CLASS_DTYPES[storage_type.name], int(numel))
        if ref.key not in self._storages:
            self._storages[ref.key] = RawStorage(ref)
            self.storage_refs[ref.key] = ref
        elif self._storages[ref.key].ref != ref:
            raise ValueError(f"storage {ref.key} is referenced with different persistent ids")
        return self._storages[ref.key]


def _legacy_storage_blobs(data: bytes, archive: Archive, refs: Dict[str, StorageRef]) -> Dict[str, bytes]:
    """Raw storage bytes of a legacy file: after the keys pickle, per key an int64 count + data."""
    start, end = archive.legacy_spans[4]
    keys = pickle.loads(data[start:end])
    sys_info = pickle.loads(data[slice(*archive.legacy_spans[2])])
    if not sys_info.get("little_endian", False):
        raise NotImplementedError("big-endian legacy files are not supported")
    blobs, pos = {}, end
    for key in keys:
        ref = refs[_decode(key)]
        (count,) = struct.unpack_from("<q", data, pos)
        pos += 8
        nbytes = count * DTYPE_SIZES[ref.dtype]
        if count != ref.numel or pos + nbytes > len(data):
            raise ValueError(f"legacy storage {key}: element count {count}, pickle says {ref.numel}")
        blobs[ref.key] = data[pos:pos + nbytes]
        pos += nbytes
    if pos != len(data):
        raise ValueError(f"legacy file has {len(data) - pos} trailing bytes")
    return blobs


def gather_tensor_bytes(blob: bytes, tensor: RawTensor) -> bytes:
    """Row-major bytes of the strided view `tensor` of the storage bytes `blob`."""
    size = DTYPE_SIZES[tensor.dtype]
    elements = np.frombuffer(blob, dtype=np.dtype(f"V{size}"))
    numel = math.prod(tensor.size)
    if numel == 0:
        return b""
    last = tensor.storage_offset + sum((n - 1) * s for n, s in zip(tensor.size, tensor.stride))
    if tensor.storage_offset < 0 or any(s < 0 for s in tensor.stride) or last >= len(elements):
        raise ValueError(f"view {tensor} exceeds its storage of {len(elements)} elements")
    view = np.lib.stride_tricks.as_strided(
        elements[tensor.storage_offset:], shape=tensor.size,
        strides=tuple(s * size for s in tensor.stride), writeable=False)
    return np.ascontiguousarray(view).tobytes()


def describe_raw(path: str) -> Dict[str, Any]:
    """Description JSON of `path` computed without torch.load (see module docstring)."""
    archive = inspect_archive(path)
    unpickler = RawUnpickler(archive.pickle)
    root = unpickler.load()
    globals_ = pickle_globals(archive.pickle)
    if globals_ != sorted(unpickler.globals_seen):  # cross-check of the opcode scan
        raise ValueError(f"{path}: opcode scan found globals {globals_}, unpickling asked for "
                         f"{sorted(unpickler.globals_seen)}")
    if archive.format == "zip":
        with zipfile.ZipFile(path) as zf:
            blobs = {key: zf.read(f"{archive.archive_name}/data/{key}") for key in unpickler.storage_refs}
    else:
        with open(path, "rb") as f:
            blobs = _legacy_storage_blobs(f.read(), archive, unpickler.storage_refs)
    for key, ref in unpickler.storage_refs.items():
        if len(blobs[key]) != ref.nbytes:
            raise ValueError(f"{path}: storage {key} has {len(blobs[key])} bytes, pickle says {ref.nbytes}")
    tensors, leaves, objects = [], [], []
    for where, obj in walk(root):
        if isinstance(obj, RawTensor):
            ref = obj.storage.ref
            if DTYPE_SIZES[obj.dtype] * ref.numel != ref.nbytes and ref.dtype != "uint8":
                raise ValueError(f"{path}: tensor at {where} has dtype {obj.dtype} on a {ref.dtype} storage")
            tensors.append({
                "path": where, "dtype": obj.dtype, "shape": list(obj.size), "stride": list(obj.stride),
                "storage_offset": obj.storage_offset, "storage_key": ref.key,
                "storage_nbytes": ref.nbytes, "device": ref.location,
                "requires_grad": obj.requires_grad, "is_parameter": obj.is_parameter,
                "sha256": sha256_hex(gather_tensor_bytes(blobs[ref.key], obj)),
            })
        elif type(obj) in LEAF_TYPES:
            leaves.append(_leaf_entry(where, obj))
        else:
            objects.append({"path": where, "class": class_name(obj)})
    desc = _archive_fields(path, archive)
    desc.update({"oracle": "raw", "top_type": top_type_name(root), "tensors": tensors, "leaves": leaves,
                 "objects": objects, "globals": globals_})
    return desc


# ----------------------------------------------------------------------------------------------------
# Comparison and output

#: Fields every description has, in output order.
CONTENT_FIELDS = ("format", "archive_name", "records", "top_type", "tensors", "leaves", "objects", "globals")


def first_difference(expected: Dict[str, Any], actual: Dict[str, Any],
                     fields: Tuple[str, ...] = CONTENT_FIELDS) -> Optional[str]:
    """One line naming the first difference between two descriptions in `fields`, or None."""
    for field in fields:
        a, b = expected.get(field), actual.get(field)
        if field in ("tensors", "leaves", "objects"):
            a, b = a or [], b or []
            for i, (x, y) in enumerate(zip(a, b)):
                if x != y:
                    keys = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
                    return (f"{field}[{i}] (path {x.get('path')}): " +
                            "; ".join(f"{k}: {x.get(k)!r} != {y.get(k)!r}" for k in keys))
            if len(a) != len(b):
                extra = (a if len(a) > len(b) else b)[min(len(a), len(b))]
                return f"{field}: {len(a)} entries != {len(b)} entries (first unmatched: {extra})"
        elif a != b:
            return f"{field}: {a!r} != {b!r}"
    return None


def write_json(desc: Dict[str, Any], path: str) -> None:
    """Writes `desc` deterministically (fixed key order, one-space indent, trailing newline)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(desc, f, indent=1)
        f.write("\n")


def read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
