"""The test suite's own rules, read from `ctest --show-only=json-v1` of the
build folder (so a test added without them fails here):

* every test has a TIMEOUT, and a TIMEOUT above suite_times.UNMEASURED_BOUND
  (300 s) only with a line in tests/test_times.txt that measured the test at
  a third of it or more; every line of that table names a test, and a test
  it gives several processors has them as PROCESSORS; only a test that
  waits for no other (a fixture's setup, a test needing no fixture) has
  more than one (ctest starts such a test only when that many slots are
  free at once: a test that becomes ready later would start last);
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import suite_times  # noqa: E402


def main():
    build = pathlib.Path(sys.argv[1])
    ctest = os.environ.get("UCP_CTEST", "ctest")
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True,
                         text=True, check=True).stdout
    tests = json.loads(out)["tests"]
    assert len(tests) > 100, len(tests)
    bad = []
    rows = suite_times.read_table()
    used = set()
    for t in tests:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        name = t["name"]
        row = suite_times.lookup(rows, name)
        if row:
            used.add(next(k for k, _, _ in rows if k == name or
                          (k.endswith("*") and name.startswith(k[:-1]))))
        if not props.get("TIMEOUT"):
            bad.append(f"{name}: no TIMEOUT")
        else:
            limit = float(props["TIMEOUT"])
            justified = row is not None and limit <= suite_times.limit_of(row[0])
            if limit > suite_times.UNMEASURED_BOUND and not justified:
                bad.append(f"{name}: TIMEOUT {limit:.0f} s above {suite_times.UNMEASURED_BOUND} s "
                           f"without a measured time of a third of it in tests/test_times.txt")
        if row and row[1] > 1 and int(props.get("PROCESSORS", 1)) != row[1]:
            bad.append(f"{name}: PROCESSORS {props.get('PROCESSORS', 1)}, the table says {row[1]}")
        if int(props.get("PROCESSORS", 1)) > 1 and (props.get("DEPENDS") or
                                                    props.get("FIXTURES_REQUIRED")):
            bad.append(f"{name}: PROCESSORS {props['PROCESSORS']} on a test that waits for "
                       f"another (ctest -j2 would start it only when both slots are free at "
                       f"once: at the end of the run); give it 1")
        command = t.get("command", [])
        if command and not os.path.isabs(command[0]):
            bad.append(f"{name}: runs {command[0]!r}, not an explicit path")
        if "--gtest_filter=" in " ".join(command) and "SKIP_REGULAR_EXPRESSION" not in props:
            bad.append(f"{name}: GoogleTest case without SKIP_REGULAR_EXPRESSION")
    for key, _, _ in rows:
        if key not in used:
            bad.append(f"tests/test_times.txt: {key} names no test")
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
