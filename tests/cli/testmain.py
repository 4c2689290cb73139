"""The runner at the end of each tests/cli/test_*.py script (it runs with the script's folder
first on sys.path: `import testmain`):

  if __name__ == "__main__":
      import testmain
      testmain.run_tests(globals())

`SCRIPT [test_name ...]` runs the named test functions (every test_* function when none is
named), in name order, printing "ok NAME" after each; a name the script does not define fails
before any test runs. ctest runs one function per entry (ucp_add_python_cases in
cmake/ucp.cmake, which requires the `if __name__ == "__main__":` line).
"""
import sys


def run_tests(namespace, argv=None):
    """Runs the test_* callables of `namespace` (a script's globals()) that argv (default
    sys.argv[1:]) names, or all of them."""
    tests = {k: v for k, v in sorted(namespace.items()) if k.startswith("test_")}
    only = sys.argv[1:] if argv is None else list(argv)
    unknown = [n for n in only if n not in tests]
    assert not unknown, f"no such test: {unknown}"
    for name, fn in tests.items():
        if not only or name in only:
            fn()
            print("ok", name, flush=True)
