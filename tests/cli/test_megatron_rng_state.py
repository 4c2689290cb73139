"""--rng-state: Megatron legacy rank files whose numpy RNG state was pickled
under numpy 1 (`numpy.core.multiarray._reconstruct`), written so that
Megatron under numpy 2 and torch >= 2.6 loads them (issue 35, defect 3).

Run by the tests' PyPI environment (torch 2.15, numpy 2, megatron-core
0.16.1). The sources are the independent generator's files
(tests/tools/make_megatron_ckpts.py, fixture megatron_ckpts), made by
Debian's /usr/bin/python3, whose numpy 1.24 pickles the state under numpy 1's
module path.

Oracle: Megatron-LM's own loader. Its legacy branch is not on PyPI
(megatron/training is not in the megatron-core wheel), so the test runs what
that loader runs, from Megatron-LM core_v0.16.1 (the release of the pinned
megatron-core), megatron/training/checkpointing.py:
  * _load_base_checkpoint, line 1251: `torch.load(checkpoint_name,
    map_location='cpu')`, weights_only by default since torch 2.6, with the
    allow-list megatron-core registers when imported (megatron/core/
    __init__.py -> safe_globals.py:register_safe_globals; here the real
    package's list, not a copy); any exception there is "could not load the
    checkpoint" and sys.exit() (status 0);
  * load_checkpoint, lines 1862-1865: `rng_state = state_dict['rng_state'][0]`,
    `random.setstate`, `np.random.set_state`, `torch.set_rng_state` (the CUDA
    states need a GPU and are not set here);
  * without 'rng_state' it reads state_dict['random_rng_state'], whose
    KeyError ends in "Unable to load rng state ... exiting" unless the run
    passes --no-load-rng or --finetune (lines 1845, 1873, 1887).
The states Megatron restores are compared, by the numbers they draw, with
the source's state under numpy 1: Debian's python (numpy 1.24, torch 1.13)
loads the source rank files and draws the same way. A torch_dist target,
which keeps the states as they are, is loaded by megatron-core's
dist_checkpointing.load and compared the same way.
"""
import json
import os
import pathlib
import pickle
import pickletools
import random
import shutil
import subprocess
import zipfile

import numpy as np
import torch

from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron"
PY1 = os.environ.get("UCP_PYTHON", "/usr/bin/python3")  # numpy 1.x
STUBS = pathlib.Path(__file__).resolve().parent.parent / "tools" / "stubs"
SRC = DATA / "gqa_swiglu_bias_untied" / "tp2_pp2_vpp1_dp1_nodo"
TOPO = ["--tp", "2", "--pp", "2", "--dp", "1"]
RANKS = ["mp_rank_00_000", "mp_rank_01_000", "mp_rank_00_001", "mp_rank_01_001"]
N = 256  # draws per generator and rank

NUMPY1 = b"numpy.core.multiarray\n_reconstruct"
NUMPY2 = b"numpy._core.multiarray\n_reconstruct"

# The draws after restoring a state (both sides run this code).
DRAW = f"""
def draw(st):
    import random, numpy as np
    random.setstate(st['random_rng_state'])
    np.random.set_state(st['np_rng_state'])
    return {{'random': [random.random() for _ in range({N})],
            'np_sample': np.random.random_sample({N}).tolist(),
            'np_int': np.random.randint(0, 2**31 - 1, {N}).tolist(),
            'np_key': np.asarray(st['np_rng_state'][1]).tolist(),
            'torch_state': st['torch_rng_state'].tolist()}}
"""
exec(DRAW)


def Tmp():
    return testmain.Tmp("ucp-rng-")


def rank_file(ckpt, rank):
    return pathlib.Path(ckpt) / "iter_0000100" / rank / "model_optim_rng.pt"


def pickle_bytes(path):
    with zipfile.ZipFile(path) as z:
        return z.read(next(n for n in z.namelist() if n.endswith("/data.pkl")))


def numpy1_draws(ckpt, names=RANKS):
    """The draws of each rank's state as numpy 1 restores it: Debian's python
    (numpy 1.24, torch 1.13, full unpickler) loads the rank files."""
    code = DRAW + """
import json, sys, numpy, torch
assert numpy.__version__.startswith('1.'), numpy.__version__
out = {}
for p in sys.argv[1:]:
    try:
        sd = torch.load(p, map_location='cpu')
    except Exception as e:
        out[p] = {'error': type(e).__name__ + ': ' + str(e)}
        continue
    out[p] = draw(sd['rng_state'][0])
print(json.dumps(out))
"""
    paths = [str(rank_file(ckpt, r)) for r in names]
    # The generator's stand-ins for Megatron's enums (args) on that side.
    env = dict(os.environ, PYTHONPATH=str(STUBS))
    p = subprocess.run([PY1, "-c", code, *paths], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout)
    return [doc[x] for x in paths]


def megatron_load(path):
    """Megatron-LM core_v0.16.1 _load_base_checkpoint's load of a legacy rank
    file under this environment (torch 2.15: weights_only=True by default) with
    megatron-core's registered allow-list. Returns the state dict, or the
    exception that makes Megatron print "could not load the checkpoint" and
    exit."""
    import megatron.core  # noqa: F401  registers megatron-core's SAFE_GLOBALS
    try:
        # builtins.getattr: Python >= 3.11 pickles an enum as getattr(cls,
        # name), and the args of these files (the generator's, Megatron's
        # 23.06 fixture, any save under Python >= 3.11) hold enums such as
        # ModelType; megatron-core's list lacks it, so Megatron's loader
        # refuses those files whatever their numpy (a separate matter,
        # reported). It is allowed here so that numpy's path is what is
        # judged; nothing else is added.
        with torch.serialization.safe_globals([getattr]):
            return torch.load(path, map_location="cpu")
    except Exception as e:  # checkpointing.py: `except Exception as e`
        return e


def megatron_restore(state_dict):
    """load_checkpoint's RNG branch (no --no-load-rng, no --finetune, no
    --data-parallel-random-init): the draws of the restored state."""
    return draw(state_dict["rng_state"][0])


def check_allow_list():
    import megatron.core  # noqa: F401
    import megatron.core.safe_globals as sg
    names = {f"{g.__module__}.{g.__qualname__}" for g in torch.serialization.get_safe_globals()}
    assert np.__version__.startswith("2."), np.__version__
    assert torch.__version__ >= "2.6", torch.__version__
    # The allow-list names numpy 2's path: what numpy 1 pickled is not on it.
    assert "numpy._core.multiarray._reconstruct" in names, sorted(names)
    assert "numpy.core.multiarray._reconstruct" not in names
    assert len(sg.SAFE_GLOBALS) >= 10


def assert_refused(path):
    e = megatron_load(path)
    assert isinstance(e, pickle.UnpicklingError), (path, e)
    assert "numpy.core.multiarray._reconstruct" in str(e), str(e)[-600:]


def assert_same_draws(expected, actual, where):
    compared = 0
    for k in ("random", "np_sample", "np_int", "np_key", "torch_state"):
        assert expected[k] == actual[k], (where, k)
        compared += len(expected[k])
    assert compared >= 3 * N + 624, compared
    return compared


def check_loads_as_source(out, src_draws, out_ranks=RANKS, src_ranks=RANKS):
    compared = 0
    for orank, srank, exp in zip(out_ranks, src_ranks, src_draws):
        f = rank_file(out, orank)
        data = pickle_bytes(f)
        assert NUMPY2 in data and NUMPY1 not in data, f
        sd = megatron_load(f)
        assert isinstance(sd, dict), (f, sd)
        compared += assert_same_draws(exp, megatron_restore(sd), (orank, srank))
    # Negative control: another stage's state (seed + 100 * pp rank) draws
    # other numbers.
    other = megatron_restore(megatron_load(rank_file(out, out_ranks[-1])))
    assert other["np_sample"] != src_draws[0]["np_sample"]
    assert other["random"] != src_draws[0]["random"]
    return compared


def test_convert_and_resume_numpy2():
    check_allow_list()
    src_draws = numpy1_draws(SRC)
    for d in src_draws:
        assert "error" not in d, d
    # The source: numpy 1's path, which Megatron under numpy 2 refuses.
    for r in RANKS:
        assert NUMPY1 in pickle_bytes(rank_file(SRC, r))
        assert_refused(rank_file(SRC, r))
    with Tmp() as t:
        # Without the option (keep): the same refusal, and a note saying so.
        doc = json.loads(run("convert", SRC, "-o", t / "keep", *TOPO, "--json", "-q").stdout)
        assert any("numpy 1's module path" in n and "--rng-state numpy2" in n
                   for n in doc["notes"]), doc["notes"]
        for r in RANKS:
            assert_refused(rank_file(t / "keep", r))
        # --rng-state numpy2: loads, and restores the source's states exactly.
        doc = json.loads(run("convert", SRC, "-o", t / "np2", *TOPO, "--rng-state", "numpy2",
                             "--json", "-q").stdout)
        assert any("--rng-state numpy2" in n for n in doc["notes"]), doc["notes"]
        n = check_loads_as_source(t / "np2", src_draws)
        assert n >= 4 * (3 * N + 624), n
        # Nothing but the RNG state changed: the rank files are the keep
        # ones with the module path respelled.
        for r in RANKS:
            a = pickle_bytes(rank_file(t / "keep", r))
            b = pickle_bytes(rank_file(t / "np2", r))
            assert a.replace(NUMPY1, NUMPY2) == b, r

    # ucp resume at the checkpoint's own layout: with --rng-state numpy2 it
    # writes a load folder (named for it) instead of handing out the source.
    with Tmp() as t:
        shutil.copytree(SRC, t / "save")
        p = run("resume", t / "save", *TOPO, "-q")
        assert pathlib.Path(p.stdout.strip()) == t / "save", p.stdout
        doc = json.loads(run("resume", t / "save", *TOPO, "--rng-state", "numpy2",
                             "--json", "-q").stdout)
        load = pathlib.Path(doc["load"])
        assert doc["reshaped"] and load.parent == t / "save" / "ucp-resume", doc
        assert load.name.endswith("-rngnumpy2"), load.name
        check_loads_as_source(load, src_draws)
        # A later run asking for numpy 1's path gets its own folder.
        doc1 = json.loads(run("resume", t / "save", *TOPO, "--rng-state", "numpy1",
                              "--json", "-q").stdout)
        assert doc1["load"] != doc["load"], doc1
        for r in RANKS:
            assert NUMPY1 in pickle_bytes(rank_file(doc1["load"], r))


def test_reshape_numpy2_then_numpy1():
    """Through a universal file to another layout (TP 1): the target ranks
    carry the states of the source ranks at the same (tp, pp)."""
    src_draws = numpy1_draws(SRC)
    with Tmp() as t:
        run("to-universal", SRC, "-o", t / "u.h5", "-q")
        run("reshape", t / "u.h5", "-o", t / "out", "--tp", 1, "--pp", 2, "--dp", 2,
            "--rng-state", "numpy2", "-q")
        tp0 = ["mp_rank_00_000", "mp_rank_00_001"]
        check_loads_as_source(t / "out", [src_draws[RANKS.index(r)] for r in tp0], tp0, tp0)

    # numpy 2's spelling back to numpy 1's: numpy 1.24 cannot unpickle
    # numpy._core at all, and loads the respelled states as the source's.
    with Tmp() as t:
        run("convert", SRC, "-o", t / "np2", *TOPO, "--rng-state", "numpy2", "-q")
        for d in numpy1_draws(t / "np2"):
            assert "numpy._core" in d.get("error", ""), d  # negative control
        doc = json.loads(run("convert", t / "np2", "-o", t / "np1", *TOPO, "--rng-state",
                             "numpy1", "--json", "-q").stdout)
        assert any("--rng-state numpy1" in n for n in doc["notes"]), doc["notes"]
        for r, exp, got in zip(RANKS, src_draws, numpy1_draws(t / "np1")):
            assert "error" not in got, got
            assert NUMPY1 in pickle_bytes(rank_file(t / "np1", r))
            assert_same_draws(exp, got, r)


def test_torch_dist_drop_and_bad_value():
    # torch_dist keeps the states as they are (README): megatron-core reads
    # its rng_state ShardedObjects through DCP's DefaultLoadPlanner.load_bytes,
    # torch.load(weights_only=False), where numpy 2 still resolves numpy 1's
    # path. dist_checkpointing.load of the four objects restores the source's
    # states. (getattr for the common state's args: megatron_load.)
    import socket
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    src_draws = numpy1_draws(SRC)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    try:
        with Tmp() as t:
            doc = json.loads(run("convert", SRC, "-o", t / "td", "--format",
                                 "megatron-torch-dist", *TOPO, "--json", "-q").stdout)
            assert not any("rng-state" in n for n in doc["notes"]), doc["notes"]
            sd = {r: ShardedObject("rng_state", None, (2, 2), (int(r[-3:]), int(r[8:10])),
                                   replica_id=0) for r in RANKS}
            with torch.serialization.safe_globals([getattr]):
                loaded = dist_checkpointing.load(sd, str(t / "td" / "iter_0000100"),
                                                 strict="assume_ok_unexpected")
            for r, exp in zip(RANKS, src_draws):
                assert_same_draws(exp, draw(loaded[r][0]), ("torch_dist", r))
    finally:
        torch.distributed.destroy_process_group()

    # --rng-state drop (legacy): no state, --no-load-rng in the flags.
    with Tmp() as t:
        doc = json.loads(run("convert", SRC, "-o", t / "out", *TOPO, "--rng-state", "drop",
                             "--json", "-q").stdout)
        assert "--no-load-rng" in doc["megatron_flags"], doc["megatron_flags"]
        assert any("--no-load-rng" in n for n in doc["notes"]), doc["notes"]
        for r in RANKS:
            f = rank_file(t / "out", r)
            sd = megatron_load(f)
            assert isinstance(sd, dict), (f, sd)
            # Without --no-load-rng, load_checkpoint would look up
            # 'random_rng_state' next: KeyError, "Unable to load rng state".
            assert "rng_state" not in sd and "random_rng_state" not in sd, sorted(sd)
            # The model and the rest are all there.
            src = torch.load(rank_file(SRC, r), map_location="cpu", weights_only=False)
            assert sorted(sd) == sorted(k for k in src if k != "rng_state"), sorted(sd)
            assert len(sd["model"]) == len(src["model"]) > 0
            # No orphan storage (the dropped state's tensors) in the archive:
            # every record under data/ is a key the pickle names.
            with zipfile.ZipFile(f) as z:
                stored = {n.rsplit("/", 1)[1] for n in z.namelist() if "/data/" in n}
            named = {arg for op, arg, _ in pickletools.genops(pickle_bytes(f))
                     if isinstance(arg, str)}
            assert stored and stored <= named, sorted(stored - named)

    # A value it does not know: one usage error line, nothing written; the
    # option is listed by --help and `ucp formats --json`.
    with Tmp() as t:
        p = run("convert", SRC, "-o", t / "out", *TOPO, "--rng-state", "numpy3", expect=2)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ucp: usage error:"), p.stderr
        assert "--rng-state" in lines[0] and "numpy3" in lines[0], lines[0]
        assert not (t / "out").exists() and not list(t.iterdir()), list(t.iterdir())
    for cmd in (["convert", "--help"], ["reshape", "--help"], ["resume", "--help"]):
        out = run(*cmd).stdout
        assert "--rng-state" in out, (cmd, out[-2000:])
    megatron = next(f for f in json.loads(run("formats", "--json").stdout)
                    if f["name"] == "megatron")
    opt = next(o for o in megatron["target_options"] if o["name"] == "rng-state")
    assert opt["type"] == "string" and "numpy2" in opt["help"], opt


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
