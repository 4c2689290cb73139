"""Megatron-LM legacy checkpoints (--ckpt-format torch) judged by the real megatron-core (the
tests' PyPI environment, run with its python): tests/tools/megatron_legacy_real.py saves one as
Megatron-LM's save_checkpoint does (GPTModel local spec, DistributedDataParallel, the real
Float16OptimizerWithFloat16Params or DistributedOptimizer after two real steps, model_optim_rng.pt
and distrib_optim.pt); ucp converts it to another TP / PP / VPP / DP and optimizer; the target
ranks load it as Megatron-LM's load_checkpoint does (GPTModel.load_state_dict(strict=True), the
optimizer's load_state_dict, load_parameter_state) and what they then hold (model weights, fp32
main params, Adam moments, steps, param groups, in megatron-core's own global coordinates) must
equal what the source ranks held, bit for bit. Negative control: one byte of one tensor of ucp's
output changed, the same check fails.
"""
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import megatron_legacy_real as mlr  # noqa: E402

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
# The model has about 30 k elements of each kind (weights, main params, two moments).
MIN_VALUES = 80_000


def ucp(*args):
    p = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True)
    assert p.returncode == 0, (args, p.returncode, p.stdout[-3000:], p.stderr[-3000:])
    return p


def flip_byte(path, byte=1):
    """Changes one byte of the largest tensor record of the torch.save file `path` in place (the
    byte `byte` of its first element, which every check compares) and fixes the record's CRC, so
    that torch reads the file and only the value differs. Returns the record's name."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename),
                   key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        head = f.read(30)
        start = info.header_offset + 30 + int.from_bytes(head[26:28], "little") + \
            int.from_bytes(head[28:30], "little")
        f.seek(start)
        data = bytearray(f.read(info.file_size))
        data[byte] ^= 0x5A
        f.seek(start)
        f.write(data)
        import zlib
        crc = zlib.crc32(bytes(data)).to_bytes(4, "little")
        f.seek(info.header_offset + 14)
        f.write(crc)
    # the central directory's copy of the CRC
    with open(path, "r+b") as f:
        raw = f.read()
        name = info.filename.encode()
        at = raw.find(b"PK\x01\x02")
        while at >= 0:
            n = int.from_bytes(raw[at + 28:at + 30], "little")
            if raw[at + 46:at + 46 + n] == name:
                f.seek(at + 16)
                f.write(crc)
                break
            at = raw.find(b"PK\x01\x02", at + 4)
    return info.filename


def convert_and_judge(t, source, target, negative=None):
    """Saves `source` (mlr.options keywords), converts it with ucp to `target`, loads and
    compares; `negative`: a file (relative to the iteration folder) of ucp's output to damage
    by one byte, after which the same judgment must fail on values."""
    src = mlr.options("save", out=t / "src", view=t / "src_view", **source)
    ok, msg = mlr.run(src)
    assert ok, msg
    flags = ["--tp", target["tp"], "--pp", target["pp"], "--vpp", target.get("vpp", 1),
             "--dp", target.get("dp", 1)]
    if target.get("optim") == "distributed":
        flags.append("--distributed-optimizer")
    ucp("convert", t / "src", "-o", t / "out", *flags, "-q")
    dst = mlr.options("load", ckpt=t / "out", view=t / "dst_view",
                      variant=source.get("variant", "gqa_swiglu_untied"), **target)
    ok, msg = mlr.run(dst)
    assert ok, msg
    ok, report = mlr.compare(t / "src_view", t / "dst_view", MIN_VALUES)
    print(report)
    assert ok, report
    assert set(report["kinds"]) == {"model", "param", "exp_avg", "exp_avg_sq"}, report
    if negative is None:
        return
    victim = t / "out" / f"iter_{mlr.STEPS:07d}" / negative
    record = flip_byte(victim)
    shutil.rmtree(t / "dst_view")
    ok, msg = mlr.run(dst)
    assert ok, ("the damaged file no longer loads", msg)
    ok, bad = mlr.compare(t / "src_view", t / "dst_view", MIN_VALUES)
    assert not ok and any("values differ" in p for p in bad["problems"]), (victim, record, bad)
    print("negative control:", victim.name, record, bad["problems"][:2])


def test_float16_tp2_pp2_to_distributed_tp1_pp2_vpp2_dp2():
    """TP 2 -> 1, VPP 1 -> 2, DP 1 -> 2, Float16OptimizerWithFloat16Params -> the distributed
    optimizer (distrib_optim.pt); no biases, untied output layer."""
    t = pathlib.Path(tempfile.mkdtemp(prefix="ucp-mlr-"))
    try:
        convert_and_judge(t, dict(tp=2, pp=2, dp=1, optim="float16"),
                          dict(tp=1, pp=2, vpp=2, dp=2, optim="distributed"),
                          negative="mp_rank_00_001/distrib_optim.pt")
    finally:
        shutil.rmtree(t)


def test_distributed_tp1_pp2_vpp2_dp2_tied_bias_to_tp2_dp2():
    """The distributed optimizer at TP 1 PP 2 VPP 2 DP 2 -> TP 2 PP 1 DP 2, still distributed
    (its buffers laid out again); biases, tied embeddings (the last stage's copy dropped)."""
    t = pathlib.Path(tempfile.mkdtemp(prefix="ucp-mlr-"))
    try:
        convert_and_judge(t, dict(tp=1, pp=2, vpp=2, dp=2, optim="distributed",
                                  variant="gqa_swiglu_bias_tied"),
                          dict(tp=2, pp=1, dp=2, optim="distributed"),
                          negative="mp_rank_00/model_optim_rng.pt")
    finally:
        shutil.rmtree(t)


def test_distributed_tp2_dp2_tied_bias_to_float16_tp1_pp2():
    """The distributed optimizer at TP 2 DP 2 -> Float16OptimizerWithFloat16Params at TP 1 PP 2
    (the tied embeddings' copy made on the last stage)."""
    t = pathlib.Path(tempfile.mkdtemp(prefix="ucp-mlr-"))
    try:
        convert_and_judge(t, dict(tp=2, pp=1, dp=2, optim="distributed",
                                  variant="gqa_swiglu_bias_tied"),
                          dict(tp=1, pp=2, dp=1, optim="float16"))
    finally:
        shutil.rmtree(t)


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
