"""`--names`: a model written under another framework's param names, with every optimizer
state, against the real frameworks (the tests' PyPI environment).

The source is a LLaMA-style GPTModel saved by the real megatron-core under torch_dist with its
distributed-optimizer state (tests/tools/megatron_torch_dist.py: GQA 4 heads / 2 groups, SwiGLU,
RMSNorm, untied, true vocabulary 100). ucp writes it for MindSpore as MindFormers' LLaMA
(`--names mindformers-llama`); MindSpore's own transform_checkpoints merges ucp's rank files, and
every record must equal the reference this test computes from the source's tensors (read by
torch's dcp_to_torch_save), mapped as written below from the two frameworks' sources:
- Megatron's fused QKV rows are grouped per query group, [groups, heads/groups + 2, head dim,
  hidden]: a group's query heads, then its key head, then its value head
  (megatron/core/transformer/attention.py, get_query_key_value_tensors); SwiGLU's linear_fc1 is
  [gate; up] (megatron/core/fused_kernels / mlp.py: glu chunks the output in two);
- MindFormers' names are transformers' LLaMA names renamed by MindFormers' own table
  (mindformers/models/llama/convert_weight.py, name_replace, copied in MF_RENAMES), weights not
  permuted; AdamW's moments are adam_m. / adam_v. (mindformers/core/optim/adamw.py).
The weights also equal `ucp export --hf` (whose split transformers' logits check against
megatron-core's forward in test_torch_dist_cli), renamed by that table. Back the other way,
`--names hf-llama` writes MindFormers' names as transformers' into a DCP checkpoint.
"""
import json
import os
import pathlib
import sys
import tempfile

os.environ.setdefault("GLOG_v", "3")
import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import megatron_torch_dist as mtd  # noqa: E402
import oracle_checks  # noqa: E402

from testmain import UCP, run  # noqa: E402
import testmain  # noqa: E402
DATA = pathlib.Path(os.environ["UCP_TESTDATA"]) / "megatron_torch_dist"
SAVE = DATA / "tp2_pp2_dp1"  # fully_reshardable distributed-optimizer state
ITER = "iter_0000010"
# transformers' name part -> MindFormers' (convert_weight.py name_replace, in its order).
MF_RENAMES = [("embed_tokens.weight", "tok_embeddings.embedding_weight"),
              (".self_attn.q_proj.", ".attention.wq."), (".self_attn.k_proj.", ".attention.wk."),
              (".self_attn.v_proj.", ".attention.wv."), (".self_attn.o_proj.", ".attention.wo."),
              (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.down_proj.", ".feed_forward.w2."),
              (".mlp.up_proj.", ".feed_forward.w3."), (".input_layernorm.", ".attention_norm."),
              (".post_attention_layernorm.", ".ffn_norm."), (".norm.", ".norm_out.")]


def one_error_line(p, *needles):
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def mf_name(hf):
    for a, b in MF_RENAMES:
        hf = hf.replace(a, b)
    return hf


def source_tensors(t):
    """The source checkpoint's tensors as torch's dcp_to_torch_save reads them."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(SAVE / ITER), str(t / "src.pt"))
    return torch.load(t / "src.pt", weights_only=False)


def mindformers_reference(src):
    """{MindFormers record name: numpy} of the source's fp32 masters and Adam moments."""
    size = mtd.SIZE
    heads, groups, hidden = size["heads"], size["groups"], size["hidden"]
    d = hidden // heads
    r = heads // groups
    out = {}
    for state, prefix in (("param", ""), ("exp_avg", "adam_m."), ("exp_avg_sq", "adam_v.")):
        def g(key):
            return src[f"optimizer.state.{state}.{key}"].numpy()

        def put(hf, a):
            out[prefix + mf_name(hf)] = np.ascontiguousarray(a)

        put("model.embed_tokens.weight", g("embedding.word_embeddings.weight")[:mtd.TRUE_VOCAB])
        for i in range(size["layers"]):
            def layer(rest):
                return g("decoder.layers." + rest)[i]
            h = f"model.layers.{i}."
            put(h + "input_layernorm.weight", layer("self_attention.linear_qkv.layer_norm_weight"))
            qkv = layer("self_attention.linear_qkv.weight").reshape(groups, r + 2, d, hidden)
            put(h + "self_attn.q_proj.weight", qkv[:, :r].reshape(heads * d, hidden))
            put(h + "self_attn.k_proj.weight", qkv[:, r].reshape(groups * d, hidden))
            put(h + "self_attn.v_proj.weight", qkv[:, r + 1].reshape(groups * d, hidden))
            put(h + "self_attn.o_proj.weight", layer("self_attention.linear_proj.weight"))
            put(h + "post_attention_layernorm.weight",
                layer("mlp.linear_fc1.layer_norm_weight"))
            gate, up = np.split(layer("mlp.linear_fc1.weight"), 2)
            put(h + "mlp.gate_proj.weight", gate)
            put(h + "mlp.up_proj.weight", up)
            put(h + "mlp.down_proj.weight", layer("mlp.linear_fc2.weight"))
        put("model.norm.weight", g("decoder.final_layernorm.weight"))
        put("lm_head.weight", g("output_layer.weight")[:mtd.TRUE_VOCAB])
    return out


def ms():
    import mindspore
    mindspore.set_context(mode=mindspore.PYNATIVE_MODE)
    return mindspore


def load(path):
    return {k: v.asnumpy() for k, v in ms().load_checkpoint(str(path)).items()}


def merged_by_mindspore(out, t, tp, pp):
    """ucp's rank files merged into one unsharded checkpoint by MindSpore."""
    from mindspore.parallel import merge_pipeline_strategys, transform_checkpoints
    strategy = out / "strategy.ckpt"
    if pp > 1:
        strategy = t / f"merged_strategy_{tp}{pp}.ckpt"
        merge_pipeline_strategys(str(out / "strategy"), str(strategy))
    transform_checkpoints(str(out), str(t / f"merged{tp}{pp}"), "m", str(strategy), None)
    return load(t / f"merged{tp}{pp}" / "rank_0" / "m0.ckpt")


def same_arrays(got, want, what):
    """Same keys, dtypes, shapes and bytes; returns the number of elements compared."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k, a in want.items():
        assert got[k].dtype == a.dtype and got[k].shape == a.shape, (what, k)
        assert np.array_equal(got[k].reshape(-1).view(np.uint8), a.reshape(-1).view(np.uint8)), \
            (what, k)
    return sum(int(a.size) for a in want.values())


def equal_values(got, want, what):
    """Same keys and equal values (np.array_equal: across dtypes); returns the number of
    elements compared."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k, v in want.items():
        assert np.array_equal(np.asarray(got[k]), np.asarray(v)), (what, k)
    return sum(int(np.asarray(v).size) for v in want.values())


def torch_equal(got, want, what):
    """Same keys and torch.equal values; returns the number of elements compared."""
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want)))
    for k, v in want.items():
        assert torch.equal(got[k], v), (what, k)
    return sum(v.numel() for v in want.values())


# Fewest values one comparison must reach (the smallest is one rank's share of the small
# LLaMA's weights and moments, thousands of values).
MIN_VALUES = 500


def assert_same(got, want, what):
    """same_arrays with the count rule and a negative control (oracle_checks.checked)."""
    oracle_checks.checked(lambda g: same_arrays(g, want, what), got, MIN_VALUES, str(what))


def assert_equal_values(got, want, what):
    oracle_checks.checked(lambda g: equal_values(g, want, what), got, MIN_VALUES, str(what))


def test_megatron_llama_to_mindformers_llama_and_on_to_dcp():
    """(One process for both: each imports torch and MindSpore.)"""
    megatron_llama_as_mindformers_llama()
    mindformers_llama_as_hf_llama_in_dcp()


def test_mindformers_llama_back_to_megatron_and_to_transformers():
    """(One process for both.)"""
    mindformers_llama_back_to_megatron()
    mindformers_llama_exported_for_transformers()


def megatron_llama_as_mindformers_llama():
    """torch_dist (Megatron-core, TP 2 x PP 2) -> MindSpore rank files at TP 2 x DP 2 and at
    TP 2 x PP 2 under MindFormers' LLaMA names: every weight and both Adam moments equal the
    reference, merged by transform_checkpoints; the step is the iteration; the weights equal the
    transformers export renamed; `ucp resume --names` writes the same rank files."""
    with tempfile.TemporaryDirectory(prefix="ucp-names-") as t:
        t = pathlib.Path(t)
        want = mindformers_reference(source_tensors(t))
        for tp, pp, dp in ((2, 1, 2), (2, 2, 1)):
            out = t / f"t{tp}p{pp}d{dp}"
            p = run("convert", SAVE, "-o", out, "--format", "mindspore", "--tp", tp, "--pp", pp,
                    "--dp", dp, "--names", "mindformers-llama", "--json")
            assert json.loads(p.stdout)["names"] == "mindformers-llama", p.stdout
            got = merged_by_mindspore(out, t, tp, pp)
            assert got.pop("global_step").tolist() == [10], (tp, pp)
            for scalar in ("learning_rate", "beta1_power", "beta2_power"):
                got.pop(scalar)
            assert_same(got, want, (tp, pp, dp))
        # The weights are transformers' LLaMA (checked by logits elsewhere), renamed.
        run("export", SAVE, "-o", t / "hf", "--hf", "-q")
        from safetensors.numpy import load_file
        hf = load_file(str(t / "hf" / "model.safetensors"))
        assert sorted(mf_name(k) for k in hf) == \
            sorted(k for k in want if not k.startswith("adam_")), sorted(hf)
        assert_equal_values({mf_name(k): v for k, v in hf.items()},
                            {k: v for k, v in want.items() if not k.startswith("adam_")},
                            "export --hf renamed")
        # From the universal file, reshape writes the same rank files.
        run("to-universal", SAVE, "-o", t / "u.h5", "-q")
        run("reshape", t / "u.h5", "-o", t / "reshaped", "--format", "mindspore", "--tp", 2,
            "--dp", 2, "--names", "mindformers-llama", "-q")
        for rank in range(4):
            mine = next((t / "reshaped" / f"rank_{rank}").glob("*.ckpt"))
            conv = next((t / "t2p1d2" / f"rank_{rank}").glob("*.ckpt"))
            assert_same(load(mine), load(conv), ("reshape", rank))
        # ucp resume on a new layout under the same names: the same rank files.
        p = run("resume", SAVE, "-o", t / "resumed", "--format", "mindspore", "--tp", 2,
                "--dp", 2, "--names", "mindformers-llama", "--json")
        r = json.loads(p.stdout)
        assert r["reshaped"] and r["names"] == "mindformers-llama", r
        for rank in range(4):
            mine = next((t / "resumed" / f"rank_{rank}").glob("*.ckpt"))
            conv = next((t / "t2p1d2" / f"rank_{rank}").glob("*.ckpt"))
            assert_same(load(mine), load(conv), ("resume", rank))


def mindformers_llama_as_hf_llama_in_dcp():
    """MindFormers' LLaMA names (a MindSpore save, TP 2) -> a PyTorch DCP checkpoint under
    transformers' names (`--names hf-llama`): torch's dcp_to_torch_save reads the model tensors
    equal to the transformers export of the same source, and the Adam moments to the source's."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory(prefix="ucp-names-") as t:
        t = pathlib.Path(t)
        want = mindformers_reference(source_tensors(t))
        run("convert", SAVE, "-o", t / "ms", "--format", "mindspore", "--tp", 2, "--dp", 1,
            "--names", "mindformers-llama", "-q")
        run("convert", t / "ms", "-o", t / "dcp", "--format", "dcp", "--dp", 1,
            "--names", "hf-llama", "-q")
        dcp_to_torch_save(str(t / "dcp"), str(t / "all.pt"))
        sd = torch.load(t / "all.pt", weights_only=False)
        model = sd["model"]
        run("export", SAVE, "-o", t / "hf", "--hf", "-q")
        from safetensors.torch import load_file
        hf = load_file(str(t / "hf" / "model.safetensors"))
        assert sorted(model) == sorted(hf), sorted(set(model) ^ set(hf))
        oracle_checks.checked(lambda g: torch_equal(g, hf, "dcp model"), model, MIN_VALUES,
                              "dcp model")
        state = sd["optimizer"]["state"]
        assert sorted(state) == sorted(hf), sorted(state)
        for k in hf:
            assert state[k]["step"].item() == 10, (k, state[k]["step"])
        assert_equal_values({(k, kind): state[k][kind].numpy() for k in hf
                             for kind in ("exp_avg", "exp_avg_sq")},
                            {(k, kind): want[prefix + mf_name(k)] for k in hf
                             for kind, prefix in (("exp_avg", "adam_m."), ("exp_avg_sq", "adam_v."))},
                            "dcp Adam moments")


def mindformers_llama_back_to_megatron():
    """The way back: MindSpore rank files under MindFormers' names (written from the
    Megatron-core source above) -> torch_dist under Megatron's (`--names mcore-llama`: wq/wk/wv
    joined per query group into linear_qkv, w1/w3 into linear_fc1, the layout from the names,
    the query groups from --model-var). megatron-core loads it at TP 1 x PP 2 with every
    optimizer shard equal to the source's and every model weight its fp32 master in bf16 (what
    MindSpore keeps is the masters)."""
    with tempfile.TemporaryDirectory(prefix="ucp-names-") as t:
        t = pathlib.Path(t)
        run("convert", SAVE, "-o", t / "ms", "--format", "mindspore", "--tp", 2, "--dp", 1,
            "--names", "mindformers-llama", "-q")
        p = run("convert", t / "ms", "-o", t / "td", "--format", "megatron-torch-dist",
                "--tp", 1, "--pp", 2, "--dp", 1, "--distributed-optimizer",
                "--names", "mcore-llama", "--model-var", "num_attention_heads=4",
                "--model-var", "num_query_groups=2")
        assert "under the names of mcore-llama" in p.stdout, p.stdout
        # (MindSpore keeps the true vocabulary's 100 rows: the padding rows zeros)
        ok, ranks = mtd.run_load(t / "td", SAVE / ITER, 1, 2, 1, log_all=True, masters=True,
                                 kept_rows=100)
        assert ok and len(ranks) == 2 and all(r["ok"] and r["checked"] > 0 for r in ranks), \
            ranks
        # Without the query groups: one line saying what to give.
        p = run("convert", t / "ms", "-o", t / "bad", "--format", "megatron-torch-dist",
                "--tp", 1, "--pp", 2, "--dp", 2, "--names", "mcore-llama", expect=2)
        one_error_line(p, "--names mcore-llama", "--model-var num_query_groups")
        assert not (t / "bad").exists()
        # Megatron's legacy format carries Megatron's args, which MindSpore has not.
        p = run("convert", t / "ms", "-o", t / "legacy", "--format", "megatron", "--tp", 1,
                "--pp", 2, "--dp", 2, "--names", "mcore-llama", "--model-var",
                "num_query_groups=2", expect=2)
        one_error_line(p, "no Megatron args", "megatron-torch-dist")
        assert not (t / "legacy").exists()


def mindformers_llama_exported_for_transformers():
    """`ucp export --hf` of MindSpore rank files under MindFormers' names (given the heads it
    does not record): its tensors are, name for name and bit for bit, those of the Megatron-core
    source's own --hf export (which transformers loads and whose logits equal megatron-core's
    forward: test_torch_dist_cli), and the model's sizes in config.json are the source's."""
    from safetensors.numpy import load_file
    with tempfile.TemporaryDirectory(prefix="ucp-names-") as t:
        t = pathlib.Path(t)
        run("convert", SAVE, "-o", t / "ms", "--format", "mindspore", "--tp", 2, "--dp", 1,
            "--names", "mindformers-llama", "-q")
        p = run("export", t / "ms", "-o", t / "bad", "--hf", expect=2)
        one_error_line(p, "--model-var num_query_groups")
        assert not (t / "bad").exists()
        run("export", t / "ms", "-o", t / "hf", "--hf", "--model-var", "num_attention_heads=4",
            "--model-var", "num_query_groups=2", "-q")
        run("export", SAVE, "-o", t / "hf_src", "--hf", "-q")
        got = load_file(str(t / "hf" / "model.safetensors"))
        want = load_file(str(t / "hf_src" / "model.safetensors"))
        assert_same(got, want, "export --hf of the MindSpore files")
        c = json.loads((t / "hf" / "config.json").read_text())
        c_src = json.loads((t / "hf_src" / "config.json").read_text())
        for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                  "tie_word_embeddings"):
            assert c[k] == c_src[k], (k, c[k], c_src[k])


def test_names_refusals():
    """An unknown map, or a model a map does not know, is one clear error line and nothing is
    written; Megatron's fused weights laid out for MindSpore without --names point to it."""
    listed = run("formats").stdout
    for name in ("hf-llama", "mcore-llama", "mindformers-llama"):
        assert f"\n{name} " in listed, listed  # `ucp formats` lists the maps
    with tempfile.TemporaryDirectory(prefix="ucp-names-") as t:
        t = pathlib.Path(t)
        p = run("convert", SAVE, "-o", t / "o1", "--format", "mindspore", "--names", "nope",
                expect=2)
        one_error_line(p, "--names nope", "mindformers-llama", "hf-llama")
        assert not (t / "o1").exists()
        # Megatron's names at --tp 2 without --names: the error says what to do.
        p = run("convert", SAVE, "-o", t / "o0", "--format", "mindspore", "--tp", 2, "--dp", 1,
                expect=2)
        one_error_line(p, "linear_fc1.weight", "--names mindformers-llama")
        assert not (t / "o0").exists()
        fixture = pathlib.Path(os.environ["UCP_FIXTURES"]) / "dcp-torch-2.6" / "dtensor_shard0_w2"
        p = run("convert", fixture, "-o", t / "o2", "--format", "mindspore",
                "--names", "mindformers-llama", expect=2)
        one_error_line(p, "--names mindformers-llama", "is not a model it maps")
        assert not (t / "o2").exists()
        # hf-llama knows Megatron's and MindFormers' names, not transformers' own.
        run("convert", SAVE, "-o", t / "hfdcp", "--format", "dcp", "--dp", 1,
            "--names", "hf-llama", "-q")
        p = run("convert", t / "hfdcp", "-o", t / "o3", "--format", "dcp", "--dp", 1,
                "--names", "hf-llama", expect=2)
        one_error_line(p, "--names hf-llama", "is not a model it maps")
        assert not (t / "o3").exists()


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
