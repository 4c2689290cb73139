"""What the tests/cli/test_*.py scripts share (each runs with its own folder first on sys.path:
`import testmain`): UCP (the binary under test), run (ucp with arguments, asserting its exit
code), run_both (the same, and the sanitized ucp_san when ctest gives one), one_error_line (the
one stderr line of a failed run, holding what it must name), fails (a run that exits with one
error line and writes nothing), Tmp (a temporary folder removed on exit), and the runner at the
end of each script:

  if __name__ == "__main__":
      import testmain
      testmain.run_tests(globals())

`SCRIPT [test_name ...]` runs the named test functions (every test_* function when none is
named), in name order, printing "ok NAME (SECONDS s)" after each; a name the script does not
define fails before any test runs. ctest runs one function per entry, or with ONE_PROCESS every
function in one entry (ucp_add_python_cases in cmake/ucp.cmake, which requires the
`if __name__ == "__main__":` line).
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
# ucp built with ASan + UBSan (ucp_san), when ctest runs the script; None otherwise.
SAN = os.environ.get("UCP_SAN")


def run(*args, expect=0):
    """ucp ARGS...; asserts the exit code is `expect` (showing the ends of its output if not)."""
    p = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == expect, (args, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def run_both(*args, expect):
    """`ucp ARGS` (exit `expect`), and under ctest the sanitized `ucp_san ARGS` too (UCP_SAN:
    ASan + UBSan): the same exit code and the same stderr, so no sanitizer report."""
    p = run(*args, expect=expect)
    if SAN:
        q = subprocess.run([SAN, *map(str, args)], capture_output=True, text=True)
        assert q.returncode == expect and q.stderr == p.stderr, (args, q.returncode,
                                                                 q.stderr[-3000:])
    return p


def one_error_line(p, *needles, kind=None):
    """The one line a failed ucp run `p` printed on stderr (asserted: exactly one), holding
    str() of every needle and, with `kind` ("usage error", "format error", ...), starting
    "ucp: KIND:"; returned."""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    if kind is not None:
        assert lines[0].startswith(f"ucp: {kind}:"), lines[0]
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def fails(args, expect, *needles, out, kind=None):
    """ucp ARGS (and ucp_san ARGS, run_both) exits `expect` with one error line holding every
    needle (one_error_line), and nothing is written: nothing at `out`, no staging folder
    (`.NAME.ucp-*`) beside it. Returns the line."""
    line = one_error_line(run_both(*args, expect=expect), *needles, kind=kind)
    out = pathlib.Path(out)
    assert not out.exists(), (args, "output left behind", out)
    if out.parent.is_dir():
        left = [q.name for q in out.parent.iterdir() if q.name.startswith(f".{out.name}.ucp-")]
        assert not left, (args, "staging left behind", left)
    return line


class Tmp:
    """`with Tmp("ucp-x-") as t:` a new folder (pathlib.Path), removed with what it holds."""

    def __init__(self, prefix="ucp-"):
        self.prefix = prefix

    def __enter__(self):
        self.path = pathlib.Path(tempfile.mkdtemp(prefix=self.prefix))
        return self.path

    def __exit__(self, *exc):
        shutil.rmtree(self.path)


def run_tests(namespace, argv=None):
    """Runs the test_* callables of `namespace` (a script's globals()) that argv (default
    sys.argv[1:]) names, or all of them."""
    tests = {k: v for k, v in sorted(namespace.items()) if k.startswith("test_")}
    only = sys.argv[1:] if argv is None else list(argv)
    unknown = [n for n in only if n not in tests]
    assert not unknown, f"no such test: {unknown}"
    for name, fn in tests.items():
        if not only or name in only:
            start = time.monotonic()
            fn()
            print(f"ok {name} ({time.monotonic() - start:.1f} s)", flush=True)
