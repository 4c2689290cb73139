"""Makes the folder fuzz_deepspeed_universal reads: DeepSpeed's own ds_to_universal (the tests'
venv; tests/tools/deepspeed_real.py runs its main in this process) of the real DeepSpeed 0.14.5
ZeRO 1 bf16 world-2 save ../shared/fixtures/deepspeed-0.14.5/ds0145_z1_bf16_w2_mlp, written to
regressions/deepspeed_universal/global_step2_universal (committed: the fuzz replay and
`.ci/dev fuzz` need no venv). Run once with the venv's python:
  ~/.cache/ucp/venv/bin/python tests/fuzz/make_deepspeed_universal_seed.py [--fixtures DIR]
"""
import argparse
import os
import pathlib
import shutil
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.environ.get(
        "UCP_FIXTURES", str(HERE.parents[2] / ".." / "shared" / "fixtures")))
    ap.add_argument("--out", default=str(HERE / "regressions" / "deepspeed_universal"
                                         / "global_step2_universal"))
    a = ap.parse_args()
    # DeepSpeed 0.14.5's pickles need torch.load without weights_only.
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, str(HERE.parent / "tools"))
    import deepspeed_real
    src = pathlib.Path(a.fixtures) / "deepspeed-0.14.5" / "ds0145_z1_bf16_w2_mlp"
    out = pathlib.Path(a.out)
    with tempfile.TemporaryDirectory() as t:
        # --inject_missing_state writes into its input: a writable copy.
        copy = pathlib.Path(t) / "save"
        shutil.copytree(src, copy)
        for p in [copy, *copy.rglob("*")]:
            p.chmod(p.stat().st_mode | 0o200)
        made = pathlib.Path(t) / "global_step2_universal"
        error = deepspeed_real.ds_to_universal(copy / "global_step2", made)
        if error is not None:
            sys.exit(f"ds_to_universal failed:\n{error}")
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(made, out)
    for p in sorted(out.rglob("*")):
        if p.is_file():
            print(p.relative_to(out), p.stat().st_size)


if __name__ == "__main__":
    main()
