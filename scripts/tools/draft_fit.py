"""The draft model of `scripts.tools.train_draft`: its config, its start from the target, its
training and its files.

The draft is the target's own mlx-lm family (llama) with fewer, narrower layers and a
tied embedding. At a narrow width the embedding (vocabulary x hidden) is most of the
draft, so it starts as the target's embedding projected on its top principal directions
(`project_embedding`); at the target's own width it is copied, with the target's first
layers where their shapes match. Training minimises, on completion positions only,

    (1 - w) * CE(the target's token) + w * CE(the target's top-k distribution, renormalised)

with w = `kd_weight`: the target's own tokens, plus what it thought of the other
likely tokens, which is how its argmax is learnt from sampled text too.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama
from mlx_lm.utils import quantize_model, save_config, save_model

from scripts.tools.draft_data import Example, collate, padded_length, plan_batches

FAMILIES = ("llama", "mistral")  # mlx-lm builds both with its llama module
# Keys of the target's config that describe its weights, not the draft's.
_TARGET_ONLY = ("quantization", "quantization_config", "gguf_sha256", "torch_dtype", "dtype", "_name_or_path")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


def draft_config(
    target_config: dict, *, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int, head_dim: int | None
) -> dict:
    """The target's config with the draft's sizes (and a tied head); ValueError for a
    family or a shape the draft cannot take."""
    family = target_config.get("model_type")
    if family not in FAMILIES:
        raise ValueError(f"the target is a {family!r} model; train_draft builds drafts for {', '.join(FAMILIES)}")
    head_dim = head_dim or hidden // heads
    if min(hidden, layers, intermediate, heads, kv_heads, head_dim) < 1:
        raise ValueError("--hidden, --layers, --intermediate, --heads, --kv-heads must be positive")
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head dim {head_dim} must be even (rotary embeddings)")
    config = {k: v for k, v in target_config.items() if k not in _TARGET_ONLY}
    config.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        tie_word_embeddings=True,
    )
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:layers]
    return config


def build(config: dict) -> nn.Module:
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def num_params(model: nn.Module) -> int:
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _dense_weight(module: nn.Module) -> mx.array:
    if "scales" in module:  # a quantized embedding the loader kept
        return mx.dequantize(module["weight"], module["scales"], module.get("biases"), module.group_size, module.bits)
    return module.weight


def project_embedding(embedding: np.ndarray, width: int) -> np.ndarray:
    """`embedding` (vocab, hidden) on its top `width` principal directions (uncentred, as
    the tied head uses it): E V_r, V_r the top eigenvectors of E^T E, signs fixed so the
    largest entry of each is positive (the same matrix on every run).

    >>> e = np.array([[3.0, 0.0, 0.1], [0.0, 2.0, 0.0], [-3.0, 0.0, -0.1]])
    >>> (np.round(project_embedding(e, 2), 2) + 0.0).tolist()
    [[3.0, 0.0], [0.0, 2.0], [-3.0, 0.0]]
    """
    e = embedding.astype(np.float64)
    values, vectors = np.linalg.eigh(e.T @ e)
    top = vectors[:, np.argsort(values)[::-1][:width]]
    top *= np.where(top[np.abs(top).argmax(axis=0), range(top.shape[1])] < 0, -1.0, 1.0)
    return (e @ top).astype(np.float32)


def soft_start_gain(embedding: np.ndarray, num_rows: int = 256) -> float:
    """A final-norm gain giving logits of standard deviation 1 when the hidden state is a
    token's own embedding, as it nearly is in a fresh draft: with the gain at 1 the tied
    head's logits are sharp and wrong (each token predicts itself), a first loss above
    the uniform one. Rows are taken evenly, so the result is the same on every run."""
    rows = embedding[np.linspace(0, len(embedding) - 1, num_rows).astype(int)]
    normed = rows / np.sqrt(np.mean(rows * rows, axis=1, keepdims=True) + 1e-6)
    return float(1.0 / max(np.std(normed @ embedding.T), 1e-6))


def init_from_target(draft: nn.Module, target: nn.Module) -> str:
    """Start `draft` from `target` where it helps; returns what was taken, for the record."""
    embedding = np.array(_dense_weight(target.model.embed_tokens).astype(mx.float32))
    width = draft.model.embed_tokens.weight.shape[1]
    if width != embedding.shape[1]:
        projected = project_embedding(embedding, width)
        draft.model.embed_tokens.weight = mx.array(projected)
        draft.model.norm.weight = mx.full((width,), soft_start_gain(projected), mx.float32)
        mx.eval(draft.parameters())
        return (
            f"embedding: the target's projected on its top {width} principal directions; "
            "final norm scaled for logits of standard deviation 1"
        )
    draft.model.embed_tokens.weight = mx.array(embedding)
    draft.model.norm.weight = target.model.norm.weight.astype(mx.float32)
    taken = 0
    for mine, theirs in zip(draft.model.layers, target.model.layers):
        theirs_flat = dict(tree_flatten(theirs.parameters()))
        mine_flat = dict(tree_flatten(mine.parameters()))
        if theirs_flat.keys() != mine_flat.keys() or any(theirs_flat[k].shape != v.shape for k, v in mine_flat.items()):
            break  # quantized or shaped otherwise: the rest start random
        mine.update(theirs.parameters())
        taken += 1
    draft.set_dtype(mx.float32)
    mx.eval(draft.parameters())
    return f"embedding and final norm copied from the target, and its first {taken} layers"


def init_from_draft(draft: nn.Module, saved: nn.Module, path: str) -> str:
    """Start `draft` from `saved`, an earlier draft of the same shape (dequantized), to
    train it further on new data; returns what was taken, for the record."""
    from models.loading import dense_weights

    dense_weights.dequantize(saved)
    theirs = dict(tree_flatten(saved.parameters()))
    mine = dict(tree_flatten(draft.parameters()))
    differ = sorted(
        k for k in mine.keys() | theirs.keys() if k not in theirs or k not in mine or theirs[k].shape != mine[k].shape
    )
    if differ:
        raise ValueError(f"--init {path!r} holds a draft of another shape (it differs at {differ[0]}); pass its shape")
    draft.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in theirs.items()]))
    mx.eval(draft.parameters())
    return f"every weight from the draft in {path}"


def lr_at(step: int, progress: float, peak: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then a cosine from `peak` to a tenth of it as
    `progress` (the larger of steps run / steps and seconds used / seconds allowed) goes 0 to 1.

    >>> [round(lr_at(s, p, 1.0, 10), 3) for s, p in ((0, 0.0), (9, 0.1), (50, 0.5), (99, 1.0))]
    [0.1, 1.0, 0.55, 0.1]
    """
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@contextlib.contextmanager
def differentiable_kernels():
    """MLX's and mlx-lm's own attention and SwiGLU while the block runs: the CPU kernels
    `models.platform.cpu_math` installs process-wide (the loader does, on x86) have no gradient."""
    from models.platform import cpu_math

    if mx.fast.scaled_dot_product_attention is not cpu_math.attention:
        yield
        return
    mx.fast.scaled_dot_product_attention = cpu_math._MLX_SDPA
    cpu_math._bind_swiglu(cpu_math._MLX_LM_SWIGLU)
    try:
        yield
    finally:
        cpu_math.install()


def train(
    model: nn.Module,
    examples: list[Example],
    *,
    steps: int,
    batch_tokens: int,
    lr: float,
    warmup: int,
    weight_decay: float,
    kd_weight: float,
    topk: int,
    seed: int,
    deadline: float = math.inf,
    log_every: int = 50,
    compiled: bool = False,
) -> dict:
    """Train `model` in place for `steps` steps, or until `deadline` (time.monotonic());
    returns the record: steps run, why it stopped, the loss curve, tokens, seconds.
    `compiled`: one `mx.compile`d step per batch shape (a first step of each shape pays for
    building its kernels)."""
    with differentiable_kernels():
        return _train(
            model,
            examples,
            steps=steps,
            batch_tokens=batch_tokens,
            lr=lr,
            warmup=warmup,
            weight_decay=weight_decay,
            kd=kd_weight if topk else 0.0,
            topk=topk,
            seed=seed,
            deadline=deadline,
            log_every=log_every,
            compiled=compiled,
        )


def _train(
    model, examples, *, steps, batch_tokens, lr, warmup, weight_decay, kd, topk, seed, deadline, log_every, compiled
) -> dict:

    def loss_fn(model, inputs, targets, mask, top_ids, top_probs):
        logits = model(inputs).astype(mx.float32)
        picked = mx.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        if kd:
            soft = (mx.take_along_axis(logits, top_ids, axis=-1) * top_probs).sum(axis=-1)
            picked = (1 - kd) * picked + kd * soft
        nll = (mx.logsumexp(logits, axis=-1) - picked) * mask
        return nll.sum() / mx.maximum(mask.sum(), 1.0)

    optimizer = optim.AdamW(learning_rate=lr, betas=(0.9, 0.95), weight_decay=weight_decay)
    optimizer.init(model.trainable_parameters())
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, optimizer.state]

    def step_fn(*batch):
        loss, grads = loss_and_grad(model, *batch)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    if compiled:
        step_fn = partial(mx.compile, inputs=state, outputs=state)(step_fn)

    rng = np.random.default_rng(seed)
    lengths = [len(e.prompt_ids) + len(e.completion_ids) for e in examples]
    start = window_start = time.monotonic()
    budget = max(deadline - start, 1e-9)
    curve, window_loss, window_steps, window_tokens, num_tokens = [], 0.0, 0, 0, 0
    step, num_batches, stopped_by = 0, 0, None
    while stopped_by is None:
        batches = plan_batches(lengths, batch_tokens, rng)
        num_batches = len(batches)
        for batch in batches:
            progress = max(step / steps, (time.monotonic() - start) / budget)
            optimizer.learning_rate = lr_at(step, progress, lr, warmup)
            rows = max(1, batch_tokens // padded_length(max(lengths[i] for i in batch)))
            loss = step_fn(*collate([examples[i] for i in batch], topk, rows))
            mx.eval(loss, state)
            tokens = sum(len(examples[i].completion_ids) for i in batch)
            window_loss += loss.item()
            window_steps, window_tokens, num_tokens = window_steps + 1, window_tokens + tokens, num_tokens + tokens
            step += 1
            now = time.monotonic()
            stopped_by = "steps" if step >= steps else "time" if now > deadline else None
            if step % log_every == 0 or stopped_by:
                elapsed = now - start
                eta = min(elapsed / step * (steps - step), max(0.0, deadline - now))
                mean = window_loss / window_steps
                curve.append({"step": step, "loss": round(mean, 4), "seconds": round(elapsed, 1)})
                print(
                    f"train: step {step}/{steps} loss {mean:.3f} lr {optimizer.learning_rate.item():.2e} "
                    f"{window_tokens / max(now - window_start, 1e-9):,.0f} completion tok/s {elapsed:.0f}s "
                    f"eta {eta:.0f}s",
                    flush=True,
                )
                window_loss, window_steps, window_tokens, window_start = 0.0, 0, 0, now
            if stopped_by:
                break
    return {
        "steps_run": step,
        "stopped_by": stopped_by,
        "epochs": round(step / max(num_batches, 1), 2),
        "loss_curve": curve,
        "trained_tokens": num_tokens,
        "seconds": round(time.monotonic() - start, 1),
    }


def save(
    model: nn.Module, config: dict, out_dir: str, tokenizer_dir: str, *, dtype: str, bits: int, group_size: int
) -> dict:
    """Write config.json, model.safetensors and the target's tokenizer files into
    `out_dir`, the weights in `dtype` and, with `bits`, quantized (mlx-lm affine, groups
    of `group_size`). Returns what the files hold, for the record."""
    model.set_dtype(getattr(mx, dtype))
    config = dict(config, torch_dtype=dtype)
    if bits:
        model, config = quantize_model(model, config, group_size, bits)
    os.makedirs(out_dir, exist_ok=True)
    save_model(Path(out_dir), model)
    save_config(config, os.path.join(out_dir, "config.json"))
    copied = []
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(tokenizer_dir, name)):
            shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
            copied.append(name)
    weight_bytes = sum(
        os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir) if f.endswith(".safetensors")
    )
    return {
        "dtype": dtype,
        "bits": bits or None,
        "group_size": group_size if bits else None,
        "weight_file_bytes": weight_bytes,
        "tokenizer_files": copied,
    }
