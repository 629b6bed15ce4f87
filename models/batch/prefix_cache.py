"""A per-replica store of KV prefixes: finished streams' keys and values, kept so that
a later prompt starting with the same tokens prefills only the rest.

An entry is a token sequence and, per layer, its keys and values (kv_heads, n, dim) for
positions 0..n-1. Attention is causal, so any prefix of an entry serves any prompt that
starts with it, and a hit may end anywhere. A lookup walks chained hashes of full
`block_size`-token blocks, then compares tokens (a hash collision cannot make a wrong hit)
and keeps the longest common prefix. Entries hold copies, never views of live rows (a row
keeps changing, an entry must not); their bytes count against `budget_bytes`, least recently
used entries are evicted first, and an entry whose tokens are a prefix of a new one is
replaced by it. Nothing here is ever a stream's state (a hit is copied into a row; a parked
session keeps its own row), so evicting an entry never reaches a running or parked stream.
See docs/configuration.md, "Prefix cache".
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import numpy as np

from models.platform.device_memory import total_memory

BLOCK_SIZE = 64
DEFAULT_BUDGET_CAP = 4 << 30
DEFAULT_BUDGET_SHARE = 8  # unset: 1/8 of the memory available at load, at most the cap


@dataclass
class PrefixHit:
    """`num_tokens` leading prompt tokens are cached: positions 0..num_tokens-1 of
    `keys` / `values` (per layer, (kv_heads, >= num_tokens, dim)). Read-only."""

    num_tokens: int
    keys: list[mx.array]
    values: list[mx.array]


@dataclass
class _Entry:
    token_ids: np.ndarray
    keys: list[mx.array]
    values: list[mx.array]
    num_bytes: int
    hashes: list[int]


def block_hashes(token_ids: Sequence[int], block_size: int) -> Iterator[int]:
    """The chained hash of every full block: the i-th names token_ids[:(i+1)*block_size]."""
    h = 0
    for end in range(block_size, len(token_ids) + 1, block_size):
        h = hash((h, tuple(token_ids[end - block_size : end])))
        yield h


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading entries `a` and `b` share.

    >>> common_prefix_length(np.array([1, 2, 3]), np.array([1, 2, 4, 5]))
    2
    """
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if len(differ) else m


def default_budget(available_bytes: int) -> int:
    """The budget when none is configured: an eighth of the memory available once the
    model is loaded, at most 4 GiB.

    >>> default_budget(16 << 30) == 2 << 30, default_budget(128 << 30) == 4 << 30
    (True, True)
    """
    return max(0, min(available_bytes // DEFAULT_BUDGET_SHARE, DEFAULT_BUDGET_CAP))


def available_memory() -> int:
    """Bytes the KV may still take: this process's share of the device's memory
    (`device_memory.total_memory`) less what MLX holds on a GPU, the host's available
    memory on a CPU."""
    total = total_memory()
    if mx.default_device() == mx.gpu and total:
        return max(total - mx.get_active_memory(), 0)
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class PrefixCache:
    """KV prefixes under a byte budget, least recently used evicted first. Not
    thread-safe: the engine thread owns it (snapshots read `stats()` between ticks)."""

    def __init__(self, budget_bytes: int, block_size: int = BLOCK_SIZE) -> None:
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently used first
        self._by_prefix: dict[int, dict[int, None]] = {}  # block chain hash -> entry ids
        self._next_id = 0
        self.num_bytes = 0
        self.num_hits = 0  # lookups that found a prefix
        self.num_misses = 0
        self.num_query_tokens = 0  # prompt tokens looked up
        self.num_hit_tokens = 0  # prompt tokens found
        self.num_stores = 0
        self.num_evictions = 0  # entries dropped for room

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def lookup(self, token_ids: Sequence[int]) -> PrefixHit | None:
        """The longest cached prefix of `token_ids` that leaves the last token to run
        (its logits give the first output token) and spans at least one block; None
        for a miss. A hit makes its entry the most recently used."""
        self.num_query_tokens += len(token_ids)
        entry_id, length = self._usable_prefix(token_ids)
        if not length:
            self.num_misses += 1
            return None
        self._entries.move_to_end(entry_id)
        entry = self._entries[entry_id]
        self.num_hits += 1
        self.num_hit_tokens += length
        return PrefixHit(length, entry.keys, entry.values)

    def cached_length(self, token_ids: Sequence[int]) -> int:
        """The length of the prefix `lookup(token_ids)` would return now (0: a miss),
        without counting a lookup or making its entry the most recently used."""
        return self._usable_prefix(token_ids)[1]

    def _usable_prefix(self, token_ids: Sequence[int]) -> tuple[int | None, int]:
        """(entry id, length) of the longest cached prefix a prefill of `token_ids` may
        start from: it leaves the last token to run and spans at least one block;
        length 0 where none does."""
        entry_id, length = self._longest(token_ids[: len(token_ids) - 1])
        return (entry_id, length) if length >= self.block_size else (None, 0)

    def store(
        self, token_ids: Sequence[int], num_bytes: int, copy_kv: Callable[[], tuple[list[mx.array], list[mx.array]]]
    ) -> bool:
        """Keep the KV of `token_ids` (about `num_bytes`). `copy_kv()` returns its
        per-layer keys and values, (kv_heads, len(token_ids), dim) copies that nothing
        else writes; it is called only when the entry is kept. Not kept: sequences
        shorter than a block, larger than the budget, or already held (the holder
        becomes the most recently used). Returns whether it was kept."""
        n = len(token_ids)
        if n < self.block_size or num_bytes > self.budget_bytes:
            return False
        tokens = np.asarray(token_ids, dtype=np.int64)
        hashes = list(dict.fromkeys(block_hashes(token_ids, self.block_size)))  # a collision may repeat one
        for entry_id in list(self._by_prefix.get(hashes[0], ())):
            held = self._entries[entry_id].token_ids
            common = common_prefix_length(held, tokens)
            if common == n:
                self._entries.move_to_end(entry_id)
                return False
            if common == len(held):  # the new entry serves everything this one does
                self._remove(entry_id)
        keys, values = copy_kv()
        size = sum(a.nbytes for a in keys) + sum(a.nbytes for a in values)
        if size > self.budget_bytes:
            return False
        while self.num_bytes + size > self.budget_bytes:
            self._remove(next(iter(self._entries)))
            self.num_evictions += 1
        entry_id, self._next_id = self._next_id, self._next_id + 1
        self._entries[entry_id] = _Entry(tokens, keys, values, size, hashes)
        for h in hashes:
            self._by_prefix.setdefault(h, {})[entry_id] = None
        self.num_bytes += size
        self.num_stores += 1
        return True

    def clear(self) -> None:
        for entry_id in list(self._entries):
            self._remove(entry_id)

    def stats(self) -> dict:
        """Counters for the scheduler snapshot and /metrics."""
        return {
            "budget_bytes": self.budget_bytes,
            "bytes": self.num_bytes,
            "entries": self.num_entries,
            "block_size": self.block_size,
            "hits": self.num_hits,
            "misses": self.num_misses,
            "query_tokens": self.num_query_tokens,
            "hit_tokens": self.num_hit_tokens,
            "stores": self.num_stores,
            "evictions": self.num_evictions,
        }

    def _longest(self, token_ids: Sequence[int]) -> tuple[int | None, int]:
        """(entry id, length) of the longest common prefix any entry shares with
        `token_ids`; (None, 0) when none shares a full block."""
        candidates: dict[int, None] = {}
        for h in block_hashes(token_ids, self.block_size):
            held = self._by_prefix.get(h)
            if not held:
                break
            candidates = held
        best_id, best = None, 0
        if candidates:
            tokens = np.asarray(token_ids, dtype=np.int64)
            for entry_id in candidates:
                length = common_prefix_length(self._entries[entry_id].token_ids, tokens)
                if length > best:
                    best_id, best = entry_id, length
        return best_id, best

    def _remove(self, entry_id: int) -> None:
        entry = self._entries.pop(entry_id)
        for h in entry.hashes:
            held = self._by_prefix[h]
            del held[entry_id]
            if not held:
                del self._by_prefix[h]
        self.num_bytes -= entry.num_bytes
