"""One model call over a slab's rows (`Slab.forward`): how its tokens are laid out, where
their keys and values go, and how attention runs over them.

Packed (a CPU): tokens are packed as rows of length one, so every projection and MLP runs
once over all of them; each token gets its own RoPE position; keys and values are
scattered into their rows at their positions (one scatter per layer); attention runs once
per run of one-token rows in consecutive slots (the classic batch: one SDPA over those
rows of the buffer with a length mask; a row that drafts splits the run in two), once
over the rows that bring 2..`EXACT_WIDTHS` tokens (rows' drafts, a verify) when their
slots have few others between them (`_Block`: a masked grid over their run of slots,
`_grid_attention` with its softmax in numpy), and once per other multi-token row (a prompt chunk, or
a row of a few tokens apart from the others: causal, over that row alone).
Grid (a GPU, `Slab.grid`): every row of a run of slots brings as many tokens as the
widest entry, padded (`grid_width`), one masked attention call over the run (two
matmuls and a softmax when rows bring several tokens, `_grid_attention`).

mlx-lm routes attention through `base.scaled_dot_product_attention`, which hands caches
with a `bits` attribute to `base.quantized_scaled_dot_product_attention`; the slab's
layer view (`SlabLayer`) has one, and `_attention` takes that name (installed on
import) for slab calls and passes every other call through.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base as mlx_base
import numpy as np

from models.platform import cpu_math
from scheduler.model_api import Interrupted

if TYPE_CHECKING:
    from models.forward.slab import Row, Slab

_NEXT_SDPA = mlx_base.quantized_scaled_dot_product_attention
STEP = 256  # capacity grows in these many positions, and grid forwards bucket keys by it
EXACT_WIDTHS = 8  # grid forwards up to this many tokens per row run at their own width
# How a grid step of several one-token rows (a classic decode step on a GPU) attends:
# "mask": one SDPA over the run's bucket of keys with a mask array (MLX CUDA's one-query
# kernel takes no mask array, so this goes to its general attention); "rows": one SDPA
# per row over exactly its keys, no mask (the one-query kernel a lone row's step uses),
# for runs of at most `PER_ROW_DECODE` rows; "matmuls": `_grid_attention` (docs/gpu.md,
# "Known issues": which is fastest is still open).
DECODE_ATTENTION = "mask"
PER_ROW_DECODE = 8
# An interruptible forward asks at most this many times: each checkpoint evaluates the graph
# so far, a sync a lone decode step feels (docs/CONTINUOUS_BATCHING.md, "Arrivals stop a decode step").
INTERRUPT_CHECKPOINTS = 3


def interrupt_every(num_layers: int) -> int:
    """The layers between an interruptible forward's checkpoints (at least 2).

    >>> [interrupt_every(n) for n in (8, 16, 30, 64)]
    [2, 4, 8, 16]
    """
    return max(2, -(-num_layers // (INTERRUPT_CHECKPOINTS + 1)))


class Forward:
    """What every layer of one forward shares: token order, positions, the scatter
    indices, the attention masks."""

    def __init__(self, slab: Slab, entries: list[tuple[Row, list[int]]]) -> None:
        if len({id(row) for row, _ in entries}) != len(entries):
            raise ValueError("a row appears twice in one forward")
        for row, tokens in entries:
            if not tokens:
                raise ValueError("an entry brings no tokens")
            if row.slab is not slab or row.freed:
                raise ValueError("an entry's row is not in this slab")
        # Runs of one-token rows in consecutive slots: (first slot, rows, keys, mask) each
        # share one attention call.
        self.runs: list[tuple[int, int, int, mx.array | None]] = []
        self.block: _Block | None = None  # packed: the rows of a few tokens, in one call
        self.groups: list[tuple[Row, int]] = []
        self.grid: tuple[int, int] | None = None  # (rows, width)
        self.grid_rows: slice | mx.array = slice(0)  # the grid's slots: a run, or gathered
        self.grid_mask = None
        self.row_keys: list[tuple[int, int]] | None = None  # (slot, keys) of a decode step's rows
        slots = [row.slot for row, _ in entries]
        lo, hi = min(slots), max(slots) + 1
        if slab.grid and _few_gaps(slots):
            self._plan_grid(slab, entries, list(range(lo, hi)))
        elif slab.grid and max(len(tokens) for _, tokens in entries) > EXACT_WIDTHS:
            # Prompt chunks of rows far apart (a group whose shorter prompts are done):
            # the entries' rows alone, their keys gathered for attention. Packed, every
            # row's causal attention would build a plan for its own shape on MLX CUDA.
            self._plan_grid(slab, entries, sorted(slots))
        else:
            self._plan_packed(slab, entries)
        self.capacity = slab.capacity
        self._flat: dict[int, mx.array] = {}
        # Asked between layers whether to give the forward up (`Slab.forward`'s `interrupt`).
        self.interrupt: Callable[[], bool] | None = None

    def _plan_packed(self, slab: Slab, entries: list[tuple[Row, list[int]]]) -> None:
        single = sorted((i for i, (_, t) in enumerate(entries) if len(t) == 1), key=lambda i: entries[i][0].slot)
        # One-token rows in consecutive slots share one attention call per run (a row that
        # drafts between them splits a run instead of sending every row to its own call).
        runs: list[list[int]] = []
        for i in single:
            if runs and entries[runs[-1][-1]][0].slot + 1 == entries[i][0].slot:
                runs[-1].append(i)
            else:
                runs.append([i])
        singles = set(single)
        short = sorted(
            (i for i in range(len(entries)) if 1 < len(entries[i][1]) <= EXACT_WIDTHS), key=lambda i: entries[i][0].slot
        )
        # float32 only (a CPU's dtype): the block's softmax runs in numpy
        if len(short) > 1 and slab.dtype == mx.float32 and _few_gaps([entries[i][0].slot for i in short]):
            self.block = _Block(slab, [(entries[i][0], len(entries[i][1])) for i in short])
        else:
            short = []
        in_block = set(short)
        self.order = single + short + [i for i in range(len(entries)) if i not in singles and i not in in_block]
        self.groups = [(entries[i][0], len(entries[i][1])) for i in self.order[len(single) + len(short) :]]
        offsets = _entry_offsets(entries)
        self.tokens, positions, slots, self.starts, self.source = [], [], [], [], []
        for i in self.order:
            row, tokens = entries[i]
            self.starts.append(len(self.tokens))
            self.tokens += tokens
            self.source += range(offsets[i], offsets[i] + len(tokens))
            positions += range(row.length, row.length + len(tokens))
            slots += [row.slot] * len(tokens)
        slab.reserve(max(positions) + 1)
        self._set_positions(slots, positions)
        for run in runs:
            lengths = np.array([entries[i][0].length for i in run], np.int64)
            keys = int(lengths.max()) + 1
            mask = None
            if len(run) > 1:
                valid = np.arange(keys)[None, :] <= lengths[:, None]
                mask = mx.array(valid[:, None, None, :])
            self.runs.append((entries[run[0]][0].slot, len(run), keys, mask))

    def _plan_grid(self, slab: Slab, entries: list[tuple[Row, list[int]]], grid_slots: list[int]) -> None:
        """A grid over `grid_slots`: a run of slots (those between entries run as padding)
        or, when they are not one run, the entries' own slots."""
        width = grid_width(max(len(tokens) for _, tokens in entries))
        by_slot = {row.slot: i for i, (row, _) in enumerate(entries)}
        lo, hi = grid_slots[0], grid_slots[-1] + 1
        lengths = np.array([slab.rows[s].length for s in grid_slots], np.int64)
        keys = -(-(int(lengths.max()) + width) // STEP) * STEP
        slab.reserve(keys)
        self.grid = (len(grid_slots), width)
        self.grid_rows = slice(lo, hi) if hi - lo == len(grid_slots) else mx.array(grid_slots)
        self.order = [by_slot[s] for s in grid_slots if s in by_slot]
        offsets = _entry_offsets(entries)
        pad = offsets[-1]  # `values` gets a zero appended at this index
        self.tokens, self.starts, self.source = [], [], []
        for s in grid_slots:
            i = by_slot.get(s)
            tokens = entries[i][1] if i is not None else []
            if i is not None:
                self.starts.append(len(self.tokens))
                self.source += range(offsets[i], offsets[i] + len(tokens))
            self.tokens += tokens + [0] * (width - len(tokens))
            self.source += [pad] * (width - len(tokens))
        # scatter order: (row, head, position), the layout of a (rows, heads, width, dim) key block
        self._grid_rows = (np.asarray(grid_slots, np.int64), lengths, width)
        self.positions = mx.array(lengths.astype(np.int32))  # RoPE: one offset per row
        if len(grid_slots) == 1 and width == 1:
            # A lone row's decode attends to exactly its keys, unmasked: the one-query
            # attention kernel takes any key length without building anything new, and
            # runs faster without a mask array. (Several queries keep the bucket: the
            # backend plans that attention per key length.)
            self.grid_keys, self.grid_mask = int(lengths[0]) + 1, None
            return
        self.grid_keys = keys
        if width == 1 and DECODE_ATTENTION == "rows" and len(grid_slots) <= PER_ROW_DECODE:
            # a decode step's rows (one-token grids always run over a run of slots), each
            # over exactly its keys (`DECODE_ATTENTION`)
            self.row_keys = [(s, int(n) + 1) for s, n in zip(grid_slots, lengths)]
            return
        self.grid_mask = _grid_mask(lengths, width, keys)

    def _set_positions(self, slots, positions) -> None:
        self.positions = mx.array(np.asarray(positions, np.int32))
        self._slots_pos = (np.asarray(slots, np.int64), np.asarray(positions, np.int64))

    def flat_index(self, heads: int) -> mx.array:
        """Indices into a layer buffer viewed as (rows * heads * capacity, dim), in the
        order of the new keys: token-major for packed (tokens, heads, 1, dim) keys,
        (row, head, position) for a grid's (rows, heads, width, dim)."""
        if heads not in self._flat:
            h = np.arange(heads, dtype=np.int64)
            if self.grid is not None:
                slots, lengths, width = self._grid_rows
                pos = lengths[:, None] + np.arange(width, dtype=np.int64)[None, :]
                flat = (slots[:, None, None] * heads + h[None, :, None]) * self.capacity + pos[:, None, :]
            else:
                slots, pos = self._slots_pos
                flat = (slots[:, None] * heads + h[None, :]) * self.capacity + pos[:, None]
            self._flat[heads] = mx.array(flat.reshape(-1))
        return self._flat[heads]


def _grid_mask(lengths: np.ndarray, width: int, keys: int) -> mx.array:
    """(rows, 1, width, keys): query i of a row of `lengths` held positions sees keys
    0..length + i (a gap's row, or a query past a row's tokens: whatever, it is padding,
    and key 0 is always seen, so no row of the softmax is all -inf)."""
    valid = np.arange(keys)[None, None, :] <= (lengths[:, None, None] + np.arange(width)[None, :, None])
    return mx.array(valid[:, None])


def _few_gaps(slots: list[int]) -> bool:
    """Whether the run of slots from the lowest to the highest of `slots` (distinct) has
    few enough others in it to run them as padding."""
    return (max(slots) + 1 - min(slots)) - len(slots) <= max(1, len(slots) // 4)


class _Block:
    """Packed rows that bring a few tokens each (rows' drafts, a verify), attended in one
    call instead of one each: their run of slots as a grid of `width` queries a row
    (slots between them, and queries past a row's tokens, are padding), one masked
    attention over the run's keys (`_grid_attention`, its softmax in numpy). `rows`:
    (row, tokens), by slot; their tokens come in that order in the packed forward."""

    def __init__(self, slab: Slab, rows: list[tuple[Row, int]]) -> None:
        self.lo = rows[0][0].slot
        self.num_rows = rows[-1][0].slot + 1 - self.lo
        self.width = max(n for _, n in rows)
        self.count = sum(n for _, n in rows)
        self.keys = max(row.length + n for row, n in rows)
        gather = np.zeros((self.num_rows, self.width), np.int64)  # padding reads token 0
        take = np.empty(self.count, np.int64)
        k = 0
        for row, n in rows:
            r = row.slot - self.lo
            gather[r, :n] = np.arange(k, k + n)
            take[k : k + n] = r * self.width + np.arange(n)
            k += n
        self.gather = mx.array(gather.reshape(-1))
        self.take = mx.array(take)
        lengths = np.array([slab.rows[s].length for s in range(self.lo, self.lo + self.num_rows)], np.int64)
        self.mask = _grid_mask(lengths, self.width, self.keys)


def grid_width(n: int) -> int:
    """The width a grid forward pads its widest entry of `n` tokens to: `n` itself up to
    `EXACT_WIDTHS` (decode steps and verifies, a few widths each compiled once), then the
    next power of two, so prefill chunks of any length share a handful of shapes instead
    of building kernels and attention plans for every prompt length.

    >>> [grid_width(n) for n in (1, 5, 8, 9, 100, 256, 300, 512)]
    [1, 5, 8, 16, 128, 256, 512, 512]
    """
    return n if n <= EXACT_WIDTHS else 1 << (n - 1).bit_length()


class _Gather:
    """Stands in for a model's body (`model.model`) during one call: runs it and keeps
    the given flat positions of its output, so the model's own head code (a tied or
    separate output projection, a soft cap, a scale) runs on those positions only.
    Attribute reads go to the body (heads read `model.model.embed_tokens`)."""

    def __init__(self, body: nn.Module, positions: list[int]) -> None:
        self._body = body
        self._positions = mx.array(positions)

    def __call__(self, *args, **kwargs) -> mx.array:
        hidden = self._body(*args, **kwargs)
        return hidden.reshape(-1, hidden.shape[-1])[self._positions][None]

    def __getattr__(self, name: str):
        return getattr(self._body, name)


@contextlib.contextmanager
def last_positions(model: nn.Module, positions: list[int] | None):
    """Within the block, `model(...)` returns logits (1, len(positions), V) for those
    flat token positions only, when `positions` is given and the model's body is its
    `model` attribute (mlx-lm's text models); yields whether it does (else the caller
    slices the full logits)."""
    body = getattr(model, "model", None) if positions is not None else None
    if not isinstance(body, nn.Module):
        yield False
        return
    object.__setattr__(model, "model", _Gather(body, positions))
    try:
        yield True
    finally:
        object.__delattr__(model, "model")


def _entry_offsets(entries: list[tuple[Row, list[int]]]) -> list[int]:
    """Where each entry's tokens start in the entries' concatenated tokens, and the total."""
    out = [0]
    for _, tokens in entries:
        out.append(out[-1] + len(tokens))
    return out


class _Keys:
    """What `update_and_fetch` hands mlx-lm's attention call for a slab layer."""

    def __init__(self, layer: "SlabLayer") -> None:
        self.layer = layer


class SlabLayer:
    bits = 0  # routes mlx-lm's attention call to `_attention` (see the module docstring)
    group_size = 0

    def __init__(self, slab: Slab, index: int, ctx: Forward) -> None:
        self.slab = slab
        self.index = index
        self.ctx = ctx
        self.offset = ctx.positions

    def make_mask(self, *args, **kwargs) -> Forward:
        return self.ctx

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[_Keys, _Keys]:
        slab, i = self.slab, self.index
        if i and self.ctx.interrupt is not None and i % interrupt_every(slab.num_layers) == 0:
            mx.eval(keys)  # the layers before this one are done: ask before running the rest
            if self.ctx.interrupt():
                raise Interrupted
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
    if ctx.row_keys is not None:  # one-token rows, each over exactly its keys
        return mx.concatenate(
            [
                mx.fast.scaled_dot_product_attention(
                    queries[j : j + 1], k_all[s : s + 1, :, :n], v_all[s : s + 1, :, :n], scale=scale
                )
                for j, (s, n) in enumerate(ctx.row_keys)
            ]
        )
    if ctx.grid is not None:  # queries: (rows, heads, width, dim)
        width, t, rows = ctx.grid[1], ctx.grid_keys, ctx.grid_rows
        if isinstance(rows, slice):
            keys, values = k_all[rows, :, :t], v_all[rows, :, :t]
        else:  # rows apart: their keys gathered (prompt chunks, where compute outweighs the copy)
            keys, values = mx.take(k_all[:, :, :t], rows, axis=0), mx.take(v_all[:, :, :t], rows, axis=0)
        if width > 1 or (ctx.grid_mask is not None and DECODE_ATTENTION == "matmuls"):
            return _grid_attention(queries, keys, values, scale, ctx.grid_mask)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=ctx.grid_mask)
    outputs, start = [], 0
    for lo, m, t, mask in ctx.runs:
        q = queries[start : start + m].reshape(m, heads, 1, dim)
        out = mx.fast.scaled_dot_product_attention(
            q, k_all[lo : lo + m, :, :t], v_all[lo : lo + m, :, :t], scale=scale, mask=mask
        )
        outputs.append(out.reshape(m, heads, 1, dim))
        start += m
    block = ctx.block
    if block is not None:
        rows, width, t = block.num_rows, block.width, block.keys
        q = mx.take(queries[start : start + block.count], block.gather, axis=0)  # (rows * width, heads, 1, dim)
        q = q.reshape(rows, width, heads, dim).transpose(0, 2, 1, 3)
        out = _grid_attention(
            q,
            k_all[block.lo : block.lo + rows, :, :t],
            v_all[block.lo : block.lo + rows, :, :t],
            scale,
            block.mask,
            numpy_softmax=True,
        )
        out = out.transpose(0, 2, 1, 3).reshape(rows * width, heads, 1, dim)
        outputs.append(mx.take(out, block.take, axis=0))
        start += block.count
    for row, n in ctx.groups:
        end = row.length + n  # lengths move after the forward
        q = queries[start : start + n].transpose(2, 1, 0, 3)  # n rows of one token -> one row of n
        out = mx.fast.scaled_dot_product_attention(
            q,
            k_all[row.slot : row.slot + 1, :, :end],
            v_all[row.slot : row.slot + 1, :, :end],
            scale=scale,
            mask="causal" if n > 1 else None,
        )
        outputs.append(out.transpose(2, 1, 0, 3))
        start += n
    return outputs[0] if len(outputs) == 1 else mx.concatenate(outputs)


def _grid_attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array, numpy_softmax: bool = False
) -> mx.array:
    """A grid's attention with several queries per row, as two matmuls and a softmax:
    `mx.fast.scaled_dot_product_attention` with a mask builds a plan on MLX CUDA for every
    new (rows, width, keys) shape, which a new concurrency's first requests wait for; this
    way builds none (docs/gpu.md, "What runs by default"). Queries (rows, heads, width,
    dim), keys and values (rows, kv heads, keys, dim), mask (rows, 1, width, keys).

    `numpy_softmax` (a packed forward's `_Block`, float32 on a CPU): the softmax in numpy
    where the scores can be evaluated (`cpu_math`, whose `exp` is far faster than MLX's on an
    x86 CPU: docs/configuration.md, "CPU softmax and SiLU")."""
    rows, heads, width, dim = queries.shape
    kv_heads = keys.shape[1]
    q = (queries * scale).reshape(rows, kv_heads, heads // kv_heads, width, dim)
    scores = q @ keys[:, :, None].swapaxes(-1, -2)  # (rows, kv heads, group, width, keys)
    if numpy_softmax and cpu_math._evaluated(scores):
        probs = cpu_math._softmax_numpy(scores, False, mask[:, :, None])
    else:
        scores = mx.where(mask[:, :, None], scores, mx.array(-mx.inf, scores.dtype))
        probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values[:, :, None]).reshape(rows, heads, width, dim)


mlx_base.quantized_scaled_dot_product_attention = _attention
