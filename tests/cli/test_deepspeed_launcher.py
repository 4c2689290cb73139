"""The forking launcher of tests/tools/deepspeed_real.py (the real-DeepSpeed
oracle's ranks) decides a run's verdict honestly: a rank still running at the
deadline fails the run (it is killed, and the run does not wait for it), as
does a rank that exits non-zero; only every rank exiting 0 in time passes.
The rank bodies are replaced by stand-ins (no torch, no DeepSpeed): what is
tested is the launcher's verdict, not DeepSpeed."""
import contextlib
import io
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import deepspeed_real  # noqa: E402

ARGS = ["make", "--world", 2, "--stage", 1, "--dtype", "fp32", "--out", "/nonexistent"]


def run_with(body, timeout):
    """deepspeed_real.command with `body(rank)` as every rank's work; returns
    (ok, seconds taken, what the launcher wrote to stderr)."""
    deepspeed_real.preload = lambda: None
    deepspeed_real.rank_make = lambda a: body(int(os.environ["RANK"]))
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err):
        _, ok = deepspeed_real.command(ARGS, timeout=timeout)
    return ok, time.monotonic() - start, err.getvalue()


def hang(_):
    time.sleep(120)


def test_every_rank_exiting_zero_passes():
    ok, took, err = run_with(lambda r: print("done", r), timeout=30)
    assert ok, err
    assert took < 25, took


def test_a_rank_running_at_the_deadline_fails():
    ok, took, err = run_with(lambda r: hang(r) if r == 1 else 0, timeout=2)
    assert not ok, err
    assert "rank 1 was still running after 2 s: killed" in err, err
    assert took < 20, took  # killed, not waited for


def test_every_rank_running_at_the_deadline_fails():
    ok, took, err = run_with(hang, timeout=2)
    assert not ok, err
    assert err.count("was still running") == 2, err
    assert took < 20, took


def test_a_rank_failing_fails():
    ok, _, err = run_with(lambda r: 1 if r == 0 else 0, timeout=30)
    assert not ok, err
    ok, _, err = run_with(lambda r: 1 / 0 if r == 1 else 0, timeout=30)
    assert not ok and "ZeroDivisionError" in err, err


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
