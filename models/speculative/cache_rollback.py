"""Exact rollback of mlx-lm prompt caches: drop a round's rejected tokens, or refuse.

The one place that reads mlx-lm cache internals (pinned mlx-lm 0.32.2). mlx-lm's own
`trim_prompt_cache` is not enough: it trusts `is_trimmable()` (for a ring: true while empty,
false once full), nobody checks how much it trimmed, and it leaves a ring's trimmed tail
where the next update takes it for valid keys. Per layer type (`trim_exact`):
- `KVCache`, `QuantizedKVCache`, `ChunkedKVCache`, a slab `RowView`: the offset moves back.
- `RotatingKVCache`: a multi-token update leaves the buffer in temporal order, its new tokens
  after at least max_size - 1 older ones, so cutting fewer than its length off the end is
  exact (max_size 4, tokens 0..9, verify [10..13]: the buffer holds 7..13; rejecting 12, 13
  leaves 7..11, whose last 4 are the next position's window). Single-token updates overwrite
  in place: take a `checkpoint` before them and `restore` it.
- state-space / recurrent layers (`ArraysCache`, `MambaCache`, ...): no rollback at all.
See docs/CONTINUOUS_BATCHING.md, "Rolling back a round: which targets speculate".
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
