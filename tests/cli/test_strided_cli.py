#!/usr/bin/python3
"""Rank files whose tensors torch saved as views (issue 35): every tensor of a Megatron-LM legacy
checkpoint (the independent generator's, fixture megatron_ckpts) is re-saved by torch.save as a view
of another layout holding the same values -- transposed (storage exactly as large), transposed and
sliced with an offset out of a larger storage, 1-D slices with an offset and a step (the distributed
optimizer's flat buffers too), two tensors viewing one storage, empty views with an offset (0-d
tensors: test_strided_dcp.py).
torch.load gives the same values as before; ucp must read them as torch does: its universal file
equals the generator's truth (check_universal.py, h5py), and its conversion equals the generator's
own files for the target layout (compare_megatron_ckpt.py), written contiguous.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
sys.path.insert(0, str(HERE.parent / "tools" / "stubs"))

from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron"
DS = pathlib.Path(os.environ["UCP_FIXTURES"]) / "deepspeed-0.14.5"
TOOLS = HERE.parent / "tools"
PY = os.environ.get("UCP_PYTHON", "/usr/bin/python3")
VARIANT = DATA / "gqa_swiglu_bias_untied"


def tool(script, *args, expect=0):
    p = subprocess.run([PY, str(TOOLS / script), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == expect, (script, args, p.stdout[-3000:], p.stderr[-3000:])
    return p


def Tmp():
    return testmain.Tmp("ucp-strided-")


def tensor_slots(obj):
    """(container, key) of every tensor in dicts / lists, depth first."""
    out = []

    def walk(o):
        items = o.items() if isinstance(o, dict) else enumerate(o) if isinstance(o, list) else ()
        for k, v in items:
            if isinstance(v, torch.Tensor):
                out.append((o, k))
            else:
                walk(v)

    walk(obj)
    return out


def as_view(x, i):
    """x's values in another layout torch can save (chosen by i)."""
    if x.dim() == 0:  # element 3 of a larger storage
        buf = torch.zeros(5, dtype=x.dtype)
        buf[3] = x
        return buf[3]
    if x.numel() == 0:  # an empty slice at offset 5 of a larger storage
        return torch.zeros(7, dtype=x.dtype)[5:5].view(x.shape)
    if x.dim() == 2 and i % 2 == 0:  # transposed; storage == numel
        return x.t().contiguous().t()
    if x.dim() == 2:  # transposed, at an offset of a larger storage
        r, c = x.shape
        buf = torch.zeros(c + 3, r, dtype=x.dtype)
        buf[2:2 + c] = x.t()
        return buf[2:2 + c].t()
    if x.dim() == 1 and i % 2 == 0:  # every other element, from offset 1
        n = x.numel()
        buf = torch.zeros(2 * n + 3, dtype=x.dtype)
        buf[1:1 + 2 * n:2] = x
        return buf[1:1 + 2 * n:2]
    n = x.numel()  # a slice at offset 4 of a larger storage
    buf = torch.zeros(n + 5, dtype=x.dtype)
    buf[4:4 + n] = x
    return buf[4:4 + n]


def share(a, b):
    """Views of one storage holding a's then b's values (a gap between)."""
    na, nb = a.numel(), b.numel()
    buf = torch.zeros(na + nb + 3, dtype=a.dtype)
    buf[1:1 + na] = a.reshape(-1)
    buf[2 + na:2 + na + nb] = b.reshape(-1)
    return buf[1:1 + na].view(a.shape), buf[2 + na:2 + na + nb].view(b.shape)


def restride_checkpoint(src, dst, pattern="*.pt"):
    """Copies checkpoint folder src to dst with every tensor of every rank file re-saved as a view
    (see as_view / share); returns how many are not contiguous, share a storage, lie at an
    offset, and are empty views at an offset."""
    shutil.copytree(src, dst)
    stats = {"strided": 0, "shared": 0, "offset": 0, "empty": 0}
    for f in sorted(dst.glob(pattern) if "/" in pattern else dst.rglob(pattern)):
        before = torch.load(f, map_location="cpu")
        sd = torch.load(f, map_location="cpu")
        pending = {}  # dtype -> the slot waiting for a partner
        for i, (o, k) in enumerate(tensor_slots(sd)):
            x = o[k]
            if x.dim() == 1 and x.numel() > 0 and x.dtype != torch.uint8 and i % 5 == 4:
                if x.dtype not in pending:
                    pending[x.dtype] = (o, k)
                    continue
                po, pk = pending.pop(x.dtype)
                po[pk], o[k] = share(po[pk], x)
                stats["shared"] += 2
                continue
            o[k] = as_view(x, i)
        for po, pk in pending.values():
            po[pk] = as_view(po[pk], 1)
        for o, k in tensor_slots(sd):
            v = o[k]
            stats["strided"] += not v.is_contiguous()
            stats["offset"] += v.storage_offset() > 0
            stats["empty"] += v.numel() == 0 and v.storage_offset() > 0
        torch.save(sd, f)
        # What torch loads from the re-saved file: the same values as before.
        after = torch.load(f, map_location="cpu")
        pairs = list(zip(tensor_slots(before), tensor_slots(after)))
        assert len(pairs) == len(tensor_slots(before)) > 0, f
        for (bo, bk), (ao, ak) in pairs:
            a, b = ao[ak], bo[bk]
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (f, bk)
    return stats


def contiguous_everywhere(folder):
    """Every tensor of every torch.save file ucp wrote is contiguous; returns how many there are."""
    n = 0
    for f in folder.rglob("*.pt"):
        for o, k in tensor_slots(torch.load(f, map_location="cpu")):
            assert o[k].is_contiguous(), (f, k, o[k].stride())
            n += 1
    return n


def test_megatron_views_read_like_torch():
    """The distributed optimizer's TP2 DP2 save, every tensor a view: to-universal equals the
    truth; convert to TP1 without it equals the generator's TP1 files."""
    with Tmp() as t:
        src = t / "src"
        stats = restride_checkpoint(VARIANT / "tp2_pp1_vpp1_dp2_do", src)
        assert stats["strided"] >= 100 and stats["shared"] >= 4, stats
        assert stats["offset"] >= 100 and stats["empty"] >= 8, stats
        run("verify", src, "-q")
        run("to-universal", src, "-o", t / "u.h5", "-q")
        tool("check_universal.py", t / "u.h5", VARIANT / "truth.pt", "--padding-from", src, "--no-align-check")
        run("convert", src, "-o", t / "o", "--tp", 1, "--pp", 1, "--dp", 1, "-q")
        tool("compare_megatron_ckpt.py", VARIANT / "tp1_pp1_vpp1_dp1_nodo", t / "o", "--ignore-rng")
        assert contiguous_everywhere(t / "o") > 300


def test_megatron_nodo_views_read_like_torch():
    """Without the distributed optimizer (fp32 masters and Adam's moments per param), every
    tensor a view: converted to PP2 DP4 with it, equal to the generator's files."""
    with Tmp() as t:
        src = t / "src"
        stats = restride_checkpoint(VARIANT / "tp1_pp1_vpp1_dp1_nodo", src)
        assert stats["strided"] >= 200 and stats["shared"] >= 20, stats
        run("convert", src, "-o", t / "o", "--tp", 1, "--pp", 2, "--dp", 4,
            "--distributed-optimizer", "-q")
        tool("compare_megatron_ckpt.py", VARIANT / "tp1_pp2_vpp1_dp4_do", t / "o", "--ignore-rng")
        assert contiguous_everywhere(t / "o") > 100


def test_deepspeed_views_read_like_torch():
    """DeepSpeed's own ZeRO-1 and ZeRO-3 files (bf16, two ranks), every tensor re-saved as a view
    (the flat fp32 partitions and Adam's moments as 1-D slices with a step or an offset): the
    universal file equals DeepSpeed's references, and converted to the same stage and world the
    files equal DeepSpeed's own (check_deepspeed.py), written contiguous."""
    import check_deepspeed as ck
    for name, stage, world in (("ds0145_z1_bf16_w2_mlp", 1, 2), ("ds0145_z3_bf16_w2_mlp", 3, 2)):
        with Tmp() as t:
            src = t / name
            stats = restride_checkpoint(DS / name, src, "global_step*/*.pt")
            assert stats["strided"] >= 2 and stats["offset"] >= 10, (name, stats)
            run("to-universal", src, "-o", t / "u.h5", "-q")
            ck.cmd_universal(str(t / "u.h5"), str(DS / name))
            run("convert", src, "-o", t / "o", "--format", "deepspeed", "--dp", world,
                "--zero-stage", stage, "-q")
            ck.cmd_native(str(t / "o"), str(DS / name), world, stage)
            assert contiguous_everywhere(t / "o") >= 4


def test_changed_value_in_a_view_is_seen():
    """Negative control: one value changed in a transposed weight (through its view) makes the
    universal file differ from the truth."""
    with Tmp() as t:
        src = t / "src"
        restride_checkpoint(VARIANT / "tp2_pp1_vpp1_dp2_do", src)
        f = next(src.rglob("mp_rank_00/model_optim_rng.pt"))
        sd = torch.load(f, map_location="cpu")
        w = sd["model"]["decoder.layers.0.self_attention.linear_proj.weight"]
        assert not w.is_contiguous()
        w[1, 0] += 1
        torch.save(sd, f)
        run("to-universal", src, "-o", t / "u.h5", "-q")
        p = tool("check_universal.py", t / "u.h5", VARIANT / "truth.pt", "--padding-from", src, "--no-align-check",
                 expect=1)
        assert "linear_proj.weight" in p.stdout + p.stderr, p.stdout + p.stderr


if __name__ == "__main__":
    for name in sys.argv[1:] or [n for n in dir() if n.startswith("test_")]:
        globals()[name]()
        print("ok", name)
