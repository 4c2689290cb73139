"""The suite's time: what each test took (a ctest JUnit file, ctest
--output-junit) against its TIMEOUT (tests/test_times.txt, read by
cmake/ucp_test_times.cmake: TIMEOUT = max(30, 3 x measured seconds)).

  suite_times.py summary JUNIT... [--slowest N]
      the N slowest tests, the sum of the tests' times, counts by outcome, and
      the N slowest functions (cases) of the tests that run several in one
      process (their "ok NAME (S s)" lines)
      (.ci/dev test prints it after ctest, then ctest's closing lines again)
  suite_times.py limits BUILD_DIR JUNIT...
      every test: measured seconds, TIMEOUT, PROCESSORS, and a flag when the
      measured time is above half its limit or the limit is over 3x what a
      fresh table would give (recalibrate then)
  suite_times.py table BUILD_DIR JUNIT... [--table tests/test_times.txt]
      the table again from the run's times (stdout): one line per test, one
      "<binary>.*" line per GoogleTest binary whose cases all take under 20 s
      (its slowest case; a line per case otherwise), PROCESSORS
      kept from the current table, lines matching no test that ran kept as they
      are; review and copy over tests/test_times.txt

Run the suite alone on the machine for the times (ctest -j1 measures each
test without the others' load; with -jN they are N-fold inflated).
"""
import argparse
import json
import math
import os
import pathlib
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

HERE = pathlib.Path(__file__).resolve().parent
TABLE = HERE.parent / "test_times.txt"
MIN_TIMEOUT = 30
# A test's TIMEOUT above this needs a line in the table measured at a third
# of it or more (check_suite.py).
UNMEASURED_BOUND = 300
GROUP_SECONDS = 20


def read_table(path=TABLE):
    """[(key, seconds, processors)] in file order; key: a test name, or a
    prefix ending in '*'."""
    rows = []
    for line in pathlib.Path(path).read_text().splitlines():
        f = line.split()
        if not f or f[0].startswith("#"):
            continue
        rows.append((f[0], int(f[1]), int(f[2]) if len(f) > 2 else 1))
    return rows


def lookup(rows, name):
    """(seconds, processors) of the first row matching `name`, or None (as
    cmake/ucp_test_times.cmake)."""
    for key, secs, procs in rows:
        if key == name or (key.endswith("*") and name.startswith(key[:-1])):
            return secs, procs
    return None


def limit_of(secs):
    return max(MIN_TIMEOUT, 3 * secs)


def read_junit(paths):
    """{test name: (seconds, outcome)} of one or more JUnit files (a test in several: its
    longest run, the last run's outcome); outcome: passed, failed, skipped, notrun."""
    out = {}
    for path in [paths] if isinstance(paths, str) else paths:
        for name, (secs, outcome) in _read_one(path).items():
            out[name] = (max(secs, out.get(name, (0, ""))[0]), outcome)
    return out


def _read_one(path):
    out = {}
    for tc in ET.parse(path).getroot().iter("testcase"):
        status = tc.get("status", "run")
        if tc.find("failure") is not None or tc.find("error") is not None or status == "fail":
            outcome = "failed"
        elif tc.find("skipped") is not None or status in ("disabled", "notrun"):
            outcome = "skipped" if status != "notrun" else "notrun"
        else:
            outcome = "passed"
        out[tc.get("name")] = (float(tc.get("time") or 0), outcome)
    return out


PART = re.compile(r"^ok (\S.*) \((\d+(?:\.\d+)?) s\)$")


def read_parts(paths):
    """{"<test> / <part>": seconds} of the tests that run several functions or cases in one
    process (ONE_PROCESS scripts print "ok <function> (<seconds> s)" after each, the DeepSpeed
    entries "ok case ... (<seconds> s)"), from the output the JUnit file keeps."""
    out = {}
    for path in [paths] if isinstance(paths, str) else paths:
        for tc in ET.parse(path).getroot().iter("testcase"):
            text = "".join(e.text or "" for e in tc.iter("system-out"))
            for line in text.splitlines():
                m = PART.match(line)
                # (an entry of one function prints its own line too: not a part)
                if m and not tc.get("name").endswith("." + m.group(1)):
                    out[f"{tc.get('name')} / {m.group(1)}"] = float(m.group(2))
    return out


def listing(build):
    ctest = os.environ.get("UCP_CTEST", "ctest")
    out = subprocess.run([ctest, "--show-only=json-v1"], cwd=build, capture_output=True,
                         text=True, check=True).stdout
    tests = {}
    for t in json.loads(out)["tests"]:
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        tests[t["name"]] = (props, t.get("command", []))
    return tests


def summary(a):
    times = read_junit(a.junit)
    if not times:
        print("test times: no tests in", " ".join(a.junit))
        return 0
    total = sum(s for s, _ in times.values())
    by = {}
    for _, o in times.values():
        by[o] = by.get(o, 0) + 1
    print(f"test times: the {min(a.slowest, len(times))} slowest of {len(times)} tests "
          f"(sum of test times {total:.0f} s; "
          + ", ".join(f"{n} {o}" for o, n in sorted(by.items())) + ")")
    for name, (s, o) in sorted(times.items(), key=lambda kv: -kv[1][0])[:a.slowest]:
        print(f"  {s:8.1f} s  {name}" + ("" if o == "passed" else f"  [{o}]"))
    parts = read_parts(a.junit)
    if parts:
        print(f"the {min(a.slowest, len(parts))} slowest of the {len(parts)} functions and cases "
              "that one-process tests ran:")
        for name, s in sorted(parts.items(), key=lambda kv: -kv[1])[:a.slowest]:
            print(f"  {s:8.1f} s  {name}")
    return 0


def limits(a):
    times = read_junit(a.junit)
    tests = listing(a.build)
    rows = read_table(a.table)
    flagged = 0
    print(f"{'measured':>9} {'TIMEOUT':>8} {'procs':>5}  test")
    for name, (props, _) in sorted(tests.items(), key=lambda kv: -times.get(kv[0], (0, ""))[0]):
        s, outcome = times.get(name, (None, "not run"))
        limit = float(props.get("TIMEOUT") or 0)
        procs = props.get("PROCESSORS", 1)
        note = []
        if s is None:
            note.append("not in the JUnit file")
        else:
            if limit and s > limit / 2:
                note.append("above half its TIMEOUT")
            if limit > 3 * limit_of(math.ceil(s)):
                note.append(f"TIMEOUT over 3x a fresh limit ({limit_of(math.ceil(s))} s)")
            if outcome != "passed":
                note.append(outcome)
        if lookup(rows, name) is None:
            note.append("no line in the table")
        flagged += bool(note)
        shown = "-" if s is None else f"{s:.1f}"
        print(f"{shown:>9} {limit:8.0f} {procs:>5}  {name}" + (f"   <- {'; '.join(note)}" if note else ""))
    print(f"{len(tests)} tests, {flagged} flagged")
    return 0


def table(a):
    times = read_junit(a.junit)
    tests = listing(a.build)
    rows = read_table(a.table)
    # A GoogleTest binary whose cases all take under GROUP_SECONDS gets one "<binary>.*" line
    # (its slowest case), one with slower cases a line per case.
    slowest = {}
    for name, (props, command) in tests.items():
        if name in times and any(c.startswith("--gtest_filter=") for c in command):
            b = name.split(".", 1)[0]
            slowest[b] = max(slowest.get(b, 0), times[name][0])
    lines = {}
    for name, (props, command) in tests.items():
        if name not in times:
            continue
        s = times[name][0]
        b = name.split(".", 1)[0]
        key = b + ".*" if slowest.get(b, GROUP_SECONDS) < GROUP_SECONDS else name
        old = lookup(rows, name)
        procs = old[1] if old else 1
        secs, p = lines.get(key, (0, 1))
        lines[key] = (max(secs, math.ceil(s)), max(p, procs))
    print("# <test name or prefix*> <measured seconds> [<processors>]  (tests/README.md)")
    # Lines of the current table no measured test matched are kept (tests not run this time).
    for key, secs, procs in rows:
        if not any(lookup([(key, secs, procs)], n) for n in times if n in tests):
            lines.setdefault(key, (secs, procs))
    for key, (secs, procs) in sorted(lines.items()):
        print(f"{key} {secs}" + (f" {procs}" if procs > 1 else ""))
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("summary")
    s.add_argument("junit", nargs="+")
    s.add_argument("--slowest", type=int, default=15)
    s.set_defaults(fn=summary)
    for name, fn in (("limits", limits), ("table", table)):
        s = sub.add_parser(name)
        s.add_argument("build")
        s.add_argument("junit", nargs="+")
        s.add_argument("--table", default=str(TABLE))
        s.set_defaults(fn=fn)
    a = ap.parse_args()
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
