"""Bad input through the `ucp` command built with ASan + UBSan (ucp_san, $UCP_SAN): the CLI's
own code (argument parsing, resume's choice, output staging), `export`, `megatron-fsdp`
reading and the name maps (`--names`) on damaged copies of the real fixtures
(../shared/fixtures: DeepSpeed 0.14.5, megatron-core torch_dist) and on bad flags.

Each failing run must end with exactly one line on stderr, `ucp: <kind>: ...`, naming the file,
option or param and the problem, the documented exit code (2 usage, 3 format, 5 i/o), no
sanitizer report (ASan / UBSan abort with their report: the one-line check fails on it), and
nothing under the output's name nor staging left beside it. Expected lines are written here
from what was damaged (the file cut, the option given), not taken from ucp's output.
Run: test_cli_malformed.py test_<name> ... (ctest: cli_malformed.test_<name>).
"""
import json
import os
import pathlib
import re
import shutil
import stat
import subprocess
import sys
import tempfile

UCP = os.environ["UCP_SAN"]
FX = pathlib.Path(os.environ["UCP_FIXTURES"])
DS = FX / "deepspeed-0.14.5" / "ds0145_z1_bf16_w2_mlp"
TD = FX / "megatron-core-torch-dist" / "tp2pp1dp1" / "ckpt"
SANITIZER = re.compile(r"AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer|"
                       r"runtime error:|SUMMARY:")
KINDS = {2: "usage error", 3: "format error", 4: "layout error", 5: "i/o error"}
RUNS = []  # every failing run checked (a minimum count at the end of each test)


def run(*args, expect=0):
    p = subprocess.run([UCP, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert not SANITIZER.search(p.stderr), (args, p.stderr[-4000:])
    assert p.returncode == expect, (args, p.returncode, p.stdout[-2000:], p.stderr[-3000:])
    return p


def fails(args, code, *needles, out=None, notes=None):
    """Runs ucp_san with `args`: exit `code`, one stderr line `ucp: <kind>: ...` holding every
    needle (the damaged file, option or param; the problem), nothing at `out` nor any
    staging beside it. `notes`: a pattern the lines before it may match (resume's one line
    per checkpoint it skipped); none else may come before."""
    p = run(*args, expect=code)
    lines = p.stderr.splitlines()
    if notes is not None:
        while len(lines) > 1 and re.match(notes, lines[0]):
            lines = lines[1:]
    assert len(lines) == 1, (args, p.stderr[-3000:])
    assert lines[0].startswith(f"ucp: {KINDS[code]}: "), (args, lines[0])
    for n in needles:
        assert re.search(n, lines[0]), (args, n, lines[0])
    if out is not None:
        out = pathlib.Path(out)
        assert not out.exists(), (args, "output left behind", out)
        if out.parent.is_dir():
            left = [q.name for q in out.parent.iterdir() if q.name.startswith(f".{out.name}.ucp-")]
            assert not left, (args, "staging left behind", left)
    RUNS.append(args)
    return lines[0]


def copy(src, dst):
    shutil.copytree(src, dst)
    for q in [dst, *pathlib.Path(dst).rglob("*")]:
        q.chmod(q.stat().st_mode | stat.S_IWUSR)
    return pathlib.Path(dst)


def cut(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


def flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_bad_flags():
    """Argument parsing: unknown commands and options, missing and malformed values, values
    out of range, unknown formats and name maps. Exit 2, the option named."""
    with tempfile.TemporaryDirectory() as t:
        out = pathlib.Path(t, "out")
        cases = [
            (["frobnicate"], ["frobnicate"]),
            (["convert", DS], ["-o|--output|output"]),
            (["convert", DS, "-o", out, "--dp", "abc"], ["--dp|dp", "abc"]),
            (["convert", DS, "-o", out, "--format", "deepspeed", "--dp", "0"], ["--dp|dp"]),
            (["convert", DS, "-o", out, "--format", "deepspeed", "--dp", "-3"], ["--dp|dp"]),
            (["convert", DS, "-o", out, "--format", "no-such-format"], ["no-such-format"]),
            (["convert", DS, "-o", out, "--format", "dcp", "--dp", "1", "--names",
              "no-such-map"], ["--names no-such-map"]),
            (["convert", DS, "-o", out, "--format", "deepspeed", "--dp", "2", "--zero-stage",
              "9"], ["zero-stage|stage", "9"]),
            (["convert", DS, "-o", out, "--format", "deepspeed", "--dp", "2",
              "--no-such-flag"], ["no-such-flag"]),
            (["export", DS, "-o", out, "--max-shard-size", "12XB"], ["--max-shard-size 12XB"]),
            (["export", DS, "-o", out, "--dtype", "int3"], ["dtype", "int3"]),
            (["export", DS, "-o", out, "--model-var", "novalue"], ["model-var", "novalue"]),
            (["resume", DS, "--dp", "x2"], ["--dp|dp", "x2"]),
            (["resume", DS, "--format", "deepspeed", "--dp", "2", "--global-batch-size",
              "0"], ["global-batch-size"]),
            (["reshape", DS, "-o", out, "--tp"], ["--tp|tp"]),
            (["verify"], ["verify needs a PATH"]),
        ]
        for args, needles in cases:
            fails(args, 2, *needles, out=out)
        # --json: the same failure as a document on stdout too.
        p = run("convert", DS, "-o", out, "--dp", "abc", "--json", expect=2)
        doc = json.loads(p.stdout)
        assert doc["ok"] is False and doc["error"]["exit_code"] == 2, doc
    assert len(RUNS) >= 16, len(RUNS)


def test_export_damaged():
    """`ucp export` of a DeepSpeed save whose rank files are cut or flipped: a format error
    naming the damaged file; nothing under -o."""
    with tempfile.TemporaryDirectory() as t:
        t = pathlib.Path(t)
        for name, damage in (
                ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", lambda q: cut(q, 0.5)),
                ("mp_rank_00_model_states.pt", lambda q: cut(q, 0.97)),
                ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", lambda q: flip(q, 40)),
                ("mp_rank_00_model_states.pt", lambda q: q.write_bytes(b""))):
            src = copy(DS, t / f"src{len(RUNS)}")
            damage(src / "global_step2" / name)
            out = t / "hf"
            fails(["export", src, "-o", out], 3, re.escape(name), out=out)
            shutil.rmtree(src)
        # A rank file missing entirely.
        src = copy(DS, t / "missing")
        (src / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
        fails(["export", src, "-o", t / "hf"], 3, "bf16_zero_pp_rank_1_mp_rank_00_optim_states",
              out=t / "hf")
        # --hf wants a LLaMA: the MLP is none (the name map's check).
        fails(["export", DS, "-o", t / "hf", "--hf"], 2, "--hf|LLaMA|llama", out=t / "hf")
        # The intact source exports (the damage above is what failed).
        run("export", DS, "-o", t / "ok", "-q")
        assert any(t.joinpath("ok").iterdir())
    assert len(RUNS) >= 6, len(RUNS)


def test_names_damaged():
    """The name maps (`--names`) on a source they cannot map: the MLP (not a GPT), the real
    torch_dist GPT with model variables its shapes contradict, and a damaged rank file."""
    with tempfile.TemporaryDirectory() as t:
        t = pathlib.Path(t)
        for m in ("mcore-llama", "mindformers-llama", "hf-llama"):
            fails(["convert", DS, "-o", t / "o", "--format", "dcp", "--dp", "1", "--names", m],
                  2, f"--names {m}", out=t / "o")
        # The real torch_dist GPT under MindFormers' names (its args do not go along): the
        # model variables the maps need then come from --model-var. 4 heads in 2 query
        # groups, hidden 32 (meta.json): wq [32, 32], wk and wv [16, 32] are not the rows
        # of 3 groups.
        ms = t / "ms"
        run("convert", TD, "-o", ms, "--format", "mindspore", "--tp", "1", "--dp", "1",
            "--names", "mindformers-llama", "-q")
        fails(["convert", ms, "-o", t / "o", "--format", "megatron-torch-dist", "--tp", "1",
               "--pp", "1", "--dp", "1", "--names", "mcore-llama", "--model-var",
               "num_query_groups=3"], 2, "--names mcore-llama", "attention.wq.weight",
              "3 groups", out=t / "o")
        fails(["export", ms, "-o", t / "o", "--hf", "--model-var", "num_attention_heads=3"],
              2, "attention.wq.weight", "3 groups", out=t / "o")
        # The MindSpore file cut: the record reader names it and the offset.
        bad = copy(ms, t / "ms-cut")
        ckpt = next((bad / "rank_0").glob("*.ckpt"))
        cut(ckpt, 0.5)
        fails(["convert", bad, "-o", t / "o", "--format", "megatron-torch-dist", "--tp", "1",
               "--pp", "1", "--dp", "1", "--names", "mcore-llama"], 3, re.escape(ckpt.name),
              out=t / "o")
        src = copy(TD.parent, t / "td")
        cut(src / "ckpt" / "iter_0000010" / "__1_0.distcp", 0.6)
        fails(["convert", src / "ckpt", "-o", t / "o", "--format", "mindspore", "--tp", "1",
               "--dp", "1", "--names", "mindformers-llama"], 3, "__1_0.distcp", out=t / "o")
    assert len(RUNS) >= 7, len(RUNS)


def make_fsdp(t):
    """A Megatron-FSDP-shaped save folder: the real torch_dist fixture written by ucp_san as a
    plain DCP folder under iter_0000010/ beside Megatron's tracker (no metadata.json: what
    tells Megatron's fsdp_dtensor from torch_dist)."""
    save = t / "fsdp"
    save.mkdir()
    run("convert", TD, "-o", save / "iter_0000010", "--format", "dcp", "--dp", "2", "-q")
    (save / "latest_checkpointed_iteration.txt").write_text("10")
    assert "megatron-fsdp" in run("verify", save).stdout
    return save


def test_megatron_fsdp_damaged():
    """megatron-fsdp reading: a .distcp cut in half or by its last byte, a cut or flipped
    .metadata, a missing rank file, a tracker naming no folder, a tracker that is no number,
    an --iteration there is none of. (A byte flipped inside tensor data is not an error: DCP
    keeps no checksums.)"""
    with tempfile.TemporaryDirectory() as t:
        t = pathlib.Path(t)
        good = make_fsdp(t)
        it = "iter_0000010"
        for n, (rel, damage, needle) in enumerate((
                (f"{it}/__0_0.distcp", lambda q: cut(q, 0.5), "__0_0.distcp"),
                (f"{it}/__1_0.distcp", lambda q: cut(q, 1 - 1 / q.stat().st_size),
                 "__1_0.distcp"),
                (f"{it}/.metadata", lambda q: flip(q, 0), r"\.metadata"),
                (f"{it}/.metadata", lambda q: cut(q, 0.7), r"\.metadata"),
                (f"{it}/__1_0.distcp", lambda q: q.unlink(), "__1_0.distcp"),
                ("latest_checkpointed_iteration.txt", lambda q: q.write_text("20"),
                 "iter_0000020|20"),
                ("latest_checkpointed_iteration.txt", lambda q: q.write_text("ten"),
                 "latest_checkpointed_iteration.txt"))):
            src = copy(good, t / f"bad{n}")
            damage(src / rel)
            out = t / "out.h5"
            code = 3
            fails(["to-universal", src, "--from", "megatron-fsdp", "-o", out], code, needle,
                  out=out)
            shutil.rmtree(src)
        fails(["to-universal", good, "--from", "megatron-fsdp", "--iteration", "99", "-o",
               t / "o.h5"], 2, "99", out=t / "o.h5")
        run("to-universal", good, "--from", "megatron-fsdp", "-o", t / "ok.h5", "-q")
        assert (t / "ok.h5").is_file()
    assert len(RUNS) >= 8, len(RUNS)


def test_resume_damaged():
    """`ucp resume`: the newest checkpoint cut is skipped with a note for the intact older one
    (exit 0, under the sanitizers); every checkpoint damaged is a format error; a damaged -o
    folder is refused and kept."""
    with tempfile.TemporaryDirectory() as t:
        t = pathlib.Path(t)
        save = copy(DS, t / "save")
        shutil.copytree(save / "global_step2", save / "global_step3")
        (save / "latest").write_text("global_step3")
        cut(save / "global_step3" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", 0.5)
        p = run("resume", save, "--format", "deepspeed", "--dp", "1", "--zero-stage", "1",
                "--json")
        doc = json.loads(p.stdout)
        assert doc["ok"] and doc["checkpoint"].endswith("global_step2"), doc
        assert any("global_step3" in json.dumps(s) for s in doc["skipped"]), doc
        load = pathlib.Path(doc["load"])
        assert load.is_dir() and load.is_relative_to(save / "ucp-resume"), doc
        # Nothing intact left: a line per checkpoint skipped, then the error, exit 3.
        cut(save / "global_step2" / "mp_rank_00_model_states.pt", 0.5)
        shutil.rmtree(save / "ucp-resume")
        fails(["resume", save, "--format", "deepspeed", "--dp", "1", "--zero-stage", "1",
               "-o", t / "load"], 3, "no complete and intact checkpoint", out=t / "load",
              notes=r"ucp: skipped global_step[23] \(iteration [23]\): .*"
                    r"(bf16_zero_pp_rank_0_mp_rank_00_optim_states|mp_rank_00_model_states)\.pt")
        # An -o folder that is no load folder (an earlier run's, damaged) is refused, kept.
        good = copy(DS, t / "good")
        (t / "mine").mkdir()
        (t / "mine" / "junk").write_text("x")
        fails(["resume", good, "--format", "deepspeed", "--dp", "1", "--zero-stage", "1",
               "-o", t / "mine"], 2, "mine")
        assert (t / "mine" / "junk").read_text() == "x"
        assert sorted(q.name for q in (t / "mine").iterdir()) == ["junk"]
        # -o under a regular file.
        fails(["resume", good, "--format", "deepspeed", "--dp", "1", "--zero-stage", "1",
               "-o", good / "latest" / "x"], 5, "latest")
    assert len(RUNS) >= 3, len(RUNS)


def test_output_staging():
    """Outputs that cannot be made: -o under a regular file, -o an existing file, -o in a
    folder already holding the output; the error names the path, nothing is staged."""
    with tempfile.TemporaryDirectory() as t:
        t = pathlib.Path(t)
        (t / "afile").write_text("x")
        fails(["to-universal", DS, "-o", t / "afile" / "u.h5"], 5, "afile")
        fails(["convert", DS, "-o", t / "afile" / "d", "--format", "deepspeed", "--dp", "1"],
              5, "afile")
        fails(["export", DS, "-o", t / "afile"], 2, "afile", "already exists")
        assert (t / "afile").read_text() == "x"
        left = [q.name for q in t.iterdir() if q.name != "afile"]
        assert not left, left
    assert len(RUNS) >= 3, len(RUNS)


if __name__ == "__main__":
    for name in sys.argv[1:]:
        globals()[name]()
        print(f"ok {name} ({len(RUNS)} failing runs checked)", flush=True)
