"""`ucp export --hf` of mixture-of-experts models (issue 37), judged by the real frameworks of
the tests' PyPI environment: megatron-core 0.16 builds a MoE GPTModel on CPU and computes its
logits in float32 (tests/tools/moe_hf_oracle.py; its weights saved by torch's DCP under the
universal file's names: global layer and expert indices, each expert's fc1 [gate; up]);
transformers 5.24 loads ucp's export with from_pretrained (no key missing, unexpected or
mismatched) and its logits for the same tokens must equal megatron-core's to 1e-5 of their
range. Mixtral-like (every layer MoE) -> MixtralForCausalLM; with QK norms and a dense first
layer -> Qwen3MoeForCausalLM; a dense first layer and a shared expert with its gate ->
Qwen2MoeForCausalLM (the only transformers MoE with Megatron's GQA attention and a gated shared
expert); DeepSeek-V3's block (sigmoid router with an expert bias, ungated shared experts, dense
first layer) -> Glm4MoeForCausalLM (DeepseekV3's block without MLA attention); each with the
per-expert names and --hf-experts fused. Two experts swapped in the export are caught, q/k
norms swapped and a zeroed expert bias too; a missing expert or one past the count is one error
line. A gated shared expert with a sigmoid router (no transformers model computes it) is one
usage error. End to end: real megatron-core MoE torch_dist saves (EP 2 with ETP 2 / PP 2) read
by ucp and exported as MixtralForCausalLM give megatron-core's logits."""
import json
import os
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import moe_hf_oracle as oracle  # noqa: E402
from testmain import Tmp, run  # noqa: E402

HEADS = ["--model-var", "num_attention_heads=4", "--model-var", "num_query_groups=2",
         "--model-var", "moe_router_topk=2"]
E, F, H = 4, 8, 16  # make_moe_torch_dist.py's experts, expert ffn, hidden


def one_error_line(p, *needles):
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def export(src, out, *extra):
    run("export", src / "dcp", "-o", out, "--hf", *HEADS, *extra, "-q")
    return json.loads((out / "config.json").read_text())


def tensors(folder):
    from safetensors.torch import load_file
    return load_file(folder / "model.safetensors")


def swap(folder, a, b):
    """Exchanges tensors a and b (or, for a 3-D fused tensor name a, its experts 0 and 1)."""
    from safetensors.torch import save_file
    w = tensors(folder)
    if b is None:
        w[a] = w[a][[1, 0, *range(2, w[a].shape[0])]].contiguous()
    else:
        w[a], w[b] = w[b], w[a]
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})


def verdict_ok(src, hf, arch):
    v = oracle.check(src, hf)
    assert v["ok"] and v["architecture"] == arch and v["compared"] >= 2 * 16 * 128, v
    return v


def verdict_fails(src, hf):
    v = oracle.check(src, hf)
    assert not v["ok"] and any("logits differ" in p for p in v["problems"]), v


def test_mixtral():
    with Tmp("ucp-moehf-") as t:
        assert oracle.make(t / "src", "mixtral")
        c = export(t / "src", t / "hf")
        assert c["architectures"] == ["MixtralForCausalLM"] and c["num_local_experts"] == E \
            and c["num_experts_per_tok"] == 2 and c["intermediate_size"] == F, c
        w = tensors(t / "hf")
        assert w["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (F, H)
        assert w["model.layers.0.block_sparse_moe.gate.weight"].shape == (E, H)
        assert not any(".mlp." in k for k in w), sorted(w)
        verdict_ok(t / "src", t / "hf", "MixtralForCausalLM")
        # The fused form: the same numbers, transformers 5's names.
        c = export(t / "src", t / "fused", "--hf-experts", "fused")
        f = tensors(t / "fused")
        gu = f["model.layers.1.mlp.experts.gate_up_proj"]
        assert gu.shape == (E, 2 * F, H) and f["model.layers.1.mlp.experts.down_proj"].shape \
            == (E, H, F), sorted(f)
        for e in range(E):
            x = f"model.layers.1.block_sparse_moe.experts.{e}."
            assert torch.equal(gu[e], torch.cat([w[x + "w1.weight"], w[x + "w3.weight"]]))
        verdict_ok(t / "src", t / "fused", "MixtralForCausalLM")
        # Negative controls: two experts swapped (per-expert: w1 of experts 0 and 1; fused).
        swap(t / "hf", "model.layers.1.block_sparse_moe.experts.0.w1.weight",
             "model.layers.1.block_sparse_moe.experts.1.w1.weight")
        verdict_fails(t / "src", t / "hf")
        swap(t / "fused", "model.layers.0.mlp.experts.down_proj", None)
        verdict_fails(t / "src", t / "fused")
        p = run("export", t / "src" / "dcp", "-o", t / "bad", "--hf", *HEADS,
                "--hf-experts", "stacked", expect=2)
        one_error_line(p, "--hf-experts stacked")
        assert not (t / "bad").exists()
        p = run("export", t / "src" / "dcp", "-o", t / "bad", "--hf-experts", "fused", expect=2)
        one_error_line(p, "--hf-experts fused", "only with --hf")
        assert not (t / "bad").exists()
        # A missing expert, an expert past the count: one line naming it, nothing written.
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
        dcp_to_torch_save(str(t / "src" / "dcp"), str(t / "all.pt"))
        x = "decoder.layers.1.mlp.experts."
        for name, edit in (("missing", lambda sd: sd.pop(x + "2.linear_fc2.weight")),
                           ("extra", lambda sd: sd.update({
                               x + "4.linear_fc1.weight": sd[x + "3.linear_fc1.weight"],
                               x + "4.linear_fc2.weight": sd[x + "3.linear_fc2.weight"]}))):
            sd = torch.load(t / "all.pt")
            edit(sd)
            dcp.save(sd, checkpoint_id=str(t / name / "dcp"), no_dist=True)
            p = run("export", t / name / "dcp", "-o", t / "bad", "--hf", *HEADS, expect=2)
            one_error_line(p, x + ("2.linear_fc2" if name == "missing" else "4.linear_fc1"),
                           "MixtralForCausalLM")
            assert not (t / "bad").exists()


def test_megatron_torch_dist_saves_export_as_mixtral():
    """From a real megatron-core MoE torch_dist save (make_moe_torch_dist.py: Mixtral-like at
    TP 2, ETP 2, EP 2, DP 2; and at PP 2, EP 2, DP 2), read by ucp's torch_dist reader, to
    transformers: with --dtype bf16 the export holds the model's own bf16 weights (by default
    the fp32 master weights, which differ after the Adam step), and MixtralForCausalLM's logits
    equal megatron-core's forward of the save's truth.pt weights; two experts swapped fail."""
    data = pathlib.Path(os.environ["UCP_TESTDATA"]) / "moe_torch_dist"
    for save in ("mixtral_tp2_etp2_ep2_dp2", "mixtral_tp1_pp2_dp2_ep2"):
        with Tmp("ucp-moehf-") as t:
            assert oracle.make(t / "src", "mixtral", truth=data / save / "truth.pt")
            run("export", data / save, "-o", t / "hf", "--hf", "--dtype", "bf16", "-q")
            c = json.loads((t / "hf" / "config.json").read_text())
            assert c["architectures"] == ["MixtralForCausalLM"] and c["num_local_experts"] == E
            verdict_ok(t / "src", t / "hf", "MixtralForCausalLM")
            swap(t / "hf", "model.layers.1.block_sparse_moe.experts.2.w2.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w2.weight")
            verdict_fails(t / "src", t / "hf")


def test_qwen3_moe_qk_norms_dense_first_layer():
    with Tmp("ucp-moehf-") as t:
        assert oracle.make(t / "src", "qwen3")
        c = export(t / "src", t / "hf")
        assert c["architectures"] == ["Qwen3MoeForCausalLM"] and c["num_experts"] == E \
            and c["mlp_only_layers"] == [0] and c["moe_intermediate_size"] == F \
            and c["intermediate_size"] == 24 and c["norm_topk_prob"] is True, c
        w = tensors(t / "hf")
        assert w["model.layers.1.self_attn.q_norm.weight"].shape == (H // 4,)
        assert w["model.layers.1.mlp.experts.0.gate_proj.weight"].shape == (F, H)
        verdict_ok(t / "src", t / "hf", "Qwen3MoeForCausalLM")
        export(t / "src", t / "fused", "--hf-experts", "fused")
        verdict_ok(t / "src", t / "fused", "Qwen3MoeForCausalLM")
        swap(t / "hf", "model.layers.0.self_attn.q_norm.weight",
             "model.layers.0.self_attn.k_norm.weight")
        verdict_fails(t / "src", t / "hf")
        swap(t / "fused", "model.layers.1.mlp.experts.down_proj", None)
        verdict_fails(t / "src", t / "fused")


def test_qwen2_moe_dense_first_layer_shared_expert():
    with Tmp("ucp-moehf-") as t:
        assert oracle.make(t / "src", "qwen2")
        c = export(t / "src", t / "hf")
        assert c["architectures"] == ["Qwen2MoeForCausalLM"] and c["num_experts"] == E \
            and c["mlp_only_layers"] == [0] and c["moe_intermediate_size"] == F \
            and c["shared_expert_intermediate_size"] == 16 and c["intermediate_size"] == 24 \
            and c["norm_topk_prob"] is True, c
        w = tensors(t / "hf")
        assert w["model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, H)
        assert w["model.layers.0.mlp.gate_proj.weight"].shape == (24, H)
        verdict_ok(t / "src", t / "hf", "Qwen2MoeForCausalLM")
        export(t / "src", t / "fused", "--hf-experts", "fused")
        verdict_ok(t / "src", t / "fused", "Qwen2MoeForCausalLM")
        swap(t / "hf", "model.layers.1.mlp.experts.2.down_proj.weight",
             "model.layers.1.mlp.experts.3.down_proj.weight")
        verdict_fails(t / "src", t / "hf")
        swap(t / "fused", "model.layers.1.mlp.experts.gate_up_proj", None)
        verdict_fails(t / "src", t / "fused")


def test_deepseek_router_as_glm4_moe():
    """DeepSeek-V3's MoE block (sigmoid router with an expert bias, ungated shared experts,
    dense first layer) with Megatron's GQA attention is transformers' Glm4MoeForCausalLM
    (DeepseekV3ForCausalLM computes the same block but has MLA attention)."""
    from safetensors.torch import save_file
    with Tmp("ucp-moehf-") as t:
        assert oracle.make(t / "src", "glm")
        c = export(t / "src", t / "hf")
        assert c["architectures"] == ["Glm4MoeForCausalLM"] and c["n_routed_experts"] == E \
            and c["first_k_dense_replace"] == 1 and c["n_shared_experts"] == 2 \
            and c["moe_intermediate_size"] == F and c["partial_rotary_factor"] == 1.0, c
        w = tensors(t / "hf")
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert w[bias].shape == (E,) and w[bias].dtype == torch.float32
        verdict_ok(t / "src", t / "hf", "Glm4MoeForCausalLM")
        export(t / "src", t / "fused", "--hf-experts", "fused")
        verdict_ok(t / "src", t / "fused", "Glm4MoeForCausalLM")
        # bf16: the expert bias stays float32 (a rounded bias would route otherwise).
        export(t / "src", t / "bf16", "--dtype", "bf16")
        b = tensors(t / "bf16")
        assert b[bias].dtype == torch.float32 and torch.equal(b[bias], w[bias]), b[bias]
        assert b["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
        # The expert bias steers the choice: without it the logits differ.
        w[bias] = torch.zeros_like(w[bias])
        save_file(w, t / "hf" / "model.safetensors", metadata={"format": "pt"})
        verdict_fails(t / "src", t / "hf")
        swap(t / "fused", "model.layers.1.mlp.experts.gate_up_proj", None)
        verdict_fails(t / "src", t / "fused")


def test_gated_shared_expert_with_sigmoid_router_is_refused():
    with Tmp("ucp-moehf-") as t:
        assert oracle.make(t / "src", "deepseek")
        p = run("export", t / "src" / "dcp", "-o", t / "hf", "--hf", *HEADS, expect=2)
        one_error_line(p, "moe_shared_expert_gate", "sigmoid router", "Glm4MoeForCausalLM")
        assert not (t / "hf").exists()
        p = run("export", t / "src" / "dcp", "-o", t / "hf", "--hf", *HEADS[:4], expect=2)
        one_error_line(p, "--model-var moe_router_topk=K")
        assert not (t / "hf").exists()


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
