"""Hugging Face import: ucp reading a transformers model folder into Megatron's torch_dist at
TP2 PP2 against what users compare it with (issue 39).

  <venv python> bench/hf_bench.py BUILD_DIR [--rounds 3] [--layers 22] [--json FILE]
                                  [--folder DIR]

The folder is written by transformers' own save_pretrained (the tests' PyPI environment: run this
with its python): a LlamaForCausalLM with GQA (hidden 2048, 16 heads in 4 query groups, ffn 5632,
vocabulary 32000, untied), bf16, random weights, in shards of at most 500 MB with
model.safetensors.index.json; ~2.1 GiB at the default 22 layers. In the same run, rounds
alternated, `sync` before each timed command, medians [min-max], peak RSS and bytes read:

  ucp convert --names mcore-llama -> torch_dist TP2 PP2             vs  cp -r SRC DST && sync
  ucp convert --names mcore-llama -> torch_dist TP2 PP2 --no-sync   vs  cp -r SRC DST

Not here yet: the Python path a user would run (transformers from_pretrained + megatron-core's
sharded_state_dict + dist_checkpointing.save at TP2 PP2 on 4 ranks).
"""
import argparse
import json
import os
import pathlib
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import pairs as pairs_mod  # noqa: E402


def make_folder(dst, layers):
    if (dst / "config.json").is_file():
        return
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=2048, num_hidden_layers=layers,
                                   num_attention_heads=16, num_key_value_heads=4,
                                   intermediate_size=5632, vocab_size=32000,
                                   tie_word_embeddings=False, torch_dtype="bfloat16")
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(dst, max_shard_size="500MB", safe_serialization=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", default="2G")
    ap.add_argument("--json")
    ap.add_argument("--folder", help="keep the generated folder here; reuse it")
    a = ap.parse_args()
    ucp = pathlib.Path(a.build_dir).resolve() / "cli" / "ucp"
    with tempfile.TemporaryDirectory(prefix="ucp-hf-bench-", dir=os.environ.get("TMPDIR")) as w:
        w = pathlib.Path(w)
        src = pathlib.Path(a.folder).resolve() if a.folder else w / "hf"
        make_folder(src, a.layers)
        nbytes = pairs_mod.tree_bytes(src)
        print(f"transformers LlamaForCausalLM folder: {nbytes / 2**30:.2f} GiB, {a.layers} "
              f"layers, {len(list(src.glob('*.safetensors')))} shards", flush=True)
        out = w / "out"
        conv = [ucp, "convert", src, "-o", out, "--names", "mcore-llama", "--format",
                "megatron-torch-dist", "--tp", 2, "--pp", 2, "--dp", 1, "--memory", a.memory,
                "-q"]
        pairs = {
            "hf -> torch_dist TP2 PP2 (durable)": (conv, f"cp -r '{src}' '{out}' && sync", True),
            "hf -> torch_dist TP2 PP2 (--no-sync)": (conv + ["--no-sync"],
                                                     f"cp -r '{src}' '{out}'", True),
        }
        results = {"bytes": nbytes, "pairs": pairs_mod.run_pairs(pairs, a.rounds, nbytes, out)}
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
