"""PyTorch DCP items holding views (issue 35), saved by the real torch of the tests' PyPI
environment (run with its python): dcp.save keeps a tensor's strides when its storage is exactly
as large as it (a transposed tensor, two tensors viewing one storage the whole way) and clones the
others (a slice with an offset, an expanded tensor, a 0-d element of a larger storage); 0-d and
empty tensors beside them. ucp reads every item as torch does: `ucp convert` resharded to two
ranks loads back in torch (dcp.load) with the saved values, its items written contiguous; `ucp
export` gives the same values to torch.load.
"""
import io
import pathlib
import sys

import torch
import torch.distributed.checkpoint as dcp

from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402


def Tmp():
    return testmain.Tmp("ucp-strided-dcp-")


def state():
    g = torch.Generator().manual_seed(35)
    base = torch.randn(3, 4, generator=g)
    big = torch.randn(5, 6, generator=g)
    s = torch.randn(6, generator=g)
    vec = torch.randn(8, generator=g)
    return {"model": {
        "transposed": base.t(),                                   # [4, 3], stride (1, 4)
        "bf16_transposed": torch.randn(5, 7, generator=g).to(torch.bfloat16).t(),
        "sliced": big[1:4, 2:5],                                  # offset 8, larger storage
        "column_slice": big[:, 1],                                # stride (6,), offset 1
        "shared_flat": s,                                         # one storage...
        "shared_transposed": s.view(2, 3).t(),                    # ...viewed twice
        "expanded": vec[:3].expand(2, 3),                         # stride (0, 1)
        "scalar": torch.tensor(2.5),
        "scalar_view": vec[5],                                    # 0-d at offset 5
        "empty": torch.zeros(0, 3),
        "empty_transposed": torch.zeros(3, 0).t(),
    }, "extra": {"epoch": 3}}


def items(ckpt):
    """{fqn: tensor} of each item of a DCP checkpoint, as torch.load reads the item's bytes."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    out = {}
    for index, info in md.storage_data.items():
        data = (pathlib.Path(ckpt) / info.relative_path).read_bytes()
        blob = data[info.offset:info.offset + info.length]
        v = torch.load(io.BytesIO(blob), weights_only=True)
        if isinstance(v, torch.Tensor):
            out.setdefault(index.fqn, []).append(v)
    return out


def same(a, b, where):
    assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8)), where


def test_dcp_views_read_like_torch():
    want = state()
    with Tmp() as t:
        ckpt = t / "ckpt"
        dcp.save(state(), checkpoint_id=str(ckpt), no_dist=True)
        # torch kept the strides of the items whose storage it saved whole.
        saved = items(ckpt)
        for k in ("model.transposed", "model.bf16_transposed", "model.shared_transposed"):
            assert not saved[k][0].is_contiguous(), (k, saved[k][0].stride())
        # ... which torch reads back as the saved values.
        back = {"model": {k: torch.empty_like(v) for k, v in want["model"].items()}}
        dcp.load(back, checkpoint_id=str(ckpt), no_dist=True)
        for k, v in want["model"].items():
            same(back["model"][k], v, f"dcp.load of torch's save: {k}")

        run("verify", ckpt, "-q")
        run("convert", ckpt, "-o", t / "o", "--dp", 2, "-q")
        got = {"model": {k: torch.full_like(v, 7) for k, v in want["model"].items()}}
        dcp.load(got, checkpoint_id=str(t / "o"), no_dist=True)
        compared = 0
        for k, v in want["model"].items():
            same(got["model"][k], v, f"dcp.load of ucp's: {k}")
            compared += v.numel()
        assert compared >= 80, compared
        written = items(t / "o")
        assert sum(len(v) for v in written.values()) >= len(want["model"]), written.keys()
        for k, vs in written.items():
            for v in vs:
                assert v.is_contiguous(), (k, v.stride())

        run("export", ckpt, "-o", t / "hf", "--format", "torch", "-q")
        exported = torch.load(t / "hf" / "pytorch_model.bin", weights_only=True)
        assert set(exported) == set(want["model"]), set(exported) ^ set(want["model"])
        for k, v in want["model"].items():
            assert exported[k].is_contiguous(), (k, exported[k].stride())
            same(exported[k], v.float(), f"export: {k}")

        # Negative control: the comparison sees one changed value.
        bad = want["model"]["transposed"].clone()
        bad[2, 1] += 1
        try:
            same(exported["transposed"], bad, "changed")
        except AssertionError:
            pass
        else:
            raise AssertionError("a changed value went unnoticed")


if __name__ == "__main__":
    for name in sys.argv[1:] or [n for n in dir() if n.startswith("test_")]:
        globals()[name]()
        print("ok", name)
