"""The test suite's own rules, read from `ctest --show-only=json-v1` of the
build folder (so a test added without them fails here):

* every test has a TIMEOUT;
* every GoogleTest case reports GTEST_SKIP as skipped (SKIP_REGULAR_EXPRESSION);
* every test runs an interpreter or program by explicit path, never the
  first `python3` on PATH;
* seeded tests replay under one variable, UCP_TEST_SEED (no other *_SEED).

  check_suite.py BUILD_DIR
"""
import json
import os
import pathlib
import re
import subprocess
import sys


def main():
    build = pathlib.Path(sys.argv[1])
    ctest = os.environ.get("UCP_CTEST", "ctest")
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True,
                         text=True, check=True).stdout
    tests = json.loads(out)["tests"]
    assert len(tests) > 100, len(tests)
    bad = []
    for t in tests:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        name = t["name"]
        if not props.get("TIMEOUT"):
            bad.append(f"{name}: no TIMEOUT")
        command = t.get("command", [])
        if command and not os.path.isabs(command[0]):
            bad.append(f"{name}: runs {command[0]!r}, not an explicit path")
        if "--gtest_filter=" in " ".join(command) and "SKIP_REGULAR_EXPRESSION" not in props:
            bad.append(f"{name}: GoogleTest case without SKIP_REGULAR_EXPRESSION")
    source = pathlib.Path(__file__).resolve().parents[2]
    for path in list((source / "tests").rglob("*.py")) + list((source / "tests").rglob("*.cc")) \
            + list((source / "examples").rglob("*.sh")):
        if path.name == "check_suite.py":
            continue
        for m in re.finditer(r"\b(UCP_[A-Z_]*SEED)\b", path.read_text(errors="replace")):
            if m.group(1) != "UCP_TEST_SEED":
                bad.append(f"{path.relative_to(source)}: seed variable {m.group(1)}")
    for b in bad:
        print(b)
    print(f"{len(tests)} tests checked, {len(bad)} problems")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
