#!/usr/bin/python3
"""Writes the Description JSON (notes/HELPERS.md) of every torch.save file in the shared fixtures.

Usage:
  describe_shared_fixtures.py --out DIR --fixtures FIXTURES_DIR

For every ``*.pt`` under FIXTURES_DIR writes ``DIR/<relative path>.expected.json`` (e.g.
``DIR/megatron-23.06/synth_tp2/iter_0000010/mp_rank_00/model_optim_rng.pt.expected.json``) and
``DIR/index.json`` (``[{"file", "expected", "oracle"}]``).  The fixtures are only read, never written.

Oracles (recorded in each description as ``"oracle"``):
  * ``"torch.load"``: files torch 1.13 can load are described through torch.load (torchdesc.describe);
    the result must equal the torch-free description (torchdesc.describe_raw).
  * ``"truth.json"``: files referencing torch globals this torch lacks (torch 2.x dtypes uint16/32/64,
    float8_*, ``_rebuild_tensor_v3``) are described by the torch-free reader, and every tensor's sha256
    is taken from ``<name>.truth.json`` (``sha256_contiguous``), which must equal the bytes the reader
    gathers.
Whenever a ``<name>.truth.json`` exists, the description is checked against it (tensor paths -- the
truth's dotted notation is matched against the component lists found by walking the pickle --, dtypes,
shapes, strides, offsets, storage sizes, sha256, leaves, globals, zip records, top-level type).
"file" in each description is the path relative to FIXTURES_DIR.
"""

from __future__ import annotations

import argparse
import importlib
import os
import struct
import sys
import tempfile
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchdesc  # noqa: E402


def _resolvable(global_name: str) -> bool:
    module, _, name = global_name.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), name)
    except ImportError:
        return False


def missing_torch_globals(path: str) -> List[str]:
    """torch globals referenced by `path` that this torch does not have."""
    archive = torchdesc.inspect_archive(path)
    return [g for g in torchdesc.pickle_globals(archive.pickle)
            if g.split(".", 1)[0] == "torch" and not _resolvable(g)]


def _dotted(path: List[Any]) -> str:
    return ".".join(str(c) for c in path)


def _by_dotted(entries: List[Dict[str, Any]], what: str, file: str) -> Dict[str, Dict[str, Any]]:
    result: Dict[str, Dict[str, Any]] = {}
    for entry in entries:
        key = _dotted(entry["path"])
        if key in result and result[key]["path"] != entry["path"]:
            raise ValueError(f"{file}: {what} paths {result[key]['path']} and {entry['path']} are both "
                             f"'{key}' in truth.json notation")
        result[key] = entry
    return result


def check_against_truth(desc: Dict[str, Any], truth: Dict[str, Any], file: str) -> Optional[str]:
    """First disagreement between a description and a ``truth.json``, or None."""
    if desc["top_type"] != truth["top_level_type"]:
        return f"top-level type {desc['top_type']} != {truth['top_level_type']}"
    tensors = _by_dotted(desc["tensors"], "tensor", file)
    if set(tensors) != set(truth["tensors"]):
        return f"tensor paths {sorted(tensors)} != truth {sorted(truth['tensors'])}"
    for key, t in truth["tensors"].items():
        ours = tensors[key]
        expected = {"dtype": t["dtype"], "shape": t["shape"], "stride": t["stride"],
                    "storage_offset": t["storage_offset"], "storage_nbytes": t["storage_nbytes"],
                    "requires_grad": t["requires_grad"], "is_parameter": t["is_parameter"],
                    "sha256": t["sha256_contiguous"]}
        for field, value in expected.items():
            if ours[field] != value:
                return f"tensor {key}: {field} {ours[field]!r} != truth {value!r}"
    leaves = _by_dotted(desc["leaves"], "leaf", file)
    truth_leaves = truth.get("non_tensor_leaves", {})
    if set(leaves) != set(truth_leaves):
        return f"leaf paths {sorted(leaves)} != truth {sorted(truth_leaves)}"
    for key, leaf in truth_leaves.items():
        if (leaves[key]["type"], leaves[key]["repr"]) != (leaf["type"], leaf["repr"]):
            return f"leaf {key}: {leaves[key]} != truth {leaf}"
    truth_globals = (truth.get("data_pkl_globals")
                     or truth.get("legacy_layout", {}).get("object_pickle_globals"))
    if truth_globals is not None and desc["globals"] != sorted(truth_globals):
        return f"globals {desc['globals']} != truth {truth_globals}"
    if desc["format"] == "zip":
        names = [e["name"] for e in truth.get("zip_entries", [])]
        prefixed = [f"{desc['archive_name']}/{r}" for r in desc["records"]]
        if names and names != prefixed:
            return f"records {prefixed} != truth {names}"
    return None


def describe_fixture(path: str, rel: str) -> Dict[str, Any]:
    """Description of one shared fixture, cross-checked by every oracle available."""
    truth_path = path[:-len(".pt")] + ".truth.json"
    truth = torchdesc.read_json(truth_path) if os.path.exists(truth_path) else None
    raw = torchdesc.describe_raw(path)
    missing = missing_torch_globals(path)
    if missing:
        if truth is None:
            raise ValueError(f"{rel}: torch lacks {missing} and there is no truth.json")
        desc = dict(raw, oracle="truth.json")
    else:
        desc = torchdesc.describe(path)
        diff = torchdesc.first_difference(desc, raw)
        if diff:
            raise ValueError(f"{rel}: torch.load and raw descriptions differ: {diff}")
    if truth is not None:
        diff = check_against_truth(desc, truth, rel)
        if diff:
            raise ValueError(f"{rel}: disagrees with {os.path.basename(truth_path)}: {diff}")
        if missing:  # sha256 values are the truth's (equal to the gathered bytes, checked above)
            for t in desc["tensors"]:
                t["sha256"] = truth["tensors"][_dotted(t["path"])]["sha256_contiguous"]
    desc["file"] = rel
    return desc


def archives_back_to_back(data: bytes) -> List[Tuple[int, int]]:
    """(offset, length) of the zip archives a file holds back to back (a DCP .distcp file), found
    without ucp: each archive ends with an end-of-central-directory record (22 bytes, no comment)
    whose central directory -- checked to lie just before it, behind a zip64 end record and
    locator, and to start at the offset the record gives relative to the archive -- ends the
    archive; the next archive starts right after."""
    out, start = [], 0
    while start < len(data):
        pos = data.find(b"PK\x05\x06", start)
        while pos >= 0:
            if pos + 22 <= len(data) and data[pos + 20:pos + 22] == b"\x00\x00":
                loc = pos - 20
                if loc >= start and data[loc:loc + 4] == b"PK\x06\x07":
                    z64 = struct.unpack("<Q", data[loc + 8:loc + 16])[0] + start
                    if data[z64:z64 + 4] == b"PK\x06\x06":
                        cd_size, cd_off = struct.unpack("<QQ", data[z64 + 40:z64 + 56])
                        if start + cd_off + cd_size == z64:
                            break
            pos = data.find(b"PK\x05\x06", pos + 1)
        if pos < 0:
            raise ValueError(f"no archive end after offset {start}")
        out.append((start, pos + 22 - start))
        start = pos + 22
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--fixtures", required=True, help="the shared fixtures folder (read only)")
    args = parser.parse_args(argv)
    fixtures = os.path.abspath(args.fixtures)
    out = os.path.abspath(args.out)
    if out == fixtures or out.startswith(fixtures + os.sep):
        parser.error("--out must not be inside --fixtures (the fixtures are read-only)")
    files = sorted(os.path.relpath(os.path.join(root, name), fixtures).replace(os.sep, "/")
                   for root, _, names in os.walk(fixtures) for name in names if name.endswith(".pt"))
    if not files:
        parser.error(f"no .pt files under {fixtures}")
    index = []
    for rel in files:
        desc = describe_fixture(os.path.join(fixtures, rel), rel)
        torchdesc.write_json(desc, os.path.join(out, rel + ".expected.json"))
        index.append({"file": rel, "expected": rel + ".expected.json", "oracle": desc["oracle"]})
    # Files of several archives (DCP .distcp): each archive described on its own, named
    # "<file>@<offset>+<length>" as `ucp inspect` names it.
    distcp = sorted(os.path.relpath(os.path.join(root, name), fixtures).replace(os.sep, "/")
                    for root, _, names in os.walk(fixtures) for name in names
                    if name.endswith(".distcp"))
    with tempfile.TemporaryDirectory() as tmp:
        for rel in distcp:
            data = open(os.path.join(fixtures, rel), "rb").read()
            for offset, length in archives_back_to_back(data):
                name = f"{rel}@{offset}+{length}"
                piece = os.path.join(tmp, "archive.pt")
                with open(piece, "wb") as f:
                    f.write(data[offset:offset + length])
                desc = describe_fixture(piece, name)
                torchdesc.write_json(desc, os.path.join(out, name + ".expected.json"))
                index.append({"file": name, "expected": name + ".expected.json",
                              "oracle": desc["oracle"]})
    torchdesc.write_json(index, os.path.join(out, "index.json"))
    counts = {o: sum(1 for e in index if e["oracle"] == o) for o in sorted({e["oracle"] for e in index})}
    print(f"described {len(index)} files into {out}: {counts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
