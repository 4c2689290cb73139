#!/usr/bin/python3
"""End-to-end tests of ucp to-universal / reshape / convert / verify / layout
on Megatron-LM checkpoints written by the independent generator
(tests/tools/make_megatron_ckpts.py, fixture megatron_ckpts), including the
issue's bad-input cases: one clear error line naming file, parameter and
problem; the right exit code; nothing left under the output name; the source
untouched.
"""
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
sys.path.insert(0, str(HERE.parent / "tools" / "stubs"))

from testmain import UCP, one_error_line, run  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron"
TOOLS = HERE.parent / "tools"
PY = os.environ.get("UCP_PYTHON", "/usr/bin/python3")
VARIANT = "gqa_swiglu_bias_untied"
SRC = DATA / VARIANT / "tp2_pp2_vpp1_dp2_do"


def tree_hash(path):
    h = hashlib.sha256()
    for f in sorted(pathlib.Path(path).rglob("*")):
        h.update(str(f.relative_to(path)).encode())
        if f.is_file():
            h.update(f.read_bytes())
    return h.hexdigest()


def compare(expected, actual, *extra):
    p = subprocess.run([PY, str(TOOLS / "compare_megatron_ckpt.py"), str(expected), str(actual),
                        *extra], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def Tmp():
    return testmain.Tmp("ucp-cli-")


def test_help_teaches_every_command():
    for cmd in ("to-universal", "reshape", "convert", "verify", "layout", "inspect"):
        out = run(cmd, "--help").stdout
        assert "usage: ucp " + cmd in out and "example" in out, (cmd, out[:300])


def test_to_universal_reshape_verify_json():
    with Tmp() as t:
        doc = json.loads(run("to-universal", SRC, "-o", t / "u.h5", "--json", "-q").stdout)
        assert doc["command"] == "to-universal" and doc["iteration"] == 100
        assert doc["source_topology"] == {"tp": 2, "pp": 2, "vpp": 1, "dp": 2,
                                          "distributed_optimizer": True}
        assert doc["params"] > 0 and doc["replicas_verified"] > 0
        v = json.loads(run("verify", t / "u.h5", "--json", "-q").stdout)
        assert v["ok"] and v["kind"] == "universal"
        info = json.loads(run("inspect", "--json", t / "u.h5").stdout)["files"][0]
        assert info["format"] == "universal" and len(info["params"]) == doc["params"]
        emb = next(p for p in info["params"] if p["name"] == "embedding.word_embeddings.weight")
        assert emb["dtype"] == "bfloat16" and emb["padding_rows"] == 192 - 130
        assert set(emb["state_kinds"]) == {"param", "fp32", "exp_avg", "exp_avg_sq"}
        assert {c["check"] for c in v["checks"]} == {"structure", "checksums", "layout"}
        # Targets whose padded vocabulary is no larger than the source's (TP2:
        # 192 rows), so every padding row they hold exists in the source.
        for topo, flags in [("tp2_pp1_vpp1_dp2_do", ["--tp", 2, "--pp", 1, "--dp", 2,
                                                     "--distributed-optimizer"]),
                            ("tp1_pp4_vpp2_dp1_nodo", ["--tp", 1, "--pp", 4, "--vpp", 2,
                                                       "--dp", 1])]:
            out = t / topo
            doc = json.loads(run("reshape", t / "u.h5", "-o", out, *flags, "--json", "-q").stdout)
            assert doc["files"] > 0 and "--load" not in doc["megatron_flags"]
            assert "--tensor-model-parallel-size" in doc["megatron_flags"]
            compare(DATA / VARIANT / topo, out, "--ignore-rng")
        v = json.loads(run("verify", t / "tp1_pp4_vpp2_dp1_nodo", "--json", "-q").stdout)
        assert v["ok"] and v["kind"] == "megatron"


def test_convert_equals_to_universal_then_reshape():
    with Tmp() as t:
        run("to-universal", SRC, "-o", t / "u.h5", "-q")
        flags = ["--tp", 1, "--pp", 2, "--dp", 4, "--distributed-optimizer", "-q"]
        run("reshape", t / "u.h5", "-o", t / "a", *flags)
        run("convert", SRC, "-o", t / "b", *flags)
        fa = sorted(p.relative_to(t / "a") for p in (t / "a").rglob("*") if p.is_file())
        fb = sorted(p.relative_to(t / "b") for p in (t / "b").rglob("*") if p.is_file())
        assert fa == fb and fa, (fa, fb)
        for rel in fa:
            assert (t / "a" / rel).read_bytes() == (t / "b" / rel).read_bytes(), rel
        assert not list(t.glob(".*ucp*")), "staging left behind"
        # And both equal the independent generator's files for that layout,
        # every one of the ~500 args fields included (the default compares
        # the load-relevant ones).
        expected = DATA / VARIANT / "tp1_pp2_vpp1_dp4_do"
        args = torch.load(next(expected.rglob("model_optim_rng.pt")), map_location="cpu")["args"]
        fields = sorted(vars(args))
        assert len(fields) > 400, len(fields)
        compare(expected, t / "b", "--ignore-rng", "--args-fields", ",".join(fields))


def test_layout_check_lists_every_param():
    doc = json.loads(run("layout", "check", SRC, "--json").stdout)
    assert doc["problems"] == 0 and doc["layout"] == "mcore-gpt"
    names = {p["param"] for p in doc["params"]}
    assert "decoder.layers.7.mlp.linear_fc1.weight" in names  # global layer index
    rules = {p["param"]: p["rule"] for p in doc["params"]}
    assert rules["embedding.word_embeddings.weight"] == "word_embeddings"


# --- bad input -------------------------------------------------------------

def copy_source(t):
    dst = t / "src"
    shutil.copytree(SRC, dst)
    return dst


def check_failure(args, kind, code, needles, output, source):
    before = tree_hash(source)
    p = run(*args, expect=code)
    one_error_line(p, *needles, kind=kind)
    assert not output.exists(), f"{output} left behind"
    assert not list(output.parent.glob("." + output.name + "*")), "staging left behind"
    assert tree_hash(source) == before, "source modified"


def test_missing_rank_file():
    with Tmp() as t:
        src = copy_source(t)
        victim = src / "iter_0000100" / "mp_rank_01_001" / "model_optim_rng.pt"
        victim.unlink()
        for cmd in (["to-universal", src, "-o", t / "u.h5"],
                    ["convert", src, "-o", t / "out", "--tp", 1, "--pp", 1, "--dp", 1]):
            out = t / ("u.h5" if cmd[0] == "to-universal" else "out")
            check_failure(cmd, "format error", 3, [victim], out, src)


def test_truncated_and_corrupt_rank_file():
    with Tmp() as t:
        src = copy_source(t)
        victim = src / "iter_0000100" / "mp_rank_00_001" / "model_optim_rng.pt"
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) * 2 // 3])
        check_failure(["to-universal", src, "-o", t / "u.h5"], "format error", 3, [victim],
                      t / "u.h5", src)
        garbled = bytearray(data)
        for i in range(64, 400):  # the zip header and data.pkl
            garbled[i] ^= 0x5A
        victim.write_bytes(bytes(garbled))
        check_failure(["to-universal", src, "-o", t / "u.h5"], "format error", 3, [victim],
                      t / "u.h5", src)


def rewrite(path, edit):
    import megatron_spec  # noqa: F401  (stub classes for torch.load)
    obj = torch.load(path, map_location="cpu")
    edit(obj)
    torch.save(obj, path)


def test_replicas_that_disagree():
    with Tmp() as t:
        src = copy_source(t)
        victim = src / "iter_0000100" / "mp_rank_01_000" / "model_optim_rng.pt"
        name = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"

        def edit(obj):
            obj["model"][name][3] += 1.0
        rewrite(victim, edit)
        check_failure(["to-universal", src, "-o", t / "u.h5"], "format error", 3,
                      ["replicas differ", name, "mp_rank_01_000"], t / "u.h5", src)
        p = run("verify", src, expect=3)
        one_error_line(p, "replicas differ", name, kind="format error")
        # With a manifest (the replicas are hashed as the records are read
        # whole) the same.
        run("manifest", src, "-q")
        p = run("verify", src, expect=3)
        one_error_line(p, "replicas differ", name, "mp_rank_01_000", kind="format error")


def run_counting_reads(*args, expect=0):
    """Runs ucp; returns (process, bytes it read): rchar of /proc/<pid>/io,
    read once the process has exited and before it is reaped."""
    p = subprocess.Popen([str(UCP), *map(str, args)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    with open(f"/proc/{p.pid}/io") as f:
        io = dict(line.split(": ") for line in f.read().splitlines())
    out, err = p.communicate()
    assert p.returncode == expect, (args, p.returncode, out[-3000:], err[-3000:])
    return subprocess.CompletedProcess(args, p.returncode, out, err), int(io["rchar"])


def byte_of(path, tensor):
    """(record name, file offset) of the middle byte of `tensor`'s elements
    in the torch.save file `path` (its storage is the one record of that
    size; Megatron keeps all params in one buffer)."""
    import zipfile
    nbytes = tensor.storage().size() * tensor.element_size()
    with zipfile.ZipFile(path) as z:
        infos = [i for i in z.infolist() if "/data/" in i.filename and i.file_size == nbytes]
    assert len(infos) == 1, infos
    info = infos[0]
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + \
        int.from_bytes(head[28:30], "little")
    middle = tensor.storage_offset() + tensor.numel() // 2
    return info.filename, start + middle * tensor.element_size()


def test_verify_reads_every_byte_once():
    # Tied embeddings on two pipeline stages, with a vocabulary large enough
    # that both copies (bf16 weights, fp32 masters and moments) are most of
    # the checkpoint's 69 MB (the replica check reads them). The CRC-32 pass
    # must not read them again: at most 1.05x the checkpoint in all (it was
    # 1.86x). With a ucp.manifest.json every record is read whole for its
    # XXH3-64, and the replicas must be hashed from that read (it was 1.86x).
    import megatron_spec  # noqa: F401  (stub classes for torch.load)
    with Tmp() as t:
        subprocess.run([PY, str(TOOLS / "make_megatron_ckpts.py"), "--out", str(t / "gen"),
                        "--variant", "gqa_swiglu_bias_tied", "--topologies",
                        "tp2_pp2_vpp1_dp2_do", "--scale",
                        "hidden=256,ffn=512,layers=2,vocab=8000,heads=4,groups=2",
                        "--no-truth"], check=True, capture_output=True)
        src = t / "gen" / "gqa_swiglu_bias_tied" / "tp2_pp2_vpp1_dp2_do"
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        p, read = run_counting_reads("verify", src, "--json", "-q")
        doc = json.loads(p.stdout)
        assert doc["ok"], doc
        replicas = next(c for c in doc["checks"] if c["check"] == "replicas")
        assert int(replicas["detail"].split()[0]) > 0, doc
        assert read <= 1.05 * size, (read, size, read / size)
        run("manifest", src, "-q")
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        p, read = run_counting_reads("verify", src, "--json", "-q")
        doc = json.loads(p.stdout)
        assert doc["ok"], doc
        checks = {c["check"]: c["detail"] for c in doc["checks"]}
        assert "match ucp.manifest.json" in checks["integrity"], doc
        assert int(checks["replicas"].split()[0]) > 0, doc
        assert read <= 1.05 * size, ("verify with a manifest", read, size, read / size)
        p, read = run_counting_reads("resume", src, "--tp", 2, "--pp", 2, "--dp", 2,
                                     "--distributed-optimizer", "--json", "-q")
        assert json.loads(p.stdout)["reshaped"] is False, p.stdout
        assert read <= 1.05 * size, ("resume with a manifest", read, size, read / size)
        # A flipped byte inside a replicated region is still the record's
        # CRC-32 mismatch (reported before the replicas are compared).
        victim = src / "iter_0000100" / "mp_rank_00_001" / "model_optim_rng.pt"
        model = torch.load(victim, map_location="cpu")["model"]
        record, at = byte_of(victim, model["output_layer.weight"])
        data = bytearray(victim.read_bytes())
        data[at] ^= 0x08
        victim.write_bytes(bytes(data))
        p = run("verify", src, expect=3)
        one_error_line(p, victim, record, "CRC-32 mismatch", kind="format error")


def test_shapes_that_disagree():
    with Tmp() as t:
        src = copy_source(t)
        victim = src / "iter_0000100" / "mp_rank_01_000" / "model_optim_rng.pt"
        name = "decoder.layers.1.self_attention.linear_proj.weight"

        def edit(obj):
            w = obj["model"][name]
            obj["model"][name] = torch.cat([w, w[:, :1]], dim=1)
        rewrite(victim, edit)
        check_failure(["to-universal", src, "-o", t / "u.h5"], "format error", 3,
                      [name, "mp_rank_01_000"], t / "u.h5", src)


def test_layout_leaving_a_param_unmatched():
    with Tmp() as t:
        yaml = run("layout", "show", "mcore-gpt").stdout
        start = yaml.index("  - name: final_norm\n")
        end = yaml.index("  - name:", start + 10)
        bad = t / "bad.yaml"
        bad.write_text(yaml[:start] + yaml[end:])  # drop the final-norm rule
        p = run("layout", "check", SRC, "--layout", bad, expect=4)
        assert "decoder.final_layernorm.weight" in p.stdout and "PROBLEM" in p.stdout
        one_error_line(p, "decoder.final_layernorm.weight", kind="layout error")
        check_failure(["to-universal", SRC, "-o", t / "u.h5", "--layout", bad],
                      "layout error", 4, ["decoder.final_layernorm.weight"], t / "u.h5", SRC)


def test_targets_that_do_not_divide():
    with Tmp() as t:
        run("to-universal", SRC, "-o", t / "u.h5", "-q")
        cases = [
            (["--tp", 3, "--pp", 1, "--dp", 1], ["tp 3 does not divide the query groups"]),
            (["--tp", 8, "--pp", 1, "--dp", 1], ["tp 8 does not divide the query groups"]),
            (["--tp", 1, "--pp", 3, "--dp", 1], ["layers"]),         # 8 layers
            (["--tp", 1, "--pp", 4, "--vpp", 4, "--dp", 1], ["layers"]),
            (["--tp", 1, "--pp", 1, "--vpp", 2, "--dp", 1], ["pipeline"]),
        ]
        for flags, needles in cases:
            check_failure(["reshape", t / "u.h5", "-o", t / "out", *flags], "layout error", 4,
                          needles, t / "out", SRC)


def test_refuses_to_overwrite():
    with Tmp() as t:
        run("to-universal", SRC, "-o", t / "u.h5", "-q")
        before = (t / "u.h5").read_bytes()
        p = run("to-universal", SRC, "-o", t / "u.h5", expect=2)
        one_error_line(p, "already exists", "--force", kind="usage error")
        assert (t / "u.h5").read_bytes() == before
        (t / "out").mkdir()
        (t / "out" / "keep.txt").write_text("mine")
        p = run("reshape", t / "u.h5", "-o", t / "out", "--tp", 1, "--pp", 1, "--dp", 1, expect=2)
        one_error_line(p, "already exists", kind="usage error")
        assert (t / "out" / "keep.txt").read_text() == "mine"
        p = run("reshape", t / "u.h5", "-o", t / "x", "--tp", 1, expect=2)
        one_error_line(p, "needs the data-parallel size", "--dp", kind="usage error")


def test_output_folder_missing_and_options_checked_first():
    with Tmp() as t:
        # The missing folder is named, not the temporary file inside it.
        p = run("to-universal", SRC, "-o", t / "no" / "such" / "u.h5", expect=5)
        one_error_line(p, t / "no" / "such", "does not exist", kind="i/o error")
        assert "ucp-tmp" not in p.stderr, p.stderr
        assert not (t / "no").exists()
        # A bad --memory / --threads is a usage error before any work: no
        # staging folder, no output.
        for flags in (["--memory", "12X"], ["--memory", "1M"], ["--threads", -1]):
            p = run("reshape", SRC, "-o", t / "out", "--tp", 1, "--pp", 1, "--dp", 1,
                    *flags, expect=2)
            one_error_line(p, kind="usage error")
            p = run("to-universal", SRC, "-o", t / "u.h5", *flags, expect=2)
            one_error_line(p, kind="usage error")
            assert list(t.iterdir()) == [], list(t.iterdir())
        # Size suffixes in any case.
        run("to-universal", SRC, "-o", t / "u.h5", "--memory", "64m", "-q")
        assert (t / "u.h5").is_file()


def test_damaged_universal_file_metadata():
    with Tmp() as t:
        run("to-universal", SRC, "-o", t / "u.h5", "-q")
        bad = t / "bad json.h5"
        shutil.copyfile(t / "u.h5", bad)
        subprocess.run([PY, "-c", "import h5py, sys\n"
                        "with h5py.File(sys.argv[1], 'r+') as f:\n"
                        "    f.attrs['model'] = '{\"hidden_size\": [' * 100000\n",
                        str(bad)], check=True)
        for cmd in (["inspect"], ["verify", "-q"]):
            p = run(*cmd, bad, expect=3)
            one_error_line(p, bad, "attribute model", "JSON", kind="format error")
        # A stored layout descriptor that is not valid YAML: the universal
        # file is damaged (format error, 3), not a bad user layout (4).
        bad = t / "bad layout.h5"
        shutil.copyfile(t / "u.h5", bad)
        subprocess.run([PY, "-c", "import h5py, sys\n"
                        "with h5py.File(sys.argv[1], 'r+') as f:\n"
                        "    f.attrs['layout'] = 'name: x\\nrules: [\\n'\n",
                        str(bad)], check=True)
        for cmd in (["verify", "-q"], ["reshape", "-q", "-o", t / "o", "--tp", 1, "--pp", 1,
                                       "--dp", 1]):
            p = run(*cmd, bad, expect=3)
            one_error_line(p, bad, "attribute layout", kind="format error")
        assert not (t / "o").exists()
        # A param's tied_copies that is not a JSON list of names (bad JSON;
        # a list holding a number): the file is damaged, the param named.
        for value in ('["output_layer.weight"', '[7]'):
            bad = t / "bad tied.h5"
            shutil.copyfile(t / "u.h5", bad)
            subprocess.run([PY, "-c", "import h5py, sys\n"
                            "with h5py.File(sys.argv[1], 'r+') as f:\n"
                            "    g = f['params'][sorted(f['params'])[0]]\n"
                            "    g.attrs['tied_copies'] = sys.argv[2]\n"
                            "    print(g.name)\n",
                            str(bad), value], check=True, capture_output=True)
            for cmd in (["verify", "-q"], ["reshape", "-q", "-o", t / "o", "--tp", 1, "--pp", 1,
                                           "--dp", 1]):
                p = run(*cmd, bad, expect=3)
                one_error_line(p, bad, "tied_copies", "JSON list of names", kind="format error")
            assert not (t / "o").exists()
        # A byte of libhdf5's global heap (where string attributes live)
        # damaged: HDF5 itself crashes on it; ucp reports a corrupt file.
        data = bytearray((t / "u.h5").read_bytes())
        gcol = data.index(b"GCOL")
        data[gcol + 16 + 8 + 5] = 0x10
        (t / "heap.h5").write_bytes(bytes(data))
        for cmd in (["inspect"], ["verify", "-q"], ["reshape", "-q", "-o", t / "o", "--tp", 1,
                                                     "--pp", 1, "--dp", 1]):
            p = run(*cmd, t / "heap.h5", expect=3)
            one_error_line(p, "heap.h5", "HDF5 crashed", kind="format error")
        assert not (t / "o").exists()


def test_json_output_is_json_even_on_failure():
    with Tmp() as t:
        for args, code in [(["verify", t / "missing.h5", "--json"], 5),
                           (["reshape", t / "missing.h5", "-o", t / "o", "--tp", 1,
                             "--pp", 1, "--dp", 1, "--json"], 5),
                           (["to-universal", t, "-o", t / "u.h5", "--json"], 3),
                           (["verify", "--json", "--bogus"], 2),
                           (["nonsense", "--json"], 2)]:
            p = run(*args, expect=code)
            doc = json.loads(p.stdout)
            assert doc["ok"] is False and doc["error"]["exit_code"] == code, doc
            assert doc["error"]["kind"] in p.stderr
            assert len(p.stderr.strip().splitlines()) == 1, p.stderr
        doc = json.loads(run("layout", "show", "mcore-gpt", "--json").stdout)
        assert doc["name"] == "mcore-gpt" and "rules:" in doc["yaml"], doc


def test_tp_reshape_splitting_dim_1_reads_what_the_target_needs():
    """TP2 -> TP4 takes half of each source row of the tensors split on dim 1
    (attention projection, fc2): ucp reads those runs, not the whole rows
    (1.15x the checkpoint was read before), and the result equals the
    generator's own TP4 checkpoint."""
    scale = "hidden=1024,ffn=1024,layers=2,vocab=512,heads=8,groups=4"
    with Tmp() as t:
        subprocess.run([PY, str(TOOLS / "make_megatron_ckpts.py"), "--out", str(t / "gen"),
                        "--variant", VARIANT, "--topologies",
                        "tp2_pp2_vpp1_dp2_do,tp4_pp1_vpp1_dp1_do", "--scale", scale,
                        "--no-truth"], check=True, capture_output=True)
        src = t / "gen" / VARIANT / "tp2_pp2_vpp1_dp2_do"
        size = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
        _, read = run_counting_reads("convert", src, "-o", t / "o", "--tp", 4, "--pp", 1,
                                     "--dp", 1, "--distributed-optimizer", "--no-sync", "-q")
        assert read <= 1.05 * size, (read, size, read / size)
        compare(t / "gen" / VARIANT / "tp4_pp1_vpp1_dp1_do", t / "o", "--ignore-rng")


def test_many_rank_files_under_a_low_open_file_limit():
    """A reshape keeps every source rank file open: ucp raises its soft
    RLIMIT_NOFILE to the hard limit, so TP4 PP4 DP4 with the distributed
    optimizer (16 model + 16 distrib_optim files) converts under a soft limit
    of 24."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # The case needs a hard limit above the 32 files (every CI machine has
    # thousands): a lower one fails here rather than skipping silently.
    assert hard == resource.RLIM_INFINITY or hard >= 256, f"hard open-file limit {hard}"
    src = DATA / VARIANT / "tp4_pp4_vpp1_dp4_do"
    assert len(list(src.rglob("*.pt"))) == 32

    def low_limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (24, hard))

    with Tmp() as t:
        p = subprocess.run([str(UCP), "to-universal", str(src), "-o", str(t / "u.h5"), "-q"],
                           capture_output=True, text=True, preexec_fn=low_limit)
        assert p.returncode == 0, p.stderr
        out = subprocess.run([str(UCP), "reshape", str(t / "u.h5"), "-o", str(t / "o"), "--tp",
                              "4", "--pp", "4", "--dp", "4", "--distributed-optimizer", "-q"],
                             capture_output=True, text=True, preexec_fn=low_limit)
        assert out.returncode == 0, out.stderr
        compare(src, t / "o", "--ignore-rng")


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
