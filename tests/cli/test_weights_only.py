"""Every torch.save file ucp writes loads with torch.load's weights-only
unpickler (the default since torch 2.6), run by the newest torch of the tests'
PyPI environment:

* files of ucp's own formats (`export --format torch`, the LibTorch
  checkpointer: tests/unit/engine/resume) need no global beyond torch's
  allowlist;
* files of a framework's format need at most the globals the framework's own
  files need (Megatron's argparse.Namespace, DeepSpeed's LossScaler, ...),
  found here by loading the real frameworks' checkpoints in ../shared/fixtures:
  ucp adds no class of its own to any file.

torch.save archives inside DCP's .distcp files are cut out at the offsets of
the .metadata and loaded the same way. (Blobs of the universal file, which
hold the source's pickles verbatim, are not files ucp writes.)
"""
import importlib
import io
import os
import pathlib
import pickle
import re
import subprocess
import tempfile

import torch

UCP = pathlib.Path(os.environ["UCP_BINARY_DIR"]) / "cli" / "ucp"
FIX = pathlib.Path(os.environ["UCP_FIXTURES"])

_NAME = re.compile(r"Unsupported global: GLOBAL (\S+) was not an allowed global")


def resolve(name):
    """The object a pickle global names (module.qualname)."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    return getattr(importlib.import_module("builtins"), name)


def needed_globals(data, where):
    """The globals beyond torch's allowlist that loading `data` with
    weights_only=True needs (each allowed in turn until it loads)."""
    names = set()
    for _ in range(50):
        try:
            with torch.serialization.safe_globals([resolve(n) for n in sorted(names)]):
                torch.load(io.BytesIO(data), weights_only=True)
            return names
        except pickle.UnpicklingError as e:
            m = _NAME.search(str(e))
            assert m and m.group(1) not in names, (where, str(e)[-800:])
            names.add(m.group(1))
    raise AssertionError(f"{where}: more than 50 globals")


class MetadataUnpickler(pickle.Unpickler):
    """pickle.load, as torch.distributed.checkpoint reads .metadata, also
    for files pickled by Python >= 3.13 (pathlib._local)."""

    def find_class(self, module, name):
        return super().find_class("pathlib" if module == "pathlib._local" else module, name)


def archives(folder):
    """(name, bytes) of every torch.save archive under `folder`: .pt/.bin
    files whole, and the items of DCP .distcp files."""
    for f in sorted(folder.rglob("*")):
        if not f.is_file():
            continue
        if f.suffix in (".pt", ".bin"):
            yield str(f), f.read_bytes()
        elif f.name == ".metadata":
            with open(f, "rb") as m:
                meta = MetadataUnpickler(m).load()
            for index, info in meta.storage_data.items():
                with open(f.parent / info.relative_path, "rb") as d:
                    d.seek(info.offset)
                    yield f"{f.parent / info.relative_path}[{index.fqn}]", d.read(info.length)


def ucp(*args):
    r = subprocess.run([str(UCP), *map(str, args)], capture_output=True, text=True)
    assert r.returncode == 0, (args, r.stderr)


def framework_globals(*folders):
    names = set()
    count = 0
    for folder in folders:
        for where, data in archives(folder):
            names |= needed_globals(data, where)
            count += 1
    assert count, folders
    return names


def check(out, allowed, what):
    count = 0
    for where, data in archives(out):
        extra = needed_globals(data, where) - allowed
        assert not extra, f"{what}: {where} needs {sorted(extra)} beyond {sorted(allowed)}"
        count += 1
    assert count, (what, out)
    print(f"ok {what}: {count} archives", flush=True)
    return count


def main():
    ds_fix = sorted((FIX / "deepspeed-0.14.5").iterdir())
    ds_allowed = framework_globals(*(d / "global_step2" for d in ds_fix))
    mg_allowed = framework_globals(FIX / "megatron-23.06" / "synth_tp2",
                                   FIX / "megatron-core-torch-dist" / "tp2pp1dp1" / "ckpt")
    dcp_allowed = framework_globals(*(d / "ckpt" for d in (FIX / "dcp-torch-2.6").iterdir()))
    print("the frameworks' own files need:", sorted(ds_allowed), sorted(mg_allowed),
          sorted(dcp_allowed), flush=True)
    # The checks have teeth: the frameworks' files do need globals that torch
    # refuses by default, and they are found.
    assert "argparse.Namespace" in mg_allowed, mg_allowed
    assert any("LossScaler" in n for n in ds_allowed), ds_allowed
    # Negative control: check() refuses the frameworks' own files when told nothing is allowed.
    try:
        check(FIX / "megatron-23.06" / "synth_tp2", set(), "negative control")
    except AssertionError:
        pass
    else:
        raise AssertionError("check() passed Megatron's files with no global allowed")

    with tempfile.TemporaryDirectory(prefix="ucp-wo-") as t:
        t = pathlib.Path(t)
        mg = FIX / "megatron-23.06" / "synth_tp2"
        td = FIX / "megatron-core-torch-dist" / "tp2pp1dp1" / "ckpt"
        for name, src in (("z1", "ds0145_z1_bf16_w2_mlp"), ("z3", "ds0145_z3_fp32_w2_mlp")):
            src = FIX / "deepspeed-0.14.5" / src
            ucp("export", src, "-o", t / f"export-{name}", "--format", "torch")
            check(t / f"export-{name}", set(), f"export --format torch of {src.name}")
            for stage in (0, 1, 2, 3):
                out = t / f"ds-{name}-z{stage}"
                ucp("convert", src, "-o", out, "--format", "deepspeed", "--dp", 2,
                    "--zero-stage", stage)
                check(out, ds_allowed, f"deepspeed ZeRO {stage} from {src.name}")
            ucp("convert", src, "-o", t / f"dsu-{name}", "--format", "deepspeed-universal")
            check(t / f"dsu-{name}", ds_allowed, f"deepspeed-universal from {src.name}")
            ucp("convert", src, "-o", t / f"dcp-{name}", "--format", "dcp", "--dp", 2)
            check(t / f"dcp-{name}", dcp_allowed, f"dcp from {src.name}")
        ucp("export", mg, "-o", t / "export-mg", "--format", "torch")
        check(t / "export-mg", set(), "export --format torch of Megatron")
        for src in (mg, td):
            for fmt in ("megatron", "megatron-torch-dist"):
                out = t / f"{src.name}-{fmt}"
                ucp("convert", src, "-o", out, "--format", fmt, "--tp", 1, "--pp", 2, "--dp", 2,
                    "--distributed-optimizer")
                check(out, mg_allowed, f"{fmt} from {src.name}")
            ucp("convert", src, "-o", t / f"{src.name}-dcp", "--format", "dcp", "--dp", 2)
            check(t / f"{src.name}-dcp", dcp_allowed, f"dcp from {src.name}")
        # A DCP source written by torch itself, back to DCP and exported.
        dcp_src = FIX / "dcp-torch-2.6" / "dtensor_shard0_w2" / "ckpt"
        ucp("convert", dcp_src, "-o", t / "dcp-dcp", "--format", "dcp", "--dp", 3)
        check(t / "dcp-dcp", dcp_allowed, "dcp from torch's DCP")
        ucp("export", dcp_src, "-o", t / "export-dcp", "--format", "torch")
        check(t / "export-dcp", set(), "export --format torch of torch's DCP")


if __name__ == "__main__":
    main()
