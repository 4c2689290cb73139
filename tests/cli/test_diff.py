"""`ucp diff` against differences torch and numpy make (the oracle is the change made, never
ucp's output): DCP saves written by the real torch (dcp.save, no process group) that differ by
one flipped element, a missing param, an extra optimizer state, a transposed tensor, noise judged
by numpy.isclose, a dtype; a Megatron checkpoint of the suite's generator
(tests/tools/make_megatron_ckpts.py) equal to its DCP conversion by `ucp convert`, to its
universal file and to the generator's other layout of the same model, and one flipped element of
the conversion found; malformed inputs (one error line, exit code neither 0 nor 1; also through
the sanitized ucp_san).
"""
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import torch
import torch.distributed.checkpoint as dcp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
from testmain import UCP, Tmp, one_error_line, run, run_both  # noqa: E402

DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron" / "gqa_swiglu_bias_untied"
MEGATRON = DATA / "tp2_pp2_vpp1_dp2_do"
# A Megatron-core LLaMA saved by the real megatron-core (tests/tools/megatron_torch_dist.py).
TORCH_DIST = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron_torch_dist" / "tp2_pp2_dp1"


def diff(a, b, *args, expect):
    """ucp diff A B ARGS --json (exit `expect`): the report."""
    p = run("diff", a, b, *args, "--json", "--quiet", expect=expect)
    return json.loads(p.stdout)


def base_state(seed=0):
    """A model and its Adam state as torch.optim keeps them (get_state_dict's keys): a 12 MiB
    float32 weight (several windows of `--memory 16M`), a bias, a square weight, a bfloat16
    embedding without optimizer state."""
    g = torch.Generator().manual_seed(seed)
    model = {"big.weight": torch.randn(1024, 3072, generator=g),
             "big.bias": torch.randn(48, generator=g),
             "sq.weight": torch.randn(32, 32, generator=g),
             "emb.weight": torch.randn(100, 16, generator=g).to(torch.bfloat16)}
    state = {n: {"step": torch.tensor(7.0), "exp_avg": torch.randn(v.shape, generator=g),
                 "exp_avg_sq": torch.rand(v.shape, generator=g)}
             for n, v in model.items() if v.dtype == torch.float32}
    groups = [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
               "params": sorted(state)}]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups}}


def save(sd, folder):
    dcp.save(sd, checkpoint_id=str(folder), no_dist=True)
    return folder


def clone(sd):
    return {"model": {k: v.clone() for k, v in sd["model"].items()},
            "optimizer": {"state": {n: {k: v.clone() for k, v in s.items()}
                                    for n, s in sd["optimizer"]["state"].items()},
                          "param_groups": [dict(g) for g in sd["optimizer"]["param_groups"]]}}


def entry(report, name):
    found = [p for p in report["params"] if p["name"] == name]
    assert len(found) == 1, (name, [p["name"] for p in report["params"]])
    return found[0]


def state_of(report, name, state):
    found = [s for s in entry(report, name)["states"] if s["state"] == state]
    assert len(found) == 1, (name, state, entry(report, name))
    return found[0]


def differing(report):
    """(param, state, status) of every state that is neither equal nor derived, and params in
    one side only."""
    out = set()
    for p in report["params"]:
        if p["status"] in ("only_in_a", "only_in_b"):
            out.add((p["name"], None, p["status"]))
        for s in p["states"]:
            if s["status"] not in ("equal", "derived"):
                out.add((p["name"], s["state"], s["status"]))
    return out


def test_single_flipped_element_found():
    with Tmp("ucp-diff-") as t:
        sd = base_state()
        a = save(sd, t / "a")
        same = save(clone(sd), t / "same")
        r = diff(a, same, "--memory", "16M", expect=0)
        assert r["equal"] and not differing(r), differing(r)
        # Every value of the model and its state compared, in several windows.
        numel = sum(v.numel() for v in sd["model"].values())
        numel += sum(v.numel() for s in sd["optimizer"]["state"].values() for v in s.values())
        assert r["summary"]["elements_compared"] == numel, (r["summary"], numel)
        assert r["summary"]["states_compared"] == 4 + 3 * 3
        # One element near the end of the big weight (its last window) and one of a moment.
        b_sd = clone(sd)
        b_sd["model"]["big.weight"][1000, 3000] += 0.25
        b_sd["optimizer"]["state"]["sq.weight"]["exp_avg"][3, 4] = -0.0 if (
            sd["optimizer"]["state"]["sq.weight"]["exp_avg"][3, 4] != 0) else 1.0
        b = save(b_sd, t / "b")
        r = diff(a, b, "--memory", "16M", expect=1)
        assert not r["equal"]
        assert differing(r) == {("big.weight", "fp32", "values_differ"),
                                ("sq.weight", "exp_avg", "values_differ")}, differing(r)
        for name, state, index, x, y in (
                ("big.weight", "fp32", (1000, 3000), sd["model"]["big.weight"],
                 b_sd["model"]["big.weight"]),
                ("sq.weight", "exp_avg", (3, 4), sd["optimizer"]["state"]["sq.weight"]["exp_avg"],
                 b_sd["optimizer"]["state"]["sq.weight"]["exp_avg"])):
            s = state_of(r, name, state)
            xa, ya = x.numpy().astype(np.float64), y.numpy().astype(np.float64)
            want_abs = np.abs(xa - ya).max()
            assert s["differing"] == 1 and s["elements"] == x.numel(), s
            assert tuple(s["first_index"]) == index, s
            assert s["first_flat_index"] == np.ravel_multi_index(index, x.shape), s
            assert s["max_abs"] == want_abs, (s, want_abs)
            if ya[index] == 0:  # an infinite relative difference: JSON's null
                assert s["max_rel"] is None, s
            else:
                assert s["max_rel"] == want_abs / abs(ya[index]), s
        assert r["summary"]["differing_elements"] == 2
        # The text form: one line per difference, then the summary.
        p = run("diff", a, b, "--quiet", expect=1)
        lines = p.stdout.strip().splitlines()
        assert len(lines) == 3 and lines[-1].startswith("different:"), lines
        assert "param big.weight > fp32: 1 of 3145728 elements differ, first at [1000, 3000]" \
            in lines[0], lines


def test_missing_param_and_extra_state():
    with Tmp("ucp-diff-") as t:
        sd = base_state()
        a = save(sd, t / "a")
        b_sd = clone(sd)
        del b_sd["model"]["big.bias"]
        del b_sd["optimizer"]["state"]["big.bias"]
        b_sd["optimizer"]["param_groups"][0]["params"].remove("big.bias")
        b_sd["optimizer"]["state"]["sq.weight"]["max_exp_avg_sq"] = torch.ones(32, 32)
        b = save(b_sd, t / "b")
        r = diff(a, b, expect=1)
        assert differing(r) == {("big.bias", None, "only_in_a"),
                                ("sq.weight", "max_exp_avg_sq", "only_in_b")}, differing(r)
        assert state_of(r, "sq.weight", "max_exp_avg_sq")["b"]["shape"] == [32, 32]
        r = diff(b, a, expect=1)
        assert differing(r) == {("big.bias", None, "only_in_b"),
                                ("sq.weight", "max_exp_avg_sq", "only_in_a")}, differing(r)
        lines = run("diff", a, b, "--quiet", expect=1).stdout.splitlines()
        assert "param big.bias: only in A" in lines, lines
        assert "param sq.weight > max_exp_avg_sq: only in B" in lines, lines


def test_transposed_tensors():
    with Tmp("ucp-diff-") as t:
        sd = base_state()
        a = save(sd, t / "a")
        b_sd = clone(sd)
        b_sd["model"]["sq.weight"] = sd["model"]["sq.weight"].t().contiguous()
        # A weight transposed with its moments (DCP wants a param's state in its shape).
        b_sd["model"]["big.weight"] = sd["model"]["big.weight"].t().contiguous()
        for k in ("exp_avg", "exp_avg_sq"):
            b_sd["optimizer"]["state"]["big.weight"][k] = \
                sd["optimizer"]["state"]["big.weight"][k].t().contiguous()
        b = save(b_sd, t / "b")
        r = diff(a, b, expect=1)
        assert differing(r) == {("sq.weight", "fp32", "values_differ"),
                                ("big.weight", "fp32", "shape_differs"),
                                ("big.weight", "exp_avg", "shape_differs"),
                                ("big.weight", "exp_avg_sq", "shape_differs")}, differing(r)
        s = state_of(r, "big.weight", "exp_avg")
        assert s["a"]["shape"] == [1024, 3072] and s["b"]["shape"] == [3072, 1024], s
        assert s["shape_differs"] and not s["values_compared"], s
        lines = run("diff", a, b, "--quiet", expect=1).stdout.splitlines()
        assert "param big.weight > exp_avg: shape [1024, 3072] vs [3072, 1024]" in lines, lines
        x = sd["model"]["sq.weight"].numpy()
        y = x.T
        ne = x.view(np.uint32) != y.view(np.uint32)
        s = state_of(r, "sq.weight", "fp32")
        assert s["differing"] == int(ne.sum()) > 900, (s, int(ne.sum()))
        assert tuple(s["first_index"]) == tuple(np.argwhere(ne)[0]), s
        d = np.abs(x.astype(np.float64) - y.astype(np.float64))
        assert s["max_abs"] == d.max(), (s, d.max())
        assert s["max_rel"] == (d / np.abs(y.astype(np.float64)))[ne].max(), s


def test_tolerance_counts_match_numpy_isclose():
    with Tmp("ucp-diff-") as t:
        sd = base_state()
        a = save(sd, t / "a")
        g = torch.Generator().manual_seed(11)
        b_sd = clone(sd)
        w = sd["model"]["sq.weight"]
        noise = torch.randn(w.shape, generator=g) * torch.logspace(-8, -1, w.numel()).reshape(
            w.shape)
        b_sd["model"]["sq.weight"] = w + noise
        # Equal NaNs (same bits) and a -0.0 against 0.0.
        sd2 = clone(sd)
        sd2["model"]["sq.weight"][0, 0] = float("nan")
        b_sd["model"]["sq.weight"][0, 0] = float("nan")
        sd2["model"]["sq.weight"][0, 1] = 0.0
        b_sd["model"]["sq.weight"][0, 1] = -0.0
        a = save(sd2, t / "a2")
        b = save(b_sd, t / "b")
        x = sd2["model"]["sq.weight"].numpy()
        y = b_sd["model"]["sq.weight"].numpy()
        xd, yd = x.astype(np.float64), y.astype(np.float64)
        counts = set()
        for atol, rtol in ((0, 0), (1e-6, 0), (0, 1e-3), (1e-5, 1e-4), (1e-2, 1e-1)):
            want = ~np.isclose(xd, yd, rtol=rtol, atol=atol, equal_nan=True)
            if atol == 0 and rtol == 0:  # exact: the bytes
                want = x.view(np.uint32) != y.view(np.uint32)
            r = diff(a, b, "--atol", atol, "--rtol", rtol,
                     expect=1 if want.any() else 0)
            s = state_of(r, "sq.weight", "fp32")
            assert s["differing"] == int(want.sum()), (atol, rtol, s, int(want.sum()))
            counts.add(int(want.sum()))
            if want.any():
                d = np.abs(xd - yd)
                assert tuple(s["first_index"]) == tuple(np.argwhere(want)[0]), (atol, rtol, s)
                assert s["max_abs"] == d[want].max(), (atol, rtol, s, d[want].max())
            # Nothing else differs.
            assert differing(r) <= {("sq.weight", "fp32", "values_differ")}, differing(r)
        assert len(counts) >= 4 and 0 not in counts - {min(counts)}, counts
        one_error_line(run("diff", a, b, "--atol", "-1", expect=2), "atol", "-1",
                       kind="usage error")


def test_dtype_difference_compared_as_values():
    with Tmp("ucp-diff-") as t:
        sd = base_state()
        # Moments that bfloat16 holds exactly, saved as float32 in A and bfloat16 in B.
        m = sd["optimizer"]["state"]["big.bias"]["exp_avg"].to(torch.bfloat16)
        sd["optimizer"]["state"]["big.bias"]["exp_avg"] = m.float()
        a = save(sd, t / "a")
        b_sd = clone(sd)
        b_sd["optimizer"]["state"]["big.bias"]["exp_avg"] = m.clone()
        b = save(b_sd, t / "b")
        r = diff(a, b, expect=1)
        assert differing(r) == {("big.bias", "exp_avg", "dtype_differs")}, differing(r)
        s = state_of(r, "big.bias", "exp_avg")
        assert s["a"]["dtype"] == "float32" and s["b"]["dtype"] == "bfloat16", s
        assert s["dtype_differs"] and not s["shape_differs"], s
        assert s["values_compared"] and s["differing"] == 0 and s["elements"] == 48, s
        line = run("diff", a, b, "--quiet", expect=1).stdout.splitlines()[0]
        assert "dtype float32 vs bfloat16 (compared as values), values equal" in line, line
        # One value changed by one bfloat16 step: found across the dtypes.
        c_sd = clone(b_sd)
        bits = c_sd["optimizer"]["state"]["big.bias"]["exp_avg"].view(torch.int16)
        bits[9] += 1
        c = save(c_sd, t / "c")
        r = diff(a, c, expect=1)
        s = state_of(r, "big.bias", "exp_avg")
        want = np.abs(m.float().numpy().astype(np.float64)
                      - c_sd["optimizer"]["state"]["big.bias"]["exp_avg"].float().numpy())
        assert s["differing"] == 1 and s["first_index"] == [9], s
        assert s["max_abs"] == want.max() > 0, (s, want.max())


def test_megatron_equals_its_conversions():
    with Tmp("ucp-diff-") as t:
        truth = torch.load(DATA / "truth.pt", weights_only=False)
        run("convert", MEGATRON, "-o", t / "dcp", "--format", "dcp", "--dp", "2", "--quiet")
        run("to-universal", MEGATRON, "-o", t / "u.h5", "--quiet")
        numel = 0
        for a, b in ((MEGATRON, t / "dcp"), (MEGATRON, t / "u.h5"), (t / "u.h5", t / "dcp")):
            r = diff(a, b, expect=0)
            assert r["equal"] and not differing(r), (a, b, sorted(differing(r))[:5])
            if b.name == "u.h5":  # every state of the Megatron checkpoint
                numel = r["summary"]["elements_compared"]
            # DCP keeps no bf16 copy of an fp32 master and writes the iteration as each param's
            # step: those states of one side are derived, nothing else.
            derived = {(s["state"], s["status"], "in_b" if "b" in s else "in_a")
                       for p in r["params"] for s in p["states"] if s["status"] == "derived"}
            if b.name == "dcp":
                assert derived == {("param", "derived", "in_a"), ("step", "derived", "in_b")}, \
                    derived
                assert r["summary"]["derived_states"] == 2 * len(truth["params"]), r["summary"]
            else:
                assert not derived, derived
        # The generator's model weights at least, each with its optimizer state.
        assert numel >= 3 * sum(v["fp32"].numel() for v in truth["params"].values()) > 1000, numel
        # Another layout of the same model (the generator's), read by its own driver.
        others = sorted(q for q in DATA.iterdir() if q.is_dir() and q != MEGATRON
                        and q.name.endswith("_do"))
        assert others, list(DATA.iterdir())
        r = diff(MEGATRON, others[0], expect=0)
        assert r["summary"]["elements_compared"] == numel, (others[0], r["summary"])
        # Negative control: one element of one DCP item changed (by torch) is found.
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(str(t / "dcp"), str(t / "whole.pt"))
        sd = torch.load(t / "whole.pt", weights_only=False)
        key = next(k for k, v in sd["model"].items() if torch.is_tensor(v) and v.dim() == 2)
        w = sd["model"][key]
        w0 = float(w[1, 2])
        w[1, 2] = w[1, 2] * 2 + 1
        # And one param's step other than the iteration (100): no longer derived.
        stepped = sorted(sd["optimizer"]["state"])[0]
        sd["optimizer"]["state"][stepped]["step"] = torch.tensor(99.0)
        save(sd, t / "changed")
        r = diff(MEGATRON, t / "changed", expect=1)
        bad = differing(r)
        assert bad == {(key.removeprefix("model."), "fp32", "values_differ"),
                       (stepped, "step", "only_in_b")}, bad
        s = state_of(r, key.removeprefix("model."), "fp32")
        assert s["differing"] == 1 and s["first_index"] == [1, 2], s
        assert s["max_abs"] == abs(w0 - float(w[1, 2])), s
        assert "step 99, A's optimizer step 100" in state_of(r, stepped, "step")["note"]


def test_names_compare_under_a_name_map():
    """A Megatron-core LLaMA and its MindFormers conversion (other names, QKV and gate/up split)
    compare equal under --names mindformers-llama, and share no param without it."""
    with Tmp("ucp-diff-") as t:
        run("convert", TORCH_DIST, "-o", t / "ms", "--format", "mindspore", "--tp", 2, "--pp", 1,
            "--dp", 2, "--names", "mindformers-llama", "-q")
        r = diff(TORCH_DIST, t / "ms", "--names", "mindformers-llama", expect=0)
        assert r["summary"]["params_compared"] > 30 and not differing(r), r["summary"]
        # fp32 master and both moments of every param, compared; the bf16 copies derived.
        assert r["summary"]["states_compared"] == 3 * r["summary"]["params_compared"], r["summary"]
        r = diff(TORCH_DIST, t / "ms", expect=1)
        assert r["summary"]["params_compared"] == 0 and r["summary"]["params_in_b_only"] > 30


def test_malformed_inputs_fail_with_one_line():
    with Tmp("ucp-diff-") as t:
        a = save(base_state(), t / "a")
        b = t / "b"
        shutil.copytree(a, b)
        f = next(b.glob("*.distcp"))
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        p = run_both("diff", a, b, expect=3)  # and under ASan + UBSan (ucp_san)
        one_error_line(p, str(b), kind="format error")
        c = save(base_state(1), t / "c")
        run_both("diff", a, c, "--memory", "16M", "--atol", "1e-3", expect=1)
        p = run("diff", a, t / "nothing", expect=5)
        one_error_line(p, "nothing", kind="i/o error")
        p = run("diff", a, expect=2)
        one_error_line(p, "two checkpoints", kind="usage error")
        p = run("diff", a, a, "--names", "no-such-map", expect=2)
        one_error_line(p, "no-such-map", kind="usage error")
        # --json: the error as a document too, exit code kept.
        p = subprocess.run([str(UCP), "diff", a, b, "--json"], capture_output=True, text=True)
        assert p.returncode == 3 and json.loads(p.stdout)["error"]["exit_code"] == 3, p.stdout
        assert "examples:" in run("diff", "--help").stdout


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
