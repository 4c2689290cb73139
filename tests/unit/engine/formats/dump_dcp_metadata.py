#!/usr/bin/env python3
"""Oracle for dcp_metadata_test.cc: what torch itself reads from a DCP `.metadata`.

Usage (the tests' venv: torch >= 2.4):  dump_dcp_metadata.py FOLDER_OR_FILE ...
Prints, for each file, what torch's FileSystemReader.read_metadata() gives, as the canonical text
the test builds from ucp's parse (one line per fact; storage lines sorted bytewise), then its
SHA-256 and how many values it holds:
  T <fqn> <dtype> <size> <offsets>:<sizes>;...     a TensorStorageMetadata and its chunks
  B <fqn>                                           a BytesStorageMetadata
  P <fqn> <component>/<component>...                planner_data (an int index as #N)
  S <fqn> <offset|-> <relative_path> <offset> <length> <transform,...|->   storage_data
  V <version|->                                      Metadata.version
sizes are comma-separated, "()" for a 0-d tensor. The files in data/ were written by
tests/tools/make_dcp_ckpts.py (cases zstd_w2 and nopg) with the venv's torch 2.15.
"""

import hashlib
import pathlib
import sys

# A .metadata written under Python >= 3.13 names pathlib._local's classes.
sys.modules.setdefault("pathlib._local", pathlib)

import torch  # noqa: E402,F401
from torch.distributed.checkpoint import FileSystemReader  # noqa: E402
import torch.distributed.checkpoint.metadata as md  # noqa: E402


def dims(s):
    return ",".join(str(int(d)) for d in s) if len(s) else "()"


def canonical(m):
    lines = []
    values = 0
    for fqn, v in m.state_dict_metadata.items():
        if isinstance(v, md.TensorStorageMetadata):
            chunks = ";".join(f"{dims(c.offsets)}:{dims(c.sizes)}" for c in v.chunks)
            lines.append(f"T {fqn} {str(v.properties.dtype).removeprefix('torch.')} {dims(v.size)} {chunks}")
            values += 2 + len(v.size) + sum(2 * len(c.offsets) for c in v.chunks)
        else:
            lines.append(f"B {fqn}")
            values += 1
    for fqn, path in (m.planner_data or {}).items():
        lines.append(f"P {fqn} " + "/".join(f"#{c}" if isinstance(c, int) else c for c in path))
        values += 1 + len(path)
    storage = []
    for k, s in m.storage_data.items():
        off = "-" if k.offset is None else dims(k.offset)
        tr = ",".join(getattr(s, "transform_descriptors", None) or []) or "-"
        storage.append(f"S {k.fqn} {off} {s.relative_path} {s.offset} {s.length} {tr}")
        values += 6
    lines += sorted(storage)
    lines.append(f"V {getattr(m, 'version', None) or '-'}")
    return "".join(line + "\n" for line in lines), values


def main(argv):
    for a in argv:
        p = pathlib.Path(a)
        if p.is_file():
            with open(p, "rb") as f:
                import pickle
                m = pickle.load(f)
        else:
            m = FileSystemReader(str(p)).read_metadata()
        text, values = canonical(m)
        print(f"{a}: torch {torch.__version__}, {len(m.state_dict_metadata)} keys, "
              f"{len(m.storage_data)} items, {values} values, sha256 {hashlib.sha256(text.encode()).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
