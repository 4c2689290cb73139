"""Shared fixtures of the Python package's tests (tests/python, pytest).

Run by ctest (tests/python/CMakeLists.txt) with the tests' venv (torch,
h5py, ml_dtypes, pytest) and PYTHONPATH=<build>/python, where the main build
puts the module _ucp beside a copy of python/ucp. By hand:
  PYTHONPATH=build/python UCP_BINARY_DIR=build UCP_FIXTURES=../shared/fixtures \
    ~/.cache/ucp/venv/bin/python -m pytest tests/python
"""

import os
import pathlib
import subprocess

import numpy as np
import pytest

try:
    import ucp  # noqa: F401
except ImportError as e:
    raise ImportError(
        f"tests/python: cannot import the package ucp ({e}): the build makes its module "
        "with -DUCP_BUILD_PYTHON=ON (the default with the tests) when pybind11 and Python's headers "
        "are there (see the configure warnings); PYTHONPATH=<build>/python") from e


def _env_path(name, default):
    value = os.environ.get(name)
    return pathlib.Path(value) if value else default


@pytest.fixture(scope="session")
def ucp_bin():
    """The `ucp` command of the same build (the CLI the binding must match)."""
    build = _env_path("UCP_BINARY_DIR", pathlib.Path(__file__).parents[2] / "build")
    exe = build / "cli" / "ucp"
    assert exe.is_file(), f"no ucp binary at {exe} (UCP_BINARY_DIR)"
    return exe


@pytest.fixture(scope="session")
def fixtures():
    """The real frameworks' checkpoints (read-only)."""
    root = _env_path("UCP_FIXTURES",
                     pathlib.Path(__file__).parents[3] / "shared" / "fixtures")
    assert root.is_dir(), f"no fixtures at {root} (UCP_FIXTURES)"
    return root


def run_cli(ucp_bin, *args, check=True):
    """Runs `ucp ARGS`; the completed process (text)."""
    p = subprocess.run([str(ucp_bin), *map(str, args)], capture_output=True,
                       text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"ucp {' '.join(map(str, args))}: rc "
                             f"{p.returncode}: {p.stderr}")
    return p


class Compared:
    """Counts the values an oracle check compared (each test asserts a
    minimum, so that a check that compares nothing fails)."""

    def __init__(self):
        self.tensors = 0
        self.elements = 0

    def equal(self, got, want, what):
        """Asserts bitwise equality of two arrays (dtype, shape, bytes)."""
        assert bits_equal(got, want), (
            f"{what}: ucp {got.dtype}{got.shape} differs from the oracle's "
            f"{want.dtype}{want.shape}")
        self.tensors += 1
        self.elements += int(np.asarray(got).size)


def bits_equal(got, want):
    """Same shape, same element size and identical bytes."""
    got = np.ascontiguousarray(got)
    want = np.ascontiguousarray(want)
    return (got.shape == want.shape and got.dtype.itemsize == want.dtype.itemsize
            and got.tobytes() == want.tobytes())


def negative_control(arr):
    """A copy of `arr` with one byte changed: bits_equal must tell it apart."""
    flipped = np.array(arr, copy=True)
    raw = flipped.reshape(-1).view(np.uint8)
    raw[raw.size // 2] ^= 0x01
    assert not bits_equal(flipped, arr), "negative control: a flipped byte went unnoticed"
    return flipped


def torch_to_numpy(t):
    """A torch tensor's exact bits as numpy (bf16 / fp8 via ml_dtypes)."""
    import ml_dtypes
    import torch

    t = t.detach().cpu().contiguous()
    special = {torch.bfloat16: ml_dtypes.bfloat16}
    for name in ("float8_e4m3fn", "float8_e5m2"):
        if hasattr(torch, name):
            special[getattr(torch, name)] = getattr(ml_dtypes, name)
    if t.dtype in special:
        bits = t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy()
        return bits.view(special[t.dtype])
    return t.numpy()
