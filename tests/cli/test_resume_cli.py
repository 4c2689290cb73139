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
import zipfile

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
        a = run("to-universal", save, "-o", t / "a.h5", "--tag", "global_step3", "-q")
        b = run("to-universal", load, "-o", t / "b.h5", "-q")
        assert a.returncode == b.returncode == 0
        assert resume(save, "--dp", 3, "--zero-stage", 1)["load"] == str(load)
        # The source is never modified (only the lock and ucp-resume/ appear).
        after = {p: p.read_bytes() for p in save.rglob("*") if p.is_file()
                 and p.relative_to(save).parts[0] != "ucp-resume" and p.name != ".ucp-resume.lock"}
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
        for case in range(60):
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
                assert r["reshaped"] == (intact[0] != "global_step3"), (where, r)
            shutil.rmtree(save)


def test_concurrent_runs_agree():
    with tempfile.TemporaryDirectory(prefix="ucp-resume-") as t:
        save = ds_save(pathlib.Path(t))
        procs = [subprocess.Popen([str(UCP), "resume", str(save), "--dp", "1", "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(4)]
        outs = [p.communicate() for p in procs]
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
        # A damaged rank file: no intact checkpoint left.
        victim = sorted((save / name).rglob("*.pt"))[0]
        flip_inside_a_record(victim, random.Random(1))
        p = run("resume", save, "--tp", 2, "--pp", 2, "--dp", 2, "--distributed-optimizer", expect=3)
        assert "no complete and intact checkpoint" in p.stderr and victim.name in p.stderr, p.stderr


if __name__ == "__main__":
    only = sys.argv[1:]
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and (not only or name in only):
            fn()
            print("ok", name, flush=True)
