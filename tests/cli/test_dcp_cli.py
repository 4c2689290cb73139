"""PyTorch DCP in and out, against the real torch (the tests' PyPI environment, run with its
python): checkpoints torch saved (tests/tools/make_dcp_ckpts.py: FSDP2, DTensor 1-D and 2-D,
ShardedTensor, no process group, rank-local, zstd) are read by ucp, resharded for other world
sizes, and loaded back by torch itself -- dcp.load into plain tensors, dcp_to_torch_save, FSDP2
models in several processes, a one-rank group -- which must give the saved state bit for bit;
DeepSpeed's real files go to DCP and torch loads DeepSpeed's masters and moments; malformed
checkpoints fail in one line naming the key; `ucp resume` walks a folder of DCP checkpoints.
"""
import io
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import make_dcp_ckpts as gen  # noqa: E402
import oracle_checks  # noqa: E402

from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "dcp"
DS = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5"


def one_error_line(p, *needles):
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def Tmp():
    return testmain.Tmp("ucp-dcp-")


def truth(case):
    return torch.load(DATA / case / "truth.pt", weights_only=False)


def same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        # bit for bit (NaNs included): compared as bytes
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), where
    else:
        assert a == b, (where, a, b)


def same_state(got, want, where):
    """`got` has `want`'s keys (flat dicts) and equal values (same()); returns the number of
    values compared (tensor elements, plain values)."""
    assert set(got) == set(want), (where, sorted(map(str, set(got) ^ set(want)))[:10])
    n = 0
    for k, v in want.items():
        same(got[k], v, f"{where} {k}")
        n += v.numel() if isinstance(v, torch.Tensor) else 1
    return n


# Fewest values a case's comparison must reach (the smallest: ranklocal_w2's 16 model values;
# the Gpt of the FSDP2 cases has 2,790 per state kind).
def min_values(case):
    return 2000 if case.startswith("fsdp2") else 15


def check_state(got, want, where, min_count):
    """same_state with the count rule and a negative control (oracle_checks.checked): the same
    comparison on `got` with one value changed must fail."""
    return oracle_checks.checked(lambda g: same_state(g, want, where), got, min_count, where)


def torch_view(ckpt):
    """What torch itself makes of a checkpoint: dcp_to_torch_save's state, flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as t:
        dcp_to_torch_save(str(ckpt), os.path.join(t, "sd.pt"))
        return gen.flatten(torch.load(os.path.join(t, "sd.pt"), weights_only=False))


def plain_load(ckpt, want):
    """dcp.load without a process group into tensors shaped as `want`'s."""
    sd = {}
    for path, v in want.items():
        if not isinstance(v, torch.Tensor):
            continue
        d = sd
        for k in path[:-1]:
            d = d.setdefault(k, {})
        d[path[-1]] = torch.empty_like(v)
    dcp.load(sd, checkpoint_id=str(ckpt), no_dist=True)
    return gen.flatten(sd)


def test_reads_what_torch_saved():
    """Every case: verified, and exported (every model tensor, as float32) equal to what the
    ranks held."""
    for case in gen.CASES:
        ckpt = DATA / case / "ckpt"
        run("verify", ckpt, "-q")
        with Tmp() as t:
            run("export", ckpt, "-o", t / "hf", "--format", "torch", "-q")
            got = torch.load(t / "hf" / "pytorch_model.bin", weights_only=True)
            want = {p[1]: v.float() if v.dtype.is_floating_point else v
                    for p, v in truth(case).items()
                    if p[0] == "model" and isinstance(v, torch.Tensor)}
            check_state(got, want, f"{case} export", min_values(case))


def test_resharded_torch_loads_the_same_state():
    """N -> M for M in {1, N + 1}: torch's dcp_to_torch_save and dcp.load give every tensor and
    object of the saved state bit for bit."""
    for case in gen.CASES:
        want = truth(case)
        for m in (1, gen.WORLD[case] + 1):
            with Tmp() as t:
                run("convert", DATA / case / "ckpt", "-o", t / "o", "--dp", m, "-q")
                assert len(list((t / "o").glob("__*_0.distcp"))) == m
                view = torch_view(t / "o")
                check_state(view, want, f"{case} -> {m} (dcp_to_torch_save)", min_values(case))
                loaded = plain_load(t / "o", want)
                tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
                check_state(loaded, tensors, f"{case} -> {m} (dcp.load)", min_values(case))


def fsdp2_load_rank(rank, world, port, ckpt, truth_path, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(123)  # other values than the saved ones
    model = gen.Gpt()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.zeros(1, 1, dtype=torch.long)).sum().backward()
    opt.step()  # the optimizer state exists before loading, as when resuming
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optimizer": osd}
    dcp.load(sd, checkpoint_id=ckpt)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    msd, osd = get_state_dict(model, opt)
    want = torch.load(truth_path, weights_only=False)
    got = {k: gen.full(v) for k, v in gen.flatten({"model": msd, "optimizer": osd}).items()}
    got = {k: v for k, v in got.items() if isinstance(v, torch.Tensor)}
    tensors = {k: want.get(k) for k in got}
    try:  # every tensor the loaded model and Adam hold, negative control included
        n = check_state(got, tensors, f"rank {rank}", min_values("fsdp2") * 3)
        results.put((rank, None, n))
    except AssertionError as e:
        results.put((rank, str(e)[:2000], 0))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_resumes_at_another_world_size():
    """FSDP2's 3-rank save, resharded by ucp for 2 ranks, loaded by an FSDP2 model and Adam in 2
    processes (get_state_dict / dcp.load / set_state_dict): every param and optimizer state equal
    to the saved one."""
    with Tmp() as t:
        run("convert", DATA / "fsdp2_w3" / "ckpt", "-o", t / "o", "--dp", 2, "-q")
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=fsdp2_load_rank,
                             args=(r, 2, port, str(t / "o"), str(DATA / "fsdp2_w3" / "truth.pt"), q))
                 for r in range(2)]
        for p in procs:
            p.start()
        oracle_checks.join_ranks(procs, 300, "FSDP2 load")  # one still running: killed, failed
        results = [q.get(timeout=10) for _ in procs]
        for rank, bad, n in results:
            assert not bad, (rank, bad)


def one_rank_group_load(ckpt, truth_path, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=0, world_size=1)
    want = torch.load(truth_path, weights_only=False)
    sd = {}
    for path, v in want.items():
        if isinstance(v, torch.Tensor):
            d = sd
            for k in path[:-1]:
                d = d.setdefault(k, {})
            d[path[-1]] = torch.zeros_like(v)
    dcp.load(sd, checkpoint_id=ckpt)
    tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
    try:
        check_state(gen.flatten(sd), tensors, "one-rank group", min_values("dtensor2d_w4"))
        results.put(None)
    except AssertionError as e:
        results.put(str(e)[:2000])
    dist.destroy_process_group()


def test_one_rank_group_loads_it():
    with Tmp() as t:
        run("convert", DATA / "dtensor2d_w4" / "ckpt", "-o", t / "o", "--dp", 3, "-q")
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=one_rank_group_load,
                        args=(str(t / "o"), str(DATA / "dtensor2d_w4" / "truth.pt"), q))
        p.start()
        oracle_checks.join_ranks([p], 300, "one-rank group load")
        bad = q.get(timeout=10)
        assert not bad, bad


def test_deepspeed_to_dcp():
    """DeepSpeed's own ZeRO files (0.14.5: ZeRO 1-3, fp32 / bf16, worlds 1 and 2) to DCP: torch
    loads DeepSpeed's fp32 master weights and Adam moments (the references DeepSpeed took in the
    training process) under model.<name> and optimizer.state.<name>.*."""
    n = 0
    for fx in sorted(DS.glob("ds0145_z[123]_*")):
        masters = torch.load(fx / "reference_fp32_master.pt", weights_only=True)
        moments = torch.load(fx / "reference_optim_state.pt", weights_only=True)
        with Tmp() as t:
            run("convert", fx, "-o", t / "o", "--format", "dcp", "--dp", 2, "-q")
            sd = {"model": {k: torch.zeros_like(v) for k, v in masters.items()},
                  "optimizer": {"state": {k: {"exp_avg": torch.zeros_like(v),
                                              "exp_avg_sq": torch.zeros_like(v)}
                                          for k, v in masters.items()}}}
            dcp.load(sd, checkpoint_id=str(t / "o"), no_dist=True)
            want = {("model", k): v for k, v in masters.items()}
            want.update({("optimizer", "state", k, kind): moments[f"{k}::{kind}"]
                         for k in masters for kind in ("exp_avg", "exp_avg_sq")})
            check_state(gen.flatten(sd), want, fx.name, 3 * 174)  # an MLP of 174 values
            view = torch_view(t / "o")
            groups = [v for k, v in view.items() if k[:2] == ("optimizer", "param_groups")]
            assert groups, view.keys()
        n += 1
    assert n >= 8, n


def test_export_streams_what_dcp_to_torch_save_holds():
    from safetensors.torch import load_file
    for case in ("fsdp2_w3", "fsdp2_bf16_w2"):
        with Tmp() as t:
            run("export", DATA / case / "ckpt", "-o", t / "hf", "--dtype", "bf16", "-q")
            got = load_file(str(t / "hf" / "model.safetensors"))
            view = torch_view(DATA / case / "ckpt")
            want = {k[1]: v.to(torch.bfloat16) for k, v in view.items() if k[0] == "model"}
            check_state(got, want, f"{case} export bf16", min_values(case))


def edit_metadata(ckpt, fn):
    from torch.distributed.checkpoint import FileSystemReader
    m = FileSystemReader(str(ckpt)).read_metadata()
    fn(m)
    import pickle
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(m, f)


def test_malformed_checkpoints_are_one_clear_error():
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    with Tmp() as t:
        def fresh(case="fsdp2_w3"):
            c = t / "c"
            if c.exists():
                shutil.rmtree(c)
            shutil.copytree(DATA / case / "ckpt", c)
            return c

        # A hole: a chunk and its item dropped.
        c = fresh()
        edit_metadata(c, lambda m: m.state_dict_metadata["model.wte.weight"].chunks.pop())
        one_error_line(run("verify", c, expect=3), "model.wte.weight", "cover")
        # An overlap: a chunk moved onto its neighbour.
        c = fresh()

        def overlap(m):
            ch = m.state_dict_metadata["model.wte.weight"].chunks
            ch[1] = ChunkStorageMetadata(offsets=torch.Size([ch[1].offsets[0] - 1, 0]), sizes=ch[1].sizes)
        edit_metadata(c, overlap)
        one_error_line(run("verify", c, expect=3), "model.wte.weight", "overlap")
        # A global that would run code in Python: refused by name, nothing executed.
        c = fresh()
        edit_metadata(c, lambda m: setattr(m, "evil", os.system))
        one_error_line(run("to-universal", c, "-o", t / "u.h5", expect=3), "unknown global",
                       "system")
        assert not (t / "u.h5").exists()
        # A truncated and a missing rank file.
        c = fresh()
        f = c / "__1_0.distcp"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        one_error_line(run("verify", c, expect=3), "__1_0.distcp", "truncated")
        c = fresh()
        (c / "__2_0.distcp").unlink()
        one_error_line(run("convert", c, "-o", t / "o", "--dp", 2, expect=3), "__2_0.distcp",
                       "missing")
        assert not (t / "o").exists()
        # Rank-local saves whose replicas differ: both files named.
        c = fresh("ranklocal_w2")
        from torch.distributed.checkpoint import FileSystemReader
        import pickle
        md = pickle.load(open(c / "__1.metadata", "rb"))
        info = next(v for k, v in md.storage_data.items() if k.fqn == "model.s")
        data = bytearray((c / info.relative_path).read_bytes())
        item = bytes(data[info.offset:info.offset + info.length])
        z = __import__("zipfile").ZipFile(io.BytesIO(item))
        rec = next(i for i in z.infolist() if i.filename.endswith("data/0"))
        start = info.offset + rec.header_offset + 30 + len(rec.filename.encode()) + \
            int.from_bytes(item[rec.header_offset + 28:rec.header_offset + 30], "little")
        data[start] ^= 0x40
        (c / info.relative_path).write_bytes(bytes(data))
        p = run("to-universal", c, "-o", t / "u.h5", expect=3)
        assert "__0_0.distcp" in p.stderr and "__1_0.distcp" in p.stderr, p.stderr


def test_metadata_of_other_torch_versions_and_frameworks():
    """The same checkpoint's .metadata written as other writers write it -- torch 2.0-2.2's
    classes (TensorProperties from torch.distributed._shard, no storage_meta, no version), pickle
    protocols 2 and 5, Megatron-core's MCoreMetadata subclass with mcore_data and saved plans
    (all_local_plans of SavePlan / WriteItem) -- reads to the same state, and the attributes a
    framework added come back when ucp writes it again."""
    import pickle
    import types
    from torch.distributed.checkpoint import FileSystemReader
    import torch.distributed.checkpoint.metadata as md
    import torch.distributed.checkpoint.planner as planner
    src = DATA / "fsdp2_w3" / "ckpt"
    real = FileSystemReader(str(src)).read_metadata()
    want = torch_view(src)

    # torch 2.0-2.2: TensorProperties and its enum lived in torch.distributed._shard.
    old = types.ModuleType("torch.distributed._shard.sharded_tensor.metadata")

    class MEM_FORMAT_ENCODING(__import__("enum").Enum):
        TORCH_CONTIGUOUS_FORMAT = 0
    MEM_FORMAT_ENCODING.__module__ = old.__name__
    MEM_FORMAT_ENCODING.__qualname__ = "MEM_FORMAT_ENCODING"

    class TensorProperties:
        def __reduce_ex__(self, proto):
            return (object.__new__, (TensorProperties,), self.state)
    TensorProperties.__module__ = old.__name__
    TensorProperties.__qualname__ = "TensorProperties"
    old.TensorProperties, old.MEM_FORMAT_ENCODING = TensorProperties, MEM_FORMAT_ENCODING
    sys.modules[old.__name__] = old

    def variant(name, m, protocol):
        with Tmp() as t:
            c = t / "c"
            shutil.copytree(src, c)
            with open(c / ".metadata", "wb") as f:
                pickle.dump(m, f, protocol=protocol)
            view_dir = t / "o"
            run("convert", c, "-o", view_dir, "--dp", 2, "-q")
            check_state(torch_view(view_dir), want, name, min_values("fsdp2"))
            return FileSystemReader(str(view_dir)).read_metadata()

    m20 = md.Metadata(state_dict_metadata={}, planner_data=real.planner_data,
                      storage_data=real.storage_data)
    del m20.storage_meta
    for k, v in real.state_dict_metadata.items():
        if isinstance(v, md.TensorStorageMetadata):
            p = TensorProperties()
            p.state = (v.properties.dtype, v.properties.layout, False,
                       MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT, False)
            v = md.TensorStorageMetadata(properties=p, size=v.size, chunks=v.chunks)
        m20.state_dict_metadata[k] = v
    for protocol in (2, 5):
        variant(f"torch 2.0 style, protocol {protocol}", m20, protocol)

    # Megatron-core: MCoreMetadata with mcore_data, and the saved plans.
    mc = types.ModuleType("megatron.core.dist_checkpointing.strategies.torch")

    class MCoreMetadata(md.Metadata):
        pass

    class MCoreSavePlan(planner.SavePlan):
        pass
    for cls in (MCoreMetadata, MCoreSavePlan):
        cls.__module__ = mc.__name__
        cls.__qualname__ = cls.__name__
        setattr(mc, cls.__name__, cls)
    sys.modules[mc.__name__] = mc
    m = MCoreMetadata(state_dict_metadata=real.state_dict_metadata,
                      planner_data=real.planner_data, storage_data=real.storage_data)
    m.mcore_data = {"model.wte.weight": {"nd_reformulated_orig_global_shape": (37, 12)}}
    m.all_local_plans = [MCoreSavePlan(items=[planner.WriteItem(
        index=md.MetadataIndex("model.wte.weight", torch.Size([0, 0])),
        type=planner.WriteItemType.SHARD)])]
    back = variant("MCoreMetadata", m, 4)
    assert back.mcore_data == m.mcore_data, getattr(back, "mcore_data", None)


def test_resume_takes_the_newest_intact_step():
    """A folder of DCP checkpoints (torchtitan's step-N/): the newest complete and intact one is
    printed as it is (DCP loads at any world size; nothing written), an unfinished one (no
    .metadata) and a damaged one are skipped with a reason."""
    with Tmp() as t:
        save = t / "save"
        save.mkdir()
        for step in (10, 20, 30):
            shutil.copytree(DATA / "fsdp2_w3" / "ckpt", save / f"step-{step}")
        (save / "step-30" / ".metadata").unlink()
        before = sorted(str(p) for p in save.rglob("*"))
        r = json.loads(run("resume", save, "--dp", 5, "--json").stdout)
        assert r["load"] == str(save / "step-20") and not r["reshaped"], r
        assert [s["name"] for s in r["skipped"]] == ["step-30"], r
        # A byte flipped inside a tensor of step-20: its CRC-32 fails.
        f = save / "step-20" / "__0_0.distcp"
        data = bytearray(f.read_bytes())
        data[len(data) - 200] ^= 0x01
        f.write_bytes(bytes(data))
        r = json.loads(run("resume", save, "--dp", 2, "--json").stdout)
        assert r["load"] == str(save / "step-10"), r
        assert sorted(str(p) for p in save.rglob("*")) == before


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
