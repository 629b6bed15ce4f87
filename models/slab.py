"""A KV store in which every row has its own length, and one forward over rows that
bring different numbers of new tokens.

Why: the fused tick runs the classic rows' decode step and the slot holder's verify
(1 + K tokens) in one forward, and streams move between the classic batch and the
slot at every grant and park. In mlx-lm's `BatchKVCache` rows share one write
position (left padding keeps them aligned), so a stream joining it is re-prefilled as
a one-token prompt, every join or leave copies the whole batch cache, and a returning
holder, longer by its speculative gain, raises every row's padding. Here a row is a
slot in one preallocated buffer per layer, (rows, kv_heads, capacity, head_dim), with
its own length: a stream moves between the batch and the slot without its keys
moving, a rejected draft is dropped by lowering the row's length, and nothing pads.

`Slab.forward(model, entries)` runs one model call for entries (row, tokens). Tokens
are packed as rows of length one, so every projection and MLP runs once over all of
them; each token gets its own RoPE position; keys and values are scattered into their
rows at their positions (one scatter per layer); attention runs once for the
one-token rows that fill slots 0..m-1 (the classic batch: one SDPA over the buffer's
first m rows with a length mask) and once per multi-token row (a verify or a prompt:
causal, over that row alone). mlx-lm routes attention through
`base.scaled_dot_product_attention`, which hands caches with a `bits` attribute to
`base.quantized_scaled_dot_product_attention`; the packed layer view has one, and
`_attention` takes that name for slab calls and passes every other call through.

`RowView` is one row of one layer behind mlx-lm's `KVCache` interface (offset,
update_and_fetch, trim, make_mask, state), so ordinary forwards (a session's prefill,
a probe, a verify alone) run on a row as on a private cache.

mlx-lm is pinned exactly; `check_support` compares this forward with separate
forwards at load, so a family whose layers do something else keeps the alternating tick.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_base
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask, make_prompt_cache

_NEXT_SDPA = mlx_base.quantized_scaled_dot_product_attention
# bf16 keeps 8 bits of mantissa (relative step 2^-7 ~ 0.008); a few roundings apart.
HALF_RTOL = 0.03
STEP = 256  # capacity grows in these many positions, as mlx-lm's KVCache does


def plain_caches(model: nn.Module) -> bool:
    """Whether every layer of `model` keeps a plain `KVCache` (no sliding window, no
    quantized or state-space cache): the only kind a slab (or a packed forward) holds."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


class Row:
    """One stream's place in the slab: `slot` (moves when rows are compacted) and one
    `RowView` per layer (`cache`), whose offsets are the row's length."""

    def __init__(self, slab: "Slab", slot: int) -> None:
        self.slab = slab
        self.slot = slot
        self.cache = [RowView(self, i) for i in range(slab.num_layers)]
        self.freed = False

    @property
    def length(self) -> int:
        return self.cache[0].offset


class RowView:
    """One row of one layer, as an mlx-lm `KVCache`: entries live at [.., :offset]."""

    def __init__(self, row: Row, layer: int) -> None:
        self.row = row
        self.layer = layer
        self.offset = 0

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        slab, slot, start = self.row.slab, self.row.slot, self.offset
        end = start + keys.shape[2]
        slab.reserve(end)
        k, v = slab.keys[self.layer], slab.values[self.layer]
        k[slot:slot + 1, :, start:end, :] = keys
        v[slot:slot + 1, :, start:end, :] = values
        self.offset = end
        return k[slot:slot + 1, :, :end, :], v[slot:slot + 1, :, :end, :]

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def keys(self) -> mx.array:
        """The row's buffer, (1, kv_heads, capacity, dim), as `KVCache.keys` (valid up to offset)."""
        return self.row.slab.keys[self.layer][self.row.slot:self.row.slot + 1]

    @property
    def values(self) -> mx.array:
        return self.row.slab.values[self.layer][self.row.slot:self.row.slot + 1]

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.row.slab.keys[self.layer], self.row.slab.values[self.layer]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.offset == 0


class Slab:
    """Rows of KV for one model. Slots 0..num_rows-1 are in use (freeing a row moves
    the last one into its place); `reserve` grows the capacity in `STEP` positions."""

    def __init__(self, model: nn.Module, rows: int = 8) -> None:
        if not plain_caches(model):
            raise ValueError("the slab holds plain KVCache layers only")
        probe = make_prompt_cache(model)
        model(mx.array([[0]]), cache=probe)
        self.num_layers = len(probe)
        self._shapes = [(c.keys.shape[1], c.keys.shape[3], c.values.shape[3]) for c in probe]
        self.dtype = probe[0].keys.dtype
        self.capacity = STEP
        self.keys = [mx.zeros((rows, h, STEP, dk), self.dtype) for h, dk, _ in self._shapes]
        self.values = [mx.zeros((rows, h, STEP, dv), self.dtype) for h, _, dv in self._shapes]
        self.rows: list[Row] = []

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def reserve(self, length: int) -> None:
        """Room for rows of `length` positions."""
        if length > self.capacity:
            extra = -(-(length - self.capacity) // STEP) * STEP
            self.keys = [_grow(k, 2, extra) for k in self.keys]
            self.values = [_grow(v, 2, extra) for v in self.values]
            self.capacity += extra

    def shrink(self) -> None:
        """Give back capacity no row needs: when the longest row fits in half of it,
        keep that length rounded up to `STEP` (one long request does not keep every
        row's buffer at its length after it ends)."""
        longest = max((r.length for r in self.rows), default=0)
        keep = max(-(-(longest + 1) // STEP) * STEP, STEP)
        if keep * 2 > self.capacity:
            return
        # contiguous copies, so the larger buffers are released
        self.keys = [mx.contiguous(k[:, :, :keep]) for k in self.keys]
        self.values = [mx.contiguous(v[:, :, :keep]) for v in self.values]
        self.capacity = keep
        mx.eval(self.arrays())

    def add(self) -> Row:
        """A new, empty row (the buffer doubles its rows when full)."""
        if len(self.rows) >= self.keys[0].shape[0]:
            extra = max(self.keys[0].shape[0], 1)
            self.keys = [_grow(k, 0, extra) for k in self.keys]
            self.values = [_grow(v, 0, extra) for v in self.values]
        row = Row(self, len(self.rows))
        self.rows.append(row)
        return row

    def add_from(self, cache: list) -> Row:
        """A new row holding a copy of a plain `KVCache` list's entries."""
        row = self.add()
        length = cache[0].offset
        self.reserve(length)
        for i, c in enumerate(cache):
            if length:
                self.keys[i][row.slot:row.slot + 1, :, :length, :] = c.keys[..., :length, :]
                self.values[i][row.slot:row.slot + 1, :, :length, :] = c.values[..., :length, :]
            row.cache[i].offset = length
        return row

    def free(self, row: Row) -> None:
        if row.freed:
            return
        row.freed = True
        last = self.rows.pop()
        if last is not row:
            self._copy(last.slot, row.slot)
            last.slot = row.slot
            self.rows[row.slot] = last

    def swap(self, a: Row, b: Row) -> None:
        """Exchange two rows' slots (their keys move with them)."""
        if a is b:
            return
        for store in (self.keys, self.values):
            for x in store:
                xa, xb = x[a.slot:a.slot + 1], x[b.slot:b.slot + 1]
                x[a.slot:a.slot + 1] = xb
                x[b.slot:b.slot + 1] = xa
        a.slot, b.slot = b.slot, a.slot
        self.rows[a.slot], self.rows[b.slot] = a, b

    def _copy(self, src: int, dst: int) -> None:
        for store in (self.keys, self.values):
            for x in store:
                x[dst:dst + 1] = x[src:src + 1]

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def forward(self, model: nn.Module, entries: list[tuple[Row, list[int]]]) -> list[mx.array]:
        """Logits (lazy), (n, V) per entry, of one forward in which each entry's row
        gains its tokens, exactly as if each row had run its own forward."""
        if not entries:
            return []
        ctx = _Forward(self, entries)
        layers = [_SlabLayer(self, i, ctx) for i in range(self.num_layers)]
        logits = model(mx.array(ctx.tokens, dtype=mx.int32)[:, None], cache=layers)[:, 0, :]
        for row, tokens in entries:
            for view in row.cache:
                view.offset += len(tokens)
        out, start = [None] * len(entries), 0
        for index in ctx.order:
            n = len(entries[index][1])
            out[index] = logits[start:start + n]
            start += n
        return out


def _grow(x: mx.array, axis: int, extra: int) -> mx.array:
    shape = list(x.shape)
    shape[axis] = extra
    return mx.concatenate([x, mx.zeros(shape, x.dtype)], axis=axis)


class _Forward:
    """What every layer of one packed forward shares: token order, positions, the
    scatter indices, the batch group's mask."""

    def __init__(self, slab: Slab, entries: list[tuple[Row, list[int]]]) -> None:
        if len({id(row) for row, _ in entries}) != len(entries):
            raise ValueError("a row appears twice in one forward")
        single = sorted((i for i, (_, t) in enumerate(entries) if len(t) == 1), key=lambda i: entries[i][0].slot)
        # The batch group: one-token rows in slots 0..m-1 share one attention call.
        self.batch_rows = len(single) if [entries[i][0].slot for i in single] == list(range(len(single))) else 0
        self.order = single[: self.batch_rows] + [i for i in range(len(entries)) if i not in single[: self.batch_rows]]
        self.groups = [(entries[i][0], len(entries[i][1])) for i in self.order[self.batch_rows:]]
        self.tokens, positions, slots = [], [], []
        for i in self.order:
            row, tokens = entries[i]
            if not tokens:
                raise ValueError("an entry brings no tokens")
            self.tokens += tokens
            positions += range(row.length, row.length + len(tokens))
            slots += [row.slot] * len(tokens)
            if row.slab is not slab or row.freed:
                raise ValueError("an entry's row is not in this slab")
        slab.reserve(max(p for p in positions) + 1)
        self.positions = mx.array(positions, dtype=mx.int32)
        self.capacity = slab.capacity
        slots_np, pos_np = np.array(slots, np.int64), np.array(positions, np.int64)
        self._slots_pos = (slots_np, pos_np)
        self._flat: dict[int, mx.array] = {}
        self.batch_len = 0
        self.batch_mask = None
        if self.batch_rows:
            lengths = np.array([entries[i][0].length for i in single[: self.batch_rows]], np.int64)
            self.batch_len = int(lengths.max()) + 1
            if self.batch_rows > 1 or lengths[0] + 1 != self.batch_len:
                valid = np.arange(self.batch_len)[None, :] <= lengths[:, None]
                self.batch_mask = mx.array(valid[:, None, None, :])

    def flat_index(self, heads: int) -> mx.array:
        """Indices into a layer buffer viewed as (rows * heads * capacity, dim), token-major."""
        if heads not in self._flat:
            slots, pos = self._slots_pos
            h = np.arange(heads, dtype=np.int64)
            flat = ((slots[:, None] * heads + h[None, :]) * self.capacity + pos[:, None]).reshape(-1)
            self._flat[heads] = mx.array(flat)
        return self._flat[heads]


class _Keys:
    """What `update_and_fetch` hands mlx-lm's attention call for a slab layer."""

    def __init__(self, layer: "_SlabLayer") -> None:
        self.layer = layer


class _SlabLayer:
    bits = 0  # routes mlx-lm's attention call to `_attention` (see the module docstring)
    group_size = 0

    def __init__(self, slab: Slab, index: int, ctx: _Forward) -> None:
        self.slab = slab
        self.index = index
        self.ctx = ctx
        self.offset = ctx.positions

    def make_mask(self, *args, **kwargs) -> _Forward:
        return self.ctx

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[_Keys, _Keys]:
        slab, i = self.slab, self.index
        index = self.ctx.flat_index(keys.shape[1])
        for store, new in ((slab.keys, keys), (slab.values, values)):
            buffer = store[i]
            flat = buffer.reshape(-1, buffer.shape[-1])
            flat[index] = new.reshape(-1, new.shape[-1])
            store[i] = flat.reshape(buffer.shape)
        marker = _Keys(self)
        return marker, marker


def _attention(queries, keys, values, scale, mask, group_size=64, bits=8):
    if not isinstance(keys, _Keys):
        return _NEXT_SDPA(queries, keys, values, scale=scale, mask=mask, group_size=group_size, bits=bits)
    layer = keys.layer
    ctx, k_all, v_all = layer.ctx, layer.slab.keys[layer.index], layer.slab.values[layer.index]
    heads, dim = queries.shape[1], queries.shape[3]
    outputs, start = [], 0
    if ctx.batch_rows:
        m, t = ctx.batch_rows, ctx.batch_len
        q = queries[:m].reshape(m, heads, 1, dim)
        out = mx.fast.scaled_dot_product_attention(q, k_all[:m, :, :t], v_all[:m, :, :t], scale=scale,
                                                   mask=ctx.batch_mask)
        outputs.append(out.reshape(m, heads, 1, dim))
        start = m
    for row, n in ctx.groups:
        end = row.length + n  # lengths move after the forward
        q = queries[start:start + n].transpose(2, 1, 0, 3)  # n rows of one token -> one row of n
        out = mx.fast.scaled_dot_product_attention(
            q, k_all[row.slot:row.slot + 1, :, :end], v_all[row.slot:row.slot + 1, :, :end], scale=scale,
            mask="causal" if n > 1 else None)
        outputs.append(out.transpose(2, 1, 0, 3))
        start += n
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)


mlx_base.quantized_scaled_dot_product_attention = _attention


def check_support(model: nn.Module, atol: float = 1e-3) -> str | None:
    """None when a slab forward of this model matches separate forwards; else why not.

    Within `atol` in float32; in half precision within `HALF_RTOL` of the largest
    logit (a batched kernel rounds differently from a one-row one). Throwaway rows: two one-token rows at different lengths (the batch group) and one
    row verifying three tokens, against the same forwards run on private caches."""
    if not plain_caches(model):
        return "its cache is not a plain KVCache in every layer"
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]
    news = [[16], [17], [13, 14, 15]]
    try:
        alone = []
        for prompt, new in zip(prompts, news):
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            alone.append(model(mx.array([new]), cache=cache)[0])
        slab = Slab(model, rows=2)
        rows = [slab.add() for _ in prompts]
        slab.forward(model, [(r, p) for r, p in zip(rows, prompts)])
        packed = slab.forward(model, [(r, n) for r, n in zip(rows, news)])
        diff = max(mx.abs(p - a).max().item() for p, a in zip(packed, alone))
        if alone[0].dtype != mx.float32:  # half precision: kernels round differently
            atol = max(atol, HALF_RTOL * max(mx.abs(a).max().item() for a in alone))
    except Exception as exc:  # noqa: BLE001 - any failure means: not supported
        return f"a slab forward failed: {type(exc).__name__}: {exc}"
    if not diff <= atol:
        return f"a slab forward differs from separate ones by {diff:.3g}"
    return None
