"""User paths of the `ucp` command that the format suites do not reach, each
checked against an independent oracle: the Megatron generator's truth.pt
(tests/tools/make_megatron_ckpts.py), safetensors parsed from the spec
(check_deepspeed.read_safetensors), torch's own rounding, Python's xxhash and
the generator's files for the target layout (compare_megatron_ckpt.py).

  Megatron `ucp export` content, fp32 / bf16 / fp16; Megatron -> DeepSpeed
  and the refusal the other way; --from; --no-optimizer; to-universal
  --force; --progress; reshape --manifest; --iteration; --exclude-frozen; reshape and export from a
  universal file with a flipped byte; Megatron's ChainedOptimizer, MoE and
  pre-v0.7 distributed-optimizer refusals.
"""
import json
import os
import pathlib
import shutil
import sys
import tempfile

import h5py
import torch
import xxhash

HERE = pathlib.Path(__file__).resolve().parent
TOOLS = HERE.parent / "tools"
sys.path.insert(0, str(TOOLS))
from check_deepspeed import read_safetensors  # noqa: E402
import oracle_checks  # noqa: E402

from testmain import UCP, one_error_line, run  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron" / "gqa_swiglu_bias_untied"
SRC = DATA / "tp2_pp2_vpp1_dp2_do"
DS = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5" / "ds0145_z1_fp32_w2_mlp"
PY = os.environ.get("UCP_PYTHON", "/usr/bin/python3")


def truth():
    return torch.load(DATA / "truth.pt")


def tmp():
    return tempfile.TemporaryDirectory(prefix="ucp-paths-")


def exported(folder):
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(read_safetensors(str(f)))
    return out


def bits_equal(a, b, what):
    assert a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape), (what, a.dtype, a.shape,
                                                                     b.dtype, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), what


def all_bits_equal(got, want, what):
    """bits_equal for every key of `want` (got may hold more); returns the number of values
    compared."""
    for k, w in want.items():
        assert k in got, (what, k)
        bits_equal(got[k], w, (what, k))
    return sum(w.numel() for w in want.values())


# The generator's Megatron model (tests/tools/make_megatron_ckpts.py's small variant) holds
# thousands of values; a comparison reaching fewer compared too little.
MIN_VALUES = 1000


def assert_bits_equal(got, want, what):
    """all_bits_equal with the count rule and a negative control (oracle_checks.checked) on the
    tensors `want` names (the control changes one of them)."""
    got = {k: v for k, v in got.items() if k in want}
    oracle_checks.checked(lambda g: all_bits_equal(g, want, what), got, MIN_VALUES, what)


def test_megatron_export_holds_the_truth():
    """fp32 = the masters; bf16 = the generator's bf16 weights; fp16 = the
    masters rounded by torch (nearest even); names are the canonical ones,
    vocabulary padding removed."""
    params = truth()["params"]
    with tmp() as t:
        t = pathlib.Path(t)
        for dtype in ("fp32", "bf16", "fp16"):
            run("export", SRC, "-o", t / dtype, "--dtype", dtype, "-q")
            got = exported(t / dtype)
            assert sorted(got) == sorted(params), (sorted(got), sorted(params))
            want = {name: {"fp32": kinds["fp32"], "bf16": kinds["model"],
                           "fp16": kinds["fp32"].to(torch.float16)}[dtype]
                    for name, kinds in params.items()}
            assert_bits_equal(got, want, f"export {dtype}")


def test_export_hf_refuses_what_is_not_a_llama():
    """export --hf writes LlamaForCausalLM folders only: a Megatron model with linear biases
    and a DeepSpeed MLP are one clear usage error each, nothing written."""
    with tempfile.TemporaryDirectory() as t:
        t = pathlib.Path(t)
        p = run("export", SRC, "-o", t / "a", "--hf", expect=2)
        one_error_line(p, "--hf", "biases", kind="usage error")
        p = run("export", DS, "-o", t / "b", "--hf", expect=2)
        one_error_line(p, "--hf", "not a Megatron-core GPTModel", kind="usage error")
        assert list(t.iterdir()) == [], list(t.iterdir())


def test_megatron_to_deepspeed_and_refused_back():
    """Megatron -> DeepSpeed ZeRO 1 at DP 2 keeps every master and moment
    (its universal content equals the generator's truth); DeepSpeed's plain
    models cannot be placed on Megatron's layout: one clear error."""
    with tmp() as t:
        t = pathlib.Path(t)
        run("convert", SRC, "-o", t / "ds", "--format", "deepspeed", "--dp", 2,
            "--zero-stage", 1, "-q", "--no-sync")
        assert sorted(p.name for p in (t / "ds").rglob("*optim_states.pt")) == [
            "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"]
        run("to-universal", t / "ds", "-o", t / "u.h5", "-q")
        params = truth()["params"]
        with h5py.File(t / "u.h5", "r") as f:
            assert sorted(f["params"]) == sorted(params)
            got = {(name, kind): torch.from_numpy(f["params"][name][kind][()])
                   for name in params for kind in ("fp32", "exp_avg", "exp_avg_sq")}
        assert_bits_equal(got, {(name, kind): kinds[kind] for name, kinds in params.items()
                                for kind in ("fp32", "exp_avg", "exp_avg_sq")}, "DeepSpeed's universal")
        p = run("convert", DS, "-o", t / "mg", "--format", "megatron", "--tp", 1, "--pp", 1,
                "--dp", 1, expect=4)
        one_error_line(p, "no layout descriptor", "match no built-in layout", kind="layout error")
        assert not (t / "mg").exists()


def test_from_forces_or_refuses_a_format():
    with tmp() as t:
        t = pathlib.Path(t)
        run("to-universal", SRC, "-o", t / "a.h5", "--from", "megatron", "-q")
        # A Megatron folder read as DeepSpeed: no DeepSpeed tracker there.
        p = run("to-universal", SRC, "-o", t / "b.h5", "--from", "deepspeed", expect=2)
        one_error_line(p, str(SRC), "'latest'", kind="usage error")
        assert not (t / "b.h5").exists()
        p = run("to-universal", SRC, "-o", t / "c.h5", "--from", "nonsense", expect=2)
        one_error_line(p, "nonsense", kind="usage error")


def test_no_optimizer_writes_model_weights_only():
    with tmp() as t:
        t = pathlib.Path(t)
        run("convert", SRC, "-o", t / "m", "--tp", 1, "--pp", 1, "--dp", 1, "--no-optimizer",
            "-q", "--no-sync")
        files = sorted((t / "m").rglob("*.pt"))
        assert [f.name for f in files] == ["model_optim_rng.pt"], files
        sys.path.insert(0, str(TOOLS / "stubs"))
        d = torch.load(files[0], map_location="cpu")
        assert d.get("optimizer") is None and "opt_param_scheduler" not in d, list(d)
        params = truth()["params"]
        # The weights are the training dtype's: the generator's bf16 weights
        # (the names are local: compare through the exported model).
        run("export", t / "m", "-o", t / "e", "--dtype", "bf16", "-q")
        got = exported(t / "e")
        assert_bits_equal(got, {name: kinds["model"] for name, kinds in params.items()},
                          "--no-optimizer export")


def test_to_universal_force_replaces_only_when_asked():
    with tmp() as t:
        t = pathlib.Path(t)
        out = t / "u.h5"
        out.write_bytes(b"not a universal file")
        p = run("to-universal", SRC, "-o", out, expect=2)
        one_error_line(p, "--force", kind="usage error")
        assert out.read_bytes() == b"not a universal file"
        run("to-universal", SRC, "-o", out, "--force", "-q")
        with h5py.File(out, "r") as f:
            assert sorted(f["params"]) == sorted(truth()["params"])


def test_progress_shows_on_request_only():
    with tmp() as t:
        t = pathlib.Path(t)
        p = run("convert", SRC, "-o", t / "a", "--tp", 1, "--pp", 1, "--dp", 1, "--progress",
                "--no-sync")
        # (text mode reads the bar's carriage returns as newlines)
        assert "\x1b[K" in p.stderr and "%" in p.stderr, p.stderr[:300]
        p = run("convert", SRC, "-o", t / "b", "--tp", 1, "--pp", 1, "--dp", 1, "--no-sync")
        assert "\x1b" not in p.stderr, p.stderr[:300]  # not a terminal: no bar
        p = run("convert", SRC, "-o", t / "c", "--tp", 1, "--pp", 1, "--dp", 1, "-q",
                "--no-sync")
        assert p.stderr == "", p.stderr


def test_reshape_manifest_lists_every_file():
    """Sizes and the xxh3 of every record (zip entries) as Python's zipfile
    and xxhash see them."""
    import zipfile
    with tmp() as t:
        t = pathlib.Path(t)
        run("to-universal", SRC, "-o", t / "u.h5", "-q")
        run("reshape", t / "u.h5", "-o", t / "o", "--tp", 1, "--pp", 2, "--dp", 1,
            "--distributed-optimizer", "--manifest", "-q", "--no-sync")
        manifests = list((t / "o").rglob("ucp.manifest.json"))
        assert len(manifests) == 1, manifests
        m = json.loads(manifests[0].read_text())
        assert (m["format"], m["version"], m["hash"]) == ("ucp.manifest", 1, "xxh3-64"), m
        folder = manifests[0].parent
        rank_files = sorted(str(p.relative_to(folder)) for p in folder.rglob("*.pt"))
        assert sorted(m["files"]) == rank_files and len(rank_files) == 4, (m["files"], rank_files)
        for rel in rank_files:
            entry = m["files"][rel]
            assert entry["size"] == (folder / rel).stat().st_size, rel
            with zipfile.ZipFile(folder / rel) as z:
                want = {i.filename: f"{xxhash.xxh3_64_intdigest(z.read(i)):016x}"
                        for i in z.infolist()}
            assert entry["records"] == want, rel


def test_flipped_byte_in_the_universal_file():
    """A byte flipped inside a dataset: reshape and export refuse in one line
    naming the param, nothing under the output name, the file untouched."""
    with tmp() as t:
        t = pathlib.Path(t)
        u = t / "u.h5"
        run("to-universal", SRC, "-o", u, "-q")
        name = "decoder.layers.0.mlp.linear_fc1.weight"
        with h5py.File(u, "r") as f:
            offset = f["params"][name]["fp32"].id.get_offset()
        data = bytearray(u.read_bytes())
        data[offset + 12] ^= 0x40
        u.write_bytes(bytes(data))
        before = u.read_bytes()
        p = run("reshape", u, "-o", t / "o", "--tp", 1, "--pp", 1, "--dp", 1, expect=3)
        one_error_line(p, name, "xxh3", kind="format error")
        p = run("export", u, "-o", t / "e", expect=3)
        one_error_line(p, name, "xxh3", kind="format error")
        assert not (t / "o").exists() and not (t / "e").exists()
        assert u.read_bytes() == before


def rewritten_copy(t, edit, which="model_optim_rng.pt"):
    """A copy of SRC with `edit(dict)` applied to each of its `which` files
    (torch.save again by torch itself)."""
    sys.path.insert(0, str(TOOLS / "stubs"))  # Megatron's classes for torch.load
    dst = t / f"edited-{which}"
    shutil.copytree(SRC, dst)
    files = sorted(dst.rglob(which))
    assert files
    for f in files:
        d = torch.load(f, map_location="cpu")
        edit(d)
        torch.save(d, f)
    return dst


def test_megatron_refusals_are_one_clear_line():
    """A ChainedOptimizer (a list of optimizers) of a dense model, args of a
    mixture-of-experts model over a dense model's rank files and the
    distributed-optimizer format before Megatron-core v0.7 are refused in one
    line naming the file and the reason; nothing written."""
    def chained(d):
        d["optimizer"] = [d["optimizer"], d["optimizer"]]

    def moe(d):
        d["args"].num_experts = 8

    def pre_v07(d):
        d.pop("buckets_coalesced", None)

    cases = [(chained, "model_optim_rng.pt", "ChainedOptimizer"),
             (moe, "model_optim_rng.pt", "mixture-of-experts"),
             (pre_v07, "distrib_optim.pt", "before v0.7")]
    with tmp() as t:
        t = pathlib.Path(t)
        for i, (edit, which, needle) in enumerate(cases):
            src = rewritten_copy(t, edit, which)
            p = run("to-universal", src, "-o", t / f"u{i}.h5", expect=3)
            one_error_line(p, needle, which, kind="format error")
            assert not (t / f"u{i}.h5").exists()
            shutil.rmtree(src)


def test_iteration_selects_a_checkpoint_of_the_save_folder():
    """--iteration N reads iter_N instead of the tracker's; an iteration the
    folder lacks is one error listing those it has. The second iteration is
    the first one re-saved by torch with iteration 50 in every rank file."""
    sys.path.insert(0, str(TOOLS / "stubs"))
    with tmp() as t:
        t = pathlib.Path(t)
        save = t / "save"
        shutil.copytree(SRC, save)
        shutil.copytree(save / "iter_0000100", save / "iter_0000050")
        for f in (save / "iter_0000050").rglob("model_optim_rng.pt"):
            d = torch.load(f, map_location="cpu")
            d["iteration"] = 50
            torch.save(d, f)
        for args, want in (((), 100), (("--iteration", 50), 50), (("--iteration", 100), 100)):
            run("to-universal", save, "-o", t / f"u{want}.h5", *args, "-q", "--force")
            with h5py.File(t / f"u{want}.h5", "r") as f:
                assert int(f.attrs["iteration"]) == want, (args, f.attrs["iteration"])
        p = run("to-universal", save, "-o", t / "x.h5", "--iteration", 70, expect=2)
        one_error_line(p, "iter_0000070", "iter_0000050, iter_0000100", kind="usage error")
        assert not (t / "x.h5").exists()


def test_exclude_frozen_leaves_out_frozen_params():
    """A DeepSpeed ZeRO-0 checkpoint with frozen params (the DeepSpeed suite's
    generator, test_deepspeed_cli.zero0_case): export keeps them, with
    --exclude-frozen only the trainable ones remain, values unchanged."""
    import random
    import test_deepspeed_cli as dsc
    with tmp() as t:
        t = pathlib.Path(t)
        rng = random.Random(7)
        for attempt in range(20):
            src = t / f"src{attempt}"
            truth, frozen = dsc.zero0_case(src, rng, "fp16")
            if frozen:
                break
        assert frozen, "no case with frozen params"
        run("export", src, "-o", t / "all", "-q")
        run("export", src, "-o", t / "trainable", "--exclude-frozen", "-q")
        everything, trainable = exported(t / "all"), exported(t / "trainable")
        assert set(frozen) <= set(everything), (frozen, sorted(everything))
        assert sorted(trainable) == sorted(set(everything) - set(frozen)), (
            sorted(trainable), frozen)
        for name, tensor in trainable.items():
            bits_equal(tensor, everything[name], name)


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
