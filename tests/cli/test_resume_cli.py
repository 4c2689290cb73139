#!/usr/bin/python3
"""`ucp resume`: the newest complete and intact checkpoint of a save folder,
reshaped when the job's layout changed.

Save folders are built from the real DeepSpeed fixtures (three tags, `latest`
naming the newest) and the Megatron generator's checkpoints (three
iterations, the tracker naming the newest). A seeded fault matrix damages a
random rank file of a random checkpoint (delete, truncate, flip a byte inside
a tensor record: caught by the zip CRC-32) and checks the choice every time.
Set UCP_TEST_SEED to replay.
"""
import json
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
import zlib

import xxhash

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
import check_universal as cu  # noqa: E402

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
DS = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5" / "ds0145_z2_fp32_w2_mlp"
MEGATRON = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron" / "gqa_swiglu_bias_untied"


def run(*args, expect=0):
    p = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == expect, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    return p


def resume(*args):
    return json.loads(run("resume", *args, "--json").stdout)


def ds_save(t, tags=(1, 2, 3)):
    save = t / "save"
    save.mkdir()
    for k in tags:
        shutil.copytree(DS / "global_step2", save / f"global_step{k}")
    (save / "latest").write_text(f"global_step{max(tags)}")
    return save


def same_atoms(a, b):
    """Every dataset under /params of two universal files, bit for bit
    (h5py); returns how many."""
    x, y = cu.param_datasets(a)[0], cu.param_datasets(b)[0]
    assert sorted(x) == sorted(y), set(x) ^ set(y)
    for n in x:
        assert x[n] == y[n], n
    return len(x)


def flip_inside_a_record(path, rng):
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if i.file_size > 0]
    info = rng.choice(infos)
    data = bytearray(path.read_bytes())
    head = info.header_offset
    start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + \
        int.from_bytes(data[head + 28:head + 30], "little")
    data[start + rng.randrange(info.file_size)] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def test_picks_newest_and_reshapes():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        save = ds_save(t)
        before = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()}
        # Same layout, latest names it: nothing to do.
        r = resume(save, "--dp", 2, "--zero-stage", 2)
        assert (r["load"], r["checkpoint"], r["reshaped"], r["skipped"]) == (str(save), "global_step3", False, []), r
        # Another DP size: a load folder, reshaped; a second run reuses it.
        r = resume(save, "--dp", 3, "--zero-stage", 1)
        load = pathlib.Path(r["load"])
        assert r["reshaped"] and load == save / "ucp-resume" / "global_step3-tp1-pp1-vpp1-dp3-z1", r
        assert (load / "latest").read_text() == "global_step3"
        assert len(list((load / "global_step3").glob("zero_pp_rank_*_optim_states.pt"))) == 3
        run("to-universal", save, "-o", t / "a.h5", "--tag", "global_step3", "-q")
        run("to-universal", load, "-o", t / "b.h5", "-q")
        assert same_atoms(t / "a.h5", t / "b.h5") > 0
        assert resume(save, "--dp", 3, "--zero-stage", 1)["load"] == str(load)
        # The source is never modified (only ucp-resume/ appears).
        after = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()
                 and p.relative_to(save).parts[0] != "ucp-resume"}
        assert after == before, (set(after) ^ set(before), [p for p in after if after[p] != before.get(p)])
        # Plain output: the folder on stdout, the explanation on stderr.
        p = run("resume", save, "--dp", 2, "--zero-stage", 2)
        assert p.stdout.strip() == str(save) and "global_step3" in p.stderr


def test_data_skip_arithmetic():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        save = ds_save(pathlib.Path(t))
        r = resume(save, "--dp", 2, "--global-batch-size", 3)
        assert r["consumed_samples"] == 8 and r["data_skip_steps"] == 8 // 3, r
        assert resume(save, "--dp", 2, "--global-batch-size", 16)["data_skip_steps"] == 0
        assert resume(save, "--dp", 2, "--global-batch-size", 3, "--ignore-data-skip")["data_skip_steps"] == 0
        assert resume(save, "--dp", 2, "--data-skip-steps", 7)["data_skip_steps"] == 7
        assert resume(save, "--dp", 2)["data_skip_steps"] is None
        run("resume", save, "--dp", 2, "--ignore-data-skip", "--data-skip-steps", 1, expect=2)
        run("resume", save, "--dp", 2, "--global-batch-size", 0, expect=2)


def test_fault_matrix():
    seed = int(os.environ.get("UCP_TEST_SEED", random.randrange(1 << 30)))
    print(f"UCP_TEST_SEED={seed}", flush=True)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        pristine = ds_save(t)
        for case in range(150):
            save = t / f"case{case}"
            shutil.copytree(pristine, save)
            damaged = set()
            faults = []
            for _ in range(rng.choice([1, 1, 2])):
                tag = f"global_step{rng.choice([1, 2, 3])}"
                victim = rng.choice(sorted((save / tag).iterdir()))
                fault = rng.choice(["delete", "truncate", "flip"])
                if fault == "delete":
                    if not victim.exists():
                        continue
                    victim.unlink()
                elif not victim.exists():
                    continue
                elif fault == "truncate":
                    data = victim.read_bytes()
                    victim.write_bytes(data[:rng.randrange(len(data))])
                elif zipfile.is_zipfile(victim):  # not one truncated just before
                    flip_inside_a_record(victim, rng)
                else:
                    continue
                damaged.add(tag)
                faults.append((tag, victim.name, fault))
            intact = [f"global_step{k}" for k in (3, 2, 1) if f"global_step{k}" not in damaged]
            where = f"seed {seed} case {case} faults {faults}"
            if not intact:
                p = run("resume", save, "--dp", 2, expect=3)
                assert "no complete and intact checkpoint" in p.stderr, (where, p.stderr)
            else:
                r = resume(save, "--dp", 2, "--zero-stage", 2)
                assert r["checkpoint"] == intact[0], (where, r)
                assert [s["name"] for s in r["skipped"]] == \
                    [f"global_step{k}" for k in (3, 2, 1) if f"global_step{k}" in damaged
                     and int(f"global_step{k}"[-1]) > int(intact[0][-1])], (where, r["skipped"])
                # Same layout: no reshape; an untracked one is hard-linked.
                assert not r["reshaped"], (where, r)
                assert (r["load"] == str(save)) == (intact[0] == "global_step3"), (where, r)
                if intact[0] != "global_step3":
                    assert r["linked_files"] == len(list((save / intact[0]).iterdir())), (where, r)
            shutil.rmtree(save)


def test_concurrent_runs_agree():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        save = ds_save(pathlib.Path(t))
        procs = [subprocess.Popen([str(UCP), "resume", str(save), "--dp", "1", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(4)]
        try:
            outs = [p.communicate(timeout=120) for p in procs]
        finally:  # one still running at the deadline: killed, and the test fails
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        assert all(p.returncode == 0 for p in procs), outs
        loads = {json.loads(o)["load"] for o, _ in outs}
        assert len(loads) == 1, loads
        assert len(list((save / "ucp-resume").iterdir())) == 1


def test_megatron_save_folder():
    src = MEGATRON / "tp2_pp2_vpp1_dp2_do"
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        save = t / "save"
        shutil.copytree(src, save)
        tracked = (save / "latest_checkpointed_iteration.txt").read_text().strip()
        name = f"iter_{int(tracked):07d}"
        r = resume(save, "--tp", 2, "--pp", 2, "--dp", 2, "--distributed-optimizer")
        assert (r["checkpoint"], r["reshaped"], r["load"]) == (name, False, str(save)), r
        r = resume(save, "--tp", 1, "--pp", 4, "--dp", 4, "--distributed-optimizer")
        assert r["reshaped"] and pathlib.Path(r["load"]).name == f"{name}-tp1-pp4-vpp1-dp4-do", r
        run("verify", r["load"], "-q")
        # The load folder equals the generator's own files for that layout
        # (beside them the manifest resume writes for its later checks).
        assert (pathlib.Path(r["load"]) / name / "ucp.manifest.json").is_file()
        plain = t / "plain"
        shutil.copytree(r["load"], plain, ignore=shutil.ignore_patterns("ucp.manifest.json"))
        cmp = subprocess.run([os.environ.get("UCP_PYTHON", "/usr/bin/python3"),
                              str(pathlib.Path(__file__).resolve().parent.parent / "tools" /
                                  "compare_megatron_ckpt.py"),
                              str(MEGATRON / "tp1_pp4_vpp1_dp4_do"), plain, "--ignore-rng"],
                             capture_output=True, text=True)
        assert cmp.returncode == 0, cmp.stdout + cmp.stderr
        # A damaged rank file: no intact checkpoint left.
        victim = sorted((save / name).rglob("*.pt"))[0]
        flip_inside_a_record(victim, random.Random(1))
        p = run("resume", save, "--tp", 2, "--pp", 2, "--dp", 2, "--distributed-optimizer", expect=3)
        assert "no complete and intact checkpoint" in p.stderr and victim.name in p.stderr, p.stderr


def rewrite_record(path, rng):
    """Flips a byte inside a tensor record and writes the record's new CRC-32
    into the central directory and the data descriptor: the archive is
    consistent again (torch.load takes it, same size); only a manifest
    tells."""
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if "/data/" in i.filename and i.file_size > 0]
    info = rng.choice(infos)
    data = bytearray(path.read_bytes())
    head = info.header_offset
    start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + \
        int.from_bytes(data[head + 28:head + 30], "little")
    old = zlib.crc32(data[start:start + info.file_size]).to_bytes(4, "little")
    data[start + rng.randrange(info.file_size)] ^= 0x10
    new = zlib.crc32(data[start:start + info.file_size]).to_bytes(4, "little")
    name = info.filename.encode()
    at = data.find(b"PK\x01\x02" + b"", 0)
    while at >= 0:  # the central-directory entry of this record
        n = int.from_bytes(data[at + 28:at + 30], "little")
        if data[at + 46:at + 46 + n] == name:
            assert data[at + 16:at + 20] == old
            data[at + 16:at + 20] = new
            break
        at = data.find(b"PK\x01\x02", at + 4)
    end = start + info.file_size  # the data descriptor, if any
    for off in (end, end + 4):
        if data[off:off + 4] == old:
            data[off:off + 4] = new
    if data[head + 14:head + 18] == old:
        data[head + 14:head + 18] = new
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every CRC holds
    return info.filename


def test_manifest():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        save = ds_save(pathlib.Path(t))
        ckpt = save / "global_step2"
        m = json.loads(run("manifest", save, "--tag", "global_step2", "--json").stdout)
        assert m["manifest"] == str(ckpt / "ucp.manifest.json"), m
        doc = json.loads((ckpt / "ucp.manifest.json").read_text())
        assert (doc["format"], doc["version"], doc["hash"]) == ("ucp.manifest", 1, "xxh3-64"), doc
        # Independent oracle: sizes from stat, record names and XXH3-64 from
        # Python's zipfile and xxhash.
        files = sorted(p.name for p in ckpt.iterdir() if p.name != "ucp.manifest.json")
        assert sorted(doc["files"]) == files, doc["files"].keys()
        for name in files:
            f = doc["files"][name]
            assert f["size"] == (ckpt / name).stat().st_size
            with zipfile.ZipFile(ckpt / name) as z:
                want = {i.filename: xxhash.xxh3_64_hexdigest(z.read(i)) for i in z.infolist()}
            assert f["records"] == want, name
        assert "manifest" in run("verify", ckpt).stdout
        # A record rewritten with a valid CRC: only the manifest catches it.
        victim = ckpt / files[0]
        record = rewrite_record(victim, random.Random(3))
        p = run("verify", ckpt, expect=3)
        assert "ucp.manifest.json" in p.stderr and record in p.stderr and victim.name in p.stderr, p.stderr
        assert "\n" not in p.stderr.strip()
        run("verify", save / "global_step1")  # no manifest: CRCs only
        (save / "latest").write_text("global_step2")
        r = resume(save, "--dp", 2, "--zero-stage", 2)
        assert r["checkpoint"] == "global_step3" and r["reshaped"] is False, r
        shutil.rmtree(save / "global_step3")
        r = resume(save, "--dp", 2, "--zero-stage", 2)
        assert r["checkpoint"] == "global_step1", r
        assert r["skipped"][0]["name"] == "global_step2" and "ucp.manifest.json" in r["skipped"][0]["reason"], r
        # A listed file that is gone; a manifest that is not one.
        shutil.copytree(DS / "global_step2", save / "global_step4")
        run("manifest", save / "global_step4", "-q")
        (save / "global_step4" / "extra.pt").write_bytes(b"x")
        doc = json.loads((save / "global_step4" / "ucp.manifest.json").read_text())
        doc["files"]["extra.pt"] = {"size": 1, "xxh3": xxhash.xxh3_64_hexdigest(b"x")}
        (save / "global_step4" / "ucp.manifest.json").write_text(json.dumps(doc))
        run("verify", save / "global_step4")
        (save / "global_step4" / "extra.pt").unlink()
        p = run("verify", save / "global_step4", expect=3)
        assert "extra.pt" in p.stderr and "missing" in p.stderr, p.stderr
        (save / "global_step4" / "ucp.manifest.json").write_text("{")
        p = run("verify", save / "global_step4", expect=3)
        assert "ucp.manifest.json" in p.stderr, p.stderr
        run("manifest", save / "nothing", expect=5)
        # convert / reshape --manifest: the output carries one.
        run("convert", DS, "-o", save / "conv", "--dp", 3, "--zero-stage", 1, "--manifest", "-q")
        out = save / "conv" / "global_step2"
        doc = json.loads((out / "ucp.manifest.json").read_text())
        assert sorted(doc["files"]) == sorted(p.name for p in out.iterdir() if p.suffix == ".pt"), doc
        assert "manifest" in run("verify", save / "conv").stdout
        rewrite_record(sorted(out.glob("*optim_states.pt"))[0], random.Random(4))
        p = run("verify", save / "conv", expect=3)
        assert "ucp.manifest.json" in p.stderr, p.stderr


def test_untracked_checkpoint_is_hard_linked():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        save = ds_save(pathlib.Path(t))
        os.remove(next((save / "global_step3").glob("*optim_states.pt")))
        r = resume(save, "--dp", 2, "--zero-stage", 2)
        load = pathlib.Path(r["load"])
        assert (r["checkpoint"], r["reshaped"]) == ("global_step2", False), r
        assert load == save / "ucp-resume" / "global_step2-tp1-pp1-vpp1-dp2-z2", r
        src = sorted((save / "global_step2").iterdir())
        assert r["linked_files"] == len(src) and r["copied_files"] == 0, r
        for f in src:
            assert os.stat(f).st_ino == os.stat(load / "global_step2" / f.name).st_ino, f
        assert (load / "latest").read_text() == "global_step2"
        run("verify", load, "-q")
        assert resume(save, "--dp", 2, "--zero-stage", 2)["load"] == str(load)


def test_reused_load_folder_is_verified():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        save = ds_save(pathlib.Path(t))
        r = resume(save, "--dp", 3, "--zero-stage", 1)
        load = pathlib.Path(r["load"])
        assert (load / "global_step3" / "ucp.manifest.json").exists()
        good = {p.name: p.read_bytes() for p in (load / "global_step3").iterdir()}
        victim = sorted((load / "global_step3").glob("*optim_states.pt"))[1]
        rewrite_record(victim, random.Random(5))
        p = run("resume", save, "--dp", 3, "--zero-stage", 1, "--json")
        assert "remaking" in p.stderr and victim.name in p.stderr, p.stderr
        assert json.loads(p.stdout)["load"] == str(load)
        assert {p.name: p.read_bytes() for p in (load / "global_step3").iterdir()} == good
        # With -o the folder is the user's: an error, nothing removed.
        out = pathlib.Path(t) / "mine"
        resume(save, "--dp", 3, "--zero-stage", 1, "-o", out)
        rewrite_record(sorted((out / "global_step3").glob("*optim_states.pt"))[0], random.Random(6))
        p = run("resume", save, "--dp", 3, "--zero-stage", 1, "-o", out, expect=3)
        assert str(out) in p.stderr and (out / "global_step3").is_dir(), p.stderr


def test_megatron_fault_matrix():
    """The fault matrix on a Megatron save folder of three iterations (the
    generator's TP2 PP2 DP2 checkpoint saved under three iteration names)."""
    seed = int(os.environ.get("UCP_TEST_SEED", random.randrange(1 << 30)))
    print(f"UCP_TEST_SEED={seed}", flush=True)
    rng = random.Random(seed)
    src = MEGATRON / "tp2_pp2_vpp1_dp2_do"
    tracked = int((src / "latest_checkpointed_iteration.txt").read_text().strip())
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        pristine = t / "pristine"
        pristine.mkdir()
        names = [f"iter_{tracked + k:07d}" for k in (0, 1, 2)]
        for n in names:
            shutil.copytree(src / f"iter_{tracked:07d}", pristine / n)
        (pristine / "latest_checkpointed_iteration.txt").write_text(str(tracked + 2))
        flags = ("--tp", 2, "--pp", 2, "--dp", 2, "--distributed-optimizer")
        for case in range(100):
            save = t / f"case{case}"
            shutil.copytree(pristine, save)
            damaged, faults = set(), []
            for _ in range(rng.choice([1, 1, 2])):
                name = rng.choice(names)
                victim = rng.choice(sorted(f for f in (save / name).rglob("*.pt") if f.exists()))
                fault = rng.choice(["delete", "truncate", "flip"])
                if fault == "delete":
                    victim.unlink()
                elif fault == "truncate":
                    data = victim.read_bytes()
                    victim.write_bytes(data[:rng.randrange(len(data))])
                elif zipfile.is_zipfile(victim):
                    flip_inside_a_record(victim, rng)
                else:
                    continue
                damaged.add(name)
                faults.append((str(victim.relative_to(save)), fault))
            intact = [n for n in reversed(names) if n not in damaged]
            where = f"seed {seed} case {case} faults {faults}"
            if not intact:
                p = run("resume", save, *flags, expect=3)
                assert "no complete and intact checkpoint" in p.stderr, (where, p.stderr)
            else:
                r = resume(save, *flags)
                assert r["checkpoint"] == intact[0], (where, r)
                assert [s["name"] for s in r["skipped"]] == \
                    [n for n in reversed(names) if n in damaged and n > intact[0]], (where, r["skipped"])
                assert not r["reshaped"] and (r["load"] == str(save)) == (intact[0] == names[-1]), (where, r)
                if intact[0] != names[-1]:
                    load = pathlib.Path(r["load"])
                    assert (load / "latest_checkpointed_iteration.txt").read_text() == str(int(intact[0][5:]))
            shutil.rmtree(save)


def test_universal_file_in_save_folder():
    """A universal file in SAVE_DIR is a candidate like any checkpoint: newest
    wins, its xxh3 checksums are its integrity check."""
    import h5py
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        save = ds_save(t, tags=(1,))
        run("to-universal", DS, "-o", save / "model.ucp.h5", "-q")  # iteration 2
        r = resume(save, "--dp", 3, "--zero-stage", 1)
        assert (r["checkpoint"], r["iteration"], r["reshaped"]) == ("model.ucp.h5", 2, True), r
        load = pathlib.Path(r["load"])
        assert load.name == "model.ucp.h5-tp1-pp1-vpp1-dp3-z1", load
        run("to-universal", load, "-o", t / "back.h5", "-q")
        assert same_atoms(save / "model.ucp.h5", t / "back.h5") > 0
        # A flipped byte inside a dataset: skipped, back to global_step1.
        with h5py.File(save / "model.ucp.h5", "r") as f:
            names = []
            f["params"].visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.size > 4 else None)
            offset = f["params"][names[0]].id.get_offset()
        data = bytearray((save / "model.ucp.h5").read_bytes())
        data[offset + 3] ^= 0x40
        (save / "model.ucp.h5").write_bytes(bytes(data))
        r = resume(save, "--dp", 2, "--zero-stage", 2)
        assert r["checkpoint"] == "global_step1", r
        assert r["skipped"][0]["name"] == "model.ucp.h5" and "xxh3" in r["skipped"][0]["reason"], r


def test_bad_input():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        (t / "empty").mkdir()
        p = run("resume", t / "empty", "--dp", 1, expect=3)
        assert "no checkpoint in" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
        (t / "file").write_text("x")
        p = run("resume", t / "file", "--dp", 1, expect=5)
        assert "not a folder" in p.stderr, p.stderr
        p = run("resume", t / "missing", "--dp", 1, expect=5)
        assert "does not exist" in p.stderr, p.stderr
        # A layout the model cannot take: one line, exit 4, nothing written.
        save = t / "save"
        shutil.copytree(MEGATRON / "tp2_pp2_vpp1_dp2_do", save)
        before = sorted(str(q.relative_to(save)) for q in save.rglob("*"))
        for flags in (("--tp", 3, "--dp", 1), ("--pp", 64, "--dp", 1)):
            p = run("resume", save, *flags, "--distributed-optimizer", expect=4)
            assert len(p.stderr.strip().splitlines()) == 1, p.stderr
            assert "layout error" in p.stderr, p.stderr
            after = sorted(str(q.relative_to(save)) for q in save.rglob("*"))
            assert after == before, sorted(set(after) ^ set(before))


def snapshot(root):
    """Every entry under root (hidden ones too): type, size and sha256 of
    files, link targets, and each folder's mtime (an entry created and
    removed again changes it)."""
    import hashlib
    root = pathlib.Path(root)
    out = {".": ("dir", root.stat().st_mtime_ns)}
    for q in sorted(root.rglob("*")):
        rel = str(q.relative_to(root))
        if q.is_symlink():
            out[rel] = ("link", os.readlink(q))
        elif q.is_dir():
            out[rel] = ("dir", q.stat().st_mtime_ns)
        else:
            out[rel] = ("file", q.stat().st_size, hashlib.sha256(q.read_bytes()).hexdigest())
    return out


def assert_same(before, after):
    assert after == before, sorted(k for k in set(before) | set(after)
                                   if before.get(k) != after.get(k))


def test_save_folder_is_left_as_it_was():
    """Nothing is written into SAVE_DIR (no lock file, no folder) by a run
    whose checkpoint fits, by a run that fails, or by one writing its load
    folder elsewhere (-o); a run whose load folder goes inside adds
    ucp-resume/ and nothing else."""
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        save = ds_save(t)
        before = snapshot(save)
        assert resume(save, "--dp", 2, "--zero-stage", 2)["load"] == str(save)
        assert_same(before, snapshot(save))
        p = run("resume", save, "--dp", 2, "--zero-stage", 2)
        assert p.stdout.strip() == str(save)
        assert_same(before, snapshot(save))
        r = resume(save, "--dp", 3, "--zero-stage", 1, "-o", t / "load")
        assert r["reshaped"] and r["load"] == str(t / "load"), r
        assert_same(before, snapshot(save))
        # Failures: a layout DeepSpeed cannot write, an empty folder, a save
        # folder whose every checkpoint is broken.
        run("resume", save, "--dp", 3, "--tp", 2, "--zero-stage", 1, expect=2)
        # (ucp-resume/ was made and removed again: the folder's mtime moved.)
        assert_same({k: v for k, v in before.items() if k != "."},
                    {k: v for k, v in snapshot(save).items() if k != "."})
        (t / "empty").mkdir()
        empty = snapshot(t / "empty")
        run("resume", t / "empty", "--dp", 1, expect=3)
        assert_same(empty, snapshot(t / "empty"))
        broken = ds_save(t / "empty", tags=(5,))
        (broken / "global_step5" / "mp_rank_00_model_states.pt").unlink()
        snap = snapshot(broken)
        run("resume", broken, "--dp", 3, "--zero-stage", 1, expect=3)
        assert_same(snap, snapshot(broken))
        # Inside: only ucp-resume/ is added.
        r = resume(save, "--dp", 3, "--zero-stage", 1)
        after = snapshot(save)
        added = {k for k in after if k not in before}
        assert added and all(k.split("/")[0] == "ucp-resume" for k in added), added
        assert {k: v for k, v in after.items() if k != "." and k not in added} == \
            {k: v for k, v in before.items() if k != "."}


def test_read_only_save_folder():
    """A save folder the caller cannot write (another user's, a snapshot):
    ucp resume reads it, writes the load folder where -o says, and without
    -o explains in one line why it cannot. Run as an unprivileged user
    (nobody, through setpriv, when the tests run as root)."""
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        os.chmod(t, 0o755)
        save = ds_save(t)
        # The binary where the unprivileged user can run it.
        ucp = t / "bin" / "ucp"
        ucp.parent.mkdir()
        shutil.copy2(UCP, ucp)
        prefix = []
        if os.geteuid() == 0:
            prefix = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
        for q in [save, *save.rglob("*")]:
            os.chmod(q, 0o555 if q.is_dir() else 0o444)
        out = t / "mine"
        out.mkdir()
        os.chmod(out, 0o777)
        before = snapshot(save)

        def as_user(*args, expect=0):
            p = subprocess.run([*prefix, str(ucp), "resume", *map(str, args)],
                               capture_output=True, text=True)
            assert p.returncode == expect, (args, p.returncode, p.stdout[-2000:], p.stderr[-2000:])
            return p

        # The user really cannot write there.
        p = subprocess.run([*prefix, "touch", str(save / "x")], capture_output=True)
        assert p.returncode != 0, "the save folder is writable: the test proves nothing"
        p = as_user(save, "--dp", 2, "--zero-stage", 2)
        assert p.stdout.strip() == str(save), p.stdout
        r = json.loads(as_user(save, "--dp", 3, "--zero-stage", 1, "-o", out / "load",
                               "--json").stdout)
        assert r["ok"] and r["reshaped"] and r["load"] == str(out / "load"), r
        assert len(list((out / "load" / "global_step3").glob("zero_pp_rank_*_optim_states.pt"))) == 3
        # A second run verifies and reuses it.
        r = json.loads(as_user(save, "--dp", 3, "--zero-stage", 1, "-o", out / "load",
                               "--json").stdout)
        assert r["load"] == str(out / "load"), r
        p = as_user(save, "--dp", 3, "--zero-stage", 1, expect=5)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "-o" in lines[0] and "inside the save folder" in lines[0], p.stderr
        assert_same(before, snapshot(save))
        for q in [save, *save.rglob("*")]:
            os.chmod(q, 0o755 if q.is_dir() else 0o644)


def test_kill9_during_resume():
    """kill -9 at random moments of `ucp resume` (while it reshapes): a rerun
    succeeds, hands out a whole load folder, and no staging is left."""
    seed = int(os.environ.get("UCP_TEST_SEED", random.randrange(1 << 30)))
    print(f"UCP_TEST_SEED={seed}", flush=True)
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        t = pathlib.Path(t)
        save = ds_save(t)
        run("to-universal", save, "-o", t / "want.h5", "--tag", "global_step3", "-q")
        for case in range(6):
            dp = rng.choice([1, 3, 4])
            p = subprocess.Popen([str(UCP), "resume", str(save), "--dp", str(dp), "--zero-stage", "1",
                                  "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            time.sleep(rng.uniform(0.0, 0.25))
            p.kill()
            p.communicate()
            r = resume(save, "--dp", dp, "--zero-stage", 1)
            load = pathlib.Path(r["load"])
            assert r["checkpoint"] == "global_step3", (seed, case, r)
            got = t / f"got{case}.h5"
            run("to-universal", load, "-o", got, "-q")
            assert same_atoms(t / "want.h5", got) > 0, (seed, case)
            leftovers = [q for q in (save / "ucp-resume").iterdir() if q.name.startswith(".")]
            assert not leftovers, (seed, case, leftovers)
            got.unlink()
            if rng.random() < 0.5:
                shutil.rmtree(load)


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
