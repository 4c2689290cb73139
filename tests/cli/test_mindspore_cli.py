"""ucp's MindSpore reader against the real MindSpore (the tests' PyPI
environment, CPU): a small network trained two steps with nn.Adam is saved by
mindspore.save_checkpoint (its parameters, Adam moments, global_step, ...);
ucp reads it to exactly what mindspore.load_checkpoint returns, exports it,
converts it for torch's DCP (which torch loads back) and refuses what it
cannot read in one clear line; files ucp writes (--format mindspore) are
what mindspore.load_checkpoint reads back, byte for byte where the source was
MindSpore's own.
"""
import json
import os
import pathlib
import subprocess
import sys
import tempfile

os.environ.setdefault("GLOG_v", "3")
import h5py  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tools"))
import oracle_checks  # noqa: E402

from testmain import UCP, one_error_line, run  # noqa: E402
import testmain  # noqa: E402


def train_and_save(path, crc=False, bf16=False):
    """Saves the network's parameters and nn.Adam's state after two steps;
    returns what mindspore.load_checkpoint gives back, as numpy."""
    import mindspore as ms
    from mindspore import nn, Tensor
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    ms.set_seed(1)

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Dense(7, 13)
            self.fc2 = nn.Dense(13, 5)

        def construct(self, x):
            return self.fc2(ms.ops.relu(self.fc1(x)))

    net = Net()
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    loss_fn = nn.MSELoss()
    grad_fn = ms.value_and_grad(lambda x, y: loss_fn(net(x), y), None, opt.parameters)
    for i in range(2):
        rs = np.random.RandomState(i)
        x = Tensor(rs.randn(2, 7).astype(np.float32))
        y = Tensor(rs.randn(2, 5).astype(np.float32))
        _, g = grad_fn(x, y)
        opt(g)
    items = [{"name": p.name, "data": p} for p in net.trainable_params()]
    items += [{"name": p.name, "data": p} for p in (opt.moment1 + opt.moment2)]
    items += [{"name": n, "data": getattr(opt, n)}
              for n in ("global_step", "learning_rate", "beta1_power", "beta2_power")]
    if bf16:
        items = [{"name": d["name"], "data": d["data"].astype(ms.bfloat16)}
                 if d["name"].startswith("fc") else d for d in items]
    ms.save_checkpoint(items, str(path), crc_check=crc)
    loaded = ms.load_checkpoint(str(path))
    return {k: (v.float().asnumpy() if bf16 and k.startswith("fc") else v.asnumpy())
            for k, v in loaded.items()}, bf16


def atoms(h5):
    out = {}
    with h5py.File(h5, "r") as f:
        for p in f["params"]:
            for k in f["params"][p]:
                out[(p, k)] = f["params"][p][k][()]
        iteration = int(f.attrs["iteration"])
    return out, iteration


def same_bytes(got, want, what):
    """got[k] has the dtype and bytes of want[k] (arrays) for every key of `want`; returns the
    number of elements compared."""
    n = 0
    for k, w in want.items():
        assert k in got, (what, k, sorted(got))
        a, b = np.asarray(got[k]), np.asarray(w)
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (what, k, a.dtype, b.dtype)
        n += int(b.size)
    return n


# The net: fc1 8 -> 12, fc2 12 -> 4, 160 weights (and as many of each Adam moment).
NET_VALUES = 160


def assert_bytes(got, want, what, min_count):
    """same_bytes with the count rule and a negative control (oracle_checks.checked) on the
    records `want` names (the control changes one of them)."""
    got = {k: v for k, v in got.items() if k in want}
    oracle_checks.checked(lambda g: same_bytes(g, want, what), got, min_count, what)


def test_universal_holds_what_mindspore_loads():
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        want, _ = train_and_save(t / "net.ckpt")
        assert {"moment1.fc1.weight", "global_step"} <= set(want), sorted(want)
        run("to-universal", t / "net.ckpt", "-o", t / "u.h5", "-q")
        got, iteration = atoms(t / "u.h5")
        assert iteration == int(want["global_step"][0]) == 2, iteration
        names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
        assert sorted({p for p, _ in got}) == sorted(names), sorted(got)
        expected = {(n, kind): want[key] for n in names
                    for kind, key in (("fp32", n), ("exp_avg", f"moment1.{n}"),
                                      ("exp_avg_sq", f"moment2.{n}"))}
        assert_bytes(got, expected, "universal atoms", 3 * NET_VALUES)


def test_bf16_and_crc():
    """bf16 weights become `param` atoms in bf16 (bits equal); a file saved
    with crc_check reads, and a flipped content byte is a CRC-32 error."""
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        want, _ = train_and_save(t / "b.ckpt", crc=True, bf16=True)
        run("to-universal", t / "b.ckpt", "-o", t / "u.h5", "-q")
        with h5py.File(t / "u.h5", "r") as f:
            g = f["params"]["fc1.weight"]
            assert "param" in g and g["param"].attrs["dtype"] == "bfloat16", list(g)
            bits = g["param"][()].astype(np.uint16)
        as_f32 = (bits.astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(as_f32, want["fc1.weight"]), "bf16 weights differ"
        data = bytearray((t / "b.ckpt").read_bytes())
        data[200] ^= 0x10
        (t / "c.ckpt").write_bytes(bytes(data))
        p = run("to-universal", t / "c.ckpt", "-o", t / "x.h5", expect=3)
        one_error_line(p, "c.ckpt", "CRC-32", kind="format error")
        assert not (t / "x.h5").exists()


def test_folder_export_and_dcp_round_trip():
    """A MindFormers-style folder (rank_0/<prefix>-<epoch>_<step>.ckpt and
    meta.json) is read at the file meta.json names, or --checkpoint's; export
    gives the parameters; DCP written from it is what torch's own
    dcp_to_torch_save reads back."""
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        (t / "save" / "rank_0").mkdir(parents=True)
        want, _ = train_and_save(t / "save" / "rank_0" / "net_rank_0-1_2.ckpt")
        old, _ = train_and_save(t / "save" / "rank_0" / "net_rank_0-1_1.ckpt")
        (t / "save" / "rank_0" / "meta.json").write_text(
            '{"last_epoch": 1, "last_step": 2, "last_ckpt_file": "net_rank_0-1_2.ckpt"}')
        run("to-universal", t / "save", "-o", t / "u.h5", "-q")
        run("to-universal", t / "save", "--checkpoint", "net_rank_0-1_1.ckpt", "-o",
            t / "u1.h5", "-q")
        assert atoms(t / "u1.h5")[0][("fc1.weight", "fp32")].tobytes() == \
            old["fc1.weight"].tobytes()
        p = run("to-universal", t / "save", "--checkpoint", "nope.ckpt", "-o", t / "n.h5",
                expect=2)
        one_error_line(p, "nope.ckpt", "net_rank_0-1_2.ckpt", kind="usage error")
        run("export", t / "save", "-o", t / "hf", "-q")
        from safetensors.numpy import load_file
        hf = load_file(str(t / "hf" / "model.safetensors"))
        assert sorted(hf) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"], sorted(hf)
        assert_bytes(hf, {n: want[n] for n in hf}, "export", NET_VALUES)
        run("convert", t / "save", "-o", t / "dcp", "--format", "dcp", "--dp", 2, "-q")
        r = subprocess.run(
            [sys.executable, "-c",
             "import sys, torch\n"
             "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
             "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n", str(t / "dcp"), str(t / "d.pt")],
            capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-2000:]
        import torch
        d = torch.load(t / "d.pt")
        flat = {}

        def walk(x, pre):
            if isinstance(x, dict):
                for k, v in x.items():
                    walk(v, f"{pre}.{k}" if pre else str(k))
            elif isinstance(x, torch.Tensor):
                flat[pre] = x
        walk(d, "")
        for n in ("fc1.weight", "fc2.bias"):
            model = [v for k, v in flat.items() if k.endswith(n) and "state" not in k]
            m1 = [v for k, v in flat.items() if k.endswith(f"{n}.exp_avg")]
            assert len(model) == 1 and len(m1) == 1, (n, sorted(flat))
            assert model[0].numpy().tobytes() == want[n].tobytes(), n
            assert m1[0].numpy().tobytes() == want[f"moment1.{n}"].tobytes(), n


def test_written_files_are_what_mindspore_loads():
    """--format mindspore: a MindSpore file rewritten (directly and through a
    universal file) is the same bytes MindSpore wrote; from DCP and from a
    real DeepSpeed checkpoint, mindspore.load_checkpoint gives every weight
    and Adam moment of the source, and the net and nn.Adam take them."""
    import mindspore as ms
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        want, _ = train_and_save(t / "net.ckpt")
        run("convert", t / "net.ckpt", "-o", t / "again", "--format", "mindspore", "-q")
        assert (t / "again" / "net.ckpt").read_bytes() == (t / "net.ckpt").read_bytes()
        run("to-universal", t / "net.ckpt", "-o", t / "u.h5", "-q")
        run("reshape", t / "u.h5", "-o", t / "again2", "--format", "mindspore", "-q")
        assert (t / "again2" / "net.ckpt").read_bytes() == (t / "net.ckpt").read_bytes()
        # MindSpore -> DCP -> MindSpore: what load_checkpoint returns is the source's.
        # (a DCP folder tells its step by its name, as torchtitan's step-N)
        run("convert", t / "net.ckpt", "-o", t / "step-2", "--format", "dcp", "--dp", 3, "-q")
        run("convert", t / "step-2", "-o", t / "back", "--format", "mindspore", "-q")
        meta = json.loads((t / "back" / "rank_0" / "meta.json").read_text())
        assert meta == {"last_epoch": 1, "last_step": 2,
                        "last_ckpt_file": "ucp_rank_0-1_2.ckpt"}, meta
        got = ms.load_checkpoint(str(t / "back" / "rank_0" / "ucp_rank_0-1_2.ckpt"))
        for k in want:  # (lr and betas through DCP's param groups: test_train_state)
            assert k in got, (k, sorted(got))
        assert_bytes({k: v.asnumpy() for k, v in got.items()}, want,
                     "MindSpore -> DCP -> MindSpore", 3 * NET_VALUES)
        net_params = {k: v for k, v in got.items() if k.startswith("fc")}
        assert sorted(net_params) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]


def test_from_a_real_deepspeed_checkpoint():
    """The real DeepSpeed 0.14.5 fixture (ZeRO 1, fp32, 2 ranks) to MindSpore:
    its fp32 masters and Adam moments are what load_checkpoint returns, and
    nn.Adam's beta powers and learning rate are what nn.Adam itself holds
    after the source's steps."""
    import mindspore as ms
    import torch
    fix = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5" / "ds0145_z1_fp32_w2_mlp"
    master = torch.load(fix / "reference_fp32_master.pt", weights_only=False)
    optim = torch.load(fix / "reference_optim_state.pt", weights_only=False)
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        run("convert", fix, "-o", t / "ms", "--format", "mindspore", "-q")
        files = list((t / "ms" / "rank_0").glob("*.ckpt"))
        assert len(files) == 1, files
        got = ms.load_checkpoint(str(files[0]))
        assert int(got["global_step"].asnumpy()[0]) == 2
        expected = {n: w.numpy() for n, w in master.items()}
        expected.update({prefix + n: optim[f"{n}::{k}"].numpy() for n in master
                         for k, prefix in (("exp_avg", "moment1."), ("exp_avg_sq", "moment2."))})
        assert_bytes({k: v.asnumpy() for k, v in got.items()}, expected, "DeepSpeed -> MindSpore",
                     3 * 174)  # DeepSpeed's MLP: 174 values
        # nn.Adam's bias-correction state after as many steps with the
        # source's betas (DeepSpeed's param group: 0.9, 0.999), as MindSpore's
        # own nn.Adam holds it, and the group's learning rate.
        groups = torch.load(fix / "global_step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                            weights_only=False)["optimizer_state_dict"][
                                "base_optimizer_state"]["param_groups"]
        b1, b2 = groups[0]["betas"]
        ms.set_context(mode=ms.PYNATIVE_MODE)
        p = ms.Parameter(ms.Tensor(np.ones(3, np.float32)), name="p")
        adam = ms.nn.Adam([p], learning_rate=groups[0]["lr"], beta1=b1, beta2=b2)
        for _ in range(2):
            adam((ms.Tensor(np.ones(3, np.float32)),))
        for k in ("beta1_power", "beta2_power", "learning_rate"):
            assert got[k].asnumpy().tobytes() == getattr(adam, k).asnumpy().tobytes(), \
                (k, got[k], getattr(adam, k))


def test_resume_falls_back_past_a_damaged_file():
    """ucp resume over a MindFormers-style folder: the newest .ckpt whose CRC
    trailer fails is skipped with the reason, the one before it handed out
    as saved (it loads at any device count: unsharded)."""
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        rank = t / "save" / "rank_0"
        rank.mkdir(parents=True)
        train_and_save(rank / "net_rank_0-1_1.ckpt", crc=True)
        train_and_save(rank / "net_rank_0-1_2.ckpt", crc=True)
        data = bytearray((rank / "net_rank_0-1_2.ckpt").read_bytes())
        data[300] ^= 1
        (rank / "net_rank_0-1_2.ckpt").write_bytes(bytes(data))
        before = sorted(p.name for p in rank.iterdir())
        r = json.loads(run("resume", t / "save", "--json").stdout)
        assert r["ok"] and r["format"] == "mindspore" and not r["reshaped"], r
        assert r["checkpoint"] == "net_rank_0-1_1.ckpt", r
        assert [s["name"] for s in r["skipped"]] == ["net_rank_0-1_2.ckpt"], r
        assert "CRC-32" in r["skipped"][0]["reason"], r
        assert sorted(p.name for p in rank.iterdir()) == before  # nothing written


def test_map_tensors_kept_verbatim():
    """A MapParameter's records (MapTensorProto: keys, values, status,
    streamed in several Values) are kept opaque and written back verbatim.
    MindSpore 2.10 cannot make one on CPU (MapTensorPut / ExportSlice have
    no CPU kernel), so the file is built with MindSpore's own protobuf
    classes (mindspore.train.checkpoint_pb2) from the proto definition."""
    from mindspore.train import checkpoint_pb2 as pb

    def record(tag, arrays, map_tensor=False):
        c = pb.Checkpoint()
        v = c.value.add()
        v.tag = tag
        for a in arrays:
            t = v.maptensor.tensor.add() if map_tensor else v.tensor
            t.dims.extend(a.shape)
            t.tensor_type = {"float32": "Float32", "int32": "Int32"}[str(a.dtype)]
            t.tensor_content = a.tobytes()
        return c.SerializeToString()

    rs = np.random.RandomState(3)
    w = rs.randn(4, 3).astype(np.float32)
    data = (record("w", [w])
            + record("emb", [np.array([1, 5], np.int32), rs.randn(2, 3).astype(np.float32),
                             np.array([0, 0], np.int32)], map_tensor=True)
            + record("emb", [np.array([9], np.int32), rs.randn(1, 3).astype(np.float32),
                             np.array([1], np.int32)], map_tensor=True)
            + record("b", [rs.randn(3).astype(np.float32)]))
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        (t / "m.ckpt").write_bytes(data)
        run("convert", t / "m.ckpt", "-o", t / "again", "--format", "mindspore", "-q")
        files = list((t / "again").rglob("*.ckpt"))
        assert len(files) == 1 and files[0].read_bytes() == data, files
        run("to-universal", t / "m.ckpt", "-o", t / "u.h5", "-q")
        with h5py.File(t / "u.h5", "r") as f:
            assert sorted(f["params"]) == ["b", "w"], sorted(f["params"])
            assert f["params"]["w"]["fp32"][()].tobytes() == w.tobytes()
        run("reshape", t / "u.h5", "-o", t / "back", "--format", "mindspore", "-q")
        files = list((t / "back").rglob("*.ckpt"))
        assert len(files) == 1 and files[0].read_bytes() == data, files


def test_what_it_cannot_read_is_one_clear_error():
    with tempfile.TemporaryDirectory(prefix="ucp-ms-") as t:
        t = pathlib.Path(t)
        train_and_save(t / "net.ckpt")
        data = (t / "net.ckpt").read_bytes()
        (t / "cut.ckpt").write_bytes(data[:len(data) // 2])
        p = run("to-universal", t / "cut.ckpt", "-o", t / "x.h5", expect=3)
        one_error_line(p, "cut.ckpt", kind="format error")
        for r in ("rank_0", "rank_1"):
            (t / "sharded" / r).mkdir(parents=True)
            (t / "sharded" / r / "net.ckpt").write_bytes(data)
        p = run("to-universal", t / "sharded", "-o", t / "y.h5", expect=3)
        one_error_line(p, "sharded", "strategy", kind="format error")
        assert not (t / "x.h5").exists() and not (t / "y.h5").exists()


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
