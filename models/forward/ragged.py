"""One model forward over groups of rows that bring different numbers of new tokens.

The fused tick needs the classic batch's decode step (B rows, one token each) and the slot
holder's verify (one row, 1 + K tokens, its own `KVCache`) in a single forward, without
padding the decode rows. Tokens are packed as rows of length one (input (T, 1), T = B + 1 +
K); each layer's `_PackedLayer` cache view gives every token its own position, writes each
group's new keys into that group's own cache, and has attention computed per group against
its own keys and mask, copying nothing. mlx-lm hands caches with a `bits` attribute to
`base.quantized_scaled_dot_product_attention`; `_attention` takes that name for packed
groups and passes every other call through unchanged. mlx-lm is pinned exactly; this is the
only module that relies on the hook. `check_support` runs a packed forward against separate
forwards at load; a family that fails it keeps the alternating tick.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_base
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from models.forward.slab import plain_caches

_MLX_QUANTIZED_SDPA = mlx_base.quantized_scaled_dot_product_attention


@dataclass
class Group:
    """Rows of one cache in a packed forward: `cache` holds one entry per layer (a
    `BatchKVCache` of B rows that bring one token each, or a `KVCache` of one row that
    brings `tokens.size` tokens); `tokens` has shape (B,) or (n,)."""

    cache: list
    tokens: mx.array

    @property
    def is_batch(self) -> bool:
        return isinstance(self.cache[0], BatchKVCache)

    @property
    def num_tokens(self) -> int:
        return self.tokens.size


class _Packed:
    """Per-group keys (or values) handed from `update_and_fetch` to `_attention`."""

    def __init__(self, parts: list[mx.array]) -> None:
        self.parts = parts


class _GroupMasks:
    """What `make_mask` returns for a packed forward: one mask per group."""

    def __init__(self, groups: list[Group]) -> None:
        self.counts = [g.num_tokens for g in groups]
        self.masks = [
            g.cache[0].make_mask(1 if g.is_batch else g.num_tokens, return_array=g.is_batch, window_size=None)
            for g in groups
        ]


class _PackedLayer:
    bits = 0  # routes mlx-lm's attention call to `_attention` (see the module docstring)
    group_size = 0

    def __init__(self, caches: list, groups: list[Group], offset: mx.array, masks: _GroupMasks) -> None:
        self._caches = caches
        self._groups = groups
        self.offset = offset
        self._masks = masks

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> _GroupMasks:
        return self._masks

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[_Packed, _Packed]:
        out_keys, out_values, start = [], [], 0
        for cache, group in zip(self._caches, self._groups):
            n = group.num_tokens
            k, v = keys[start : start + n], values[start : start + n]
            if not group.is_batch:  # n rows of one token -> one row of n tokens
                k, v = k.transpose(2, 1, 0, 3), v.transpose(2, 1, 0, 3)
            k, v = cache.update_and_fetch(k, v)
            out_keys.append(k)
            out_values.append(v)
            start += n
        return _Packed(out_keys), _Packed(out_values)


def _attention(queries, keys, values, scale, mask, group_size=64, bits=8):
    if not isinstance(keys, _Packed):
        return _MLX_QUANTIZED_SDPA(queries, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits)
    outputs, start = [], 0
    for k, v, n, m in zip(keys.parts, values.parts, mask.counts, mask.masks):
        q = queries[start : start + n]
        if k.shape[0] == 1 and n > 1:  # one row's n tokens attend causally to its cache
            out = mx.fast.scaled_dot_product_attention(q.transpose(2, 1, 0, 3), k, v, scale=scale, mask=m)
            out = out.transpose(2, 1, 0, 3)
        else:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)
        outputs.append(out)
        start += n
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)


mlx_base.quantized_scaled_dot_product_attention = _attention


def _offsets(group: Group) -> mx.array:
    offset = group.cache[0].offset
    if group.is_batch:
        return offset.astype(mx.int32)
    return mx.arange(offset, offset + group.num_tokens, dtype=mx.int32)


def packed_forward(model: nn.Module, groups: list[Group]) -> list[mx.array]:
    """Logits (lazy) of every group's new tokens from one forward: (B, V) for a batch
    group, (n, V) for a one-row group. Each group's cache gains its tokens, exactly as
    if the group had run its own forward."""
    if not groups:
        return []
    masks = _GroupMasks(groups)
    offset = mx.concatenate([_offsets(g) for g in groups])
    layers = [_PackedLayer([g.cache[i] for g in groups], groups, offset, masks) for i in range(len(groups[0].cache))]
    tokens = mx.concatenate([g.tokens.astype(mx.int32) for g in groups])
    logits = model(tokens[:, None], cache=layers)[:, 0, :]
    out, start = [], 0
    for g in groups:
        out.append(logits[start : start + g.num_tokens])
        start += g.num_tokens
    return out


class Rider:
    """Stands in for the model in one classic decode step and carries a verify along:
    called like the model with the batch's (B, 1) tokens and caches, it runs one
    packed forward with `extra` and keeps the extra group's logits in `extra_logits`
    (None until the step ran)."""

    def __init__(self, model: nn.Module, extra: Group) -> None:
        self.model = model
        self.extra = extra
        self.extra_logits: mx.array | None = None

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        if self.extra_logits is not None:
            raise RuntimeError("a Rider carries its verify in one forward only")
        batch, self.extra_logits = packed_forward(self.model, [Group(cache, inputs[:, 0]), self.extra])
        return batch[:, None, :]


def check_support(model: nn.Module, atol: float = 1e-3) -> str | None:
    """None when a packed forward of this model matches separate forwards; else why not.

    Runs on throwaway caches: a batch of two rows at different lengths plus one row
    verifying three tokens, compared with the same three forwards run apart.
    """
    if not plain_caches(model):
        return "its cache is not a plain KVCache in every layer"
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    try:

        def prefilled(prompt):
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            return cache

        def batch_of(caches):
            return [BatchKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]

        verify, step = mx.array([13, 14, 15]), mx.array([16, 17])
        alone_batch = model(step[:, None], cache=batch_of([prefilled(p) for p in prompts[:2]]))[:, 0, :]
        alone_verify = model(verify[None], cache=prefilled(prompts[2]))[0]
        packed = packed_forward(
            model, [Group(batch_of([prefilled(p) for p in prompts[:2]]), step), Group(prefilled(prompts[2]), verify)]
        )
        diff = max(mx.abs(packed[0] - alone_batch).max().item(), mx.abs(packed[1] - alone_verify).max().item())
    except Exception as exc:  # noqa: BLE001 - any failure means: not supported
        return f"a packed forward failed: {type(exc).__name__}: {exc}"
    if not diff <= atol:
        return f"a packed forward differs from separate ones by {diff:.3g}"
    return None
