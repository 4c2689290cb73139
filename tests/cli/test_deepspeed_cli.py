#!/usr/bin/python3
"""End-to-end tests of ucp on DeepSpeed checkpoints: the real DeepSpeed 0.14.5
files in ../shared/fixtures (ZeRO 0-3 x fp32/bf16 x world 1/2, with DeepSpeed's
own in-memory references) and the independent generator's cases
(tests/tools/make_deepspeed_ckpts.py: frozen, shared and buffer entries, two
optimizer groups, worlds 3 and 8). Oracles: tests/tools/check_deepspeed.py,
written from the format spec, and DeepSpeed's own files.
"""
import collections
import json
from collections import OrderedDict
import os
import pathlib
import random
import shutil
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
sys.path.insert(0, str(HERE.parent / "tools" / "stubs"))
import check_deepspeed as ck  # noqa: E402
import check_universal as cu  # noqa: E402
from testmain import one_error_line  # noqa: E402

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
FIXTURES = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5"
ALL = sorted(p for p in FIXTURES.iterdir() if p.is_dir())


# Commands whose durability is not what these tests check run with --no-sync
# (test_staging_cli.py tests the durable path).
NO_SYNC = {"convert", "reshape", "to-universal", "export"}


def run(*args, expect=0):
    args = [*args, "--no-sync"] if args and args[0] in NO_SYNC else list(args)
    p = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == expect, (args, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


class Tmp:
    def __enter__(self):
        self.path = pathlib.Path(tempfile.mkdtemp(prefix="ucp-ds-"))
        return self.path

    def __exit__(self, *exc):
        shutil.rmtree(self.path)


def stage_world(fixture):
    meta = json.load(open(fixture / "meta.json"))
    return meta["zero_stage"], meta["world_size"], meta["dtype"]


atoms_of = cu.param_datasets


def test_fixtures_to_universal_equal_deepspeeds_references():
    with Tmp() as t:
        for fx in ALL:
            doc = json.loads(run("to-universal", fx, "-o", t / "u.h5", "--json", "-q").stdout)
            stage, world, _ = stage_world(fx)
            assert doc["format"] == "deepspeed" and doc["source_topology"]["dp"] == world
            assert doc["source_topology"]["zero_stage"] == stage
            ck.cmd_universal(str(t / "u.h5"), str(fx))
            (t / "u.h5").unlink()


def test_fixtures_export_equal_references():
    with Tmp() as t:
        for fx in ALL:
            run("export", fx, "-o", t / "e", "-q")
            ck.cmd_export(str(t / "e"), str(fx), "fp32", "safetensors")
            shutil.rmtree(t / "e")
        fx = FIXTURES / "ds0145_z3_bf16_w2_mlp"
        for fmt in ("safetensors", "torch"):
            doc = json.loads(run("export", fx, "-o", t / fmt, "--format", fmt, "--dtype", "bf16",
                                 "--max-shard-size", "300B", "--json").stdout)
            assert len(doc["files"]) > 2 and doc["files"][-1].endswith(".index.json"), doc
            ck.cmd_export(str(t / fmt), str(fx), "bf16", fmt)
        # From a universal file too.
        run("to-universal", fx, "-o", t / "u.h5", "-q")
        run("export", t / "u.h5", "-o", t / "fromu", "-q")
        ck.cmd_export(str(t / "fromu"), str(fx), "fp32", "safetensors")


def test_native_same_topology_reproduces_deepspeeds_files():
    """Every fixture converted to its own world size and stage: the files,
    keys, classes and every tensor equal DeepSpeed's (check_deepspeed)."""
    with Tmp() as t:
        for fx in ALL:
            stage, world, _ = stage_world(fx)
            run("convert", fx, "-o", t / "o", "--format", "deepspeed", "--dp", world,
                "--zero-stage", stage, "-q")
            ck.cmd_native(str(t / "o"), str(fx), world, stage)
            shutil.rmtree(t / "o")


def test_native_every_stage_and_world_size_round_trips():
    """Every fixture -> native files for stages 0-3 at dp 1, 2, 3 or 8
    (checked against the spec's flat layouts and the references) -> universal
    file whose atoms equal those of the fixture's own universal file. Each
    fixture goes to every stage, each at one dp, rotated so that the fixtures
    of each dtype (eight: every source stage and world) reach all 16
    (stage, dp) targets twice (asserted below)."""
    dps = (1, 2, 3, 8)
    covered = collections.Counter()
    with Tmp() as t:
        for i, fx in enumerate(ALL):
            run("to-universal", fx, "-o", t / "a.h5", "-q")
            want, _ = atoms_of(t / "a.h5")
            offset = i + i // 4
            for stage in (0, 1, 2, 3):
                dp = dps[(offset + stage) % 4]
                covered["bf16" in fx.name, stage, dp] += 1
                out = t / f"s{stage}dp{dp}"
                run("reshape", t / "a.h5", "-o", out, "--dp", dp, "--zero-stage", stage, "-q")
                ck.cmd_native(str(out), str(fx), dp, stage)
                run("to-universal", out, "-o", t / "b.h5", "-q")
                got, _ = atoms_of(t / "b.h5")
                for k, v in want.items():
                    if k.endswith("/param") and stage == 3:
                        continue  # ZeRO-3 files hold no lp weights
                    assert got.get(k) == v, (fx.name, stage, dp, k)
                (t / "b.h5").unlink()
                shutil.rmtree(out)
            (t / "a.h5").unlink()
    assert len(ALL) == 16 and sorted(covered.values()) == [2] * 32, covered


def test_deepspeed_universal_folders_both_ways():
    with Tmp() as t:
        for fx in ALL:
            # No --dp: a universal folder has no world size (ds_to_universal
            # takes none), and giving one is an error that says so.
            p = run("convert", fx, "-o", t / "u", "--format", "deepspeed-universal",
                    "--dp", 1, expect=2)
            assert "written without a topology" in p.stderr and not (t / "u").exists(), p.stderr
            doc = json.loads(run("convert", fx, "-o", t / "u", "--format", "deepspeed-universal",
                                 "--json", "-q").stdout)
            assert doc["format"] == "deepspeed-universal"
            assert "dp" not in doc["target_topology"], doc
            assert (t / "u" / "latest_universal").read_text() == "global_step2_universal"
            ck.cmd_dsuniversal(str(t / "u"), str(fx))
            # Readable as a source: the same atoms as the fixture.
            run("to-universal", t / "u", "-o", t / "b.h5", "-q")
            ck.cmd_universal(str(t / "b.h5"), str(fx))
            # And back to native files at another world size.
            stage, _, _ = stage_world(fx)
            run("convert", t / "u", "-o", t / "n", "--format", "deepspeed", "--dp", 3,
                "--zero-stage", max(stage, 1), "-q")
            ck.cmd_native(str(t / "n"), str(fx), 3, max(stage, 1))
            for p in ("u", "n"):
                shutil.rmtree(t / p)
            (t / "b.h5").unlink()


def test_verify_and_formats():
    fx = FIXTURES / "ds0145_z2_bf16_w2_mlp"
    doc = json.loads(run("verify", fx, "--json").stdout)
    assert doc["ok"] and doc["kind"] == "deepspeed", doc
    names = {f["name"] for f in json.loads(run("formats", "--json").stdout)}
    assert {"megatron", "deepspeed", "deepspeed-universal"} <= names
    with Tmp() as t:
        # --tag picks the source's tag, --target-tag names the output's.
        run("convert", fx, "--tag", "global_step2", "--target-tag", "step_two", "-o", t / "o",
            "--dp", 1, "-q")
        assert (t / "o" / "latest").read_text() == "step_two"
        assert (t / "o" / "step_two" / "mp_rank_00_model_states.pt").exists()


def copy_fixture(name, dst):
    shutil.copytree(FIXTURES / name, dst)
    return dst


def check_failure(args, kind, code, needles, output):
    p = run(*args, expect=code)
    one_error_line(p, *needles, kind=kind)
    assert not pathlib.Path(output).exists(), output
    assert not list(pathlib.Path(output).parent.glob(f".{pathlib.Path(output).name}*")), "staging left"


def test_bad_input():
    with Tmp() as t:
        # Missing optimizer file.
        src = copy_fixture("ds0145_z2_fp32_w2_mlp", t / "missing")
        victim = src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        victim.unlink()
        check_failure(["to-universal", src, "-o", t / "o.h5"], "format error", 3,
                      ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "missing"], t / "o.h5")
        # A byte flipped inside a tensor: parsing cannot see it, the CRC-32 can.
        src = copy_fixture("ds0145_z2_fp32_w2_mlp", t / "flip")
        victim = src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        run("verify", src, "-q")
        import zipfile
        with zipfile.ZipFile(victim) as z:
            info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 16)
        data = bytearray(victim.read_bytes())
        name_len, extra_len = int.from_bytes(data[info.header_offset + 26:info.header_offset + 28], "little"), \
            int.from_bytes(data[info.header_offset + 28:info.header_offset + 30], "little")
        data[info.header_offset + 30 + name_len + extra_len + 5] ^= 0x10
        victim.write_bytes(bytes(data))
        p = run("verify", src, "-q", expect=3)
        one_error_line(p, victim.name, info.filename, "CRC-32 mismatch", kind="format error")
        # Truncated optimizer file.
        src = copy_fixture("ds0145_z2_fp32_w2_mlp", t / "trunc")
        victim = src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) // 2])
        before = victim.read_bytes()
        check_failure(["convert", src, "-o", t / "o", "--dp", 1], "format error", 3,
                      ["zero_pp_rank_1_mp_rank_00_optim_states.pt"], t / "o")
        assert victim.read_bytes() == before
        # Files from mixed world sizes: rank 1 taken from a world-1 run.
        src = copy_fixture("ds0145_z2_fp32_w2_mlp", t / "mixed")
        shutil.copy(FIXTURES / "ds0145_z2_fp32_w1_mlp" / "global_step2" /
                    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                    src / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        check_failure(["export", src, "-o", t / "o"], "format error", 3,
                      ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mixed world sizes"], t / "o")
        # An extra rank file beyond the world size.
        src = copy_fixture("ds0145_z1_fp32_w1_mlp", t / "extra")
        shutil.copy(FIXTURES / "ds0145_z1_fp32_w2_mlp" / "global_step2" /
                    "zero_pp_rank_1_mp_rank_00_optim_states.pt", src / "global_step2")
        check_failure(["to-universal", src, "-o", t / "o.h5"], "format error", 3,
                      ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mixed world sizes"], t / "o.h5")
        # An unknown ZeRO stage.
        src = copy_fixture("ds0145_z1_fp32_w1_mlp", t / "stage")
        f = src / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        obj = torch.load(f)
        obj["optimizer_state_dict"]["zero_stage"] = 7
        torch.save(obj, f)
        check_failure(["to-universal", src, "-o", t / "o.h5"], "format error", 3,
                      ["unknown ZeRO stage 7", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                      t / "o.h5")
        # No latest and no --tag.
        src = copy_fixture("ds0145_z1_fp32_w1_mlp", t / "nolatest")
        (src / "latest").unlink()
        check_failure(["to-universal", src, "-o", t / "o.h5"], "usage error", 2,
                      ["no 'latest' file", "--tag", "global_step2"], t / "o.h5")
        run("to-universal", src, "--tag", "global_step2", "-o", t / "ok.h5", "-q")
        # A tag that is not there.
        check_failure(["to-universal", src, "--tag", "global_step9", "-o", t / "o.h5"],
                      "format error", 3, ["global_step9"], t / "o.h5")
        # Bad target options.
        fx = FIXTURES / "ds0145_z1_fp32_w1_mlp"
        check_failure(["convert", fx, "-o", t / "o", "--dp", 2, "--zero-stage", 4],
                      "usage error", 2, ["--zero-stage 4"], t / "o")
        check_failure(["convert", fx, "-o", t / "o", "--dp", 2, "--tp", 2],
                      "usage error", 2, ["tp"], t / "o")
        check_failure(["convert", fx, "-o", t / "o", "--dp", 2, "--format", "nosuch"],
                      "usage error", 2, ["unknown format 'nosuch'", "deepspeed"], t / "o")
        check_failure(["export", fx, "-o", t / "o", "--dtype", "int8"],
                      "usage error", 2, ["--dtype int8"], t / "o")


def test_generated_cases():
    """The independent generator's checkpoints (frozen params, a shared
    param, buffers, two optimizer groups, worlds 3 and 8, fp32, bf16 and fp16
    with a dynamic loss scaler, ZeRO 1/2/3 and BF16_Optimizer): to-universal equals the generator's truth,
    export too, and conversions to every other stage and world size come back
    to identical atoms."""
    gen = HERE.parent / "tools" / "make_deepspeed_ckpts.py"
    with Tmp() as t:
        subprocess.run([sys.executable, str(gen), "--out", str(t / "gen")], check=True)
        cases = sorted(p for p in (t / "gen").iterdir() if p.is_dir())
        assert len(cases) >= 8
        for case in cases:
            truth = torch.load(case / "truth.pt")
            run("to-universal", case, "-o", t / "a.h5", "-q")
            check_truth(t / "a.h5", truth, case.name)
            want, frozen = atoms_of(t / "a.h5")
            assert frozen == truth["frozen_flags"], (case.name, frozen)
            run("export", case, "-o", t / "e", "-q")
            sd = ck.read_export(str(t / "e"), "safetensors")
            for n, t32 in truth["export"].items():
                ck.same(sd[n], t32, f"{case.name} export {n}")
            assert set(sd) == set(truth["export"]), (case.name, sorted(sd))
            shutil.rmtree(t / "e")
            # Converted to its own stage and world size: the generator's files.
            meta = case.name.split("_")
            stage0, world0 = int(meta[0][1:]), int(meta[2][1:])
            run("convert", case, "-o", t / "same", "--dp", world0, "--zero-stage", stage0, "-q")
            tag = (case / "latest").read_text()
            for f in sorted((case / tag).iterdir()):
                ck.compare_tree(torch.load(t / "same" / tag / f.name), torch.load(f),
                                f"{case.name}/{f.name}")
            shutil.rmtree(t / "same")
            for stage in (0, 1, 2, 3):
                for dp in (1, 5):
                    out = t / f"s{stage}dp{dp}"
                    run("convert", case, "-o", out, "--dp", dp, "--zero-stage", stage, "-q")
                    run("to-universal", out, "-o", t / "b.h5", "-q")
                    got, _ = atoms_of(t / "b.h5")
                    for k, v in want.items():
                        if k.endswith("/param") and stage == 3 and not truth["param_is_stored"].get(k, False):
                            continue  # ZeRO-3 keeps no lp copies of trainable params
                        assert got.get(k) == v, (case.name, stage, dp, k)
                    # Shared params load as the same tensor (torch.load).
                    files = sorted(out.rglob("*model_states.pt"))
                    m = torch.load(files[0])
                    if "fp16" in case.name and stage > 0:  # the dynamic loss scaler survives
                        o = torch.load(sorted(out.rglob("*optim_states.pt"))[0])
                        ls = o["optimizer_state_dict"]["loss_scaler"]
                        assert type(ls).__name__ == "DynamicLossScaler" and ls.cur_scale == 2.0**12
                        assert ls.cur_iter == 5 and ls.scale_window == 1000, vars(ls)
                        assert o["optimizer_state_dict"]["dynamic_loss_scale"] is True
                    elif "fp16" in case.name:  # FP16_Optimizer's own fields
                        o = m["optimizer"]
                        assert o["dynamic_loss_scale"] is True and o["cur_scale"] == 2.0**12, o
                        assert o["cur_iter"] == 5 and o["scale_window"] == 1000, o
                        # FP16_Optimizer: a flat master per group, the group's
                        # params back to back; unfused: a master per param.
                        unfused = "unfused" in case.name
                        assert ("fp32_groups" in o) == unfused, sorted(o)
                        for gi, g in enumerate(truth["groups"]):
                            masters = [truth["atoms"][n]["fp32"] for n in g]
                            if unfused:
                                assert len(o["fp32_groups"][gi]) == len(g)
                                for w, got in zip(masters, o["fp32_groups"][gi]):
                                    ck.same(got, w, f"{case.name} fp32_groups")
                            else:
                                ck.same(o["fp32_groups_flat"][gi],
                                        torch.cat([w.flatten() for w in masters]),
                                        f"{case.name} fp32_groups_flat")
                    if stage < 3:
                        assert m["module"]["head.weight"].data_ptr() == m["module"]["embed.weight"].data_ptr()
                    # ZeRO 0 without bf16 records no shared_params.
                    if stage == 0 and "bf16" not in case.name:
                        assert m["shared_params"] is None, m["shared_params"]
                    else:
                        assert m["shared_params"] == {"head.weight": "embed.weight"}
                    (t / "b.h5").unlink()
                    shutil.rmtree(out)
            (t / "a.h5").unlink()


def test_megatron_deepspeed_tp_pp():
    """Megatron-DeepSpeed checkpoints with TP and PP (the independent
    generator tests/tools/make_megatron_deepspeed_ckpts.py: GPTModelPipe layer
    files with BF16_Optimizer / FP16_Optimizer / ZeRO-1, and GPTModel without
    pipeline at ZeRO 1 / 2 / FP16_Optimizer, SwiGLU, vocabulary padding): to-universal merges every mp
    rank into the generator's full tensors (true vocabulary rows, padding rows
    kept beside), the same model read at tp 1/2/4 x pp 1/2 gives identical
    atoms, and export equals the fp32 masters (writing them:
    test_megatron_deepspeed_write)."""
    gen = HERE.parent / "tools" / "make_megatron_deepspeed_ckpts.py"
    with Tmp() as t:
        subprocess.run([sys.executable, str(gen), "--out", str(t / "gen")], check=True,
                       capture_output=True)
        cases = sorted(p for p in (t / "gen").iterdir() if p.is_dir())
        assert len(cases) == 8, cases
        fp32_atoms = {}
        for case in cases:
            truth = torch.load(case / "truth.pt")
            h5 = t / f"{case.name}.h5"
            p = run("to-universal", case, "-o", h5, "--json")
            info = json.loads(p.stdout)
            tp, pp = (int(x[2:]) for x in case.name.split("_") if x[:2] in ("tp", "pp")) \
                if "_pp" in case.name else (int(case.name.split("_tp")[1][0]), 1)
            check_truth(h5, truth, case.name)
            with h5py.File(h5, "r") as f:
                names = set(f["params"].keys())
                assert names == set(truth["atoms"]), (case.name, names ^ set(truth["atoms"]))
                for n, kinds in truth["pad"].items():
                    for k, ref in kinds.items():
                        ds = f["params"][n]["pad"][k]
                        raw = ds[()]
                        half = {"bfloat16": torch.bfloat16, "float16": torch.float16}
                        got = (torch.from_numpy(raw.astype(np.int16)).view(half[ds.attrs["dtype"]])
                               if ds.attrs["dtype"] in half else torch.from_numpy(raw))
                        ck.same(got, ref, f"{case.name} {n}/pad/{k}")
                meta = json.loads(f.attrs["deepspeed"])["model_parallel"]
                assert (meta["tp"], meta["pp"], meta["vocab_size"]) == (tp, pp, 30), meta
                src = json.loads(f.attrs["source"])
                assert (src["tp"], src["pp"]) == (tp, pp), src
            assert json.dumps(info).count('"tp": %d' % tp) >= 1, info
            # One model, several topologies: identical fp32 / moment atoms.
            got, _ = atoms_of(h5)
            key = ("pipe" if case.name.startswith("pipe") else "nopipe", "swiglu" in case.name)
            kept = {k: v for k, v in got.items() if k.rsplit("/", 1)[-1] in
                    ("fp32", "exp_avg", "exp_avg_sq")}
            if key in fp32_atoms:
                assert kept == fp32_atoms[key], (case.name, "atoms differ between topologies")
            fp32_atoms[key] = kept
            # Export: the fp32 masters at the true vocabulary size.
            run("export", case, "-o", t / "e", "-q")
            sd = ck.read_export(str(t / "e"), "safetensors")
            assert set(sd) == set(truth["export"]), case.name
            for n, ref in truth["export"].items():
                ck.same(sd[n], ref, f"{case.name} export {n}")
            shutil.rmtree(t / "e")
            # Every name has its layout rule (ucp layout check).
            p = run("layout", "check", case)
            assert "27 entries, 0 problem(s)" in p.stdout, p.stdout[-500:]
            h5.unlink()
        # Without model parallelism no layout applies: one clear line.
        p = run("layout", "check", FIXTURES / "ds0145_z2_fp32_w2_mlp", expect=2)
        one_error_line(p, "no layout descriptor applies", kind="usage error")
        # --vocab-size overrides universal_checkpoint_info: the padded
        # rows become part of the tensor.
        case = t / "gen" / "pipe_bf16opt_tp2_pp2_dp2"
        run("to-universal", case, "-o", t / "v.h5", "--vocab-size", 32, "-q")
        with h5py.File(t / "v.h5", "r") as f:
            e = f["params"]["tied_modules.embed.word_embeddings.weight"]
            assert e["fp32"].shape == (32, 8) and "pad" not in e, list(e)
        # Broken Megatron-DeepSpeed folders: one line naming the file.
        tag = case / "global_step3"
        for victim, needles in [
                ("layer_03-model_01-model_states.pt", ["layer_03-model_01-model_states.pt", "missing"]),
                ("mp_rank_03_model_states.pt", ["mp_rank_03_model_states.pt", "missing"]),
                ("bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt",
                 ["bf16_zero_pp_rank_1_mp_rank_02_optim_states.pt", "missing"])]:
            saved = (tag / victim).read_bytes()
            (tag / victim).unlink()
            check_failure(["to-universal", case, "-o", t / "o.h5"], "format error", 3, needles,
                          t / "o.h5")
            (tag / victim).write_bytes(saved)
        # A pipeline at ZeRO 0 with fp16 (FP16_Optimizer) records no
        # param_shapes: its stages are inferred and its masters must confirm
        # them. Layer files of a stage that does not fit: refused.
        fp16 = t / "gen" / "pipe_fp16opt_tp2_pp2_dp2"
        ftag = fp16 / "global_step3"
        a, b = ftag / "layer_03-model_00-model_states.pt", ftag / "layer_02-model_00-model_states.pt"
        saved = a.read_bytes(), b.read_bytes()
        a.write_bytes(saved[1])
        b.write_bytes(saved[0])
        check_failure(["to-universal", fp16, "-o", t / "o.h5"], "format error", 3,
                      ["model_states.pt", "fp32_groups_flat", "no trainable module param matches"],
                      t / "o.h5")
        a.write_bytes(saved[0])
        b.write_bytes(saved[1])
        # A tp rank whose local shape disagrees with tp rank 0.
        f = tag / "layer_02-model_01-model_states.pt"
        saved = f.read_bytes()
        sd = torch.load(f)
        sd["input_layernorm.weight"] = sd["input_layernorm.weight"][:4].clone()
        torch.save(sd, f)
        check_failure(["to-universal", case, "-o", t / "o.h5"], "format error", 3,
                      ["layer_02-model_01-model_states.pt", "2.input_layernorm.weight"], t / "o.h5")
        f.write_bytes(saved)
        run("to-universal", case, "-o", t / "ok.h5", "-q")


def same_files(a, b, where):
    """Every rank file of two tag folders: the same names, and torch.load
    gives equal trees (tensors equal in dtype, shape and bits). The generator
    writes frozen_param_* as None at ZeRO-2 where DeepSpeed writes an empty
    OrderedDict: both mean "none"."""
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir()), (where, names, sorted(p.name for p in b.iterdir()))

    # universal_checkpoint_info's TP pattern lists: a TP 1 source has none (Megatron-DeepSpeed
    # writes them at TP > 1 only) and ucp adds them at TP > 1, where they then stay; what
    # they say is judged by DeepSpeed's own merge (test_deepspeed_megatron_real.py).
    tp_lists = {"tp_replicated_parameter_patterns", "parameter_with_row_parallelism_patterns",
                "parameter_with_2_sub_params_cat_dim_0"}

    def cmp(x, y, path):
        if path.endswith("/universal_checkpoint_info"):
            x = {k: v for k, v in x.items() if k not in tp_lists}
            y = {k: v for k, v in y.items() if k not in tp_lists}
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), path
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), path
        elif isinstance(x, dict) and isinstance(y, dict):
            assert list(x) == list(y), (path, list(x), list(y))
            for k in x:
                cmp(x[k], y[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            assert len(x) == len(y), path
            for i, (u, v) in enumerate(zip(x, y)):
                cmp(u, v, f"{path}[{i}]")
        elif hasattr(x, "__dict__") and type(x).__name__ == type(y).__name__:
            cmp(vars(x), vars(y), path)
        elif path.rsplit("/", 1)[-1] in ("frozen_param_shapes", "frozen_param_fragments"):
            assert not x and not y, path
        else:
            assert x == y, (path, x, y)
    for n in names:
        cmp(torch.load(a / n), torch.load(b / n), f"{where} {n}")


def test_fp16_optimizer_masters_must_match_the_module():
    """ZeRO stage 0 with fp16 saves FP16_Optimizer's flat fp32 masters, which
    do not say which params they hold: ucp matches each slice to the module's
    fp16 weights (the masters rounded). A module that does not fit its masters
    is refused in one line naming the file and the group, nothing written."""
    with Tmp() as t:
        tag = t / "ck" / "global_step1"
        tag.mkdir(parents=True)
        (t / "ck" / "latest").write_text("global_step1")
        master = torch.arange(8, dtype=torch.float32) / 3

        def save(weight):
            opt = {"dynamic_loss_scale": True, "cur_scale": 1024.0, "cur_iter": 1,
                   "last_overflow_iter": -1, "scale_factor": 2.0, "scale_window": 1000,
                   "optimizer_state_dict": {"state": {0: {"step": torch.tensor(1.0),
                                                          "exp_avg": torch.ones(8),
                                                          "exp_avg_sq": torch.ones(8)}},
                                            "param_groups": [{"lr": 1e-3, "params": [0]}]},
                   "fp32_groups_flat": [master], "clip_grad": 1.0}
            torch.save({"module": OrderedDict(w=weight), "buffer_names": [], "optimizer": opt,
                        "param_shapes": None, "shared_params": None,
                        "dp_world_size": 1, "mp_world_size": 1, "global_steps": 1,
                        "ds_config": {"zero_optimization": {"stage": 0}, "fp16": {"enabled": True}},
                        "ds_version": "0.14.5"}, tag / "mp_rank_00_model_states.pt")
        # A module one step behind its masters: refused.
        save((master + 1).view(4, 2).half())
        check_failure(["to-universal", t / "ck", "-o", t / "x.h5"], "format error", 3,
                      ["mp_rank_00_model_states.pt", "fp32_groups_flat[0]",
                       "no trainable module param matches"], t / "x.h5")
        # The module that fits: read, the master at the module's shape.
        save(master.view(4, 2).half())
        run("to-universal", t / "ck", "-o", t / "x.h5", "-q")
        with h5py.File(t / "x.h5", "r") as f:
            assert np.array_equal(f["params/w/fp32"][()], master.view(4, 2).numpy())
            assert np.array_equal(f["params/w/exp_avg"][()], np.ones((4, 2), np.float32))


def zero0_case(path, rng, kind):
    """A ZeRO-0 checkpoint of a random model, as DeepSpeed's engine saves it
    without bf16 (no param_shapes, no shared_params): `kind` fp16 =
    FP16_Optimizer (a flat fp32 master per group, params back to back),
    fp16_unfused = FP16_UnfusedOptimizer (a master per param), fp32 = the torch
    optimizer itself (the module holds the fp32 weights). Groups are
    Megatron's weight decay / no decay split of the module's order, in either
    order; layer norms start at 1.0 and 0.0 and have drifted less than fp16
    can show, so their fp16 weights are equal and only their order tells them
    apart. Returns the truth: {name: {state kind: tensor}} and frozen names."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    H, F, V = rng.choice([4, 6, 8]), rng.choice([5, 8, 12]), rng.choice([7, 11])
    shapes = OrderedDict([("embed.weight", (V, H))])
    for i in range(rng.randint(1, 4)):
        shapes.update([(f"layers.{i}.ln.weight", (H,)), (f"layers.{i}.ln.bias", (H,)),
                       (f"layers.{i}.fc1.weight", (F, H)), (f"layers.{i}.fc1.bias", (F,)),
                       (f"layers.{i}.fc2.weight", (H, F))])
    shapes.update([("final_ln.weight", (H,)), ("final_ln.bias", (H,))])
    # The fp32 torch optimizer keeps no weights to tell a frozen param from a
    # trainable one of the same shape: frozen params only with fp16. Nor can
    # fp16 weights tell a frozen layer norm from a trainable one while both
    # round to the same values (README, Known limits): frozen params are
    # drawn among the others.
    frozen = set() if kind == "fp32" else {
        n for n in list(shapes)[1:] if "ln." not in n and rng.random() < 0.2}
    lp = torch.float32 if kind == "fp32" else torch.float16
    truth, module = {}, OrderedDict()
    for n, shape in shapes.items():
        if n.endswith("ln.weight"):
            master = 1 + 1e-5 * torch.randn(shape, generator=g)
        elif n.endswith("ln.bias"):
            master = 1e-5 * torch.randn(shape, generator=g)
        else:
            master = torch.randn(shape, generator=g)
        module[n] = master.to(lp)
        if n in frozen:
            truth[n] = {"param": module[n]}
            continue
        truth[n] = {"fp32": master, "exp_avg": torch.randn(shape, generator=g) * 1e-2,
                    "exp_avg_sq": torch.rand(shape, generator=g) * 1e-4}
        if lp != torch.float32:
            truth[n]["param"] = module[n]
    module["head.weight"] = module["embed.weight"]  # tied: the same tensor
    module["running"] = torch.randn(3, generator=g)  # a buffer
    truth["running"] = {"param": module["running"]}
    trainable = [n for n in shapes if n not in frozen]
    groups = [[n for n in trainable if len(shapes[n]) >= 2],
              [n for n in trainable if len(shapes[n]) < 2]]
    groups = [x for x in groups if x]
    if rng.random() < 0.5:
        groups.reverse()
    hyper = [dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1 * (i == 0))
             for i in range(len(groups))]
    scale = OrderedDict([("dynamic_loss_scale", True), ("cur_scale", 1024.0), ("cur_iter", 3),
                         ("last_overflow_iter", -1), ("scale_factor", 2.0),
                         ("scale_window", 1000)])
    step = torch.tensor(3.0)
    if kind == "fp16":
        opt = OrderedDict(scale)
        opt["optimizer_state_dict"] = {
            "state": {i: {"step": step.clone(),
                          **{k: torch.cat([truth[n][k].flatten() for n in grp])
                             for k in ("exp_avg", "exp_avg_sq")}}
                      for i, grp in enumerate(groups)},
            "param_groups": [dict(hyper[i], params=[i]) for i in range(len(groups))]}
        opt["fp32_groups_flat"] = [torch.cat([truth[n]["fp32"].flatten() for n in grp])
                                   for grp in groups]
        opt["clip_grad"] = 1.0
    else:
        ids, state, pid = [], {}, 0
        for grp in groups:
            ids.append(list(range(pid, pid + len(grp))))
            for n in grp:
                state[pid] = {"step": step.clone(), "exp_avg": truth[n]["exp_avg"],
                              "exp_avg_sq": truth[n]["exp_avg_sq"]}
                pid += 1
        inner = {"state": state,
                 "param_groups": [dict(hyper[i], params=ids[i]) for i in range(len(groups))]}
        if kind == "fp32":
            opt = inner
        else:
            opt = OrderedDict(scale)
            opt["optimizer_state_dict"] = inner
            opt["fp32_groups"] = [[truth[n]["fp32"].clone() for n in grp] for grp in groups]
    for n in trainable:
        truth[n]["step"] = step
    tag = path / "global_step3"
    tag.mkdir(parents=True)
    (path / "latest").write_text("global_step3")
    torch.save(OrderedDict([
        ("module", module), ("buffer_names", ["running"]), ("optimizer", opt),
        ("param_shapes", None), ("frozen_param_shapes", None), ("shared_params", None),
        ("frozen_param_fragments", None), ("lr_scheduler", None), ("global_steps", 3),
        ("global_samples", 6), ("dp_world_size", 2), ("mp_world_size", 1),
        ("ds_config", {"zero_optimization": {"stage": 0}, "fp16": {"enabled": kind != "fp32"}}),
        ("ds_version", "0.14.5")]), tag / "mp_rank_00_model_states.pt")
    return truth, frozen


def test_zero0_membership_property():
    """ZeRO stage 0 without bf16 records neither which params a group holds
    nor which are frozen or tied (zero0_case): over seeded random models,
    every atom ucp reads equals the truth, frozen flags and the tie included,
    and a round trip through native ZeRO-0 files at another DP size is the
    identity."""
    seed = int(os.environ.get("UCP_TEST_SEED", random.randrange(1 << 30)))
    print(f"UCP_TEST_SEED={seed}", flush=True)
    rng = random.Random(seed)
    with Tmp() as t:
        for case in range(15):
            kind = ("fp16", "fp16_unfused", "fp32")[case % 3]
            src = t / f"c{case}"
            truth, frozen = zero0_case(src, rng, kind)
            where = f"UCP_TEST_SEED={seed} case {case} ({kind})"
            run("to-universal", src, "-o", t / "a.h5", "-q")
            check_truth(t / "a.h5", {"atoms": truth}, where)
            got, flags = atoms_of(t / "a.h5")
            assert set(flags) == set(truth), (where, sorted(set(flags) ^ set(truth)))
            assert {n for n, f in flags.items() if f} == frozen, (where, flags, frozen)
            with h5py.File(t / "a.h5", "r") as f:
                tied = json.loads(f["params/embed.weight"].attrs["tied_copies"])
            assert tied == ["head.weight"], (where, tied)
            run("convert", src, "-o", t / "n", "--dp", 3, "--zero-stage", 0, "-q")
            m = torch.load(t / "n" / "global_step3" / "mp_rank_00_model_states.pt")
            assert ("fp32_groups" in m["optimizer"]) == (kind == "fp16_unfused"), where
            run("to-universal", t / "n", "-o", t / "b.h5", "-q")
            assert atoms_of(t / "b.h5") == (got, flags), where
            for x in ("a.h5", "b.h5"):
                (t / x).unlink()
            shutil.rmtree(t / "n")
            shutil.rmtree(src)


def test_megatron_deepspeed_write():
    """Megatron-DeepSpeed checkpoints written for another TP / PP / DP size
    and ZeRO stage, against the independent generator's own files: GPTModel
    without pipeline (fp32 ZeRO-2, bf16 SwiGLU ZeRO-1, fp16 FP16_Optimizer) and
    GPTModelPipe with layer files (bf16 BF16_Optimizer TP2 PP2, fp32 ZeRO-1 PP2,
    fp16 FP16_Optimizer TP2 PP2). Written back
    at its own layout every rank file equals the generator's; through another
    layout (TP 1, PP 1, another DP size and stage; read back with --layout
    where TP 1 without pipeline looks plain) and from the universal file,
    the original files come back equal. Layouts the model cannot take are
    refused in one line with nothing written."""
    gen = HERE.parent / "tools" / "make_megatron_deepspeed_ckpts.py"
    cases = [  # name, its (tp, pp, dp, stage), another layout, --layout to read that back
        ("nopipe_z2_tp2_dp2", (2, 1, 2, 2), (1, 1, 4, 1), "megatron-gpt-legacy"),
        ("nopipe_z1_tp2_dp3_swiglu", (2, 1, 3, 1), (1, 1, 2, 2), "megatron-gpt-legacy"),
        ("pipe_bf16opt_tp2_pp2_dp2", (2, 2, 2, 0), (1, 1, 3, 1), None),
        ("pipe_z1_tp1_pp2_dp2", (1, 2, 2, 1), (2, 1, 1, 2), None),
        ("nopipe_fp16opt_tp2_dp2", (2, 1, 2, 0), (1, 1, 3, 1), "megatron-gpt-legacy"),
        ("pipe_fp16opt_tp2_pp2_dp2", (2, 2, 2, 0), (1, 1, 3, 1), None),
    ]
    with Tmp() as t:
        subprocess.run([sys.executable, str(gen), "--out", str(t / "gen"), "--only",
                        *[c[0] for c in cases]], check=True, capture_output=True)
        for name, own, other, layout in cases:
            src = t / "gen" / name
            tag = src / "global_step3"

            def flags(tp, pp, dp, stage):
                return ["--tp", tp, "--pp", pp, "--dp", dp, "--zero-stage", stage]
            run("convert", src, "-o", t / "same", *flags(*own), "-q")
            same_files(tag, t / "same" / "global_step3", f"{name} same layout")
            run("convert", src, "-o", t / "other", *flags(*other), "-q")
            n_mp = other[0] * other[1]
            assert len(list((t / "other" / "global_step3").glob("mp_rank_*"))) == n_mp, name
            back = ["--layout", layout] if layout else []
            run("convert", t / "other", "-o", t / "back", *flags(*own), *back, "-q")
            same_files(tag, t / "back" / "global_step3", f"{name} via {other}")
            run("to-universal", src, "-o", t / "u.h5", "-q")
            run("reshape", t / "u.h5", "-o", t / "re", *flags(*own), "--format", "deepspeed", "-q")
            same_files(tag, t / "re" / "global_step3", f"{name} via the universal file")
            for d in ("same", "other", "back", "re"):
                shutil.rmtree(t / d)
            (t / "u.h5").unlink()
        nopipe, pipe = t / "gen" / "nopipe_z2_tp2_dp2", t / "gen" / "pipe_z1_tp1_pp2_dp2"
        for src, args, kind, code, needles in [
                (nopipe, ["--tp", 4, "--dp", 1, "--zero-stage", 1], "layout error", 4,
                 ["tp 4 does not divide the query groups"]),
                (nopipe, ["--tp", 2, "--dp", 1, "--zero-stage", 3], "usage error", 2, ["stage 1 or 2"]),
                (nopipe, ["--pp", 2, "--dp", 1, "--zero-stage", 1], "usage error", 2, ["no pipeline"]),
                (pipe, ["--pp", 3, "--dp", 1, "--zero-stage", 1], "usage error", 2,
                 ["2 transformer layers", "pp must divide"]),
                (pipe, ["--pp", 2, "--vpp", 2, "--dp", 1, "--zero-stage", 1], "usage error", 2,
                 ["no virtual pipeline"]),
                (FIXTURES / "ds0145_z2_fp32_w2_mlp", ["--tp", 2, "--dp", 1], "usage error", 2,
                 ["only for a Megatron-DeepSpeed source"])]:
            check_failure(["convert", src, "-o", t / "bad", *args], kind, code, needles, t / "bad")

def check_truth(h5path, truth, where):
    with h5py.File(h5path, "r") as f:
        for n, kinds in truth["atoms"].items():
            g = f["params"][n]
            for k, ref in kinds.items():
                raw = g[k][()]
                if g[k].attrs["dtype"] == "bfloat16":
                    got = torch.from_numpy(raw.astype(np.int16)).view(torch.bfloat16)
                elif g[k].attrs["dtype"] == "float16":
                    got = torch.from_numpy(raw.astype(np.int16)).view(torch.float16)
                else:
                    got = torch.from_numpy(np.ascontiguousarray(raw))
                ck.same(got.reshape(ref.shape), ref, f"{where} {n}/{k}")


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
