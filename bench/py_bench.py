#!/usr/bin/python3
"""Python baseline for bench/run.sh: torch.load / torch.save of the same file.

  py_bench.py load FILE        time torch.load (all tensors materialised)
  py_bench.py save FILE DST    torch.load untimed, then time torch.save to DST (+ fsync)
Prints one JSON line like torchfile_bench.
"""
import json
import os
import resource
import sys
import time

import torch


def nbytes(obj):
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def report(op, n, start):
    s = time.perf_counter() - start
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(json.dumps({"op": op, "bytes": n, "seconds": round(s, 4),
                      "gbps": round(n / s / 1e9, 3), "max_rss_mib": round(rss, 1)}))


def main():
    torch.set_num_threads(1)
    if sys.argv[1] == "load":
        start = time.perf_counter()
        obj = torch.load(sys.argv[2], map_location="cpu")
        report("py-load", nbytes(obj), start)
    elif sys.argv[1] == "save":
        obj = torch.load(sys.argv[2], map_location="cpu")
        start = time.perf_counter()
        with open(sys.argv[3], "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        report("py-save", nbytes(obj), start)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
