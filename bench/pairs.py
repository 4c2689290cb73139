"""Timing ucp against another command on the same input, for the benchmarks: rounds alternated,
`sync` before every timed command, medians [min-max], peak RSS and bytes read.

Timed commands run under a small torch-free python (/usr/bin/python3): a child's peak RSS
(ru_maxrss) starts at its parent's, since Linux carries the high-water mark across fork and exec.
"""
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys


def tree_bytes(p):
    p = pathlib.Path(p)
    return p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


WRAPPER = """import json, os, subprocess, sys, time
cmd = json.loads(sys.argv[1])
t = time.perf_counter()
p = subprocess.Popen(cmd, shell=isinstance(cmd, str), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
s = time.perf_counter() - t
rchar = 0
try:
    rchar = int([l for l in open(f"/proc/{p.pid}/io") if l.startswith("rchar:")][0].split()[1])
except (OSError, IndexError):
    pass
_, status, ru = os.wait4(p.pid, 0)
if os.waitstatus_to_exitcode(status):
    sys.exit(p.stderr.read().decode()[-2000:])
print(json.dumps([s, ru.ru_maxrss / 1024, rchar]))
"""


def timed(cmd, shell=False):
    os.sync()
    arg = cmd if shell else list(map(str, cmd))
    p = subprocess.run(["/usr/bin/python3", "-c", WRAPPER, json.dumps(arg)], capture_output=True, text=True)
    if p.returncode:
        sys.exit(f"failed: {cmd}\n{p.stderr}")
    return tuple(json.loads(p.stdout))



def drop_caches():
    """Empties the page cache (root only): for commands that need free memory, such as
    MindSpore's loader, which refuses a file larger than the free (not cached) memory."""
    os.sync()
    pathlib.Path("/proc/sys/vm/drop_caches").write_text("3\n")


def run_pairs(pairs, rounds, size, out, before=None):
    """pairs: {name: (ucp argv, other argv or shell string, other is shell)}; `out` is removed
    after every command; `before` (optional) is called before each timed command. Prints one
    line per pair; returns {name: figures}."""
    results = {}
    for name, (ours, theirs, shell) in pairs.items():
        r = {"ucp": [], "other": [], "rss": [], "other_rss": [], "read": []}
        for k in range(rounds):
            order = [("other", theirs), ("ucp", ours)]
            if k % 2:
                order.reverse()
            for who, cmd in order:
                if before:
                    before()
                if who == "ucp":
                    s, rss, rchar = timed(list(map(str, cmd)))
                    r["ucp"].append(s)
                    r["rss"].append(rss)
                    r["read"].append(rchar)
                else:
                    s, rss, _ = timed(cmd if shell else list(map(str, cmd)), shell=shell)
                    r["other"].append(s)
                    r["other_rss"].append(rss)
                out = pathlib.Path(out)
                if out.is_dir():
                    shutil.rmtree(out)
                elif out.exists():
                    out.unlink()
        mu, mo = statistics.median(r["ucp"]), statistics.median(r["other"])
        results[name] = {"ucp_s": [round(mu, 2), round(min(r["ucp"]), 2), round(max(r["ucp"]), 2)],
                         "other_s": [round(mo, 2), round(min(r["other"]), 2),
                                     round(max(r["other"]), 2)],
                         "ratio": round(mu / mo, 3), "ucp_rss_mib": round(max(r["rss"])),
                         "other_rss_mib": round(max(r["other_rss"])),
                         "read": round(max(r["read"]) / size, 3)}
        print(f"{name:22s} ucp {mu:6.2f}s [{min(r['ucp']):.2f}-{max(r['ucp']):.2f}] "
              f"other {mo:6.2f}s [{min(r['other']):.2f}-{max(r['other']):.2f}] ratio {mu / mo:5.3f} "
              f"rss {max(r['rss']):.0f} MiB (other {max(r['other_rss']):.0f}) "
              f"read x{max(r['read']) / size:.3f}", flush=True)
    return results
