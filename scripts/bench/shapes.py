"""Models of realistic shapes with random weights, built locally with mlx-lm's own model
classes (no model hub is reachable here), with the bundled tokenizer.

    python -m scripts.bench.shapes q15 /tmp/q15 [--tokenizer-vocab] [--bits 4|0]

- `q15`: Qwen2.5-1.5B (28 layers, hidden 1536, 12/2 heads, vocab 151,936).
- `q7`: Qwen2.5-7B (28 layers, hidden 3584, 28/4 heads, vocab 152,064).
- `llama1b`: Llama-3.2-1B (16 layers, hidden 2048, 32/8 heads, vocab 128,256).
- `tiny`: a 2-layer Qwen2 for dry runs on a CPU.

Weights are bf16, quantized to 4 bits (group 64) unless `--bits 0`. The bundled tokenizer
knows 2,048 tokens: a server that detokenizes (HTTP) needs `--tokenizer-vocab`, which cuts
the vocabulary (embedding and output head) to the tokenizer's size, so the output head is
smaller than the real model's. Every figure from these models comes from random weights:
say so next to it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil

BUNDLED_TOKENIZER = "models/bundled/target"

SHAPES = {  # family, (hidden, layers, heads, kv heads, intermediate, vocab), extra config
    "q15": ("qwen2", (1536, 28, 12, 2, 8960, 151936), dict(rms_norm_eps=1e-6, rope_theta=1000000.0)),
    "q7": (
        "qwen2",
        (3584, 28, 28, 4, 18944, 152064),
        dict(rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False),
    ),
    "llama1b": ("llama", (2048, 16, 32, 8, 8192, 128256), dict(rms_norm_eps=1e-5, rope_theta=500000.0, head_dim=64)),
    "tiny": ("qwen2", (128, 2, 4, 2, 256, 151936), dict(rms_norm_eps=1e-6, rope_theta=1000000.0)),
}


def tokenizer_vocab(tokenizer_dir: str = BUNDLED_TOKENIZER) -> int:
    with open(os.path.join(tokenizer_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def build(shape: str, path: str, vocab: int | None = None, bits: int = 4) -> int:
    """Writes a model directory of `shape` (random weights, the bundled tokenizer's files)
    at `path`; `vocab` overrides the shape's vocabulary size. Returns the vocabulary size."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    import models  # noqa: F401  (fast BLAS before mlx on a CPU)

    family, (hidden, layers, heads, kv, inter, full_vocab), extra = SHAPES[shape]
    module = importlib.import_module(f"mlx_lm.models.{family}")
    cfg = dict(
        model_type=family,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        intermediate_size=inter,
        vocab_size=vocab or full_vocab,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )
    cfg.update(extra)
    model = module.Model(module.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.bfloat16)
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        cfg["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    os.makedirs(path, exist_ok=True)
    mx.save_safetensors(os.path.join(path, "model.safetensors"), dict(tree_flatten(model.parameters())))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    for name in os.listdir(BUNDLED_TOKENIZER):
        if "token" in name:
            shutil.copy(os.path.join(BUNDLED_TOKENIZER, name), path)
    return cfg["vocab_size"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("path")
    ap.add_argument(
        "--tokenizer-vocab",
        action="store_true",
        help="cut the vocabulary to the bundled tokenizer's (for servers that detokenize)",
    )
    ap.add_argument("--bits", type=int, default=4, choices=(0, 4, 8), help="0: unquantized bf16")
    args = ap.parse_args(argv)
    vocab = build(args.shape, args.path, tokenizer_vocab() if args.tokenizer_vocab else None, args.bits)
    print(f"{args.shape}: random weights, vocab {vocab}, {args.bits or 16} bits -> {args.path}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
