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


def test_generated_fixtures():
    files = sorted((TESTDATA / "torch").glob("*.pt"))
    assert len(files) >= 15, files
    report = json.loads(run("inspect", "--json", *files).stdout)
    assert report["errors"] == []
    by_path = {pathlib.Path(f["path"]).name: f for f in report["files"]}
    for f in files:
        desc = json.loads(f.with_suffix(".expected.json").read_text())
        check_against(desc, by_path[f.name], f.name)


def test_shared_fixtures_folder():
    # Inspect the whole fixtures folder at once (directory recursion).
    report = json.loads(run("inspect", "--json", FIXTURES).stdout)
    assert report["errors"] == [], report["errors"][:3]
    seen = 0
    for f in report["files"]:
        rel = pathlib.Path(f["path"]).relative_to(FIXTURES)
        desc_path = TESTDATA / "shared" / (str(rel) + ".expected.json")
        assert desc_path.exists(), desc_path
        check_against(json.loads(desc_path.read_text()), f, str(rel))
        seen += 1
    want = len(list((TESTDATA / "shared").rglob("*.pt.expected.json")))
    assert seen == want, (seen, want)


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


if __name__ == "__main__":
    tests = [v for k, v in sorted(globals().items()) if k.startswith("test_")]
    for t in tests:
        t()
        print("ok", t.__name__)
