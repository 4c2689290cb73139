#!/usr/bin/python3
"""h5py oracle for the universal atom store (engine/atoms), run by atoms_test.

  h5py_oracle.py check FILE EXPECTED.json
      Opens FILE with h5py and checks it against the description the C++ test
      wrote: every root attribute, every param group's attributes, every
      dataset's shape, numpy dtype, dtype/xxh3 attributes, contiguous storage,
      4 KiB alignment of large datasets, and the SHA-256 of its bytes; and that
      the file holds no other datasets or root attributes. Exit 0 if all match.

  h5py_oracle.py malform VALID OUTDIR PARAM_GROUP ATOM_DATASET
      Writes damaged variants of the valid store VALID into OUTDIR (one file
      per defect, named after it).
"""

import hashlib
import json
import os
import shutil
import sys

import h5py
import numpy as np

ALIGNMENT = 4096


def fail(msg):
    print("MISMATCH:", msg)
    sys.exit(1)


def norm_attr(v):
    if isinstance(v, bytes):
        return v.decode("utf-8")
    if isinstance(v, np.ndarray):
        return [int(x) for x in v.tolist()]
    if isinstance(v, (np.integer, int)):
        return int(v)
    return v


def check(path, expected_path):
    with open(expected_path, encoding="utf-8") as f:
        exp = json.load(f)
    with h5py.File(path, "r") as f:
        # Root attributes: exactly the expected ones, with the expected types.
        root = {k: f.attrs[k] for k in f.attrs.keys()}
        if set(root) != set(exp["root"]):
            fail(f"root attrs {sorted(root)} != {sorted(exp['root'])}")
        for name, want in exp["root"].items():
            got = root[name]
            if isinstance(want, str):
                if not isinstance(got, str):
                    fail(f"root attr {name} is {type(got)}, expected str")
            elif not isinstance(got, np.int64):
                fail(f"root attr {name} is {type(got)}, expected int64")
            if norm_attr(got) != want:
                fail(f"root attr {name}: {norm_attr(got)!r} != {want!r}")

        for p in exp["params"]:
            g = f.get(p["path"])
            if not isinstance(g, h5py.Group):
                fail(f"{p['path']} is not a group")
            if set(g.attrs.keys()) != set(p["attrs"]):
                fail(f"{p['path']} attrs {sorted(g.attrs.keys())}")
            for name, want in p["attrs"].items():
                got = g.attrs[name]
                if name == "shape":
                    if got.dtype != np.int64 or got.ndim != 1:
                        fail(f"{p['path']} shape attr {got!r}")
                if norm_attr(got) != want:
                    fail(f"{p['path']} attr {name}: {norm_attr(got)!r} != {want!r}")

        seen = set()

        def visit(name, obj):
            if isinstance(obj, h5py.Dataset):
                seen.add("/" + name)

        f.visititems(visit)
        want_paths = {d["path"] for d in exp["datasets"]}
        if seen != want_paths:
            fail(f"datasets differ: extra {sorted(seen - want_paths)}, "
                 f"missing {sorted(want_paths - seen)}")

        for d in exp["datasets"]:
            ds = f[d["path"]]
            where = d["path"]
            if ds.shape != tuple(d["shape"]):
                fail(f"{where}: shape {ds.shape} != {d['shape']}")
            if ds.dtype.str != d["numpy"]:
                fail(f"{where}: numpy dtype {ds.dtype.str} != {d['numpy']}")
            if ds.chunks is not None or ds.compression is not None:
                fail(f"{where}: not contiguous")
            if set(ds.attrs.keys()) != {"dtype", "xxh3"}:
                fail(f"{where}: attrs {sorted(ds.attrs.keys())}")
            if norm_attr(ds.attrs["dtype"]) != d["dtype"]:
                fail(f"{where}: dtype attr {ds.attrs['dtype']!r}")
            xxh3 = ds.attrs["xxh3"]
            if not isinstance(xxh3, np.uint64) or int(xxh3) != int(d["xxh3"]):
                fail(f"{where}: xxh3 attr {xxh3!r} != {d['xxh3']}")
            data = np.ascontiguousarray(np.asarray(ds[()])).tobytes()
            if hashlib.sha256(data).hexdigest() != d["sha256"]:
                fail(f"{where}: bytes differ (sha256)")
            offset = ds.id.get_offset()
            if len(data) >= ALIGNMENT and offset % ALIGNMENT != 0:
                fail(f"{where}: offset {offset} not aligned")
            if len(data) > 0 and offset != d["offset"]:
                fail(f"{where}: h5py offset {offset} != reader's {d['offset']}")
    print(f"OK {len(exp['datasets'])} datasets, {len(exp['params'])} params")


def malform(valid, outdir, param_group, atom):
    def variant(name):
        dst = os.path.join(outdir, name + ".h5")
        shutil.copyfile(valid, dst)
        return h5py.File(dst, "r+")

    with h5py.File(os.path.join(outdir, "no_attrs.h5"), "w") as f:
        f["x"] = np.arange(10, dtype=np.float32)
    with variant("wrong_format") as f:
        f.attrs["ucp_format"] = "zarr"
    with variant("wrong_version") as f:
        f.attrs["ucp_version"] = np.int64(3)
    with variant("version1") as f:  # what a version-1 writer made
        f.attrs["ucp_version"] = np.int64(1)
        if "training" in f.attrs:
            del f.attrs["training"]
        for g in f["params"].values():
            if "frozen" in g.attrs:
                del g.attrs["frozen"]
    with variant("missing_version") as f:
        del f.attrs["ucp_version"]
    with variant("chunked") as f:
        g = f[param_group]
        shape = tuple(int(x) for x in g.attrs["shape"])
        ds = g.create_dataset("chunky", data=np.ones(shape, dtype=np.float32),
                              chunks=True, compression="gzip")
        ds.attrs["dtype"] = "float32"
        ds.attrs["xxh3"] = np.uint64(0)
    with variant("unknown_dtype") as f:
        f[atom].attrs["dtype"] = "float99"
    with variant("type_mismatch") as f:
        f[atom].attrs["dtype"] = "int32"
    with variant("shape_mismatch") as f:
        shape = f[param_group].attrs["shape"]
        f[param_group].attrs["shape"] = np.array(list(shape) + [1], np.int64)
    with variant("missing_xxh3") as f:
        del f[atom].attrs["xxh3"]
    with variant("noncanonical_name") as f:
        f.move(param_group, param_group.replace(".", "%2e"))
    with variant("soft_link") as f:
        f[param_group + "/alias"] = h5py.SoftLink(atom)
    with variant("cycle") as f:
        f["/opaque/loop"] = f["/opaque"]
    with variant("bad_kind") as f:
        f[param_group].attrs["kind"] = "tensor"
    with variant("fanout") as f:
        # 28 levels of groups, each linked twice from the one above: 2^28
        # paths through 28 groups.
        groups = [f.create_group(f"/opaque/f{i}") for i in range(28)]
        for upper, lower in zip(groups, groups[1:]):
            upper["a"] = lower
            upper["b"] = lower
    with variant("deep") as f:
        f.create_group("/opaque/" + "/".join(f"d{i}" for i in range(34)))
    with variant("pad_0d") as f:
        g = f.create_group("/params/scalar")
        for name, value in f[param_group].attrs.items():
            g.attrs[name] = value
        g.attrs["shape"] = np.zeros((0,), np.int64)
        ds = g.create_group("pad").create_dataset("fp32", data=np.float32(1))
        ds.attrs["dtype"] = "float32"
        ds.attrs["xxh3"] = np.uint64(0)
    print("OK malformed variants written")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 6 and sys.argv[1] == "malform":
        malform(*sys.argv[2:])
    else:
        print(__doc__)
        sys.exit(2)


if __name__ == "__main__":
    main()
