"""A KV store in which every row has its own length, and one forward over rows that
bring different numbers of new tokens.

Why: the fused tick runs the classic rows' decode and the slot holder's verify in one
forward, and streams move between batch and slot at every grant and park, where mlx-lm's
`BatchKVCache` (one write position for all rows) re-prefills, copies and pads. Here a row
is a slot in one buffer per layer, (rows, kv_heads, capacity, head_dim), with its own
length: a stream moves without its keys moving, a rejected draft is dropped by lowering the
row's length, and nothing pads.
`Slab.forward(model, entries)` gives each row its tokens at its own positions, exactly as its
own forward would (`models.forward.slab_forward`); `RowView` puts one row of one layer behind
mlx-lm's `KVCache` interface. mlx-lm is pinned exactly; `check_support` compares this forward
with separate forwards at load, and a family that fails keeps the alternating tick.
See docs/CONTINUOUS_BATCHING.md, "The fused tick".
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, create_attention_mask, make_prompt_cache

from models.forward.slab_forward import STEP, Forward, SlabLayer, last_positions

# Of a position's logit spread. bf16 keeps 8 bits of mantissa (relative step 2^-7), and a
# batched kernel's rounding compounds over a real model's layers to a few percent
# (docs/gpu.md, "What runs by default").
HALF_RTOL = 0.06
FLOAT_RTOL = 0.005  # a GPU's float32 matmuls may round like TF32
# What the load check feeds a model (real text: random ids give logits no model meets).
CHECK_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs back home to sleep."
FRUGAL_ROWS = 4  # rows a packed slab allocates at first (it doubles them as rows come)
RECENT_ROWS = 8  # a packed slab keeps the capacity its last these many freed rows needed
MAX_DOUBLING = 4096  # a packed slab's capacity doubles by at most these many positions


def plain_caches(model: nn.Module, caches: list | None = None) -> bool:
    """Whether every layer of `model` keeps a plain `KVCache` (no sliding window, no
    quantized or state-space cache): the only kind a slab (or a packed forward) holds.
    `caches`: the model's prompt cache, if made already."""
    return all(type(c) is KVCache for c in (make_prompt_cache(model) if caches is None else caches))


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
        k[slot : slot + 1, :, start:end, :] = keys
        v[slot : slot + 1, :, start:end, :] = values
        self.offset = end
        return k[slot : slot + 1, :, :end, :], v[slot : slot + 1, :, :end, :]

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def keys(self) -> mx.array:
        """The row's buffer, (1, kv_heads, capacity, dim), as `KVCache.keys` (valid up to offset)."""
        return self.row.slab.keys[self.layer][self.row.slot : self.row.slot + 1]

    @property
    def values(self) -> mx.array:
        return self.row.slab.values[self.layer][self.row.slot : self.row.slot + 1]

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
    the last one into its place); `reserve` grows the capacity (see `__init__`)."""

    def __init__(self, model: nn.Module, rows: int = 8, grid: bool | None = None) -> None:
        """`rows`: the rows expected at most. `grid`: run forwards as a grid where the
        rows allow it (see `forward`); None: on a GPU, where padding costs little and
        every new shape costs a lot.

        How the buffers grow depends on what a copy of them costs. A packed slab (a CPU)
        allocates `FRUGAL_ROWS` rows and doubles them as rows come, and doubles its
        capacity when a row outgrows it: there growing or shrinking the buffers costs
        as much as a forward of hundreds of tokens, in proportion to the rows
        allocated, and a conversation that grows a turn at a time would pay it at every
        `STEP` (docs/history/benchmarks-2026-12.md). A grid slab (a GPU), where copies cost
        little and memory counts, allocates `rows` at once and grows by `STEP`."""
        self.grid = (mx.default_device() == mx.gpu) if grid is None else grid
        self._frugal = not self.grid
        rows = min(rows, FRUGAL_ROWS) if self._frugal else rows
        # the lengths of the last rows freed: a packed slab keeps the capacity they
        # needed (a conversation's next turn comes back longer than its last)
        self._recent: deque[int] = deque([0], maxlen=RECENT_ROWS)
        probe = make_prompt_cache(model)
        if not plain_caches(model, probe):
            raise ValueError("the slab holds plain KVCache layers only")
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
            if self._frugal:  # double, by at most MAX_DOUBLING positions
                extra = max(extra, min(self.capacity, MAX_DOUBLING))
            self.keys = [_grow(k, 2, extra) for k in self.keys]
            self.values = [_grow(v, 2, extra) for v in self.values]
            self.capacity += extra

    def shrink(self) -> None:
        """Give back capacity no row needs: when the longest row fits in half of it (a
        quarter on a packed slab, which doubled it), keep that length rounded up to
        `STEP` (one long request does not keep every row's buffer at its length after
        it ends). On a packed slab the longest row counts the last `RECENT_ROWS` rows
        freed too, so a replica serving one conversation at a time does not give the
        capacity back between turns and copy it all again at the next. Rows are never
        given back: a slab keeps the most it held at once."""
        longest = max([r.length for r in self.rows] + list(self._recent))
        keep = max(-(-(longest + 1) // STEP) * STEP, STEP)
        if keep * (4 if self._frugal else 2) > self.capacity:
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
        if cache[0].offset:
            self.write_prefix(row, [c.keys[0] for c in cache], [c.values[0] for c in cache], cache[0].offset)
        return row

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position of one row takes, keys and values of every layer."""
        return sum(h * (dk + dv) for h, dk, dv in self._shapes) * self.dtype.size

    def write_prefix(self, row: Row, keys: list[mx.array], values: list[mx.array], length: int) -> None:
        """Fill an empty row with positions 0..length-1 of per-layer (kv_heads, >= length,
        dim) keys and values (the arrays themselves are only read)."""
        if row.length:
            raise ValueError("write_prefix needs an empty row")
        self.reserve(length)
        for i in range(self.num_layers):
            if length:
                self.keys[i][row.slot : row.slot + 1, :, :length, :] = keys[i][None, :, :length, :]
                self.values[i][row.slot : row.slot + 1, :, :length, :] = values[i][None, :, :length, :]
            row.cache[i].offset = length

    def copy_prefix(self, row: Row, length: int) -> tuple[list[mx.array], list[mx.array]]:
        """Evaluated copies of the row's positions 0..length-1, per layer (kv_heads,
        length, dim): new buffers, so later writes to the slab never reach them and
        they do not keep the slab's buffers alive (a slice, even a contiguous one, may
        be a view of the buffer)."""
        if length > row.length:
            raise ValueError(f"the row holds {row.length} positions, not {length}")
        keys = [mx.array(k[row.slot, :, :length, :]) for k in self.keys]
        values = [mx.array(v[row.slot, :, :length, :]) for v in self.values]
        mx.eval(keys, values)
        return keys, values

    def free(self, row: Row) -> None:
        if row.freed:
            return
        row.freed = True
        if self._frugal:
            self._recent.append(row.length)
        last = self.rows.pop()
        if last is not row:
            self._move([(last.slot, row.slot, last.length)] if last.length else [])
            last.slot = row.slot
            self.rows[row.slot] = last

    def swap(self, a: Row, b: Row, discard: Row | None = None) -> None:
        """Exchange two rows' slots (their keys move with them; `discard`, one of them
        about to be freed, takes the other's slot without its keys being copied)."""
        if a is not b:
            self.arrange([b if r is a else a if r is b else r for r in self.rows], discard)

    def arrange(self, order: list[Row], discard: Row | None = None) -> None:
        """Give the rows of `order` (the slab's rows, each once) slots 0, 1, ... in that
        order. Only the rows that hold positions and change slots are copied, and of
        those only the positions they hold; `discard` (a row about to be freed) is not
        copied at all: its new slot holds whatever was there."""
        if len(order) != len(self.rows) or {id(r) for r in order} != {id(r) for r in self.rows}:
            raise ValueError("arrange takes every row of the slab once")
        moves = [
            (row.slot, slot, row.length)
            for slot, row in enumerate(order)
            if row.slot != slot and row.length and row is not discard
        ]
        self._move(moves)
        for slot, row in enumerate(order):
            row.slot = slot
        self.rows = list(order)

    def _move(self, moves: list[tuple[int, int, int]]) -> None:
        """Copy positions 0..length-1 of slot `src` to slot `dst` for each (src, dst,
        length), every read before any write (a row's positions past its length are
        never read: every forward masks them). The rows read are evaluated copies first:
        a write whose source is a view of the buffer it writes to copies the whole buffer
        (MLX cannot update it in place while another array shares its memory), so one
        gather before the writes copies each buffer once, where pairwise swaps would copy it
        at every write. Only the longest moved row's positions are copied, not the whole
        capacity (a packed slab doubles it as rows grow)."""
        if not moves:
            return
        index = mx.array([src for src, _, _ in moves])
        held = max(length for _, _, length in moves)
        taken = [mx.take(x[:, :, :held], index, axis=0) for x in self.arrays()]
        mx.eval(taken)
        for store, parts in ((self.keys, taken[: self.num_layers]), (self.values, taken[self.num_layers :])):
            for x, part in zip(store, parts):
                for j, (_, dst, _) in enumerate(moves):
                    x[dst : dst + 1, :, :held] = part[j : j + 1]

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def forward(
        self,
        model: nn.Module,
        entries: list[tuple[Row, list[int]]],
        values: mx.array | None = None,
        last_only: bool = False,
        interrupt: Callable[[], bool] | None = None,
    ) -> list[mx.array]:
        """Logits (lazy), (n, V) per entry, of one forward in which each entry's row
        gains its tokens, exactly as if each row had run its own forward.

        Packed (the CPU's way): only the entries' own tokens run, and attention is one
        call per run of one-token rows in consecutive slots, one over the rows of a few
        tokens each (drafts, a verify) where they lie close together, and one per other
        multi-token row, over the keys the rows hold. Grid (`self.grid`, when the entries fill a run of slots
        with few gaps): every row of the run brings as many tokens as the widest entry
        (the others padded; a gap's row is a row of padding) and attention is one call
        over the run, against keys up to the longest row rounded up to `STEP`, with a
        mask. The grid computes the padding, which a GPU does nearly for free; in
        exchange a forward's shapes depend only on the run's size, its width and the
        key bucket, so the backend's kernels and attention plans are reused from step
        to step instead of being built for every new length.

        `values`: the entries' tokens as one (lazy) int32 array, the entries' lists
        concatenated in entry order; the lists then only give each entry's length (a
        pipelined step feeds tokens the device has not produced yet).

        `last_only`: each entry's logits at its last token only, (1, V): the output head
        runs on those positions alone (`slab_forward.last_positions`), so a prompt
        chunk that ends with the token to draw from costs no head over the others.

        `interrupt` (a packed slab only): the forward evaluates the layers so far and
        asks it before every `slab_forward.interrupt_every(num_layers)`-th layer, and raises
        `scheduler.model_api.Interrupted` where it returns True. The rows' lengths are then
        as before the call; the layers already run wrote keys and values past them, which
        the rows' next tokens overwrite."""
        if not entries:
            return []
        if interrupt is not None and self.grid:
            raise ValueError("a grid slab's forward is not interruptible")
        ctx = Forward(self, entries)
        ctx.interrupt = interrupt
        layers = [SlabLayer(self, i, ctx) for i in range(self.num_layers)]
        if values is None:
            tokens = mx.array(ctx.tokens, dtype=mx.int32)
        else:  # padding reads the appended zero
            tokens = mx.concatenate([values.astype(mx.int32), mx.zeros((1,), mx.int32)])[mx.array(ctx.source)]
        if ctx.grid is not None:  # (rows, width), as a batch of rows at their own offsets
            tokens = tokens.reshape(*ctx.grid)
        else:  # (tokens, 1): every token a row of its own
            tokens = tokens[:, None]
        ends = None  # with last_only: each entry's last token, in the flat token order
        if last_only:
            ends = [start + len(entries[index][1]) - 1 for index, start in zip(ctx.order, ctx.starts)]
        with last_positions(model, ends) as gathered:
            logits = model(tokens, cache=layers)
        logits = logits.reshape(-1, logits.shape[-1])
        for row, tokens in entries:
            for view in row.cache:
                view.offset += len(tokens)
        out = [None] * len(entries)
        for k, (index, start) in enumerate(zip(ctx.order, ctx.starts)):
            if gathered:
                out[index] = logits[k : k + 1]
            elif last_only:
                out[index] = logits[ends[k] : ends[k] + 1]
            else:
                out[index] = logits[start : start + len(entries[index][1])]
        return out


def _grow(x: mx.array, axis: int, extra: int) -> mx.array:
    shape = list(x.shape)
    shape[axis] = extra
    return mx.concatenate([x, mx.zeros(shape, x.dtype)], axis=axis)


def check_support(model: nn.Module, atol: float = 1e-3, token_ids: list[int] | None = None) -> str | None:
    """None when a slab forward of this model matches separate forwards; else why not.

    Throwaway rows: two one-token rows at different lengths (a run) and one row verifying
    three tokens, against the same forwards on private caches; and the same with each
    row's last logits only (`last_only`). `token_ids` (at least 17: real text) feed them;
    without, ids 1-17. A match is `logits_agree`'s, so a half-precision model's batched
    kernels may round differently as long as the greedy tokens stay the same."""
    if not plain_caches(model):
        return "its cache is not a plain KVCache in every layer"
    ids = list(token_ids)[:17] if token_ids is not None and len(token_ids) >= 17 else list(range(1, 18))
    prompts = [ids[0:5], ids[5:8], ids[8:12]]
    news = [ids[12:13], ids[13:14], ids[14:17]]
    try:
        alone = []
        for prompt, new in zip(prompts, news):
            cache = make_prompt_cache(model)
            model(mx.array([prompt]), cache=cache)
            alone.append(model(mx.array([new]), cache=cache)[0])
        pairs = []
        for last_only in (False, True):  # every position; the last ones alone (a prefill's draw)
            slab = Slab(model, rows=2)
            rows = [slab.add() for _ in prompts]
            slab.forward(model, [(r, p) for r, p in zip(rows, prompts)])
            packed = slab.forward(model, [(r, n) for r, n in zip(rows, news)], last_only=last_only)
            pairs += [(p, a[-1:] if last_only else a) for p, a in zip(packed, alone)]
        rtol = HALF_RTOL if alone[0].dtype != mx.float32 else FLOAT_RTOL
        why = logits_agree(mx.concatenate([p for p, _ in pairs]), mx.concatenate([a for _, a in pairs]), atol, rtol)
    except Exception as exc:  # noqa: BLE001 - any failure means: not supported
        return f"a slab forward failed: {type(exc).__name__}: {exc}"
    return None if why is None else f"a slab forward differs from separate ones: {why}"


def logits_agree(got: mx.array, want: mx.array, atol: float, rtol: float) -> str | None:
    """None when logits `got` (positions x vocabulary) stand for `want`: at every position
    the largest difference is within `atol` or `rtol` of `want`'s spread (max - min);
    else by how much they differ. Within that bound a greedy token can change only where
    `want`'s top two are within twice the difference (a near tie rounding may flip)."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err = mx.abs(got - want).max(axis=-1)
    spread = want.max(axis=-1) - want.min(axis=-1)
    if bool(mx.all(err <= mx.maximum(atol, rtol * spread)).item()):
        return None
    rel = (err / mx.maximum(spread, 1e-6)).max().item()
    return f"by {err.max().item():.3g} ({rel:.2%} of the logits' spread; tolerance {rtol:.2%} of it, or {atol:g})"
