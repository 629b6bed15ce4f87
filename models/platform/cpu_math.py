"""Attention's softmax and the MLP's SiLU on MLX's CPU backend, in numpy for prompt-sized
inputs and from MLX's fast primitives for the rest (MLX's own `exp` is slow on x86).

A prompt chunk's softmax and SiLU run in numpy, in place over one copy (a sync per call,
which small inputs would not win back); the rest, and every call inside `mx.compile` (where
nothing may be evaluated), uses `exp` here, a polynomial as accurate as MLX's. `install`
puts `attention` and `swiglu` in place of MLX's and mlx-lm's, process-wide on an x86-64 CPU
only (`models.loading.loader` calls it), so every path of the process computes the same
function. `attention` takes multi-query float32 calls with no mask, a causal one or a 2-D
one; anything else (one query, fewer than `MIN_SCORES` scores, other dtypes, attention
sinks, other masks) goes to MLX's kernel. Not for `mx.compile(shapeless=True)`: `view` of
the exponent bits has no shapeless form, and mlx-lm's one shapeless user
(`activations.swiglu`) is what `swiglu` replaces.
See docs/configuration.md, "CPU softmax and SiLU".
"""

from __future__ import annotations

import functools
import platform
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import activations

X86_64 = ("x86_64", "amd64")
LOG2E = 1.4426950408889634
# 2^f for f in [0, 1): least-squares polynomial of degree 6 (highest power first), its
# relative error ~6e-9, under float32's resolution.
_POLY = (
    2.1871254533521088e-04,
    1.2382410007126033e-03,
    9.686187987641670e-03,
    5.547891082457537e-02,
    2.402310974359102e-01,
    6.931468375864389e-01,
    1.0000000061639827,
)

BLOCK_SCORES = 1 << 18  # attention scores per query block (1 MiB of float32)
# Below this many scores (a short verify) a call's few exponentials cost less than the ~25
# operations here, so it stays on MLX's kernel.
MIN_SCORES = 1 << 14
# SiLU inputs from this many elements (prompt chunks of ~40+ tokens at MLP width 768) go
# to numpy: evaluating there costs a synchronization, which a decode step's few
# thousand elements would not win back.
NUMPY_ELEMENTS = 1 << 15
_MLX_SDPA = mx.fast.scaled_dot_product_attention
_MLX_LM_SWIGLU = activations.swiglu
_installed = False  # `install` ran: `row_logsumexp` and `row_softmax` use `exp`


def exp(x: mx.array) -> mx.array:
    """e^x in float32, as accurate as MLX's `exp`; the result is clamped to float32's
    normal range (0 < e^x < inf for every x, -inf included)."""
    t = mx.clip(x * LOG2E, -126.0, 127.99)
    n = mx.floor(t)
    f = t - n
    p = f * _POLY[0] + _POLY[1]
    for c in _POLY[2:]:
        p = p * f + c
    return p * mx.left_shift((n + 127).astype(mx.int32), 23).view(mx.float32)  # 2^n: its exponent bits


def softmax(x: mx.array) -> mx.array:
    """Softmax over the last axis (-inf entries get 0 weight, up to float32's smallest
    normal: the clamp in `exp`)."""
    e = exp(x - mx.max(x, axis=-1, keepdims=True))
    return e * (1.0 / mx.sum(e, axis=-1, keepdims=True))


def installed() -> bool:
    """Whether `install` put this module's functions in place (an x86-64 CPU)."""
    return _installed


def row_logsumexp(x: mx.array) -> mx.array:
    """`mx.logsumexp(x, axis=-1, keepdims=True)`; after `install` (an x86-64 CPU), from
    `exp` for float32 (a sampler's normalisation: MLX's takes ~1 ms for one position of a
    49k vocabulary, this ~0.4)."""
    if not _installed or x.dtype != mx.float32:
        return mx.logsumexp(x, axis=-1, keepdims=True)
    peak = mx.max(x, axis=-1, keepdims=True)
    peak = mx.where(peak == -mx.inf, 0.0, peak)  # a row that is all -inf stays -inf
    return peak + mx.log(mx.sum(_exact_zeros(x, exp(x - peak)), axis=-1, keepdims=True))


def row_softmax(x: mx.array) -> mx.array:
    """`mx.softmax(x, axis=-1)`; after `install`, from `exp` for float32, -inf entries
    exactly 0 (a filtered token is never drawn)."""
    if not _installed or x.dtype != mx.float32:
        return mx.softmax(x, axis=-1)
    return _exact_zeros(x, softmax(x))


def _exact_zeros(x: mx.array, e: mx.array) -> mx.array:
    # `exp` clamps e^-inf to float32's smallest normal
    return mx.where(x == -mx.inf, 0.0, e)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `activations.swiglu`: SiLU(gate) * x (in half precision mlx-lm's own: `exp`
    is for float32). From `NUMPY_ELEMENTS` elements (a prompt chunk) the SiLU runs in
    numpy, as attention's softmax does; below (decode steps, short verifies) and inside a
    function transformation, from `exp`."""
    if gate.dtype != mx.float32:
        return _MLX_LM_SWIGLU(gate, x)
    if gate.size >= NUMPY_ELEMENTS and _evaluated(gate):
        g = np.array(gate, copy=True)
        np.negative(g, out=g)
        with np.errstate(over="ignore"):  # e^-gate = inf: SiLU's 0, as it should be
            np.exp(g, out=g)
        g += 1.0
        np.reciprocal(g, out=g)
        return mx.array(g) * gate * x
    return gate / (1.0 + exp(-gate)) * x


def _evaluated(array: mx.array) -> bool:
    """Evaluates `array`; False inside a function transformation (`mx.compile`, `vmap`),
    where nothing may be evaluated and the caller stays with MLX operations."""
    try:
        mx.eval(array)
    except (RuntimeError, ValueError):
        return False
    return True


def attention(queries, keys, values, *, scale, mask=None, sinks=None, **kwargs):
    """`mx.fast.scaled_dot_product_attention`'s contract; queries (B, heads, N, dim),
    keys and values (B, kv heads, T, dim). The queries go in blocks whose scores take at
    most `BLOCK_SCORES` elements (each softmax pass stays in the cache, which one over a long
    prompt's whole grid would not), and with a causal mask a block
    reads only the keys up to its last query. A block's softmax runs in numpy
    (`_softmax_numpy`): the scores are evaluated there, so inside a function transformation
    (`mx.compile`, where nothing may be evaluated) the softmax is `softmax`'s instead."""
    n, heads, t = queries.shape[2], queries.shape[1], keys.shape[2]
    plain_mask = (
        mask is None or (isinstance(mask, str) and mask == "causal") or (isinstance(mask, mx.array) and mask.ndim <= 2)
    )
    small = n == 1 or heads * n * t < MIN_SCORES
    if small or sinks is not None or kwargs or queries.dtype != mx.float32 or not plain_mask:
        return _MLX_SDPA(queries, keys, values, scale=scale, mask=mask, sinks=sinks, **kwargs)
    b, _, _, dim = queries.shape
    kv_heads = keys.shape[1]
    causal = isinstance(mask, str)
    step = max(1, BLOCK_SCORES // (heads * t))
    outputs = []
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        end = t - n + hi if causal else t  # the N queries are the last N of the T positions
        q = (queries[:, :, lo:hi] * scale).reshape(b, kv_heads, heads // kv_heads, hi - lo, dim)
        scores = q @ keys[:, :, None, :end].swapaxes(-1, -2)  # (B, kv heads, group, rows, keys)
        block_mask = (
            None if causal or mask is None else (mask[lo:hi] if mask.ndim == 2 and mask.shape[0] == n else mask)
        )
        if _evaluated(scores):
            probs = _softmax_numpy(scores, causal, block_mask)
        else:
            probs = _softmax_mlx(scores, causal, block_mask, t - n + lo, end)
        outputs.append((probs @ values[:, :, None, :end]).reshape(b, heads, hi - lo, dim))
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=2)


def _softmax_numpy(scores: mx.array, causal: bool, mask: mx.array | None) -> mx.array:
    """Masked softmax over the last axis of evaluated float32 `scores` (..., rows, keys),
    computed in numpy, whose `exp` is far faster than MLX's on an x86 CPU (docs/configuration.md,
    "CPU softmax and SiLU"), the five passes over the block in place. `causal`: row i sees keys up to
    keys - rows + i (the rows are the last queries of the block's keys)."""
    x = np.array(scores, copy=True)
    rows, keys = x.shape[-2:]
    if causal and rows > 1:
        np.copyto(x[..., keys - rows :], -np.inf, where=_upper(rows))
    elif mask is not None and mask.dtype == mx.bool_:
        np.copyto(x, -np.inf, where=~np.array(mask))
    elif mask is not None:
        x += np.array(mask.astype(mx.float32))
    x -= x.max(axis=-1, keepdims=True)
    np.exp(x, out=x)
    x *= 1.0 / x.sum(axis=-1, keepdims=True)
    return mx.array(x)


@functools.lru_cache(maxsize=64)
def _upper(rows: int) -> np.ndarray:
    """(rows, rows): True above the diagonal, the keys a causal row may not see."""
    return np.triu(np.ones((rows, rows), dtype=bool), k=1)


def _softmax_mlx(scores: mx.array, causal: bool, mask: mx.array | None, first: int, end: int) -> mx.array:
    """`_softmax_numpy`'s result from MLX operations only (`softmax`), for a traced call;
    `first`: the block's first query position."""
    if causal:
        mask = mx.arange(first, end)[:, None] >= mx.arange(end)[None]
    if mask is not None and mask.dtype == mx.bool_:
        scores = mx.where(mask, scores, mx.array(-mx.inf, scores.dtype))
    elif mask is not None:
        scores = scores + mask
    return softmax(scores)


def install() -> bool:
    """On an x86-64 CPU: `attention` and `swiglu` in place of MLX's and mlx-lm's, also in
    every mlx-lm model module imported so far (call it again after loading a model of a
    new family). Returns whether they are in place. Other machines keep MLX's kernels:
    the slow `exp` was measured on x86-64 only (MLX's CPU code is vectorized differently
    on arm64)."""
    global _installed
    if mx.default_device() != mx.cpu or platform.machine().lower() not in X86_64:
        return False
    mx.fast.scaled_dot_product_attention = attention
    _bind_swiglu(swiglu)
    _installed = True
    return True


def _bind_swiglu(chosen) -> None:
    """`chosen` (`swiglu` or mlx-lm's own) as the `swiglu` of `activations` and of every
    mlx-lm model module that imported either."""
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "swiglu", None) in (_MLX_LM_SWIGLU, swiglu):
            module.swiglu = chosen
