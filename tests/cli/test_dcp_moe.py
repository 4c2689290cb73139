"""torchtitan mixture-of-experts DCP saves against the real torch (the tests' PyPI environment,
run with its python). The saves (tests/tools/make_dcp_moe.py: EP x FSDP2 on 4 CPU ranks, Adam
state, the shape-suffixed names, an empty chunk) are read by ucp into one param per global expert,
compared with h5py against what the ranks held (DTensor.full_tensor() of every key, truth.pt);
written back by ucp for other world sizes, restacked, and loaded by torch's own dcp.load at 1, 2
and 3 ranks, equal to the saved state; with --ep 2 placed as the real EP x FSDP2 save is, and
loaded by that model and its Adam; per-expert params of content that is not DCP's restacked;
DCP -> universal -> DCP -> universal is the identity (h5py); between frameworks by name maps:
--names mcore-llama to torch_dist (against the source re-fused by torch), export --hf of that
loaded by transformers' Glm4MoeForCausalLM, and --names torchtitan back to DCP, loaded by the
EP x FSDP2 model and Adam bit for bit;
a save that lost an expert, holds one twice or has a gap is one error line naming the file, the key
and the experts, nothing written, under the sanitized ucp_san too.
"""
import io
import json
import os
import pathlib
import pickle
import shutil
import sys
import tempfile
import zipfile

import h5py
import numpy as np
import torch
import torch.distributed.checkpoint as dcp

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import make_dcp_moe as gen  # noqa: E402
import oracle_checks  # noqa: E402

from testmain import one_error_line, run, run_both  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "dcp_moe"
STEMS = {"w1", "w2", "w3", "w1_EFD", "w2_EDF", "w3_EFD"}


def Tmp():
    return testmain.Tmp("ucp-dcpmoe-")


def truth(case):
    return torch.load(DATA / case / "truth.pt", weights_only=False)


def as_bytes(t):
    return t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def stacked(param):
    """('layers.1.moe.experts.', 'w1') for a stacked expert param, else None."""
    head, _, base = param.rpartition(".")
    return (head + ".", base) if head.endswith("moe.experts") and base in STEMS else None


def expected_atoms(case):
    """{(universal param, kind): tensor} a save's universal file must hold, from truth.pt alone:
    each stacked expert tensor (and its Adam state) as one param per global expert, named
    <layer>.moe.experts.<e>.<w1|w2|w3>, the slice of row e; the rest under its own name."""
    want = {}

    def put(param, kind, t):
        s = stacked(param)
        if s is None:
            want[(param, kind)] = t
            return
        prefix, base = s
        for e in range(t.shape[0] if t.dim() else n_experts[prefix]):
            want[(f"{prefix}{e}.{base[:2]}", kind)] = t[e] if t.dim() else t

    tr = truth(case)
    n_experts = {stacked(p[1])[0]: v.shape[0] for p, v in tr.items()
                 if p[0] == "model" and stacked(p[1])}
    for path, v in tr.items():
        if path[0] == "model":
            put(path[1], "fp32", v)
        elif path[:2] == ("optimizer", "state"):
            put(path[2], path[3], v)
    return want


def h5_atoms(h5):
    out = {}
    with h5py.File(h5, "r") as f:
        for name, g in f["params"].items():
            for kind, d in g.items():
                if isinstance(d, h5py.Dataset):
                    out[(name, kind)] = d[()]
    return out


def compare_atoms(want, got):
    assert set(want) == set(got), sorted(map(str, set(want) ^ set(got)))[:10]
    n = 0
    for k, t in want.items():
        a = got[k]
        assert a.shape == tuple(t.shape), (k, a.shape, tuple(t.shape))
        assert np.ascontiguousarray(a).tobytes() == as_bytes(t), k
        n += t.numel()
    return n


def min_values(case):
    """Fewest values a universal file holds (model and both moments): every expert's."""
    experts, *_ = gen.SPEC[case]
    per_expert = 3 * gen.EXPERT_FFN * gen.DIM
    return 3 * 2 * experts * per_expert


def test_reads_one_param_per_expert():
    """Each case: verified, and its universal file holds every expert's slice of the stacked
    tensors and of their Adam moments and step, and every other param, as the ranks held them."""
    for case in gen.CASES:
        ckpt = DATA / case / "ckpt"
        run("verify", ckpt, "-q")
        with Tmp() as t:
            run("to-universal", ckpt, "-o", t / "u.h5", "-q")
            got = h5_atoms(t / "u.h5")
            want = expected_atoms(case)
            experts = {k for k in want if ".moe.experts." in k[0]}
            assert len(experts) >= 2 * 3 * gen.SPEC[case][0] * 4, (case, len(experts))
            oracle_checks.checked(lambda g: compare_atoms(want, g), got, min_values(case),
                                  f"{case} universal")
            # The order each key's suffix or shape tells, kept for the writer.
            with h5py.File(t / "u.h5", "r") as f:
                rec = json.loads(f.attrs["dcp"])
            orders = {k["key"]: k["order"] for k in rec["keys"] if k.get("experts")}
            old = gen.SPEC[case][3]
            w1 = next(k for k in orders if k.startswith("model.layers.1.moe.experts.w1"))
            assert orders[w1] == ("EDF" if old else "EFD"), orders
            # inspect lists the per-expert params of the universal file
            p = run("inspect", t / "u.h5")
            assert "layers.2.moe.experts.1.w2" in p.stdout, p.stdout[:2000]


def full_view(ckpt):
    """dcp_to_torch_save's state of a checkpoint (torch's own single-process load), flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as t:
        dcp_to_torch_save(str(ckpt), os.path.join(t, "sd.pt"))
        return gen.flatten(torch.load(os.path.join(t, "sd.pt"), weights_only=False))


def same_state(got, want, where):
    assert set(got) == set(want), (where, sorted(map(str, set(got) ^ set(want)))[:10])
    n = 0
    for k, v in want.items():
        g = got[k]
        if isinstance(v, torch.Tensor):
            assert isinstance(g, torch.Tensor) and g.dtype == v.dtype and g.shape == v.shape, \
                (where, k)
            assert as_bytes(g) == as_bytes(v), (where, k)
            n += v.numel()
        else:
            assert g == v, (where, k, g, v)
            n += 1
    return n


def flip_expert_byte(ckpt, fqn):
    """One byte of the tensor data of key `fqn`'s first non-empty item in a DCP folder."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    idx, info = next((k, v) for k, v in md.storage_data.items()
                     if k.fqn == fqn and v.length > 0)
    f = ckpt / info.relative_path
    data = bytearray(f.read_bytes())
    item = bytes(data[info.offset:info.offset + info.length])
    z = zipfile.ZipFile(io.BytesIO(item))
    rec = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    start = info.offset + rec.header_offset + 30 + len(rec.filename.encode()) + \
        int.from_bytes(item[rec.header_offset + 28:rec.header_offset + 30], "little")
    data[start + 1] ^= 0x10
    f.write_bytes(bytes(data))


# dcp.load at M ranks (a few seconds each): M = 2 and 3 once each, the FSDP Shard(1) save and
# the uneven one (test_ep_places_experts_as_torchtitan loads ep2_fsdp2 at 4 ranks).
MULTI = {("ep2_fsdp2_suffix", 2), ("uneven_e3", 3)}


def test_torch_loads_ucps_files_at_other_worlds():
    """ucp's --dp M output (M = 1, 2, 3) loaded by torch: dcp_to_torch_save in one process (every
    key and object), and for some (case, M) (MULTI) dcp.load into DTensors at M ranks (experts
    Shard(0), or Shard(1) at 3): the saved state bit for bit; a byte changed in an expert item of
    ucp's output fails the check."""
    for case in gen.CASES:
        want = truth(case)
        tensors = {k: v for k, v in want.items() if isinstance(v, torch.Tensor)}
        for m in (1, 2, 3):
            with Tmp() as t:
                out = t / "o"
                run("convert", DATA / case / "ckpt", "-o", out, "--dp", m, "-q")
                assert len(list(out.glob("__*_0.distcp"))) == m
                md = dcp.FileSystemReader(str(out)).read_metadata()
                keys = [k for k in md.state_dict_metadata if ".moe.experts." in k]
                assert keys and all(stacked(k.split(".", 1)[1]) or k.startswith("optimizer")
                                    for k in keys), keys
                view = full_view(out)
                oracle_checks.checked(lambda g: same_state(g, want, f"{case} -> {m}"), view,
                                      min_values(case) // 2, f"{case} -> {m}")
                if (case, m) in MULTI:
                    got = gen.load_check(out, DATA / case / "truth.pt", m)
                    oracle_checks.checked(lambda g: same_state(g, tensors, f"{case} -> {m}"), got,
                                          min_values(case) // 2, f"{case} -> {m}")
                if m == 2:
                    w1 = next(k for k in md.state_dict_metadata
                              if k.startswith("model.layers.2.moe.experts.w1"))
                    flip_expert_byte(out, w1)
                    try:
                        same_state(full_view(out), want, "flipped")
                    except (AssertionError, RuntimeError):
                        pass
                    else:
                        raise AssertionError(f"{case}: a byte of {w1} changed in ucp's output "
                                             "and torch's load still equals the source")


def nonempty_chunks(ckpt):
    """{key: sorted (offsets, sizes, rank of the file holding it) of its non-empty chunks} of
    the stacked expert keys (each chunk saved once: torch's dedup)."""
    md = dcp.FileSystemReader(str(ckpt)).read_metadata()
    rank = {(k.fqn, tuple(k.offset)): int(v.relative_path.split("_")[2])
            for k, v in md.storage_data.items() if k.offset is not None}
    return {k: sorted((tuple(c.offsets), tuple(c.sizes), rank[(k, tuple(c.offsets))])
                      for c in v.chunks if 0 not in c.sizes)
            for k, v in md.state_dict_metadata.items()
            if ".moe.experts." in k and hasattr(v, "chunks") and len(v.size) == 3}


def test_ep_places_experts_as_torchtitan():
    """--dp 4 --ep 2: every stacked expert key's chunks are the boxes the real FSDP2-on-EP save
    has, on the same ranks (Shard(0) of the local experts, or Shard(1) with one local expert;
    torchtitan's mesh (dp_shard_mod_ep, ep)), the state equal to the source's, also as the EP x
    FSDP2 model and Adam of the save load it (ep2_fsdp2); an --ep not dividing the experts or
    --dp is one usage error line."""
    for case in ("ep2_fsdp2", "ep2_fsdp2_suffix"):
        with Tmp() as t:
            run("convert", DATA / case / "ckpt", "-o", t / "o", "--dp", 4, "--ep", 2, "-q")
            want, got = nonempty_chunks(DATA / case / "ckpt"), nonempty_chunks(t / "o")
            assert len(want) >= 12 and got == want, (case, sorted(set(got.items()) ^
                                                                  set(want.items()))[:3])
            oracle_checks.checked(lambda g: same_state(g, truth(case), f"{case} --ep 2"),
                                  full_view(t / "o"), min_values(case) // 2, f"{case} --ep 2")
            if case == "ep2_fsdp2":
                # loaded as torchtitan loads: its EP x FSDP2 model and a fresh Adam
                got = gen.torchtitan_load(case, t / "o")
                oracle_checks.checked(lambda g: same_state(g, truth(case), f"{case} torchtitan"),
                                      got, min_values(case) // 2, f"{case} torchtitan")
            # the plain --dp 4 layout is not torchtitan's (the check above can fail)
            run("convert", DATA / case / "ckpt", "-o", t / "p", "--dp", 4, "-q")
            assert nonempty_chunks(t / "p") != want, case
    with Tmp() as t:
        one_error_line(run("convert", DATA / "uneven_e3" / "ckpt", "-o", t / "o", "--dp", 4,
                           "--ep", 2, expect=2), "--ep 2", "3 experts")
        one_error_line(run("convert", DATA / "ep2_fsdp2" / "ckpt", "-o", t / "o", "--dp", 4,
                           "--ep", 3, expect=2), "--ep 3", "--dp 4")
        assert not (t / "o").exists()


def test_round_trip_is_the_identity():
    """DCP -> universal -> DCP (--dp 2, reshape) -> universal, and the streaming convert: the two
    universal files hold the same datasets bit for bit (h5py), and the key record."""
    for case in gen.CASES:
        with Tmp() as t:
            run("to-universal", DATA / case / "ckpt", "-o", t / "a.h5", "-q")
            run("reshape", t / "a.h5", "-o", t / "d", "--dp", 2, "-q")
            run("to-universal", t / "d", "-o", t / "b.h5", "-q")
            run("convert", DATA / case / "ckpt", "-o", t / "e", "--dp", 3, "-q")
            run("to-universal", t / "e", "-o", t / "c.h5", "-q")
            a = h5_atoms(t / "a.h5")
            want = {k: torch.from_numpy(np.array(v)) for k, v in a.items()}
            for other in ("b.h5", "c.h5"):
                oracle_checks.checked(lambda g: compare_atoms(want, g), h5_atoms(t / other),
                                      min_values(case), f"{case} round trip {other}")
            with h5py.File(t / "a.h5", "r") as f, h5py.File(t / "b.h5", "r") as g:
                ka = [(k["key"], k.get("experts")) for k in json.loads(f.attrs["dcp"])["keys"]]
                kb = [(k["key"], k.get("experts")) for k in json.loads(g.attrs["dcp"])["keys"]]
            assert sorted(ka) == sorted(kb) and any(e for _, e in ka), (ka[:5], kb[:5])


def test_per_expert_params_of_other_content_are_restacked():
    """A universal file whose content is not DCP's (its "dcp" record removed with h5py, as
    another format's reader leaves it) but holds per-expert params named as torchtitan's experts
    are held: the dcp target restacks them as <layer>.moe.experts.<w1|w2|w3> with their Adam
    state, which torch's dcp_to_torch_save gives equal to the save's stacked tensors; the param
    groups list the stacked params."""
    for case in gen.CASES:
        with Tmp() as t:
            run("to-universal", DATA / case / "ckpt", "-o", t / "u.h5", "-q")
            with h5py.File(t / "u.h5", "r+") as f:
                del f.attrs["dcp"]
            run("reshape", t / "u.h5", "-o", t / "o", "--format", "dcp", "--dp", 2, "-q")
            view = full_view(t / "o")
            want = {}
            for path, v in truth(case).items():
                if not isinstance(v, torch.Tensor):
                    continue
                if path[0] == "model":
                    s = stacked(path[1])
                    want[("model", f"{s[0]}{s[1][:2]}" if s else path[1])] = v
                elif path[:2] == ("optimizer", "state"):
                    s = stacked(path[2])
                    want[(*path[:2], f"{s[0]}{s[1][:2]}" if s else path[2], path[3])] = v
            got = {k: v for k, v in view.items() if k in want}
            oracle_checks.checked(lambda g: same_state(g, want, f"{case} restacked"), got,
                                  min_values(case) // 2, f"{case} restacked")
            params = view[("optimizer", "param_groups", 0, "params")]
            assert "layers.2.moe.experts.w2" in params and \
                not any(".experts.0." in p for p in params), params


def edit_metadata(ckpt, fn):
    m = dcp.FileSystemReader(str(ckpt)).read_metadata()
    fn(m)
    with open(ckpt / ".metadata", "wb") as f:
        pickle.dump(m, f)


def test_lost_doubled_or_cut_experts_are_one_clear_error():
    """An expert lost (layer 1's stacked tensors hold 3 of the router's 4: each rank's local
    experts under the global name, KempnerForge#202), an expert's chunk saved over another's (a
    duplicate), a chunk dropped (a gap), a stacked tensor's Adam moment lost: one error line
    naming the folder, the key and the global experts, from verify, to-universal and convert,
    nothing written; resume skips such a save."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    case = "ep2_fsdp2"
    with Tmp() as t:
        def fresh():
            c = t / "c"
            if c.exists():
                shutil.rmtree(c)
            shutil.copytree(DATA / case / "ckpt", c)
            return c

        def lose_last_expert(m):
            for k, v in m.state_dict_metadata.items():
                if k.startswith(("model.layers.1.moe.experts.",
                                 "optimizer.state.layers.1.moe.experts.")) and len(v.size) == 3:
                    n = v.size[0] - 1
                    v.size = torch.Size([n, *v.size[1:]])
                    v.chunks = [ch for ch in v.chunks if ch.offsets[0] < n]

        def doubled(m):
            ch = m.state_dict_metadata["model.layers.1.moe.experts.w2"].chunks
            i = next(i for i, x in enumerate(ch) if x.offsets[0] == 1)
            ch[i] = ChunkStorageMetadata(offsets=torch.Size([0, *ch[i].offsets[1:]]),
                                         sizes=ch[i].sizes)

        def overflowing(m):  # offset + size past int64: outside, not a wrapped bound
            ch = m.state_dict_metadata["model.layers.1.moe.experts.w2"].chunks
            i = next(i for i, x in enumerate(ch) if x.offsets[0] == 1)
            ch[i] = ChunkStorageMetadata(offsets=torch.Size([2**63 - 1, *ch[i].offsets[1:]]),
                                         sizes=ch[i].sizes)

        def gap(m):
            ch = m.state_dict_metadata["optimizer.state.layers.2.moe.experts.w3.exp_avg"].chunks
            i = next(i for i, x in enumerate(ch) if x.offsets[0] == 2)
            ch.pop(i)

        def lose_moments(m):
            key = "optimizer.state.layers.2.moe.experts.w1.exp_avg"
            del m.state_dict_metadata[key]
            m.storage_data = {k: v for k, v in m.storage_data.items() if k.fqn != key}

        cases = [(lose_moments, ("optimizer.state.layers.2.moe.experts.w1.exp_avg", "missing",
                                 "global experts 0-3")),
                 (lose_last_expert, ("model.layers.1.moe.experts.", "global experts 3 missing",
                                     "router")),
                 (doubled, ("model.layers.1.moe.experts.w2", "overlap",
                            "global experts 0 stored more than once")),
                 (overflowing, ("model.layers.1.moe.experts.w2", "lies outside")),
                 (gap, ("optimizer.state.layers.2.moe.experts.w3.exp_avg",
                        "global experts 2 missing or incomplete"))]
        for fn, needles in cases:
            c = fresh()
            edit_metadata(c, fn)
            for args in (("verify", c), ("to-universal", c, "-o", t / "u.h5"),
                         ("convert", c, "-o", t / "o", "--dp", 2)):
                one_error_line(run_both(*args, expect=3), str(c), *needles,
                               kind="format error")
                assert not (t / "u.h5").exists() and not (t / "o").exists()
        # resume: the newest save lost an expert: skipped with that reason, the older one taken.
        save = t / "save"
        save.mkdir()
        shutil.copytree(DATA / case / "ckpt", save / "step-10")
        shutil.copytree(DATA / case / "ckpt", save / "step-20")
        edit_metadata(save / "step-20", lose_last_expert)
        r = json.loads(run("resume", save, "--dp", 2, "--json").stdout)
        assert r["load"] == str(save / "step-10"), r
        skipped = {s["name"]: s for s in r["skipped"]}
        assert "global experts 3 missing" in json.dumps(skipped.get("step-20")), r


def megatron_of(get, experts):
    """{Megatron-core canonical name: tensor} of the test model (gen.Transformer) whose
    torchtitan-named tensors `get` gives (a param or one of its Adam moments; None when it has
    none), re-fused here by torch from torchtitan's / Megatron's definitions alone: one query
    group, so linear_qkv = [wq; wk; wv]; fc1 = [w1 (gate); w3 (up)] (silu(gate) * up in both);
    fc2 = w2; the stacked experts' row e as expert e."""
    out = {"embedding.word_embeddings.weight": get("tok_embeddings.weight"),
           "decoder.final_layernorm.weight": get("norm.weight"),
           "output_layer.weight": get("output.weight")}
    for layer in range(3):
        p, d = f"layers.{layer}.", f"decoder.layers.{layer}."
        out[d + "self_attention.linear_qkv.weight"] = torch.cat(
            [get(p + f"attention.{w}.weight") for w in ("wq", "wk", "wv")])
        out[d + "self_attention.linear_qkv.layer_norm_weight"] = get(p + "attention_norm.weight")
        out[d + "self_attention.linear_proj.weight"] = get(p + "attention.wo.weight")
        if layer == 0:
            f = p + "feed_forward."
            out[d + "mlp.linear_fc1.layer_norm_weight"] = get(p + "ffn_norm.weight")
            out[d + "mlp.linear_fc1.weight"] = torch.cat([get(f + "w1.weight"),
                                                          get(f + "w3.weight")])
            out[d + "mlp.linear_fc2.weight"] = get(f + "w2.weight")
            continue
        m = p + "moe."
        # pre_mlp_layernorm, which Megatron's local spec saves under this key too
        # (sharded_state_dict_keys_map)
        out[d + "mlp.linear_fc1.layer_norm_weight"] = get(p + "ffn_norm.weight")
        out[d + "mlp.router.weight"] = get(m + "router.gate.weight")
        out[d + "mlp.router.expert_bias"] = get(m + "expert_bias")
        s = m + "shared_experts."
        out[d + "mlp.shared_experts.linear_fc1.weight"] = torch.cat([get(s + "w1.weight"),
                                                                     get(s + "w3.weight")])
        out[d + "mlp.shared_experts.linear_fc2.weight"] = get(s + "w2.weight")
        w1, w2, w3 = (get(m + f"experts.{w}") for w in ("w1", "w2", "w3"))
        for e in range(experts):
            x = d + f"mlp.experts.{e}."
            out[x + "linear_fc1.weight"] = None if w1 is None else torch.cat([w1[e], w3[e]])
            out[x + "linear_fc2.weight"] = None if w2 is None else w2[e]
    return {k: v for k, v in out.items() if v is not None}


def megatron_view(iter_dir):
    """{(Megatron-core canonical name, kind): tensor} of a torch_dist save, read by torch's own
    dcp_to_torch_save: model keys (`decoder.layers.<g>.` per layer or `decoder.layers.` stacked
    [L, ...]; routed experts `mlp.experts.experts.linear_fc{1,2}.weight` [E, ...], split per
    global expert) and the optimizer's `optimizer.state.<kind>.<key>`; padded vocabulary rows
    are cut to the source's."""
    out = {}
    for path, v in full_view(iter_dir).items():
        key = path[0] if len(path) == 1 else ".".join(map(str, path))
        if not isinstance(v, torch.Tensor) or "_extra_state" in key:
            continue
        kind = "param"
        if key.startswith("optimizer.state."):
            kind, _, key = key[len("optimizer.state."):].partition(".")
            if kind in ("param", "fp32_param"):
                kind = "main"  # the optimizer's fp32 main param
        elif not (key.startswith("decoder.") or key.startswith("embedding.")
                  or key.startswith("output_layer.")):
            continue
        if key.startswith("decoder.layers.") and not key[len("decoder.layers."):][0].isdigit():
            # stacked over the layers
            rest = key[len("decoder.layers."):]
            items = [(f"decoder.layers.{i}.{rest}", v[i]) for i in range(v.shape[0])]
        else:
            items = [(key, v)]
        for k, t in items:
            if ".mlp.experts.experts." in k:
                head, _, tail = k.partition(".mlp.experts.experts.")
                for e in range(t.shape[0]):
                    out[(f"{head}.mlp.experts.{e}.{tail}", kind)] = t[e]
            else:
                if k in ("embedding.word_embeddings.weight", "output_layer.weight"):
                    t = t[:gen.VOCAB]
                out[(k, kind)] = t
    return out


def test_names_mcore_llama_to_torch_dist():
    """torchtitan's MoE save (E=4, EP 2 x FSDP 2, Adam) -> `convert --names mcore-llama --format
    megatron-torch-dist` at EP 1 and EP 2: read back by torch's dcp_to_torch_save, every model
    tensor and Adam moment is the source's re-fused by torch (megatron_of) bit for bit (a changed
    value fails: the negative control); the older [D, F] expert order and a missing query-group
    count are one error line, nothing written."""
    case = "ep2_fsdp2"
    experts = gen.SPEC[case][0]
    tr = truth(case)
    model = {p[1]: v for p, v in tr.items() if p[0] == "model"}
    state = {(p[2], p[3]): v for p, v in tr.items() if p[:2] == ("optimizer", "state")}
    want = {(k, "param"): v for k, v in megatron_of(model.get, experts).items()}
    # the fp32 main params of the distributed optimizer: the params (not the buffers)
    want.update({(k, "main"): v for k, v in megatron_of(
        lambda n: model[n] if (n, "exp_avg") in state else None, experts).items()})
    for kind in ("exp_avg", "exp_avg_sq"):
        want.update({(k, kind): v for k, v in
                     megatron_of(lambda n: state.get((n, kind)), experts).items()})
    # each MoE layer's experts' fc1 / fc2, as param, main param and two moments
    assert sum(".mlp.experts." in k for k, _ in want) == 2 * experts * 2 * 4, sorted(want)
    with Tmp() as t:
        for ep in (1, 2):
            out = t / f"ep{ep}"
            run("convert", DATA / case / "ckpt", "-o", out, "--names", "mcore-llama",
                "--format", "megatron-torch-dist", "--tp", 1, "--pp", 1, "--dp", 2, "--ep", ep,
                "--distributed-optimizer", "--model-var", "num_query_groups=1",
                "--model-var", "num_attention_heads=1", "-q")
            iters = sorted(out.glob("iter_*"))
            assert len(iters) == 1, list(out.iterdir())
            got = megatron_view(iters[0])
            # Adam's step, per optimizer (EP > 1: the chained optimizer's dense and expert
            # halves): the source's
            steps = {k: v for k, v in full_view(iters[0]).items()
                     if k[-1] == "step" and "param_groups" in k}
            src_step = {float(v) for p, v in tr.items() if p[-1] == "step"}
            assert len(src_step) == 1 and len(steps) >= ep, (src_step, steps)
            assert {float(v) for v in steps.values()} == src_step, (steps, src_step)

            def compare(g):
                assert set(g) == set(want), sorted(map(str, set(g) ^ set(want)))[:10]
                n = 0
                for k, v in want.items():
                    a = g[k]
                    assert a.shape == v.shape and a.dtype == v.dtype, (k, a.shape, v.shape)
                    assert as_bytes(a) == as_bytes(v), k
                    n += v.numel()
                return n
            oracle_checks.checked(compare, got, min_values(case), f"{case} -> torch_dist ep {ep}")
            # ucp reads its output back (the chained halves' plain torch groups, in Megatron's
            # group order): the experts' fp32 main params and moments are the source's.
            run("to-universal", out, "-o", t / f"u{ep}.h5", "-q")
            atoms = h5_atoms(t / f"u{ep}.h5")
            n = 0
            for (k, kind), v in want.items():
                if ".mlp.experts." in k and kind in ("main", "exp_avg", "exp_avg_sq"):
                    a = atoms[(k, "fp32" if kind == "main" else kind)]
                    assert a.tobytes() == as_bytes(v), (ep, k, kind)
                    n += 1
            assert n == 2 * experts * 2 * 3, n
        # the older [D, F] expert order: refused naming the param (a transpose)
        p = run_both("convert", DATA / "uneven_e3" / "ckpt", "-o", t / "old", "--names",
                     "mcore-llama", "--format", "megatron-torch-dist", "--tp", 1, "--pp", 1,
                     "--dp", 1, "--model-var", "num_query_groups=1", expect=2)
        one_error_line(p, "--names mcore-llama", "layers.1.moe.experts.0.w1", "[D, F]")
        p = run_both("convert", DATA / case / "ckpt", "-o", t / "nog", "--names", "mcore-llama",
                     "--format", "megatron-torch-dist", "--tp", 1, "--pp", 1, "--dp", 1,
                     expect=2)
        one_error_line(p, "--names mcore-llama", "num_query_groups")
        assert not (t / "old").exists() and not (t / "nog").exists()


def test_names_mcore_llama_then_export_hf():
    """torchtitan's MoE save -> torch_dist under Megatron-core's names -> `ucp export --hf`:
    transformers' Glm4MoeForCausalLM (a sigmoid router with an expert bias, shared experts, a
    dense first layer: what the model's names give) loads it with no key missing or left over,
    and every tensor is the source's, mapped here from torchtitan's names to transformers' by
    torch alone (q/k/v/o_proj = wq/wk/wv/wo, gate/up/down = w1/w3/w2, the experts' fused
    gate_up_proj = [w1; w3] per expert); a changed value fails (negative control)."""
    import transformers
    case = "ep2_fsdp2"
    experts = gen.SPEC[case][0]
    m = {p[1]: v for p, v in truth(case).items() if p[0] == "model"}
    want = {"model.embed_tokens.weight": m["tok_embeddings.weight"],
            "model.norm.weight": m["norm.weight"], "lm_head.weight": m["output.weight"]}
    for layer in range(3):
        p, h = f"layers.{layer}.", f"model.layers.{layer}."
        for w, proj in (("wq", "q"), ("wk", "k"), ("wv", "v"), ("wo", "o")):
            want[h + f"self_attn.{proj}_proj.weight"] = m[p + f"attention.{w}.weight"]
        want[h + "input_layernorm.weight"] = m[p + "attention_norm.weight"]
        want[h + "post_attention_layernorm.weight"] = m[p + "ffn_norm.weight"]
        mlp = [("gate", "w1"), ("up", "w3"), ("down", "w2")]
        if layer == 0:
            for proj, w in mlp:
                want[h + f"mlp.{proj}_proj.weight"] = m[p + f"feed_forward.{w}.weight"]
            continue
        for proj, w in mlp:
            want[h + f"mlp.shared_experts.{proj}_proj.weight"] = \
                m[p + f"moe.shared_experts.{w}.weight"]
        want[h + "mlp.gate.weight"] = m[p + "moe.router.gate.weight"]
        want[h + "mlp.gate.e_score_correction_bias"] = m[p + "moe.expert_bias"]
        want[h + "mlp.experts.gate_up_proj"] = torch.cat(
            [m[p + "moe.experts.w1"], m[p + "moe.experts.w3"]], dim=1)
        want[h + "mlp.experts.down_proj"] = m[p + "moe.experts.w2"]
        assert want[h + "mlp.experts.down_proj"].shape[0] == experts
    with Tmp() as t:
        run("convert", DATA / case / "ckpt", "-o", t / "td", "--names", "mcore-llama",
            "--format", "megatron-torch-dist", "--tp", 1, "--pp", 1, "--dp", 1,
            "--model-var", "num_query_groups=1", "--model-var", "num_attention_heads=1", "-q")
        run("export", t / "td", "-o", t / "hf", "--hf", "--model-var", "num_attention_heads=1",
            "--model-var", "num_query_groups=1", "--model-var", "moe_router_topk=2",
            "--vocab-size", gen.VOCAB, "-q")
        c = json.loads((t / "hf" / "config.json").read_text())
        assert c["architectures"] == ["Glm4MoeForCausalLM"] and c["n_routed_experts"] == experts, c
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            str(t / "hf"), dtype=torch.float32, output_loading_info=True)
        assert type(model).__name__ == "Glm4MoeForCausalLM", type(model)
        assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys",
                                             "mismatched_keys")), info
        got = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def compare(g):
            assert set(g) == set(want), sorted(set(g) ^ set(want))[:10]
            n = 0
            for k, v in want.items():
                assert g[k].shape == v.shape and as_bytes(g[k]) == as_bytes(v), k
                n += v.numel()
            return n
        oracle_checks.checked(compare, got, 2 * experts * 3 * gen.EXPERT_FFN * gen.DIM,
                              f"{case} -> torch_dist -> export --hf")


def test_names_round_trip_through_megatron():
    """torchtitan's MoE save -> torch_dist (--names mcore-llama, EP 1) -> DCP (--names
    torchtitan, --dp 4 --ep 2): Megatron's fused QKV split per query group back into wq / wk /
    wv, each expert's fc1 into w1 / w3 (restacked by the DCP writer), the padded vocabulary cut
    to --model-var vocab_size; torchtitan's EP x FSDP2 model and a fresh Adam (make_dcp_moe's
    torchtitan_load) load it with every tensor of the saved state (model, Adam moments, step)
    bit for bit; a changed value fails (negative control). A torchtitan source is refused by
    --names torchtitan (no map from it) in one line."""
    case = "ep2_fsdp2"
    want = {k: v for k, v in truth(case).items() if isinstance(v, torch.Tensor)}
    with Tmp() as t:
        heads = ("--model-var", "num_query_groups=1", "--model-var", "num_attention_heads=1")
        run("convert", DATA / case / "ckpt", "-o", t / "td", "--names", "mcore-llama",
            "--format", "megatron-torch-dist", "--tp", 1, "--pp", 1, "--dp", 1, *heads, "-q")
        run("convert", t / "td", "-o", t / "back", "--names", "torchtitan", "--format", "dcp",
            "--dp", 4, "--ep", 2, *heads, "--model-var", f"vocab_size={gen.VOCAB}", "-q")
        got = {k: v for k, v in gen.torchtitan_load(case, t / "back").items()
               if isinstance(v, torch.Tensor)}
        oracle_checks.checked(lambda g: same_state(g, want, f"{case} round trip"), got,
                              min_values(case), f"{case} -> torch_dist -> torchtitan")
        p = run("convert", DATA / case / "ckpt", "-o", t / "no", "--names", "torchtitan",
                "--format", "dcp", "--dp", 1, expect=2)
        one_error_line(p, "--names torchtitan", "is not a model it maps")
        assert not (t / "no").exists()


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
