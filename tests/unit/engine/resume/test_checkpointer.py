"""ucp::resume::Checkpointer, driven through the elastic-resume example
trainer (examples/elastic-resume/train.cc), checked with real torch:

* a 1-process checkpoint is the dict a Python trainer saves: torch.load
  opens it, torch.optim.Adam.load_state_dict takes its optimizer state;
* every file (meta.pt, each shard) loads with torch.load's defaults in the
  newest torch (run by the tests' PyPI environment: weights_only=True) and
  in Debian's torch 1.13 (UCP_PYTHON);
* resharding 1 -> 3 -> 2 -> 4 processes (each resumed state saved again at
  once) keeps every weight, Adam moment and step bit for bit: the pieces are
  reassembled here from the format spec (checkpointer.h), independently of
  the C++ reader; a rank reads only about its share of the tensor bytes;
* SIGKILL at random moments of saves: every visible checkpoint is whole, and
  a rerun resumes from the newest;
* a damaged or incomplete newest checkpoint is skipped with a reason; none
  intact is a clear error.
Set UCP_TEST_SEED to replay.
"""
import os
import pathlib
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile

import torch

TRAIN = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "examples" / "elastic-resume" / "elastic_train"
SEED = int(os.environ.get("UCP_TEST_SEED", random.randrange(1 << 30)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(n, *args, expect=0, timeout=120):
    port = free_port()
    procs = []
    for r in range(n):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        procs.append(subprocess.Popen([str(TRAIN), *map(str, args)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=timeout) for p in procs]
    codes = [p.returncode for p in procs]
    if expect is not None:
        assert all(c == expect for c in codes), (args, codes, [e[-1500:] for _, e in outs])
    return outs[0][1]


def steps_in(d):
    if not d.exists():
        return []
    return sorted(int(p.name[5:]) for p in d.iterdir() if re.fullmatch(r"step_\d+", p.name))


def assemble(step_dir):
    """The flat weights / exp_avg / exp_avg_sq and the per-param Adam steps of
    a checkpoint, from its shards, by the spec."""
    meta = torch.load(step_dir / "meta.pt")
    world, numel = meta["world_size"], meta["numel"]
    flat = {k: torch.full((numel,), float("nan")) for k in ("w", "m1", "m2")}
    names = [p[0] for p in meta["params"]]
    for r in range(world):
        d = torch.load(step_dir / f"shard_{r:05d}-of-{world:05d}.pt")
        s = d["shard"]
        assert (s["rank"], s["world_size"], s["numel"]) == (r, world, numel)
        chunk = -(-numel // world)
        assert (s["begin"], s["end"]) == (min(numel, r * chunk), min(numel, (r + 1) * chunk))
        for i, (name, shape, off) in enumerate(meta["params"]):
            lo, hi = max(s["begin"], off), min(s["end"], off + int(torch.Size(shape).numel()))
            if lo >= hi:
                assert name not in d["model"]
                continue
            piece = d["model"][name]
            whole = hi - lo == torch.Size(shape).numel()
            assert list(piece.shape) == (list(shape) if whole else [hi - lo]), (name, piece.shape)
            flat["w"][lo:hi] = piece.reshape(-1)
            st = d["optimizer"]["state"][i]
            assert float(st["step"]) == meta["steps"][i]
            flat["m1"][lo:hi] = st["exp_avg"].reshape(-1)
            flat["m2"][lo:hi] = st["exp_avg_sq"].reshape(-1)
    for k, v in flat.items():
        assert not torch.isnan(v).any(), (step_dir, k)
    return names, flat, meta


def resave_as_views(step_dir):
    """Rewrites each shard with torch.save, its weights, exp_avg and
    exp_avg_sq pieces each viewing one flat storage per kind, and meta.pt
    as Python saves it."""
    params = {p[0] for p in torch.load(step_dir / "meta.pt")["params"]}
    for f in step_dir.iterdir():
        d = torch.load(f)
        if f.name.startswith("shard_"):
            groups = {"w": [(d["model"], n) for n in list(d["model"]) if n in params],
                      "m1": [(st, "exp_avg") for st in d["optimizer"]["state"].values()],
                      "m2": [(st, "exp_avg_sq") for st in d["optimizer"]["state"].values()]}
            for pieces in groups.values():
                flat = torch.cat([c[k].reshape(-1) for c, k in pieces])
                at = 0
                for c, k in pieces:
                    n = c[k].numel()
                    c[k] = flat[at:at + n].view(c[k].shape)
                    at += n
                assert pieces and all(c[k].untyped_storage().data_ptr() ==
                                      flat.untyped_storage().data_ptr() for c, k in pieces)
        torch.save(d, f)


def check_weights_only(step_dir):
    """Every file of a checkpoint loads with the weights-only unpickler here
    (the newest torch: its default) and with torch 1.13's default (its
    weights-only unpickler lacks BINFLOAT, so Python's own files fail it)."""
    files = sorted(step_dir.iterdir())
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    assert files and version >= (2, 6), (files, torch.__version__)
    for f in files:
        torch.load(f)  # the default: weights_only=True
        torch.load(f, weights_only=True)
    old = subprocess.run(
        [os.environ["UCP_PYTHON"], "-c",
         "import sys, torch\n"
         "assert torch.__version__.startswith('1.'), torch.__version__\n"
         "for f in sys.argv[1:]: torch.load(f)\n",
         *map(str, files)], capture_output=True, text=True)
    assert old.returncode == 0, old.stderr[-2000:]


def test_python_dict_and_resharding():
    with tempfile.TemporaryDirectory(prefix="ucp-ckpt-") as t:
        t = pathlib.Path(t)
        launch(1, "--dir", t / "w1", "--steps", 3, "--save-every", 3)
        d = torch.load(t / "w1" / "step_000000003" / "shard_00000-of-00001.pt")
        assert sorted(d) == ["extra", "model", "optimizer", "scaler", "shard", "step"], sorted(d)
        assert d["step"] == 3 and d["extra"] == {"tokens_seen": 3 * 12 * 16}, d["extra"]
        assert d["scaler"] == {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5,
                               "growth_interval": 2000, "_growth_tracker": 0}
        assert d["model"]["causal_mask"].dtype == torch.bool
        params = {k: v for k, v in d["model"].items() if k != "causal_mask"}
        opt = torch.optim.Adam([torch.nn.Parameter(v.clone()) for v in params.values()])
        opt.load_state_dict(d["optimizer"])  # the real torch takes it
        assert list(opt.state_dict()["state"]) == list(range(len(params)))
        check_weights_only(t / "w1" / "step_000000003")
        names, base, _ = assemble(t / "w1" / "step_000000003")
        assert names == list(params)
        src = t / "w1"
        for n in (3, 2, 4):  # 1 -> 3 -> 2 -> 4
            err = launch(n, "--dir", src, "--steps", 3, "--save-on-resume", "--save-dir", t / f"w{n}")
            m = re.search(r"read (\d+) bytes of tensor data on rank 0", err)
            assert m and int(m.group(1)) <= 3 * 4 * (-(-base["w"].numel() // n)), err
            got_names, got, meta = assemble(t / f"w{n}" / "step_000000003")
            assert meta["world_size"] == n and got_names == names
            check_weights_only(t / f"w{n}" / "step_000000003")
            for k in base:
                assert torch.equal(got[k], base[k]), (n, k)
            dn = torch.load(t / f"w{n}" / "step_000000003" / f"shard_00000-of-{n:05d}.pt")
            assert dn["extra"] == d["extra"] and dn["scaler"] == d["scaler"]
            src = t / f"w{n}"
        # Re-saved by Python, the pieces of one kind as views of one storage
        # per shard (as LibTorch-written files of earlier ucp had them): a
        # resume reads them too, at another world size.
        resave_as_views(src / "step_000000003")
        launch(3, "--dir", src, "--steps", 3, "--save-on-resume", "--save-dir", t / "views")
        got_names, got, _ = assemble(t / "views" / "step_000000003")
        assert got_names == names
        for k in base:
            assert torch.equal(got[k], base[k]), ("views", k)


def test_kill9_in_saves():
    rng = random.Random(SEED)
    print(f"UCP_TEST_SEED={SEED}", flush=True)
    with tempfile.TemporaryDirectory(prefix="ucp-ckpt-") as t:
        d = pathlib.Path(t) / "ckpt"
        target = 0
        for case in range(6):
            target += 400
            n = rng.choice([1, 2])
            port = free_port()
            procs = [subprocess.Popen(
                [str(TRAIN), "--dir", str(d), "--steps", str(target), "--save-every", "1", "--keep", "2",
                 "--timeout-ms", "2500"],
                env=dict(os.environ, RANK=str(r), WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1",
                         MASTER_PORT=str(port)),
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(n)]
            time.sleep(rng.uniform(0.5, 2.0))
            victim = rng.randrange(n)
            procs[victim].send_signal(signal.SIGKILL)
            for p in procs:
                p.communicate(timeout=60)
            where = f"seed {SEED} case {case} world {n}"
            visible = steps_in(d)
            # keep_last 2, plus one when the kill fell between a commit and
            # its rotation (the next save rotates it away).
            assert len(visible) <= 3, (where, visible)
            for s in visible:  # every visible checkpoint is whole
                names, flat, meta = assemble(d / f"step_{s:09d}")
                for f in (d / f"step_{s:09d}").iterdir():
                    with zipfile.ZipFile(f) as z:
                        assert z.testzip() is None, (where, f)
            newest = visible[-1] if visible else 0
            err = launch(1, "--dir", d, "--steps", newest + 1, "--save-every", 1, "--keep", 2)
            if visible:
                assert f"step {newest}," in err, (where, err)
            assert steps_in(d)[-1] == newest + 1, (where, steps_in(d))
            assert len(steps_in(d)) == min(2, len(visible) + 1), (where, visible, steps_in(d))
            target = newest + 1


def test_fallback_and_errors():
    with tempfile.TemporaryDirectory(prefix="ucp-ckpt-") as t:
        d = pathlib.Path(t) / "ckpt"
        launch(2, "--dir", d, "--steps", 6, "--save-every", 2, "--keep", 3)
        assert steps_in(d) == [2, 4, 6]
        # A flipped byte inside the newest checkpoint's second shard.
        victim = d / "step_000000006" / "shard_00001-of-00002.pt"
        with zipfile.ZipFile(victim) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
        data = bytearray(victim.read_bytes())
        data[info.header_offset + 200] ^= 1
        victim.write_bytes(bytes(data))
        # meta.pt of step 4 is gone.
        (d / "step_000000004" / "meta.pt").unlink()
        err = launch(3, "--dir", d, "--steps", 6, "--log", pathlib.Path(t) / "l.txt")
        assert "skipped step_000000006: rank 1: " in err and "CRC-32" in err, err
        assert "skipped step_000000004: " in err and "meta.pt" in err, err
        assert "resumed from" in err and "step 2," in err, err
        # Nothing intact: one clear error, non-zero exit.
        for s in steps_in(d):
            (d / f"step_{s:09d}" / "meta.pt").unlink(missing_ok=True)
        err = launch(1, "--dir", d, "--steps", 8, expect=1)
        assert "no complete and intact checkpoint" in err, err
        assert len(err.strip().splitlines()) == 1, err


def test_damaged_meta_is_skipped():
    with tempfile.TemporaryDirectory(prefix="ucp-ckpt-") as t:
        d = pathlib.Path(t) / "ckpt"
        launch(1, "--dir", d, "--steps", 4, "--save-every", 2, "--keep", 3)
        assert steps_in(d) == [2, 4]
        # A flipped byte inside a record of the newest meta.pt: its CRC-32
        # fails (checked over the bytes read to parse it).
        victim = d / "step_000000004" / "meta.pt"
        with zipfile.ZipFile(victim) as z:
            info = max(z.infolist(), key=lambda i: i.file_size)
        data = bytearray(victim.read_bytes())
        head = info.header_offset
        start = head + 30 + int.from_bytes(data[head + 26:head + 28], "little") + \
            int.from_bytes(data[head + 28:head + 30], "little")
        data[start + info.file_size // 2] ^= 0x20
        victim.write_bytes(bytes(data))
        err = launch(1, "--dir", d, "--steps", 5)
        assert "skipped step_000000004: " in err and "meta.pt" in err, err
        assert "CRC-32" in err and "resumed from" in err and "step 2," in err, err


if __name__ == "__main__":
    only = sys.argv[1:]
    for name, fn in sorted(globals().items()):
        if name.startswith("test_") and (not only or name in only):
            fn()
            print("ok", name, flush=True)
