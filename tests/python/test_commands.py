"""ucp.convert / reshape / export / to_universal against the `ucp` command
(the same files from the same options), and the exceptions: class, exit
code and the CLI's one-line message."""

import filecmp
import pathlib
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ucp
from conftest import run_cli


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    g = torch.Generator().manual_seed(7)
    sd = {"layers.0.w": torch.randn(48, 32, generator=g),
          "layers.1.w": torch.randn(48, 32, generator=g).to(torch.bfloat16),
          "head": torch.randn(10, generator=g)}
    path = tmp_path_factory.mktemp("src") / "step-5"
    dcp.save(sd, checkpoint_id=str(path))
    return path


def _tree(root):
    root = pathlib.Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# A DCP .metadata holds a random save_id (a UUID, as torch writes one).
_UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-a[0-9a-f]{3}-[0-9a-f]{12}")


def assert_same_files(a, b):
    """Same file names and byte-identical files (counted); a .metadata's
    save_id aside."""
    names = _tree(a)
    assert names == _tree(b)
    files = [n for n in names if (pathlib.Path(a) / n).is_file()]
    assert files
    _, mismatch, errors = filecmp.cmpfiles(a, b, files, shallow=False)
    assert not errors, errors
    for name in mismatch:
        x, y = ((pathlib.Path(r) / name).read_bytes() for r in (a, b))
        assert name.endswith(".metadata") and len(_UUID.findall(x)) == 1, name
        assert _UUID.sub(b"U", x) == _UUID.sub(b"U", y), name
    return len(files)


def test_convert_kwargs_equal_cli(source, tmp_path, ucp_bin):
    summary = ucp.convert(source, tmp_path / "py", format="dcp", dp=2, no_sync=True)
    assert summary["command"] == "convert" if "command" in summary else summary
    run_cli(ucp_bin, "convert", source, "-o", tmp_path / "cli", "--format", "dcp",
            "--dp", 2, "--no-sync", "-q")
    assert assert_same_files(tmp_path / "py", tmp_path / "cli") >= 3
    # Negative control: another layout gives other files.
    ucp.convert(source, tmp_path / "py1", format="dcp", dp=1)
    with pytest.raises(AssertionError):
        assert_same_files(tmp_path / "py1", tmp_path / "cli")


def test_to_universal_reshape_export_kwargs_equal_cli(source, tmp_path, ucp_bin):
    u_py, u_cli = tmp_path / "py.h5", tmp_path / "cli.h5"
    ucp.to_universal(source, u_py)
    run_cli(ucp_bin, "to-universal", source, "-o", u_cli, "-q")
    assert u_py.read_bytes() == u_cli.read_bytes()
    ucp.reshape(u_py, tmp_path / "r_py", dp=3, threads=2)
    run_cli(ucp_bin, "reshape", u_cli, "-o", tmp_path / "r_cli", "--dp", 3,
            "--threads", 2, "-q")
    assert assert_same_files(tmp_path / "r_py", tmp_path / "r_cli") >= 4
    s = ucp.export(source, tmp_path / "e_py", dtype="bf16", max_shard_size="1KB")
    run_cli(ucp_bin, "export", source, "-o", tmp_path / "e_cli", "--dtype", "bf16",
            "--max-shard-size", "1KB", "-q")
    assert len(s["files"]) >= 2, s
    assert assert_same_files(tmp_path / "e_py", tmp_path / "e_cli") >= 3


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_progress_callback(source, tmp_path):
    """progress=callable: called from the engine's threads with (label,
    done, total); the last call of each stage has done == total; an
    exception in it is reported, not raised through the engine."""
    import threading

    calls = []
    main = threading.get_ident()

    def progress(label, done, total):
        calls.append((label, done, total, threading.get_ident() == main))

    ucp.to_universal(source, tmp_path / "u.h5", progress=progress)
    assert calls, "never called"
    labels = {c[0] for c in calls}
    for label in labels:
        last = [c for c in calls if c[0] == label][-1]
        assert last[1] == last[2] > 0, last
    assert all(isinstance(c[1], int) and c[1] <= c[2] for c in calls)

    def broken(label, done, total):
        raise RuntimeError("in the callback")

    ucp.to_universal(source, tmp_path / "v.h5", progress=broken)
    assert (tmp_path / "v.h5").read_bytes() == (tmp_path / "u.h5").read_bytes()
    with pytest.raises(ucp.UsageError, match="progress"):
        ucp.to_universal(source, tmp_path / "w.h5", progress="yes")


def _cli_error(ucp_bin, *args):
    p = run_cli(ucp_bin, *args, check=False)
    line = p.stderr.strip().splitlines()[-1]
    return p.returncode, line


@pytest.mark.parametrize("case", ["io", "format", "usage", "unknown_flag", "layout"])
def test_errors_carry_cli_message_and_class(case, source, tmp_path, ucp_bin):
    """Each error class: the exception's class and exit_code are the CLI's
    exit code's, and `ucp: <kind>: <message>` is the CLI's stderr line."""
    missing = tmp_path / "nothing-here"
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.bin").write_bytes(b"not a checkpoint")
    if case == "io":
        call = lambda: ucp.convert(missing, tmp_path / "o", dp=1)
        cli = ("convert", missing, "-o", tmp_path / "o", "--dp", 1)
        cls, code = ucp.IoError, 5
    elif case == "format":
        call = lambda: ucp.convert(junk, tmp_path / "o", dp=1)
        cli = ("convert", junk, "-o", tmp_path / "o", "--dp", 1)
        cls, code = ucp.FormatError, 3
    elif case == "usage":
        call = lambda: ucp.convert(source, tmp_path / "o", format="dcp")
        cli = ("convert", source, "-o", tmp_path / "o", "--format", "dcp")
        cls, code = ucp.UsageError, 2
    elif case == "unknown_flag":
        call = lambda: ucp.convert(source, tmp_path / "o", dp=1, bogus_flag=3)
        cli = ("convert", source, "-o", tmp_path / "o", "--dp", 1, "--bogus-flag", 3)
        cls, code = ucp.UsageError, 2
    else:
        call = lambda: ucp.convert(source, tmp_path / "o", format="megatron",
                                   tp=2, pp=1, dp=1)
        cli = ("convert", source, "-o", tmp_path / "o", "--format", "megatron",
               "--tp", 2, "--pp", 1, "--dp", 1)
        cls, code = None, None
    with pytest.raises(ucp.Error) as info:
        call()
    e = info.value
    rc, line = _cli_error(ucp_bin, *cli, "-q")
    if cls is not None:
        assert type(e) is cls, (type(e), e)
        assert e.exit_code == code == rc
    else:  # whichever class the engine raises, the CLI's code matches it
        assert e.exit_code == rc and e.exit_code in (2, 3, 4)
    assert line == f"ucp: {e.kind}: {e}", (line, str(e))
    assert isinstance(e, ucp.Error) and str(e) and "\n" not in str(e)
    assert not (tmp_path / "o").exists()


def test_open_errors(tmp_path):
    with pytest.raises(ucp.IoError, match="nothing"):
        ucp.open(tmp_path / "nothing")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("hello")
    with pytest.raises(ucp.FormatError) as info:
        ucp.open(tmp_path / "d")
    assert info.value.exit_code == 3 and str(tmp_path / "d") in str(info.value)
    with pytest.raises(ucp.UsageError, match="memory"):
        ucp.open(tmp_path / "d", memory="1K")


def test_read_errors(source):
    with ucp.open(source) as ckpt:
        with pytest.raises(ucp.UsageError, match="no param nope"):
            ckpt.read("nope")
        with pytest.raises(ucp.UsageError, match="no state exp_avg"):
            ckpt.read("head", "exp_avg")
        with pytest.raises(ucp.UsageError, match="rank"):
            ckpt.read("head", index=(slice(0, 2), slice(0, 1)))


def test_diff(source, tmp_path):
    """ucp.diff: a checkpoint equals its conversion, and one element changed
    (in a copy torch saves) makes them differ by that one element."""
    ucp.convert(source, tmp_path / "two", format="dcp", dp=2)
    assert ucp.diff(source, tmp_path / "two")["equal"] is True
    full = {k: torch.zeros(v) for k, v in (("layers.0.w", (48, 32)), ("head", (10,)))}
    full["layers.1.w"] = torch.zeros(48, 32, dtype=torch.bfloat16)
    dcp.load(full, checkpoint_id=str(source))
    full["head"][3] += 1
    dcp.save(full, checkpoint_id=str(tmp_path / "step-5"))
    report = ucp.diff(source, tmp_path / "step-5")
    assert report["equal"] is False
    assert report["summary"]["differing_elements"] == 1, report["summary"]
    assert report["summary"]["params_differing"] == 1, report["summary"]
