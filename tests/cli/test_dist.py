"""ucp as one job of several processes (engine/dist), under torch's own launcher (torchrun from
the tests' venv: 2 and 4 processes on one node, and two agents with `--nnodes 2 --rdzv-backend
c10d` standing in for two hosts) and under Slurm's and MPI's variables (processes spawned here):
every writable format's output (Megatron legacy and torch_dist, DeepSpeed, DCP, MindSpore, the
export, a reshape of a universal file) is byte-identical, file for file, to the one-process run
of the same command (the oracle: ucp without a launcher, whose outputs the other tests check
against the frameworks); DCP's `.metadata` holds a random uuid in every run (torch's too), masked
before comparing. --json's `processes` (rank 0 only; the other ranks print nothing) add up to the
output. `verify` as a job reports what one process reports and fails on a damaged file in every
process; `to-universal` as a job writes ONE universal file from every process, byte-identical to
the one-process file (h5py reads it whole, ucp verify passes); `resume` as a job writes the load
folder one process writes, rank 0 alone printing; `--progress` of a job draws the job's sums on
rank 0. The store carries a bounded number
of messages and bytes per process whatever the tensor count (--manifest's entries go through
part files, none left). A rank that fails, a rank that planned another target than rank 0, a
rank failing while two others are busy (all end within seconds), rank 0 refusing the output, a
differing replica, a rank SIGKILLed mid-run, and rank 0 (the store) SIGKILLed leave nothing
under the final name, every other process exits non-zero with one error line, and a rerun
succeeds. Ports are chosen by binding 127.0.0.1:0; every process has a timeout.
"""
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

from testmain import UCP, run, Tmp  # noqa: E402

F = pathlib.Path(os.environ["UCP_FIXTURES"])
TORCHRUN = pathlib.Path(sys.executable).parent / "torchrun"
MEG = F / "megatron-23.06" / "synth_tp2"
TD = F / "megatron-core-torch-dist" / "tp2pp1dp1" / "ckpt"
DS = F / "deepspeed-0.14.5" / "ds0145_z1_fp32_w2_mlp"
DCP = F / "dcp-torch-2.6" / "dtensor_shard0_w2"

# name -> the command without its output (-o NAME is added); "u.h5" is made first, alone.
CASES = {
    "megatron": ["convert", MEG, "--tp", 1, "--pp", 2, "--dp", 1, "--manifest"],
    "torch_dist": ["convert", TD, "--tp", 1, "--pp", 2, "--dp", 2, "--manifest"],
    "deepspeed": ["convert", DS, "--dp", 3, "--zero-stage", 1, "--manifest"],
    "dcp": ["convert", DCP, "--dp", 4, "--manifest"],
    "mindspore": ["convert", TD, "--format", "mindspore", "--tp", 2, "--dp", 2,
                  "--names", "mindformers-llama"],
    "export": ["export", MEG, "--max-shard-size", "20KB"],
    "reshape": ["reshape", "u.h5", "--tp", 2, "--pp", 2, "--dp", 1],
}
# Run as jobs beside CASES (their own checks): one universal file, a resume's load folder (-o: the
# fixture is only read).
EXTRA = {
    "universal": ["to-universal", MEG],
    "resume": ["resume", MEG, "--tp", 1, "--pp", 2, "--dp", 1],
}
TIMEOUT = 60
STORE_BYTES = 2000  # per process, keys and values (--manifest entries through the store: 14 KB)
_REF = None  # the first references()
UUID = re.compile(rb"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-a[0-9a-f]{3}-[0-9a-f]{12}")


def free_ports(n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def free_port_pair():
    """A free port P whose P + 1 is free too (the default store port under
    torchrun is MASTER_PORT + 1: a busy P + 1 would fail the job)."""
    for _ in range(100):
        a, b = socket.socket(), socket.socket()
        try:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
        finally:
            a.close()
            b.close()
    raise RuntimeError("no two consecutive free ports")


def clean_env(**extra):
    """This environment without any launcher's variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not re.match(r"(RANK|WORLD_SIZE|LOCAL_RANK|MASTER_|SLURM_|OMPI_|PMI_|TORCHELASTIC_|"
                           r"UCP_STORE_PORT|UCP_DIST|UCP_TESTING_DIST)", k)}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def args_of(name, out):
    return [str(a) for a in {**CASES, **EXTRA}[name]] + ["-o", str(out)]


def file_bytes(p):
    """A file's bytes, DCP's random .metadata uuid masked (exactly one in such a file)."""
    b = p.read_bytes()
    if p.name == ".metadata":
        assert len(UUID.findall(b)) == 1, p
        b = UUID.sub(b"u" * 36, b)
    if p.name == "ucp.manifest.json":
        j = json.loads(b)
        for name, e in j["files"].items():
            if name.endswith(".metadata"):
                e.pop("xxh3", None)
        b = json.dumps(j).encode()
    return b


def compare_trees(a, b):
    """Every file of `a` and `b` (the same names) byte-identical (file_bytes); returns the
    number of files compared."""
    fa = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    fb = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert fa == fb, (a, b, sorted(set(map(str, fa)) ^ set(map(str, fb))))
    for rel in fa:
        ha = hashlib.sha256(file_bytes(a / rel)).hexdigest()
        hb = hashlib.sha256(file_bytes(b / rel)).hexdigest()
        assert ha == hb, (str(rel), a, b)
    return len(fa)


def nothing_under(t, name):
    assert not (t / name).exists(), name
    left = [q.name for q in t.iterdir() if q.name.startswith(f".{name}.ucp-")]
    return left


def references(t):
    """The one-process outputs of every case, in t/ref (copied from the first test's)."""
    global _REF
    if _REF is not None and _REF.is_dir():
        shutil.copytree(_REF.parent, t, dirs_exist_ok=True)
        return t / "ref"
    _REF = t / "ref"
    (t / "ref").mkdir()
    run("to-universal", MEG, "-o", t / "u.h5", "-q")
    for name in list(CASES) + list(EXTRA):
        a = [x.replace("u.h5", str(t / "u.h5")) if x == "u.h5" else x
             for x in args_of(name, t / "ref" / name)]
        run(*a, "-q")
    return t / "ref"


def script(t, names, outdir, store_ports=None):
    """A shell script running the cases (side by side when each has its own UCP_STORE_PORT,
    else in turn: the default rule, MASTER_PORT + 1 under torchrun's agent store), their --json
    on stdout in OUT.RANK.json, their stderr in OUT.RANK.err; it fails if one fails."""
    lines = ["pids="]
    for i, name in enumerate(names):
        a = [x if x != "u.h5" else str(t / "u.h5") for x in args_of(name, outdir / name)]
        port = f"UCP_STORE_PORT={store_ports[i]} " if store_ports else ""
        lines.append(f"{port}{UCP} {' '.join(a)} --json > {outdir}/{name}.$RANK.json "
                     f"2> {outdir}/{name}.$RANK.err &")
        lines.append('pids="$pids $!"' if store_ports else "wait $! || exit 1")
    lines.append("for p in $pids; do wait $p || exit 1; done")
    p = t / f"{outdir.name}.sh"
    p.write_text("\n".join(lines) + "\n")
    return p


def torchrun(*args, env):
    p = subprocess.run([str(TORCHRUN), *map(str, args)], env=env, capture_output=True,
                       text=True, timeout=TIMEOUT)
    errs = {e.name: e.read_text()[-1000:] for a in args if str(a).endswith(".sh")
            for e in pathlib.Path(str(a)[:-3]).glob("*.err")}
    assert p.returncode == 0, (args, errs, p.stdout[-2000:], p.stderr[-3000:])


def check_json(outdir, name, world):
    """Rank 0's --json: a `processes` entry per rank, their files and bytes adding up to the
    output's; the other ranks printed nothing (stdout and stderr empty)."""
    j = json.loads((outdir / f"{name}.0.json").read_text())
    procs = j["processes"]
    assert [p["rank"] for p in procs] == list(range(world)), procs
    written = j["files"] if isinstance(j["files"], int) else len(j["files"])
    assert 0 < sum(p["files"] for p in procs) <= written, (name, procs)
    on_disk = sum(p.stat().st_size for p in (outdir / name).rglob("*") if p.is_file())
    if "bytes" in j:
        assert j["bytes"] == sum(p.stat().st_size for p in (outdir / name).rglob("*")
                                 if p.is_file() and p.name != "ucp.manifest.json"), name
    assert sum(p["bytes_written"] for p in procs) <= on_disk
    for p in procs:
        assert p["store_messages"] > 0 and p["seconds"] >= 0, p
        # A fixed handful of small messages whatever the tensor count (the manifest entries go
        # through part files in the staging folder, none of which is left).
        assert p["store_messages"] <= 12 and p["store_bytes"] < STORE_BYTES, (name, p)
    assert not [q for q in (outdir / name).rglob(".ucp-manifest-part-*")], name
    for r in range(1, world):
        assert (outdir / f"{name}.{r}.json").read_text() == "", (name, r)
        assert (outdir / f"{name}.{r}.err").read_text() == "", (name, r)
    return procs


def h5_datasets(path):
    """Every dataset of an HDF5 file (h5py): {name: (bytes, attributes)} in visiting order."""
    import h5py
    out = {}

    def visit(name, obj):
        if isinstance(obj, h5py.Dataset):
            out[name] = (obj[()].tobytes(), {k: repr(v) for k, v in obj.attrs.items()})
    with h5py.File(path, "r") as f:
        f.visititems(visit)
    return out


def h5_leftovers(t, name):
    """The final file's hidden staging and part files in t (.NAME.ucp-...)."""
    return sorted(q.name for q in t.iterdir() if q.name.startswith(f".{name}.ucp-"))


def check_universal(outdir, world, ref):
    """to-universal as a job of `world` processes wrote ONE file byte-identical to the
    one-process file `ref` (the oracle: ucp without a launcher, whose file the other tests check
    against h5py and the frameworks; a changed byte is seen: test_to_universal_as_a_job), h5py
    reads it whole, ucp verify passes; each process wrote datasets (none all of them), the other
    ranks printed nothing, no part file is left."""
    out = outdir / "universal"
    assert out.read_bytes() == ref.read_bytes(), world
    j = json.loads((outdir / "universal.0.json").read_text())
    procs = j["processes"]
    assert [p["rank"] for p in procs] == list(range(world)), procs
    assert all(p["datasets"] > 0 and p["bytes_written"] > 0 for p in procs), procs
    assert sum(p["bytes_written"] for p in procs) >= j["atom_bytes"], (j, procs)
    assert all(p["bytes_written"] < j["atom_bytes"] for p in procs), procs
    assert all(p["store_messages"] <= 12 and p["store_bytes"] < STORE_BYTES for p in procs), procs
    for r in range(1, world):
        assert (outdir / f"universal.{r}.json").read_text() == "", r
        assert (outdir / f"universal.{r}.err").read_text() == "", r
    assert h5_leftovers(outdir, "universal") == [], world
    datasets = h5_datasets(out)
    assert len(datasets) >= 20 and h5_datasets(ref) == datasets  # h5py reads it whole
    run("verify", out, "-q")


def test_launchers_write_what_one_process_writes():
    with Tmp("ucp-dist-") as t:
        ref = references(t)
        compared = 0
        # Negative control: a changed byte (or a file too many) is found.
        shutil.copytree(ref / "deepspeed", t / "bad")
        f = t / "bad" / "latest"
        f.write_bytes(f.read_bytes() + b" ")
        try:
            compare_trees(ref / "deepspeed", t / "bad")
            raise AssertionError("a changed byte went unnoticed")
        except AssertionError as e:
            assert "latest" in str(e), e

        # torchrun, 2 processes: every case, one store port each.
        master, *ports = free_ports(1 + len(CASES) + len(EXTRA))
        out2 = t / "two"
        out2.mkdir()
        torchrun("--nproc-per-node", 2, "--master-addr", "127.0.0.1", "--master-port", master,
                 "--no-python", "sh", script(t, list(CASES) + list(EXTRA), out2, ports),
                 env=clean_env())
        check_universal(out2, 2, ref / "universal")
        # resume: rank 0 chose and printed, both wrote the reshaped load folder.
        j = json.loads((out2 / "resume.0.json").read_text())
        assert j["reshaped"] and j["checkpoint"] == "iter_0000010", j
        assert [p["files"] for p in j["processes"]] == [1, 1], j["processes"]
        assert (out2 / "resume.1.json").read_text() == "" == (out2 / "resume.1.err").read_text()
        compared += compare_trees(ref / "resume", out2 / "resume")
        for name in CASES:
            compared += compare_trees(ref / name, out2 / name)
            procs = check_json(out2, name, 2)
            if name in ("dcp", "torch_dist", "mindspore"):
                assert all(p["files"] >= 1 for p in procs), (name, procs)
                assert all(p["bytes_read"] > 0 for p in procs), (name, procs)
        # ucp verify checks the joined manifest (DCP's .metadata hashed by rank 0).
        for name in ("dcp", "deepspeed", "torch_dist", "megatron"):
            run("verify", out2 / name, "-q")

        # torchrun, 4 processes; the store on MASTER_PORT + 1 (the agent store's port + 1).
        master = free_port_pair()
        out4 = t / "four"
        out4.mkdir()
        torchrun("--nproc-per-node", 4, "--master-addr", "127.0.0.1", "--master-port", master,
                 "--no-python", "sh", script(t, ["dcp", "universal"], out4), env=clean_env())
        check_universal(out4, 4, ref / "universal")
        compared += compare_trees(ref / "dcp", out4 / "dcp")
        procs = check_json(out4, "dcp", 4)
        # 4 equal-sized .distcp files, one per process (balanced by bytes).
        assert [p["files"] for p in procs] == [1, 1, 1, 1], procs  # (+ .metadata by rank 0)
        total = sum(p["bytes_read"] for p in procs)
        assert all(p["bytes_read"] < 0.4 * total for p in procs), procs

        # Two torchrun agents (two "hosts") meeting at a c10d rendezvous.
        rdzv, store_a, store_b = free_ports(3)
        out_n = t / "nodes"
        out_n.mkdir()
        sh = script(t, ["torch_dist", "export"], out_n, [store_a, store_b])
        agents = [subprocess.Popen(
            [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{rdzv}", "--rdzv-id", "ucp-test", "--no-python",
             "sh", str(sh)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True) for _ in range(2)]
        for a in agents:
            _, err = a.communicate(timeout=TIMEOUT)
            assert a.returncode == 0, err[-3000:]
        for name in ("torch_dist", "export"):
            compared += compare_trees(ref / name, out_n / name)
            check_json(out_n, name, 2)
        assert compared >= 40, compared


def spawn(world, kind, args, master, **extra):
    extra.setdefault("UCP_DIST_CONNECT_TIMEOUT", 20)
    """`world` ucp processes started as a Slurm step or an MPI job would (their variables)."""
    procs = []
    for r in range(world):
        if kind == "slurm":
            v = dict(SLURM_PROCID=r, SLURM_NTASKS=world, SLURM_LOCALID=r, SLURM_JOB_ID=77)
        elif kind == "mpi":
            v = dict(OMPI_COMM_WORLD_RANK=r, OMPI_COMM_WORLD_SIZE=world,
                     OMPI_COMM_WORLD_LOCAL_RANK=r)
        else:
            v = dict(PMI_RANK=r, PMI_SIZE=world)
        env = clean_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=master, **v, **extra)
        procs.append(subprocess.Popen([str(UCP), *map(str, args)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        if r == 0:
            time.sleep(0.1)  # its store up before the others' first try (c10d retries in 1 s)
    return procs


def finish(procs):
    out = []
    for p in procs:
        o, e = p.communicate(timeout=TIMEOUT)
        out.append((p.returncode, o, e))
    return out


def test_slurm_and_mpi_environments():
    with Tmp("ucp-dist-") as t:
        ref = references(t)
        jobs = [("slurm", 3, "deepspeed"), ("mpi", 2, "mindspore"), ("pmi", 2, "export")]
        ports = free_ports(len(jobs))
        started = [spawn(world, kind, args_of(name, t / kind) + ["-q"], port)
                   for (kind, world, name), port in zip(jobs, ports)]  # side by side
        for (kind, world, name), procs in zip(jobs, started):
            res = finish(procs)
            assert [r[0] for r in res] == [0] * world, res
            assert all(r[1] == "" and r[2] == "" for r in res[1:]), res
            assert compare_trees(ref / name, t / kind) >= 3
        # verify as a job: each process checks its share of the files (rank 0 also coverage
        # and replicas) and rank 0 reports them all; a byte flipped in one file fails every
        # process with one line naming that file (exit 3).
        port, = free_ports(1)
        res = finish(spawn(3, "slurm", ["verify", t / "slurm", "--json"], port))
        assert [r[0] for r in res] == [0, 0, 0] and res[1][1:] == ("", ""), res
        checks = {c["check"]: c["detail"] for c in json.loads(res[0][1])["checks"]}
        want = json.loads(run("verify", t / "slurm", "--json").stdout)["checks"]
        assert checks == {c["check"]: c["detail"] for c in want}, (checks, want)
        bad = t / "slurm" / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
        b = bytearray(bad.read_bytes())
        b[len(b) // 2] ^= 1
        bad.write_bytes(bytes(b))
        port, = free_ports(1)
        res = finish(spawn(3, "slurm", ["verify", t / "slurm", "-q"], port))
        assert [r[0] for r in res] == [3, 3, 3], res
        for _, _, err in res:
            assert err.count("\n") == 1 and bad.name in err, err
        # to-universal as a job (MPI's variables): both processes write datasets of the one
        # file, the other prints nothing; the file is the one-process file and verifies.
        port, = free_ports(1)
        res = finish(spawn(2, "mpi", ["to-universal", DS, "-o", t / "job.h5", "--json"], port))
        assert [r[0] for r in res] == [0, 0] and res[1][1:] == ("", ""), res
        procs = json.loads(res[0][1])["processes"]
        assert [p["rank"] for p in procs] == [0, 1] and all(p["datasets"] > 0 for p in procs)
        run("to-universal", DS, "-o", t / "one.h5", "-q")
        assert (t / "job.h5").read_bytes() == (t / "one.h5").read_bytes()
        run("verify", t / "job.h5", "-q")
        # A Slurm rank without MASTER_ADDR: a usage error naming the variables, nothing written.
        p = subprocess.run([str(UCP), *args_of("deepspeed", t / "nomaster")], text=True,
                           capture_output=True, timeout=TIMEOUT,
                           env=clean_env(SLURM_PROCID=1, SLURM_NTASKS=2))
        assert p.returncode == 2, p
        assert p.stderr.count("\n") == 1 and "SLURM_PROCID=1 of 2 without MASTER_ADDR" in \
            p.stderr, p.stderr
        assert not (t / "nomaster").exists()


def damage_a_small_record(path):
    """Flips a bit in the first 64-byte tensor record of a torch.save zip (hidden 16 fp32: a
    bias or layernorm, replicated over TP), CRC-32 left as it was."""
    import struct
    import zipfile
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size == 64)
    b = bytearray(path.read_bytes())
    h = info.header_offset
    n, e = struct.unpack("<HH", b[h + 26:h + 30])
    b[h + 30 + n + e + 5] ^= 0x40
    path.write_bytes(bytes(b))


def wait_for_staging(t, name, procs):
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        if any(q.name.startswith(f".{name}.ucp-partial-") for q in t.iterdir()):
            return
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    raise AssertionError("no staging folder appeared")


def test_failures_leave_nothing_and_a_rerun_succeeds():
    with Tmp("ucp-dist-") as t:
        ref = references(t)
        fast = dict(UCP_DIST_DEAD_AFTER=1, UCP_DIST_CONNECT_TIMEOUT=15)
        # 1. Rank 1 fails: every process exits 5 with one line naming the failure.
        port, = free_ports(1)
        res = finish(spawn(2, "slurm", args_of("dcp", t / "out"), port,
                           UCP_TESTING_DIST_FAIL=1, **fast))
        assert [r[0] for r in res] == [5, 5], res
        for code, _, err in res:
            assert err.count("\n") == 1 and "rank 1 fails" in err, err
        assert "process 1 failed" in res[0][2], res[0][2]
        nothing_under(t, "out")
        # 1'. Rank 1 planned another target than rank 0 (a byte more in one file, as another
        # ucp build or another view of the source would): every process fails (usage, exit 2)
        # with the one line naming it, nothing written. Without the check this run succeeds.
        port, = free_ports(1)
        res = finish(spawn(2, "slurm", args_of("dcp", t / "outplan"), port,
                           UCP_TESTING_DIST_PERTURB_PLAN=1, **fast))
        assert [r[0] for r in res] == [2, 2], res
        for code, _, err in res:
            assert err.count("\n") == 1 and \
                "process 1 planned another target than rank 0" in err, err
        assert "process 1 failed" in res[0][2], res[0][2]
        nothing_under(t, "outplan")
        # 1''. Three processes, rank 2 fails while ranks 0 and 1 are busy (paused 30 s, as if
        # writing): their heartbeat threads end them with rank 2's error, each exits 5 with one
        # line, and the job ends in a few seconds (rank 0 does not linger: the others left).
        port, = free_ports(1)
        start = time.monotonic()
        res = finish(spawn(3, "slurm", args_of("dcp", t / "outbusy"), port,
                           UCP_TESTING_DIST_FAIL=2, UCP_TESTING_DIST_PAUSE="0:30,1:30", **fast))
        took = time.monotonic() - start
        assert [r[0] for r in res] == [5, 5, 5], res
        for code, _, err in res:
            assert err.count("\n") == 1 and "rank 2 fails" in err, err
        for code, _, err in res[:2]:
            assert "process 2 failed" in err, err
        assert took < 8, took
        # rank 0's staging folder went with it (the heartbeat's _exit runs no destructor: the
        # abort removes what the process registered)
        assert nothing_under(t, "outbusy") == [], nothing_under(t, "outbusy")
        # 1a. Rank 0 refuses the output (it exists): every process exits 2 at once (the others
        # read rank 0's error before its store goes, no waiting on a silent rank).
        (t / "taken").mkdir()
        (t / "taken" / "x").write_text("x")
        port, = free_ports(1)
        start = time.monotonic()
        res = finish(spawn(2, "slurm", args_of("dcp", t / "taken"), port, **fast))
        assert [r[0] for r in res] == [2, 2], res
        assert "process 0 failed" in res[1][2] and "already exists" in res[1][2], res
        assert time.monotonic() - start < 8, time.monotonic() - start
        # 1b. A replicated region of the source that differs (a layer's bias of Megatron's TP
        # rank 1 changed: replicated over TP): the process whose share of the replica checks
        # holds it fails, and so does the other, with that error.
        src = t / "damaged"
        shutil.copytree(MEG, src)
        damage_a_small_record(src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt")
        port, = free_ports(1)
        res = finish(spawn(2, "slurm", ["convert", src, "-o", t / "outr", "--tp", 1, "--dp", 1],
                           port, **fast))
        assert [r[0] for r in res] == [3, 3], res
        for _, _, err in res:
            assert err.count("\n") == 1 and "replicas differ" in err, err
        assert not (t / "outr").exists()
        # 2. Rank 1 SIGKILLed mid-run: rank 0 finds its heartbeat stalled. 3. (side by side)
        # Rank 0 (and the store with it) SIGKILLed while rank 1 writes: rank 1 stops with one
        # line; rank 0's staging stays until the next run reclaims it.
        p2, p3 = free_ports(2)
        two = spawn(2, "slurm", args_of("dcp", t / "out"), p2, UCP_TESTING_DIST_PAUSE="1:30",
                    **fast)
        three = spawn(2, "mpi", args_of("dcp", t / "out3"), p3, UCP_TESTING_DIST_PAUSE="1:30",
                      **fast)
        wait_for_staging(t, "out", two)
        wait_for_staging(t, "out3", three)
        time.sleep(1.5)  # both joined (LibTorch loaded, connected) and beating
        two[1].send_signal(signal.SIGKILL)
        three[0].send_signal(signal.SIGKILL)
        (c0, _, e0), (c1, _, _) = finish(two)
        assert c1 == -signal.SIGKILL and c0 == 5, (c0, e0)
        assert e0.count("\n") == 1 and "process 1 of 2 stopped responding" in e0, e0
        assert nothing_under(t, "out") == []
        (c0, _, _), (c1, _, e1) = finish(three)
        assert c0 == -signal.SIGKILL and c1 == 5, (c1, e1)
        assert e1.count("\n") == 1 and "lost the coordination store" in e1, e1
        assert len(nothing_under(t, "out3")) == 1
        # The reruns (jobs again) reclaim what is left and write what one process writes.
        for name in ("out", "out3"):
            port, = free_ports(1)
            res = finish(spawn(2, "slurm", args_of("dcp", t / name) + ["-q"], port, **fast))
            assert [r[0] for r in res] == [0, 0], res
            assert [q.name for q in t.iterdir() if q.name.startswith(f".{name}.ucp-")] == []
            assert compare_trees(ref / "dcp", t / name) == 6


def test_to_universal_as_a_job():
    """to-universal as a job (under torchrun with 2 and 4 processes: check_universal in the first
    test) when it fails: a rank that planned another file, a failing rank, a rank SIGKILLed while
    rank 0 writes leave nothing under the final name and no temporary or part file, every other
    process exits with one line naming the failure, and a rerun writes the one-process file.
    Negative control of the byte comparison: a changed byte differs and fails verify."""
    with Tmp("ucp-dist-") as t:
        ref = (references(t) / "universal").read_bytes()
        bad = t / "bad.h5"
        b = bytearray(ref)
        b[-len(b) // 3] ^= 1
        bad.write_bytes(bytes(b))
        assert bad.read_bytes() != ref
        run("verify", bad, "-q", expect=3)

        fast = dict(UCP_DIST_DEAD_AFTER=1, UCP_DIST_CONNECT_TIMEOUT=15)
        args = ["to-universal", MEG, "-o"]
        # Side by side: a rank that planned another file than rank 0, a failing rank, and rank 1
        # SIGKILLed (paused once assigned) while rank 0 has allocated the file and writes.
        p1, p2, p3 = free_ports(3)
        plan = spawn(2, "slurm", args + [t / "plan.h5"], p1, UCP_TESTING_DIST_PERTURB_PLAN=1,
                     **fast)
        fail = spawn(2, "slurm", args + [t / "fail.h5"], p2, UCP_TESTING_DIST_FAIL=1, **fast)
        kill = spawn(2, "slurm", args + [t / "kill.h5"], p3, UCP_TESTING_DIST_PAUSE="1:30",
                     **fast)
        # Rank 1 fails while rank 0 is busy (paused 30 s, as if writing): rank 0's heartbeat
        # ends it within seconds, removing its temporary file first.
        busy = spawn(2, "slurm", args + [t / "busy.h5"], free_ports(1)[0],
                     UCP_TESTING_DIST_FAIL=1, UCP_TESTING_DIST_PAUSE="0:30", **fast)
        start = time.monotonic()
        # The plan: every process exits 2 naming it (without the check the run succeeds).
        res = finish(plan)
        assert [r[0] for r in res] == [2, 2], res
        for _, _, err in res:
            assert err.count("\n") == 1 and "process 1 planned another target" in err, err
        assert not (t / "plan.h5").exists()
        # The failing rank: every process exits 5 with its one line; rank 0 removed its
        # temporary file (waiting, or ended by its heartbeat while writing).
        res = finish(fail)
        assert [r[0] for r in res] == [5, 5], res
        for _, _, err in res:
            assert err.count("\n") == 1 and "rank 1 fails" in err, err
        assert not (t / "fail.h5").exists()
        assert h5_leftovers(t, "fail.h5") == []
        res = finish(busy)
        assert [r[0] for r in res] == [5, 5] and time.monotonic() - start < 20, res
        for _, _, err in res:
            assert err.count("\n") == 1 and "rank 1 fails" in err, err
        assert "process 1 failed" in res[0][2], res[0][2]
        assert not (t / "busy.h5").exists() and h5_leftovers(t, "busy.h5") == []
        # The killed rank: rank 0 finds it stopped and removes its temporary and part files.
        deadline = time.monotonic() + TIMEOUT
        while not h5_leftovers(t, "kill.h5"):
            assert time.monotonic() < deadline and all(p.poll() is None for p in kill)
            time.sleep(0.01)
        time.sleep(1.2)  # both joined and beating
        kill[1].send_signal(signal.SIGKILL)
        (c0, _, e0), (c1, _, _) = finish(kill)
        assert c1 == -signal.SIGKILL and c0 == 5, (c0, e0)
        assert e0.count("\n") == 1 and "process 1 of 2 stopped responding" in e0, e0
        assert not (t / "kill.h5").exists()
        assert h5_leftovers(t, "kill.h5") == []
        # The reruns (side by side) write the one-process file.
        names = ("plan.h5", "fail.h5", "kill.h5", "busy.h5")
        reruns = [spawn(2, "slurm", args + [t / name, "-q"], port, **fast)
                  for name, port in zip(names, free_ports(len(names)))]
        for name, procs in zip(names, reruns):
            res = finish(procs)
            assert [r[0] for r in res] == [0, 0], res
            assert (t / name).read_bytes() == ref, name
            assert h5_leftovers(t, name) == [], name


def test_resume_and_progress_as_jobs():
    """`ucp resume` as a job (under torchrun: the first test) in which a process planned another
    target: both fail naming it, no load folder. `--progress` of a job: rank 0 draws the job's
    sums (both processes reporting once the paused one wrote) and a final line; the other
    process prints nothing; without --progress nothing is drawn."""
    with Tmp("ucp-dist-") as t:
        ports = free_ports(3)
        perturbed = spawn(2, "slurm", args_of("resume", t / "load"), ports[0],
                          UCP_TESTING_DIST_PERTURB_PLAN=1, UCP_DIST_DEAD_AFTER=1)
        # Rank 1 paused 1.2 s once assigned, so that rank 0 draws while it waits.
        progress = spawn(2, "slurm", ["to-universal", MEG, "-o", t / "p.h5", "--progress"],
                         ports[1], UCP_TESTING_DIST_PAUSE="1:1.2")
        quiet = spawn(2, "slurm", ["to-universal", MEG, "-o", t / "q.h5"], ports[2],
                      UCP_TESTING_DIST_PAUSE="1:1.2")
        res = finish(perturbed)
        assert [r[0] for r in res] == [2, 2], res
        for _, _, err in res:
            assert err.count("\n") == 1 and "process 1 planned another target" in err, err
        assert not (t / "load").exists()

        res = finish(progress)
        assert [r[0] for r in res] == [0, 0], res
        assert res[1][1:] == ("", ""), res[1]
        err = res[0][2]
        # Each drawing starts with "\r\x1b[K" (the \r read as a newline here).
        lines = [x.strip("\r\n") for x in err.split("\x1b[K") if x.strip("\r\n")]
        assert err.endswith("\n"), err
        bar = re.compile(r"to-universal \[[#.]{30}\] +\d+% [\d.]+ [KMG]?i?B / [\d.]+ [KMG]?i?B "
                         r"\(([12]) of 2 processes reporting\)$")
        drawn = [bar.match(x) for x in lines[:-1]]
        assert len(drawn) >= 2 and all(drawn), lines
        assert {m.group(1) for m in drawn} == {"1", "2"}, lines  # rank 1 joins the sums
        assert re.fullmatch(r"to-universal: [\d.]+ [KMG]?i?B in [\d.]+ s by 2 processes",
                            lines[-1]), lines
        res = finish(quiet)
        assert [r[0] for r in res] == [0, 0] and res[0][2] == "" and res[1][2] == "", res


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
