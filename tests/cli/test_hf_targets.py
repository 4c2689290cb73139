"""Hugging Face folders imported into DeepSpeed and MindSpore, judged by those frameworks (the
tests' PyPI environment).

transformers' own save_pretrained writes a small random LlamaForCausalLM (GQA, untied, sharded
with an index); the oracle of its tensors is the safetensors package reading the folder's shards
(checked equal to transformers' state dict).
- DeepSpeed (`--format deepspeed --dp 2 --zero-stage S`, ZeRO 0, 1, 3 fp32 and 2 bf16, with and
  without `--init-optimizer`): two ranks forked from this process (tests/tools/deepspeed_real.py's
  launcher) build transformers' LlamaForCausalLM itself from the folder's config.json under the
  newest DeepSpeed (CPU, gloo, torch's Adam), `engine.load_checkpoint` ucp's folder, and on every
  rank the module's state_dict (ZeRO 3: gathered) equals the folder's tensors bit for bit, the
  fp32 masters DeepSpeed holds too (safe_get_full_fp32_param), and the Adam moments are zeros
  (ZeRO 0: zeros or none, as a fresh torch Adam holds) with the optimizer's step 0 and the
  engine's global_steps 0; then one training step equals, bit for bit, that of DeepSpeed's own
  fresh start (an engine over the same model with the folder's tensors loaded, Adam with torch's
  defaults, which ucp writes). Negative control: one byte of one tensor of the folder changed,
  the load of ucp's conversion of that folder is found to differ (in that tensor only: module
  and master).
- MindSpore (`--format mindspore`): mindspore.load_checkpoint of the one .ckpt ucp writes gives
  every tensor under transformers' names bit for bit; with `--names mindformers-llama` under
  MindFormers' names (its convert_weight.py table, copied here as in test_names.py). Negative
  control: the changed folder's conversion differs in that tensor.
"""
import argparse
import json
import os
import pathlib
import shutil
import sys

os.environ.setdefault("GLOG_v", "3")
import torch  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tools"))
import deepspeed_real  # noqa: E402 (imports DeepSpeed only when a command runs)

from testmain import Tmp, run  # noqa: E402

MIN_VALUES = 10000  # values each comparison covers at least (the model holds 14,528)
LLAMA = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=48, vocab_size=100, tie_word_embeddings=False, rms_norm_eps=1e-5,
             max_position_embeddings=64)
CHANGED = "model.layers.1.mlp.down_proj.weight"  # the negative controls' tensor
# transformers' name part -> MindFormers' (mindformers/models/llama/convert_weight.py
# name_replace, in its order; as tests/cli/test_names.py).
MF_RENAMES = [("embed_tokens.weight", "tok_embeddings.embedding_weight"),
              (".self_attn.q_proj.", ".attention.wq."), (".self_attn.k_proj.", ".attention.wk."),
              (".self_attn.v_proj.", ".attention.wv."), (".self_attn.o_proj.", ".attention.wo."),
              (".mlp.gate_proj.", ".feed_forward.w1."), (".mlp.down_proj.", ".feed_forward.w2."),
              (".mlp.up_proj.", ".feed_forward.w3."), (".input_layernorm.", ".attention_norm."),
              (".post_attention_layernorm.", ".ffn_norm."), (".norm.", ".norm_out.")]


def make_hf(out, dtype=torch.float32):
    """transformers' save_pretrained of a random LLaMA (every weight random, norms too), sharded."""
    import transformers
    cfg = transformers.LlamaConfig(**LLAMA)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + 0.01)
    model.save_pretrained(out, max_shard_size="20KB")
    assert (pathlib.Path(out) / "model.safetensors.index.json").exists()
    want = folder_tensors(out)
    sd = model.state_dict()
    assert sorted(want) == sorted(sd), (sorted(want), sorted(sd))
    for k, v in sd.items():
        assert bits_equal(want[k], v), k
    return want


def folder_tensors(folder):
    """The folder's tensors as the safetensors package reads them."""
    from safetensors.torch import load_file
    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def bits_equal(a, b):
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                            b.contiguous().reshape(-1).view(torch.uint8)))


def change_one_byte(folder, name):
    """One byte of tensor `name` in the folder's shard changed (read back by safetensors)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][name]
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        meta = f.metadata()
    tensors[name].reshape(-1).view(torch.uint8)[5] ^= 0x10
    save_file(tensors, str(shard), metadata=meta)


# --- DeepSpeed ---------------------------------------------------------------------------------

def ds_engine(a, model):
    import deepspeed
    ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              # torch.optim.Adam's hyper-parameters, which ucp writes (DeepSpeed's Adam
              # decays weights by 0.01 by default; a loaded checkpoint's groups replace it)
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True,
                                                       "weight_decay": 0.0}},
              "zero_optimization": {"stage": a.stage}, "steps_per_print": 1000}
    if a.dtype == "bf16":
        ds_cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_cfg)
    return engine


def module_state(engine, stage):
    """The module's tensors, whole (ZeRO 3: gathered), in their own dtype."""
    import deepspeed
    if stage != 3:
        return engine.module.state_dict()
    named = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in named], modifier_rank=None):
        return {n: p.detach().clone() for n, p in named}


def train_step(engine):
    """One step on this rank's batch (the same for both engines of a rank)."""
    g = torch.Generator().manual_seed(7 + torch.distributed.get_rank())
    ids = torch.randint(0, LLAMA["vocab_size"], (1, 6), generator=g)
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()


def ds_rank(a):
    """A forked rank: transformers' LlamaForCausalLM from the folder's config.json in a DeepSpeed
    engine at ZeRO a.stage, engine.load_checkpoint(a.dir), compared with the folder's tensors;
    then one training step, whose result must equal that of DeepSpeed's own fresh start (an
    engine over the same model with the folder's tensors loaded: no optimizer state)."""
    import deepspeed
    import transformers
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(1234 + int(os.environ["RANK"]))  # the engine's own random start
    cfg = transformers.AutoConfig.from_pretrained(a.hf)
    engine = ds_engine(a, transformers.LlamaForCausalLM(cfg).to(dtype))
    path, _ = engine.load_checkpoint(a.dir)
    failures, checked = [], 0
    if path is None:
        failures.append(f"load_checkpoint({a.dir}) found nothing")
    want = folder_tensors(a.hf)
    got = module_state(engine, a.stage)
    if sorted(got) != sorted(want):
        failures.append(f"module keys {sorted(set(got) ^ set(want))} differ")
    _, master, optim = deepspeed_real.in_memory(engine, a.stage)
    for k, w in want.items():
        if k not in got:
            continue
        checked += w.numel()
        if not bits_equal(got[k], w):
            failures.append(f"module {k}: values differ")
        m = master.get(k)
        if m is None:
            if a.stage != 0 or a.dtype != "fp32":  # ZeRO 0 fp32: the module is the master
                failures.append(f"fp32 master {k}: the engine reports none")
        elif not bits_equal(m, w.float()):
            failures.append(f"fp32 master {k}: values differ")
        for kind in ("exp_avg", "exp_avg_sq"):
            t = optim.get(f"{k}::{kind}")
            if t is None:
                if a.stage != 0:  # ZeRO 0: torch's Adam holds no state before its first step
                    failures.append(f"{kind} {k}: the engine reports none")
            elif t.dtype != torch.float32 or t.shape != w.shape or bool(t.abs().sum() != 0):
                failures.append(f"{kind} {k}: not float32 zeros of {tuple(w.shape)}")
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    if steps - {0.0}:
        failures.append(f"optimizer steps {sorted(steps)}, expected 0")
    if engine.global_steps != 0:
        failures.append(f"global_steps {engine.global_steps}, expected 0")
    if a.step:
        try:
            train_step(engine)
        except Exception as e:  # noqa: BLE001: reported
            failures.append(f"a training step after the load failed: {e!r}"[:300])
        else:
            torch.manual_seed(99)
            model = transformers.LlamaForCausalLM(cfg).to(dtype)
            model.load_state_dict(want, strict=True)
            fresh = ds_engine(a, model)
            train_step(fresh)
            theirs = module_state(fresh, a.stage)
            mine = module_state(engine, a.stage)
            for k in want:
                checked += 1
                if not bits_equal(mine[k], theirs[k]):
                    failures.append(f"after one step {k}: differs from a fresh engine's")
            if all(bits_equal(mine[k], w) for k, w in want.items()):
                failures.append("the training step changed no weight")  # nothing compared
    return 0 if deepspeed_real.verdict(failures, checked) else 1


def ds_load(hf, folder, stage, dtype, expect_ok=True, step=True):
    """DeepSpeed at 2 ranks loads `folder` (ds_rank); returns rank 0's verdict."""
    a = argparse.Namespace(cmd="load", world=2, stage=stage, dtype=dtype, hf=str(hf),
                           dir=str(folder), rank_fn=ds_rank, step=step)
    out, codes = deepspeed_real.launch(a, timeout=300)
    last = out.strip().splitlines()[-1] if out.strip() else ""
    print(last, flush=True)
    verdict = json.loads(last)
    assert verdict["ok"] == expect_ok and all(c == 0 for c in codes) == expect_ok, (verdict,
                                                                                    codes)
    assert verdict["checked"] >= MIN_VALUES, verdict
    return verdict


def ds_case(stage, dtype, negative=False):
    with Tmp("ucp-hfds-") as t:
        hf = t / "hf"
        make_hf(hf, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
        for flag in ([], ["--init-optimizer"]):
            out = t / f"ds{len(flag)}"
            run("convert", hf, "-o", out, "--format", "deepspeed", "--dp", 2, "--zero-stage",
                stage, *flag, "-q")
            ds_load(hf, out, stage, dtype)
            print(f"ok DeepSpeed loads ZeRO {stage} {dtype} at world 2 {' '.join(flag)}",
                  flush=True)
        if negative:
            bad = t / "hf-changed"
            shutil.copytree(hf, bad)
            change_one_byte(bad, CHANGED)
            run("convert", bad, "-o", t / "ds-changed", "--format", "deepspeed", "--dp", 2,
                "--zero-stage", stage, "-q")
            v = ds_load(hf, t / "ds-changed", stage, dtype, expect_ok=False, step=False)
            assert sorted(v["failures"]) == sorted([f"module {CHANGED}: values differ",
                                                    f"fp32 master {CHANGED}: values differ"]), v
            print("ok one changed byte of the folder is seen", flush=True)


def test_deepspeed_zero1_fp32():
    ds_case(1, "fp32", negative=True)


def test_deepspeed_zero2_bf16():
    ds_case(2, "bf16")


def test_deepspeed_zero3_fp32():
    ds_case(3, "fp32")


def test_deepspeed_zero0_fp32():
    ds_case(0, "fp32")


# --- MindSpore (after the DeepSpeed cases: its ranks are forked before MindSpore is imported) --

def ms_load(path):
    import mindspore
    return {k: torch.from_numpy(v.asnumpy().copy())
            for k, v in mindspore.load_checkpoint(str(path)).items()}


def mf_name(hf):
    for a, b in MF_RENAMES:
        hf = hf.replace(a, b)
    return hf


def one_ckpt(folder):
    files = sorted(pathlib.Path(folder).rglob("*.ckpt"))
    assert len(files) == 1, files
    return files[0]


def ms_compare(got, want, rename):
    """Every tensor of `want` under its renamed name in `got`, bit for bit; returns the names
    that differ."""
    differ, n = [], 0
    for k, w in want.items():
        g = got.get(rename(k))
        assert g is not None, (rename(k), sorted(got))
        n += w.numel()
        if not bits_equal(g, w):
            differ.append(k)
    assert n >= MIN_VALUES, n
    return differ


def test_mindspore():
    with Tmp("ucp-hfms-") as t:
        hf = t / "hf"
        want = make_hf(hf)
        bad = t / "hf-changed"
        shutil.copytree(hf, bad)
        change_one_byte(bad, CHANGED)
        for names, rename in ((None, lambda k: k), ("mindformers-llama", mf_name)):
            flag = ["--names", names] if names else []
            run("convert", hf, "-o", t / f"ms-{names}", "--format", "mindspore", *flag, "-q")
            got = ms_load(one_ckpt(t / f"ms-{names}"))
            assert ms_compare(got, want, rename) == [], names
            print(f"ok mindspore.load_checkpoint gives the folder's tensors (names {names})",
                  flush=True)
            run("convert", bad, "-o", t / f"ms-bad-{names}", "--format", "mindspore", *flag, "-q")
            got = ms_load(one_ckpt(t / f"ms-bad-{names}"))
            assert ms_compare(got, want, rename) == [CHANGED], names
            print("ok one changed byte of the folder is seen", flush=True)


if __name__ == "__main__":
    import testmain
    testmain.run_tests(globals())
