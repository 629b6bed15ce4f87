"""Shape-stable forwards over a KV cache: the GPU path of a speculative round.

Why: on MLX CUDA, multi-query `mx.fast.scaled_dot_product_attention` compiles a kernel for
every new key length, and a verify at a growing offset meets a new one every round. Here the
forward attends over the cache's whole buffer, a multiple of `bucket` long, with a mask that
hides every slot at or beyond each query's own position, and `prefill` runs fixed chunks of
`prefill_chunk` positions, the last one padded; each (bucket, query length) is one
`mx.compile`d function, compiled once (`warm` does it at load). Contract: any mlx-lm model
whose layers take a standard `KVCache` (`offset`, `update_and_fetch`,
`create_attention_mask(..., cache)`) and need no sliding window; `supports(model)` checks
the cache type. Results equal the plain forward up to float summation order, and the caches
stay ordinary `KVCache`s. llama and qwen2 run `_FusedDecoder`; any other model its own
forward. See docs/gpu.md, "`fast_verify: true`: the compiled per-session verify".
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache, make_prompt_cache

from models.runner_config import RunnerConfig
from models.sampling.samplers import greedy

DEFAULT_BUCKET = 256
DEFAULT_PREFILL_CHUNK = RunnerConfig.prefill_chunk


class _BufferView:
    """Stands in for one layer's `KVCache` inside a traced forward."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys = keys
        self.values = values
        self.offset = offset  # int32 scalar: rope offset and first write position

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        start = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, start, axes=(2,))
        self.values = mx.slice_update(self.values, values, start, axes=(2,))
        return self.keys, self.values

    def make_mask(self, n: int, return_array: bool = False, window_size=None) -> mx.array:
        if window_size is not None:
            raise ValueError("bucketed forward does not support sliding-window attention")
        # Query i sits at absolute position offset + i and sees keys 0..offset + i.
        query_pos = self.offset + mx.arange(n, dtype=mx.int32)
        key_pos = mx.arange(self.keys.shape[2], dtype=mx.int32)
        visible = key_pos[None, :] <= query_pos[:, None]
        # Additive, not boolean: on MLX CUDA a boolean mask takes SDPA with several queries
        # off its fast path. Adding 0 or -inf gives the same softmax.
        return mx.where(visible, 0.0, -mx.inf).astype(self.keys.dtype)


class _FusedDecoder:
    """A llama-family decoder (mlx-lm's llama module, which also loads mistral, and
    qwen2: pre-norm blocks of full attention and a SwiGLU MLP) run with fewer, wider
    matmuls: q, k and v come from one product, gate and up from another, and rope turns
    q and k in one call. On MLX CUDA every matmul of more than one row is a cuBLAS call
    wrapped in a CUDA-graph capture, whose host cost dominates a short verify forward, so
    seven products per layer becoming four is what a verify saves.

    The model keeps its modules: their q/k/v and gate/up weights become row slices (views)
    of the fused matrices, so no weight is stored twice and the plain forward (classic
    decode, probes) computes exactly what it did. `build` returns None for any model this
    does not fit; the bucketed forward then runs the model itself.
    """

    def __init__(self, model: nn.Module):
        inner = model.model
        self.embed = inner.embed_tokens
        self.norm = inner.norm
        self.head = None if model.args.tie_word_embeddings else model.lm_head
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up = _fuse_rows([mlp.gate_proj, mlp.up_proj])
            self.layers.append((layer.input_layernorm, qkv, attn, layer.post_attention_layernorm, gate_up, mlp))

    @staticmethod
    def build(model: nn.Module) -> "_FusedDecoder | None":
        """The fused decoder of `model`, built once per model (later calls reuse it), or
        None where the model is not of this shape. A built decoder must reproduce the
        model's own logits on a short input, or it is dropped."""
        cached = getattr(model, "_specslot_fused", None)
        if cached is not None:
            return cached or None
        fused = None
        if _fusable(model):
            fused = _FusedDecoder(model)
            tokens = mx.arange(1, 5, dtype=mx.int32)[None] % model.model.embed_tokens.weight.shape[0]
            want = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
            got = fused(tokens, make_prompt_cache(model)).astype(mx.float32)
            # Same products summed in another blocking differ in the last bits only; a
            # structural mismatch (heads, rope, norms) shows at the scale of the logits.
            if not mx.abs(got - want).max().item() <= 0.05 * mx.abs(want).max().item() + 1e-4:
                fused = None
        object.__setattr__(model, "_specslot_fused", fused or False)
        return fused

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        h = self.embed(tokens)
        batch, length, _ = h.shape
        mask = create_attention_mask(h, cache[0])
        for (norm1, qkv, attn, norm2, gate_up, mlp), c in zip(self.layers, cache):
            heads, kv_heads = attn.n_heads, attn.n_kv_heads
            x = qkv(norm1(h))
            dim = x.shape[-1] // (heads + 2 * kv_heads)
            x = x.reshape(batch, length, heads + 2 * kv_heads, dim).transpose(0, 2, 1, 3)
            qk = attn.rope(x[:, : heads + kv_heads], offset=c.offset)
            keys, values = c.update_and_fetch(qk[:, heads:], x[:, heads + kv_heads :])
            out = mx.fast.scaled_dot_product_attention(qk[:, :heads], keys, values, scale=attn.scale, mask=mask)
            h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))
            gate, up = mx.split(gate_up(norm2(h)), 2, axis=-1)
            h = h + mlp.down_proj(nn.silu(gate) * up)
        h = self.norm(h)
        return self.embed.as_linear(h) if self.head is None else self.head(h)


# mlx-lm loads mistral checkpoints with its llama module.
_FUSABLE_MODULES = {"mlx_lm.models.llama", "mlx_lm.models.qwen2"}


def _fusable(model: nn.Module) -> bool:
    """Llama-family module, full attention in every layer, plain (unquantized) linears."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if type(model).__module__ not in _FUSABLE_MODULES or not layers:
        return False
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        if getattr(layer, "use_sliding", False):
            return False
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if any(type(lin) is not nn.Linear for lin in linears):
            return False
        if any(type(n) is not nn.RMSNorm for n in (layer.input_layernorm, layer.post_attention_layernorm)):
            return False
    return True


def _fuse_rows(linears: list) -> nn.Linear:
    """One `nn.Linear` whose output is the concatenated outputs of `linears` (same input
    size); each of `linears` keeps its weight and bias as a row slice of the fused ones."""
    weight = mx.concatenate([lin.weight for lin in linears], axis=0)
    has_bias = "bias" in linears[0]
    bias = mx.concatenate([lin.bias for lin in linears]) if has_bias else None
    mx.eval(weight, *([bias] if has_bias else []))
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias)
    fused.weight = weight
    if has_bias:
        fused.bias = bias
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = weight[start : start + rows]
        if has_bias:
            lin.bias = bias[start : start + rows]
        start += rows
    mx.eval([lin.parameters() for lin in linears])
    return fused


HEADS = ("logits", "last", "every", "top")


def _greedy(logits: mx.array) -> mx.array:
    return greedy(logits).astype(mx.int32)  # exactly as the sampler picks at temperature 0


def _forward(model, head: str, tokens: mx.array, offset: mx.array, *buffers):
    views = [_BufferView(buffers[i], buffers[i + 1], offset) for i in range(0, len(buffers), 2)]
    logits = model(tokens, cache=views)
    if head == "last":
        out = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
    elif head == "top":
        # The last position's argmax and its probability, as float32 (exact for ids below 2**24).
        last = logits[0, -1].astype(mx.float32)
        peak = mx.max(last)
        out = mx.stack([mx.argmax(last).astype(mx.float32), 1.0 / mx.sum(mx.exp(last - peak))])
    elif head == "every":
        out = _greedy(logits)
    else:
        out = logits
    return (out, *[a for v in views for a in (v.keys, v.values)])


def supports(model: nn.Module) -> bool:
    """True when every layer's cache is a plain (full-attention, unquantized) KVCache."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def round_up(n: int, bucket: int) -> int:
    """Smallest multiple of `bucket` that is >= n (and >= bucket)."""
    return max(-(-n // bucket), 1) * bucket


class BucketedForward:
    """Compiled, shape-stable forwards of one model over its `KVCache` lists.

    `logits(cache, tokens)`, `greedy(cache, tokens)` and `greedy_every(cache, tokens)`
    append `tokens` (shape (1, L)) to `cache` exactly like `model(tokens, cache=cache)`
    and return the logits (1, L, V), the argmax token of the last position (shape (1,)),
    resp. the greedy token of every position (1, L; `models.sampling.samplers.greedy`,
    as a temperature-0 sampler takes it), all lazily (no host sync).
    A cache that holds nothing yet (no buffers to infer shapes from) goes through the
    plain model once; `prefill` allocates the buffers instead, so its whole path is
    compiled. `prefill_chunk` = 0 means callers should prefill with the plain model.
    """

    def __init__(
        self,
        model: nn.Module,
        bucket: int = DEFAULT_BUCKET,
        compile: bool = True,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        fuse: bool = True,
    ):
        if bucket < 1:
            raise ValueError("bucket must be >= 1")
        if prefill_chunk < 0:
            raise ValueError("prefill_chunk must be >= 0")
        self.model = model
        self.bucket = bucket
        self.prefill_chunk = prefill_chunk
        wrap = mx.compile if compile else (lambda f: f)
        self.fused = _FusedDecoder.build(model) if fuse else None
        body = self.fused or model
        self._fns = {head: wrap(partial(_forward, body, head)) for head in HEADS}
        self._template: list | None = None  # per layer: (keys, values) with 0 positions

    def prefill(self, cache: list, ids: Sequence[int]) -> None:
        """Append `ids` to `cache` lazily (nothing waits for the device), in chunks of
        `prefill_chunk` positions; the last chunk is padded and the padding trimmed.
        Gives `cache` bucket-sized buffers first if it has none (also for empty `ids`)."""
        if self.prefill_chunk < 1:
            raise ValueError("prefill needs prefill_chunk >= 1")
        if cache[0].keys is None:
            for c, (k, v) in zip(cache, self._empty_buffers()):
                c.keys, c.values, c.offset = _resize(k, self.bucket), _resize(v, self.bucket), 0
        ids = list(ids)
        size = self.prefill_chunk
        for start in range(0, len(ids), size):
            chunk = ids[start : start + size]
            pad = size - len(chunk)
            self._run(self._fns["last"], cache, mx.array([chunk + [0] * pad], dtype=mx.int32))
            if pad:
                for c in cache:
                    c.offset -= pad  # padded slots lie beyond the offset: masked, then overwritten

    def _empty_buffers(self) -> list:
        if self._template is None:
            probe = make_prompt_cache(self.model)
            self.model(mx.zeros((1, 1), dtype=mx.int32), cache=probe)  # shapes and dtypes
            self._template = [(c.keys[..., :0, :], c.values[..., :0, :]) for c in probe]
            mx.eval(self._template)
        return self._template

    def logits(self, cache: list, tokens: mx.array) -> mx.array:
        return self._run(self._fns["logits"], cache, tokens)

    def greedy(self, cache: list, tokens: mx.array) -> mx.array:
        if cache[0].keys is None:
            return mx.argmax(self.model(tokens, cache=cache)[:, -1], axis=-1).astype(mx.int32)
        return self._run(self._fns["last"], cache, tokens)

    def greedy_top(self, cache: list, tokens: mx.array) -> mx.array:
        """[argmax token, its probability] of the last position (float32, shape (2,))."""
        if cache[0].keys is None:
            logits = self.model(tokens, cache=cache)[0, -1].astype(mx.float32)
            token = mx.argmax(logits)
            return mx.stack([token.astype(mx.float32), mx.softmax(logits)[token]])
        return self._run(self._fns["top"], cache, tokens)

    def greedy_every(self, cache: list, tokens: mx.array) -> mx.array:
        if cache[0].keys is None:
            return _greedy(self.model(tokens, cache=cache))
        return self._run(self._fns["every"], cache, tokens)

    def _run(self, fn, cache: list, tokens: mx.array) -> mx.array:
        if cache[0].keys is None:
            return self.model(tokens, cache=cache)
        n = tokens.shape[1]
        offset = cache[0].offset
        self._reserve(cache, offset + n)
        buffers = []
        for c in cache:
            buffers += [c.keys, c.values]
            # Drop the cache's own references so the update can reuse the buffers.
            c.keys = c.values = None
        try:
            out = fn(tokens, mx.array(offset, dtype=mx.int32), *buffers)
        except BaseException:
            for i, c in enumerate(cache):
                c.keys, c.values = buffers[2 * i], buffers[2 * i + 1]
            raise
        del buffers
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset = offset + n
        return out[0]

    def _reserve(self, cache: list, needed: int) -> None:
        """Grow every buffer to a bucket multiple that holds `needed` positions."""
        for c in cache:
            capacity = c.keys.shape[2]
            if needed <= capacity and capacity % self.bucket == 0:
                continue
            size = round_up(max(needed, capacity), self.bucket)
            c.keys = _resize(c.keys, size)
            c.values = _resize(c.values, size)

    def warm(self, lengths: Sequence[int], max_positions: int, head: str = "logits") -> int:
        """Compile every (bucket, query length) of one head (`HEADS`: "logits" for
        `logits`, "last" for `greedy` and prefill, "every" for `greedy_every`) up to
        `max_positions`; returns the count."""
        fn = self._fns[head]
        count = 0
        for size in range(self.bucket, round_up(max_positions, self.bucket) + 1, self.bucket):
            for n in lengths:
                if n > size:
                    continue
                buffers = []
                for k, v in self._empty_buffers():
                    buffers += [_resize(k, size), _resize(v, size)]
                mx.eval(fn(mx.zeros((1, n), dtype=mx.int32), mx.array(size - n, dtype=mx.int32), *buffers))
                count += 1
        return count


def _resize(buffer: mx.array, size: int) -> mx.array:
    """`buffer` cut or zero-padded to `size` positions along axis 2."""
    have = buffer.shape[2]
    if have >= size:
        return buffer[..., :size, :]
    pad = mx.zeros((*buffer.shape[:2], size - have, buffer.shape[3]), dtype=buffer.dtype)
    return mx.concatenate([buffer, pad], axis=2)
