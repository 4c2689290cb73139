# Type stubs of the package ucp (python/ucp/__init__.py).
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from ._ucp import (
    Error as Error,
    FormatError as FormatError,
    InternalError as InternalError,
    IoError as IoError,
    LayoutError as LayoutError,
    UsageError as UsageError,
)

__version__: str
_Path = str | os.PathLike[str]
# True: ucp's bar on stderr; a callable: called as progress(label, done, total).
_Progress = bool | Callable[[str, int, int], Any] | None

@dataclass(frozen=True)
class Param:
    name: str
    shape: tuple[int, ...]
    dtype: str
    states: tuple[str, ...]
    kind: str = ...
    frozen: bool = ...
    state_shapes: Mapping[str, tuple[int, ...]] = ...
    state_dtypes: Mapping[str, str] = ...

class Checkpoint:
    @property
    def format(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def iteration(self) -> int: ...
    @property
    def topology(self) -> dict[str, Any]: ...
    @property
    def bytes_read(self) -> int: ...
    def params(self) -> list[Param]: ...
    def __contains__(self, name: str) -> bool: ...
    def read(
        self, name: str, state: str = ..., index: Any = ..., dtype: Any = ...
    ) -> np.ndarray: ...
    def read_into(
        self, name: str, tensor: Any, state: str = ..., index: Any = ...
    ) -> Any: ...
    def close(self) -> None: ...
    def __enter__(self) -> Checkpoint: ...
    def __exit__(self, *exc: Any) -> None: ...

def open(
    path: _Path,
    format: str | None = ...,
    *,
    layout: str | None = ...,
    vocab_size: int | None = ...,
    threads: int = ...,
    memory: str = ...,
    **options: Any,
) -> Checkpoint: ...
def to_universal(
    src: _Path, dst: _Path, *, progress: _Progress = ..., **options: Any
) -> dict[str, Any]: ...
def reshape(
    src: _Path,
    dst: _Path,
    format: str | None = ...,
    names: str | None = ...,
    *,
    progress: _Progress = ...,
    **topology_and_options: Any,
) -> dict[str, Any]: ...
def convert(
    src: _Path,
    dst: _Path,
    format: str | None = ...,
    names: str | None = ...,
    progress: _Progress = ...,
    **topology_and_options: Any,
) -> dict[str, Any]: ...
def export(
    src: _Path,
    dst: _Path,
    format: str | None = ...,
    *,
    progress: _Progress = ...,
    **options: Any,
) -> dict[str, Any]: ...

@dataclass(frozen=True)
class SkippedCheckpoint:
    name: str
    iteration: int
    reason: str

@dataclass(frozen=True)
class ResumeResult:
    load_dir: str
    iteration: int
    consumed_samples: int | None
    skipped: tuple[SkippedCheckpoint, ...]
    data_skip_steps: int | None
    checkpoint: str
    format: str
    reshaped: bool
    summary: dict[str, Any]

def resume(
    save_dir: _Path,
    output: _Path | None = ...,
    *,
    progress: _Progress = ...,
    **topology_and_options: Any,
) -> ResumeResult: ...
def diff(
    a: _Path,
    b: _Path,
    atol: float = ...,
    rtol: float = ...,
    names: str | None = ...,
    *,
    progress: _Progress = ...,
    **options: Any,
) -> dict[str, Any]: ...
