"""Exact rollback of mlx-lm prompt caches: drop a round's rejected tokens, or refuse.

The one place that reads mlx-lm cache internals (pinned mlx-lm 0.32.2). mlx-lm's own
`trim_prompt_cache` is not enough: it decides on `is_trimmable()` (for a
`RotatingKVCache`: offset < max_size, so true on an empty cache and false once the ring
has filled), returns how much it trimmed without anyone checking, and leaves the
trimmed tail of a ring in its buffer, where the next update takes it for valid keys.

Per layer type (`trim_exact`):
- `KVCache`, `QuantizedKVCache`, `ChunkedKVCache`, and a slab row (`models.forward.slab.RowView`):
  entries live at [.., :offset]; moving
  the offset back is exact while there are that many entries to drop.
- `RotatingKVCache` (sliding-window layers): a multi-token update (`_update_concat`)
  leaves the buffer in temporal order with `_idx == keys.shape[2]`, holding the new
  tokens after at least max_size - 1 older ones. Cutting n entries off the end (offset,
  `_idx` and the buffer itself) leaves exactly the state an update without them would
  have left, as long as >= min(offset, max_size) entries remain, which holds for any
  n below the update's length. Worked example, max_size 4, tokens 0..9 cached, verify
  [10..13]: the buffer becomes 7..13 (3 older + 4 new); rejecting 12, 13 leaves 7..11,
  whose last 4 are the window the next token at position 12 attends to. Single-token
  updates overwrite the oldest slot in place once the ring is full, so entries they
  wrote cannot be dropped that way: take a `checkpoint` before them and `restore` it.
- anything else (state-space / recurrent layers: `ArraysCache`, `MambaCache`, ...)
  folds every token into its state and cannot be rolled back at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)

from models.forward.slab import RowView

# Exact types, not isinstance: a model's own subclass may keep its entries differently.
_OFFSET_TYPES = (KVCache, QuantizedKVCache, ChunkedKVCache, RowView)


class RollbackError(RuntimeError):
    """A cache cannot drop the requested entries exactly; nothing was changed."""


def _layers(cache: list) -> Iterator[object]:
    for c in cache:
        if type(c) is CacheList:
            yield from _layers(c.caches)
        else:
            yield c


def can_roll_back(cache: list) -> bool:
    """Whether entries appended by a multi-token forward can always be dropped from
    `cache` exactly (decided by the layer types, so an empty cache answers for a full one)."""
    return all(type(c) in _OFFSET_TYPES or type(c) is RotatingKVCache for c in _layers(cache))


def has_ring(cache: list) -> bool:
    """Whether some layer is a sliding-window ring (single-token updates overwrite)."""
    return any(type(c) is RotatingKVCache for c in _layers(cache))


def _droppable(c: object) -> int:
    """How many of the newest entries of one layer cache can be dropped exactly."""
    if type(c) in (KVCache, QuantizedKVCache, RowView):
        return c.offset
    if type(c) is ChunkedKVCache:
        return c.offset - c.start_position
    if type(c) is RotatingKVCache:
        if c.keys is None:
            return 0
        if c._idx == c.offset:  # never wrapped: the whole history is at [.., :_idx]
            return c.offset
        if c._idx != c.keys.shape[2]:  # wrapped and mid-ring: not in temporal order
            return 0
        # Temporal with history evicted: keep max_size entries (max_size - 1 would do
        # for attention, but mlx-lm's one-token update would then try to grow the ring).
        return max(c._idx - c.max_size, 0)
    return 0


def trim_exact(cache: list, n: int) -> None:
    """Drop the newest `n` entries of every layer, leaving the state the cache would
    have had without them; raises `RollbackError` (cache untouched) where any layer
    cannot. n == 0 is always a no-op."""
    if n == 0:
        return
    if n < 0:
        raise ValueError(f"cannot trim a negative number of entries ({n})")
    layers = list(_layers(cache))
    for c in layers:
        if _droppable(c) < n:
            raise RollbackError(
                f"{type(c).__name__} (offset {getattr(c, 'offset', '?')}) cannot drop its "
                f"last {n} entries exactly (at most {_droppable(c)})"
            )
    for c in layers:
        if type(c) is RotatingKVCache:
            c.offset -= n
            c._idx -= n
            # The dropped tail must leave the buffer too: an update takes everything
            # up to the buffer's end as history once the ring is full.
            c.keys = c.keys[..., : c._idx, :]
            c.values = c.values[..., : c._idx, :]
        elif c.trim(n) != n:  # checked above; a mismatch means mlx-lm changed
            raise RollbackError(f"{type(c).__name__}.trim({n}) dropped fewer entries")


@dataclass
class Checkpoint:
    """A cache's state at one point: per layer, a ring's arrays or another's offset."""

    layers: list  # (layer, state tuple) for a RotatingKVCache, else (layer, offset)


def checkpoint(cache: list) -> Checkpoint:
    """Remember `cache` as it is now, so `restore` can return to it after any updates.

    Ring arrays are held through new handles: an in-place ring write rebinds the
    cache's own handle (and copies the buffer once, since it is shared) but leaves
    these. Offset-type layers only ever write past their offset, so it is enough.
    """
    saved = []
    for c in _layers(cache):
        if type(c) is RotatingKVCache:
            keys = None if c.keys is None else mx.array(c.keys)
            values = None if c.values is None else mx.array(c.values)
            saved.append((c, (keys, values, c.offset, c.keep, c.max_size, c._idx)))
        else:
            saved.append((c, c.offset))
    return Checkpoint(saved)


def restore(saved: Checkpoint) -> None:
    """Return the checkpointed cache to that state (after any appends since)."""
    for c, state in saved.layers:
        if type(c) is RotatingKVCache:
            c.keys, c.values, c.offset, c.keep, c.max_size, c._idx = state
        else:
            trim_exact([c], c.offset - state)
