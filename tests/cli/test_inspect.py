#!/usr/bin/python3
"""End-to-end tests of `ucp inspect` against Python oracles.

For every generated torch.save fixture ($UCP_TESTDATA/torch) and every file of
the frameworks' own fixtures ($UCP_FIXTURES, described by torch.load or by
their truth.json into $UCP_TESTDATA/shared), `ucp inspect --json` must report
exactly the tensors, leaves and opaque objects the description lists. Also
checks help, exit codes and one-line errors on bad input.
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
TESTDATA = pathlib.Path(os.environ["UCP_TESTDATA"])
FIXTURES = pathlib.Path(os.environ["UCP_FIXTURES"])


def run(*args, expect=0):
    p = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == expect, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p


def key(path):
    return json.dumps(path)


def check_against(description, report, label):
    """The report of one file against torch's own description of it (tensors' fields, leaves,
    objects, records); returns the number of values compared."""
    want = {key(t["path"]): t for t in description["tensors"]}
    got = {key(t["path"]): t for t in report["tensors"]}
    assert set(want) == set(got), (label, sorted(set(want) ^ set(got))[:5])
    for k, w in want.items():
        g = got[k]
        for field in ("dtype", "shape", "stride", "storage_offset", "storage_key",
                      "storage_nbytes", "device", "requires_grad", "is_parameter"):
            assert w[field] == g[field], (label, k, field, w[field], g[field])
        esize = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8,
                 "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
                 "complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4,
                 "uint64": 8}.get(w["dtype"], 1)
        numel = 1
        for d in w["shape"]:
            numel *= d
        assert g["nbytes"] == numel * esize, (label, k, g["nbytes"])
    wl = {key(l["path"]): (l["type"], l["repr"]) for l in description["leaves"]}
    gl = {key(l["path"]): (l["type"], l["repr"]) for l in report["leaves"]}
    assert wl == gl, (label, [(k, wl.get(k), gl.get(k)) for k in set(wl) | set(gl)
                              if wl.get(k) != gl.get(k)][:5])
    wo = {key(o["path"]): o["class"] for o in description["objects"]}
    go = {key(o["path"]): o["class"] for o in report["objects"]}
    # numpy scalars pickle through numpy.core.multiarray.scalar: the pickle does
    # not name their class, so only the container position is compared.
    for k in set(wo) | set(go):
        if go.get(k) == "numpy.core.multiarray.scalar" and str(wo.get(k, "")).startswith("numpy."):
            continue
        assert wo.get(k) == go.get(k), (label, k, wo.get(k), go.get(k))
    if "records" in description:
        assert description["records"] == report["records"], label
        assert description["archive_name"] == report["archive_name"], label
    assert report["suspicious_globals"] == [], (label, report["suspicious_globals"])
    return 10 * len(want) + len(wl) + len(set(wo) | set(go))


def negative_control(description, report, label):
    """check_against fails on a copy of `report` with one tensor's storage offset changed (or,
    without tensors, one leaf's repr)."""
    bad = json.loads(json.dumps(report))
    if bad["tensors"]:
        bad["tensors"][len(bad["tensors"]) // 2]["storage_offset"] += 1
    else:
        bad["leaves"][0]["repr"] += "x"
    try:
        check_against(description, bad, label)
    except AssertionError:
        return
    raise AssertionError(f"{label}: negative control: a changed field went unnoticed")


def test_generated_fixtures():
    files = sorted((TESTDATA / "torch").glob("*.pt"))
    assert len(files) >= 15, files
    report = json.loads(run("inspect", "--json", *files).stdout)
    assert report["errors"] == []
    by_path = {pathlib.Path(f["path"]).name: f for f in report["files"]}
    compared = 0
    for f in files:
        desc = json.loads(f.with_suffix(".expected.json").read_text())
        compared += check_against(desc, by_path[f.name], f.name)
        negative_control(desc, by_path[f.name], f.name)
    assert compared >= 10 * len(files), compared


def test_shared_fixtures_folder():
    # Inspect the whole fixtures folder at once (directory recursion).
    report = json.loads(run("inspect", "--json", FIXTURES).stdout)
    assert report["errors"] == [], report["errors"][:3]
    seen = 0
    for f in report["files"]:
        rel = pathlib.Path(f["path"]).relative_to(FIXTURES)
        desc_path = TESTDATA / "shared" / (str(rel) + ".expected.json")
        assert desc_path.exists(), desc_path
        desc = json.loads(desc_path.read_text())
        assert check_against(desc, f, str(rel)) > 0, rel
        negative_control(desc, f, str(rel))
        seen += 1
    want = len(list((TESTDATA / "shared").rglob("*.pt.expected.json"))) + \
        len(list((TESTDATA / "shared").rglob("*.distcp@*.expected.json")))
    assert seen == want, (seen, want)
    # A checkpoint folder of a format with an index of its own (DCP) is shown
    # by it too: every key with its global shape and chunks.
    cks = {c["path"]: c for c in report["checkpoints"]}
    dcp = cks[str((FIXTURES / "dcp-torch-2.6" / "dtensor_shard0_w2" / "ckpt").resolve())]
    wte = next(k for k in dcp["keys"] if k["key"] == "model.wte.weight")
    assert wte["shape"] == [50, 24] and len(wte["chunks"]) == 2, wte


def test_totals_and_tree():
    f = TESTDATA / "torch" / "megatron_rank.pt"
    doc = json.loads(run("inspect", "--json", f).stdout)["files"][0]
    desc = json.loads(f.with_suffix(".expected.json").read_text())
    distinct = {t["storage_key"] for t in desc["tensors"]}
    assert doc["totals"]["storages"] >= len(distinct)
    assert doc["totals"]["objects_by_class"].get("argparse.Namespace") == 1
    text = run("inspect", f).stdout
    assert "args: argparse.Namespace" in text
    assert "totals:" in text and "suspicious globals: none" in text


def test_suspicious_global_is_reported_not_executed():
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        marker = tmp / "pwned"
        # A torch.save file whose pickle calls os.system when Python loads it.
        script = f"""
import os, torch
class Evil:
    def __reduce__(self):
        return (os.system, ("touch {marker}",))
torch.save({{"w": torch.ones(2), "evil": Evil()}}, "{tmp / 'evil.pt'}")
"""
        subprocess.run([os.environ.get("UCP_PYTHON", "/usr/bin/python3"), "-c", script], check=True)
        assert not marker.exists()
        doc = json.loads(run("inspect", "--json", tmp / "evil.pt").stdout)["files"][0]
        assert doc["suspicious_globals"] in (["posix.system"], ["os.system"]), doc["suspicious_globals"]
        text = run("inspect", tmp / "evil.pt").stdout
        assert "WARNING: suspicious globals" in text
        assert not marker.exists(), "inspect executed the pickle"
    finally:
        shutil.rmtree(tmp)


def test_help_and_errors():
    out = run("--help").stdout
    assert "inspect" in out and "exit codes" in out
    out = run("inspect", "--help").stdout
    assert "examples:" in out and "--json" in out
    run("nonsense", expect=2)
    p = run("inspect", expect=2)
    assert p.stderr.startswith("ucp: usage error:"), p.stderr
    p = run("inspect", "/nonexistent/file.pt", expect=5)
    assert p.stderr.count("\n") == 1 and "/nonexistent/file.pt" in p.stderr, p.stderr
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        src = TESTDATA / "torch" / "megatron_rank.pt"
        bad = tmp / "truncated.pt"
        data = src.read_bytes()
        bad.write_bytes(data[: len(data) // 2])
        before = bad.read_bytes()
        p = run("inspect", bad, expect=3)
        assert p.stderr.startswith("ucp: format error:") and str(bad) in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1, p.stderr
        assert bad.read_bytes() == before, "source modified"
        p = run("inspect", "--bogus-flag", src, expect=2)
        assert "bogus" in p.stderr
    finally:
        shutil.rmtree(tmp)


def write_zip_pickle(path, data):
    import zipfile
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", data)
        z.writestr("archive/version", "3\n")


def deep_shared_chain(segments, length=900):
    """A pickle of list chains N_1 -> ... -> N_segments, each `length` deep,
    where the root first reaches every N_i directly ([[N_k], ..., [N_1]] + the
    chain): shallow for the unpickler's depth check, segments x length deep
    along the path through the chain."""
    import struct
    put = lambda i: b"r" + struct.pack("<I", i)
    get = lambda i: b"j" + struct.pack("<I", i)
    out = bytearray(b"\x80\x02")
    out += b"]" * length + b"a" * (length - 1) + put(segments) + b"0"
    for i in range(segments - 1, 0, -1):
        out += b"]" * length + get(i + 1) + b"a" * length + put(i) + b"0"
    out += b"("
    for i in range(segments, 0, -1):
        out += b"]" + get(i) + b"a"
    out += b"l."
    return bytes(out)


def run_limited(args, seconds=120, address_space=4 << 30):
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    return subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True,
                          timeout=seconds, preexec_fn=limit)


def test_hostile_graphs_neither_crash_nor_explode():
    import pickle
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        # 200 x 900 levels along one path: no stack overflow in the tree or
        # the --json walk.
        deep = tmp / "deep.pt"
        write_zip_pickle(deep, deep_shared_chain(200))
        p = run_limited(["inspect", deep])
        assert p.returncode == 0, (p.returncode, p.stderr[-500:])
        assert "nested deeper than" in p.stdout
        p = run_limited(["inspect", "--json", deep])
        assert p.returncode == 0, (p.returncode, p.stderr[-500:])
        assert json.loads(p.stdout)["files"][0]["complete"] is True
        # 2^40 paths through 40 shared lists (a 300-byte file): the --json
        # walk stops at its budget and says so.
        x = None
        for _ in range(40):
            x = [x, x]
        dag = tmp / "dag.pt"
        write_zip_pickle(dag, pickle.dumps(x, protocol=2))
        p = run_limited(["inspect", "--json", dag])
        assert p.returncode == 0, (p.returncode, p.stderr[-500:])
        doc = json.loads(p.stdout)["files"][0]
        assert doc["complete"] is False and len(doc["leaves"]) > 1000
        p = run_limited(["inspect", dag])
        assert p.returncode == 0 and "same object as" in p.stdout, p.stderr[-500:]
        # One 1 MB key shared by 900 nested dicts (a 1 MB file): the tree
        # shows the key cut short, the --json walk stops at its budget
        # instead of copying the key 900 times.
        big = "k" * (1 << 20)
        d = {big: 1}
        for _ in range(900):
            d = {big: d}
        keys = tmp / "keys.pt"
        sys.setrecursionlimit(10000)
        write_zip_pickle(keys, pickle.dumps(d, protocol=2))
        p = run_limited(["inspect", keys], address_space=2 << 30)
        assert p.returncode == 0, (p.returncode, p.stderr[-500:])
        assert len(p.stdout) < (8 << 20), len(p.stdout)
        p = run_limited(["inspect", "--json", keys])
        assert p.returncode == 0, (p.returncode, p.stderr[-500:])
        assert json.loads(p.stdout)["files"][0]["complete"] is False
    finally:
        shutil.rmtree(tmp)


def test_tree_never_prints_control_characters():
    import pickle
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        f = tmp / "esc.pt"
        evil = "\x1b]0;pwned\x07\x1b[2J\nline"
        write_zip_pickle(f, pickle.dumps({evil: 1, "ok": [evil]}, protocol=2))
        p = run("inspect", f)
        assert "\x1b" not in p.stdout and "\x07" not in p.stdout, p.stdout
        assert "\\x1b]0;pwned" in p.stdout, p.stdout
        doc = json.loads(run("inspect", "--json", f).stdout)["files"][0]
        assert [l["path"] for l in doc["leaves"]] == [[evil], ["ok", 0]]
    finally:
        shutil.rmtree(tmp)


def test_errors_are_one_line_and_json_stays_json():
    tmp = pathlib.Path(tempfile.mkdtemp())
    try:
        p = run("help", "bogus", expect=2)
        assert "unknown command 'bogus'" in p.stderr, p.stderr
        weird = tmp / "line\nbreak\x1b[31m\u009b1m\u00e9.pt"
        p = run("inspect", weird, expect=5)
        assert p.stderr.count("\n") == 1 and "line\\nbreak\\x1b" in p.stderr, p.stderr
        assert "\\u009b1m\u00e9.pt" in p.stderr, p.stderr
        # --json: a missing PATH is one of the errors; the others are still
        # inspected and the output stays one JSON document.
        good = TESTDATA / "torch" / "megatron_rank.pt"
        p = run("inspect", "--json", tmp / "missing.pt", good, expect=5)
        doc = json.loads(p.stdout)
        assert [e["kind"] for e in doc["errors"]] == ["i/o error"], doc["errors"]
        assert [pathlib.Path(f["path"]).name for f in doc["files"]] == [good.name]
        # A FIFO is refused at once instead of waiting for a writer.
        fifo = tmp / "fifo.pt"
        os.mkfifo(fifo)
        p = subprocess.run([str(UCP), "inspect", str(fifo)], capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 5 and "not a regular file" in p.stderr, p.stderr
    finally:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
