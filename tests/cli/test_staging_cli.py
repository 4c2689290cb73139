#!/usr/bin/python3
"""What a crashed run leaves behind, and running out of disk.

- Staging named after a process that no longer exists (or whose pid was
  reused: another start time) is reclaimed by the next run writing the same
  name; staging of a live process is never touched; `ucp verify` and
  `ucp inspect` report leftovers.
- kill -9 in the middle of `convert`, `to-universal` and `export` leaves
  hidden staging only; a rerun into the same name removes it and succeeds.
- Too little free space (UCP_TESTING_FREE_BYTES stands in for statvfs) fails
  before anything is written, naming both numbers.
- Nothing is written outside the output: no scratch files in $TMPDIR (a
  crash could leave them there), so every command works with TMPDIR naming a
  file.
Sources: the real DeepSpeed fixtures and tests/tools/make_deepspeed_ckpts.py
(a larger checkpoint, so that there is time to kill the run).
"""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
FIX = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5" / "ds0145_z2_fp32_w2_mlp"
MEGATRON = pathlib.Path(os.environ["UCP_FIXTURES"]) / "megatron-23.06" / "synth_tp2"


def run(*args, expect=0, env=None):
    p = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True,
                       env=dict(os.environ, **(env or {})))
    assert p.returncode == expect, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p


def start_time(pid):
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[19])


def dead_pid():
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def staging(parent, name):
    return sorted(x.name for x in parent.iterdir() if x.name.startswith(f".{name}.ucp-"))


def test_reclaim_rules_and_reports():
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        me = os.getpid()
        dead = dead_pid()
        entries = {
            # A dead process (a folder with data, a file).
            f".out.ucp-partial-{dead}-123-aaaaaa": True,
            f".out.h5.ucp-tmp-{dead}-456-0": False,  # output "out.h5", not "out"
            # Our pid, but another start time: the pid was reused.
            f".out.ucp-partial-{me}-{start_time(me) + 1}-bbbbbb": True,
            # A live process (this one): never touched.
            f".out.ucp-partial-{me}-{start_time(me)}-cccccc": False,
            # Another output's staging, and an older name without a token.
            f".other.ucp-partial-{dead}-1-dddddd": False,
            ".out.ucp-partial-eeeeee": False,
        }
        for name in entries:
            if ".ucp-partial-" in name:
                (t / name / "global_step2").mkdir(parents=True)
                (t / name / "global_step2" / "x.pt").write_bytes(b"\0" * 4096)
            else:
                (t / name).write_bytes(b"\0" * 1000)
        # verify / inspect say so (and change nothing).
        run("convert", FIX, "-o", t / "ok", "--dp", 1, "-q")
        shutil.copytree(t / f".out.ucp-partial-{dead}-123-aaaaaa", t / "ok" / f".x.ucp-partial-{dead}-9-ffffff")
        p = run("verify", t / "ok", "--json", "-q")
        left = json.loads(p.stdout)["leftovers"]
        assert [(pathlib.Path(x["path"]).name, x["running"], x["bytes"]) for x in left] == \
            [(f".x.ucp-partial-{dead}-9-ffffff", False, 4096)], left
        assert "ucp: note:" in p.stderr and "no longer running" in p.stderr, p.stderr
        p = run("inspect", t / "ok", "--json")
        assert len(json.loads(p.stdout)["leftovers"]) == 1
        assert all(".ucp-partial-" not in f["path"] for f in json.loads(p.stdout)["files"])
        # The next run writing "out" reclaims the dead ones only.
        run("convert", FIX, "-o", t / "out", "--dp", 1, "-q")
        assert (t / "out" / "latest").exists()
        want = sorted(n for n, gone in entries.items() if not gone and n.startswith(".out.ucp-"))
        assert staging(t, "out") == want, staging(t, "out")
        assert staging(t, "out.h5") == [f".out.h5.ucp-tmp-{dead}-456-0"]
        assert staging(t, "other") == [f".other.ucp-partial-{dead}-1-dddddd"]
        # ... and a run writing "out.h5" reclaims that one.
        run("to-universal", FIX, "-o", t / "out.h5", "-q")
        assert staging(t, "out.h5") == []


def test_reclaim_file_outputs():
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        dead = dead_pid()
        (t / f".a.h5.ucp-tmp-{dead}-7-0").write_bytes(b"x" * 100)
        run("to-universal", FIX, "-o", t / "a.h5", "-q")
        assert staging(t, "a.h5") == [] and (t / "a.h5").exists()


def kill_when_staging_appears(args, parent, name):
    """Starts ucp, SIGKILLs it as soon as its staging shows up; returns the
    staging names seen at the kill."""
    p = subprocess.Popen([str(UCP), *map(str, args)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    seen = []
    while time.monotonic() < deadline and p.poll() is None:
        seen = staging(parent, name)
        if seen and any(x.stat().st_size > 0 for x in parent.glob(f".{name}.ucp-*/**/*")
                        if x.is_file()) or (seen and ".ucp-tmp-" in seen[0]):
            os.kill(p.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    p.wait()
    assert p.returncode == -signal.SIGKILL, ("finished before it could be killed", args)
    return seen


def test_kill_9_then_rerun():
    gen = HERE.parent / "tools" / "make_deepspeed_ckpts.py"
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        subprocess.run([sys.executable, str(gen), "--out", str(t / "gen"), "--bench-gib", "0.3"],
                       check=True, capture_output=True)
        src = t / "gen" / "z2_bf16_w2"
        for cmd, out in [(["convert", src, "--dp", 3, "--zero-stage", 1], "conv"),
                         (["to-universal", src], "u.h5"),
                         (["export", src], "hf")]:
            args = [*cmd, "-o", t / out, "--threads", 1, "-q"]
            seen = kill_when_staging_appears(args, t, out)
            assert seen, cmd
            assert not (t / out).exists(), cmd  # nothing under the final name
            assert staging(t, out), cmd          # the crash left staging behind
            run("verify", t / "gen" / "z2_bf16_w2", "-q")  # the source is intact
            run(*args)
            assert (t / out).exists() and staging(t, out) == [], (cmd, staging(t, out))


def test_not_enough_free_space():
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        for cmd, out in [(["convert", FIX, "--dp", 1], "o"), (["to-universal", FIX], "o.h5"),
                         (["export", FIX], "hf")]:
            p = run(*cmd, "-o", t / out, expect=5, env={"UCP_TESTING_FREE_BYTES": "100"})
            lines = p.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("ucp: i/o error: not enough free space"), p.stderr
            assert "100 bytes" in lines[0] and "needs at least" in lines[0], lines[0]
            assert not (t / out).exists() and staging(t, out) == [], (cmd, list(t.iterdir()))
        # Enough space: fine.
        run("convert", FIX, "--dp", 1, "-o", t / "o", "-q", env={"UCP_TESTING_FREE_BYTES": str(1 << 40)})


def test_no_scratch_files_in_tmpdir():
    """Torch blobs (args, RNG and optimizer state) are built and read in
    memory: with TMPDIR naming a file, where nothing can be created, every
    command still works (it failed when they went through $TMPDIR, where a
    kill -9 left them for good)."""
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        (t / "not-a-folder").write_bytes(b"")
        env = {"TMPDIR": str(t / "not-a-folder")}
        for name, src, layout in [("ds", FIX, ["--dp", 1]), ("mg", MEGATRON, ["--tp", 1, "--dp", 1])]:
            run("to-universal", src, "-o", t / f"{name}.h5", "-q", env=env)
            run("reshape", t / f"{name}.h5", "-o", t / f"{name}-r", *layout, "-q", env=env)
            run("convert", src, "-o", t / f"{name}-c", *layout, "-q", env=env)
            run("export", src, "-o", t / f"{name}-e", "-q", env=env)
            run("verify", src, "-q", env=env)
            run("verify", t / f"{name}-c", "-q", env=env)
            save = t / f"{name}-save"
            shutil.copytree(src, save)
            run("resume", save, *layout, "-o", t / f"{name}-load", "-q", env=env)
            assert (t / f"{name}-load").is_dir(), name
            run("verify", t / f"{name}-load", "-q", env=env)


def fsyncs(args, t, no_sync_env=None):
    """Runs ucp under strace; returns how many fsync/fdatasync calls it made.
    The suite runs with UCP_NO_SYNC=1 (cmake/ucp.cmake): left out here unless
    `no_sync_env` gives its value."""
    log = t / "strace.log"
    env = {k: v for k, v in os.environ.items() if k != "UCP_NO_SYNC"}
    if no_sync_env is not None:
        env["UCP_NO_SYNC"] = no_sync_env
    p = subprocess.run(["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", str(log),
                        str(UCP), *map(str, args)], capture_output=True, text=True, env=env)
    assert p.returncode == 0, (args, p.stderr[-2000:])
    return sum(1 for line in log.read_text().splitlines() if "sync(" in line)


def test_output_folders_get_the_umask_permissions():
    """An output folder is made under a temporary name (mkdtemp: 0700) and
    renamed into place: it must end with the permissions any new folder gets
    (0777 less the umask), or the job's other users cannot read it."""
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        for mask in (0o022, 0o027):
            old = os.umask(mask)
            try:
                out = t / f"out{mask:o}"
                run("convert", FIX, "-o", out, "--dp", 1, "--zero-stage", 1, "-q")
                run("export", FIX, "-o", t / f"hf{mask:o}", "-q")
            finally:
                os.umask(old)
            for folder in (out, t / f"hf{mask:o}"):
                mode = folder.stat().st_mode & 0o777
                assert mode == 0o777 & ~mask, (folder, oct(mode), oct(mask))


def test_no_sync_skips_fsync():
    """Outputs are fsynced before they are renamed into place; --no-sync (like
    cp) skips that, and writes the same bytes."""
    with tempfile.TemporaryDirectory(prefix="ucp-staging-") as t:
        t = pathlib.Path(t)
        for cmd, out in [(["convert", FIX, "--dp", 1], "c"), (["to-universal", FIX], "u.h5"),
                         (["export", FIX], "e")]:
            assert fsyncs([*cmd, "-o", t / out, "-q"], t) > 0, cmd
            assert fsyncs([*cmd, "-o", t / f"{out}-ns", "-q", "--no-sync"], t) == 0, cmd
            # UCP_NO_SYNC=1 is --no-sync for every command; "0" is not.
            assert fsyncs([*cmd, "-o", t / f"{out}-env", "-q"], t, "1") == 0, cmd
            assert fsyncs([*cmd, "-o", t / f"{out}-env0", "-q"], t, "0") > 0, cmd
        for a, b in [("c", "c-ns"), ("e", "e-ns")]:
            fa = sorted(p.relative_to(t / a) for p in (t / a).rglob("*") if p.is_file())
            fb = sorted(p.relative_to(t / b) for p in (t / b).rglob("*") if p.is_file())
            assert fa == fb and all((t / a / f).read_bytes() == (t / b / f).read_bytes() for f in fa)


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
