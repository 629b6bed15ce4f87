"""Tiny random-weight models for tests, built in about a second.

`build_tiny_pair(out_dir)` writes two Hugging Face–format directories (`target/`,
`draft/`) that `mlx_lm.load` reads: config.json, model.safetensors (float32),
tokenizer.json and tokenizer_config.json. Both share one byte-level BPE tokenizer
trained offline on a few standard-library source files (`models.corpus`).

The draft is the target's first `draft_layers` layers with the same embeddings, final
norm and head, so it agrees with the target often but not always, which exercises both
accepted and rejected draft tokens. `tiny_sliding_pair` builds such a pair in memory
with sliding-window layers (gemma3_text, or llama with sliding layers).

Why the weights are scaled: with default init every layer adds a residual of similar size,
so the top-2 logit gap is often tiny and a K-token verify can flip an argmax against
single steps. Scaling the embeddings up makes each step's logits dominated by a few
clear directions; `greedy_margins` lets tests check that the gaps they rely on are far
above float32 noise instead of hoping.
"""

from __future__ import annotations

import json
import os
import sysconfig

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama

from models import corpus

# Small, stable stdlib modules: enough text for a 512-token BPE, quick to train on.
_TOKENIZER_FILES = ("textwrap.py", "string.py", "bisect.py", "heapq.py", "fnmatch.py")


def train_tiny_tokenizer(out_dir: str, vocab_size: int = 512) -> None:
    """Byte-level BPE on a few stdlib files, written to `out_dir` (tokenizer files only)."""
    root = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in _TOKENIZER_FILES:
        with open(os.path.join(root, name), encoding="utf-8") as f:
            texts.append(f.read())
    corpus.train_tokenizer(texts, out_dir, vocab_size=vocab_size)


def tiny_args(vocab_size: int, num_layers: int = 4, hidden: int = 64) -> llama.ModelArgs:
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        intermediate_size=hidden * 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )


def random_model(args, seed: int, embed_scale: float, out_scale: float, module=llama):
    """A `module.Model` (llama unless given: any mlx-lm module with llama's layer
    naming, e.g. gemma3_text) with seeded random float32 weights.

    `embed_scale` grows the token embeddings (peaked, stable logits); `out_scale`
    shrinks every layer's output projections, which controls how much the later layers
    (the ones a truncated draft lacks) change the prediction.
    """
    mx.random.seed(seed)
    model = module.Model(args)
    emb = model.model.embed_tokens
    emb.weight = mx.random.normal(emb.weight.shape) * embed_scale
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * out_scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * out_scale
    mx.eval(model.parameters())
    return model


def save_model(model: nn.Module, args: llama.ModelArgs, tokenizer_dir: str, out_dir: str) -> None:
    """Write `model` as an HF-format directory loadable by `mlx_lm.load`."""
    os.makedirs(out_dir, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(os.path.join(out_dir, "model.safetensors"), weights, {"format": "mlx"})
    config = {k: v for k, v in vars(args).items() if k not in ("layer_types",)}
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = "float32"
    config["eos_token_id"] = 0  # corpus.EOS_TOKEN is the first special token
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tokenizer_dir, name)) as src, open(os.path.join(out_dir, name), "w") as dst:
            dst.write(src.read())


def build_tiny_pair(
    out_dir: str,
    *,
    seed: int = 0,
    num_layers: int = 4,
    draft_layers: int = 2,
    embed_scale: float = 4.0,
    out_scale: float = 0.5,
) -> tuple[str, str]:
    """Build target + draft under `out_dir`; returns (target_path, draft_path)."""
    tok_dir = os.path.join(out_dir, "tokenizer")
    train_tiny_tokenizer(tok_dir)
    with open(os.path.join(tok_dir, "tokenizer.json")) as f:
        vocab_size = len(json.load(f)["model"]["vocab"])
    args = tiny_args(vocab_size, num_layers=num_layers)
    target = random_model(args, seed, embed_scale, out_scale)
    target_path = os.path.join(out_dir, "target")
    save_model(target, args, tok_dir, target_path)

    draft_args = tiny_args(vocab_size, num_layers=draft_layers)
    draft = truncated_draft(target, draft_args)
    draft_path = os.path.join(out_dir, "draft")
    save_model(draft, draft_args, tok_dir, draft_path)
    return target_path, draft_path


def truncated_draft(target: nn.Module, draft_args, module=llama) -> nn.Module:
    """A draft of `draft_args.num_hidden_layers` layers sharing the target's first
    layers, embeddings, final norm and head (no weight is copied)."""
    draft = module.Model(draft_args)
    draft.model.layers = target.model.layers[: draft_args.num_hidden_layers]
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    return draft


def greedy_margins(model: nn.Module, prompt_ids: list[int], num_tokens: int) -> list[float]:
    """Top-1 minus top-2 logit, per step, along the model's greedy continuation.

    Single-token steps through a fresh KV cache (the classic decode shape).
    """
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt_ids]), cache=cache)[0, -1]
    margins = []
    for _ in range(num_tokens):
        top2 = mx.topk(logits, 2)
        mx.eval(top2)
        hi, lo = sorted(top2.tolist(), reverse=True)
        margins.append(hi - lo)
        token = mx.argmax(logits).item()
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return margins


def sliding_args(family: str, vocab_size: int, window: int, num_layers: int):
    """Args of a tiny model whose even layers attend over a sliding window of `window`
    tokens (mlx-lm gives those a `RotatingKVCache`) and odd layers over everything:
    "gemma3_text", or "llama" with mistral-style `layer_types`."""
    if family == "gemma3_text":
        return gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=num_layers,
            intermediate_size=128,
            num_attention_heads=4,
            head_dim=16,
            num_key_value_heads=2,
            vocab_size=vocab_size,
            sliding_window=window,
            sliding_window_pattern=2,
            query_pre_attn_scalar=16,
            max_position_embeddings=4096,
        )
    if family == "llama":
        args = tiny_args(vocab_size, num_layers=num_layers)
        args.layer_types = [("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)]
        args.sliding_window = window
        return args
    raise ValueError(f"no tiny sliding-window {family!r}")


def tiny_sliding_pair(
    family: str,
    vocab_size: int,
    window: int,
    *,
    seed: int = 0,
    num_layers: int = 4,
    draft_layers: int = 2,
    embed_scale: float = 1.0,
    out_scale: float = 0.5,
) -> tuple[nn.Module, nn.Module]:
    """In-memory float32 (target, draft) of `sliding_args`, the draft truncated from
    the target as in `build_tiny_pair`."""
    module = gemma3_text if family == "gemma3_text" else llama
    args = sliding_args(family, vocab_size, window, num_layers)
    target = random_model(args, seed, embed_scale, out_scale, module)
    draft_args = sliding_args(family, vocab_size, window, draft_layers)
    return target, truncated_draft(target, draft_args, module)
