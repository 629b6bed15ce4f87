"""Drafts from what this replica wrote before: an n-gram index over the outputs of
streams that left the batch, for rows whose answer repeats earlier answers (agents that
re-ask, code edits that return most of a file).

A row drafts from it (`models.batch.slab_batch`, `replica_drafts`) when the row's last
`min_ngram`..`max_ngram` tokens occurred in a stored output: the tokens that followed
that occurrence, the longest match winning, its most recent occurrence first. The
row's own prompt lookup (`NgramIndex`, n-grams up to 3) is asked when the replica's
index has no match of at least `min_ngram` tokens: a longer match is the likelier draft.

Bounded memory: at most `capacity` tokens are held; when a new output would pass it,
the older half of the outputs is dropped and the index rebuilt from the rest (each
token is indexed at most twice, so adding costs O(max_ngram) per token amortized). An
output never joins n-grams across the boundary with the next one.
"""

from __future__ import annotations

from collections import deque
from typing import Sequence

DEFAULT_CAPACITY = 16384  # tokens of past outputs (about 2 MB of index entries per 1,000 tokens)


class ReplicaIndex:
    """>>> index = ReplicaIndex(min_ngram=2, max_ngram=3)
    >>> index.add([1, 2, 3, 4, 5]); index.add([9, 2, 3, 7])
    >>> index.propose([8, 2, 3], 2), index.propose([1, 2, 3], 2), index.propose([6, 6], 2)
    ([7], [4, 5], [])
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, min_ngram: int = 4, max_ngram: int = 8):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity, self.min_ngram, self.max_ngram = capacity, min_ngram, max_ngram
        self._outputs: deque[list[int]] = deque()
        self._size = 0
        self._tokens: list[int] = []  # the outputs, each followed by a separator (None)
        self._starts: dict[tuple, int] = {}  # n-gram -> where its latest occurrence's follower is
        self.num_proposals = self.num_hits = 0
        self.last_match = 0  # the suffix length the last `propose` matched (0: none)

    def __len__(self) -> int:
        return self._size

    def add(self, output: Sequence[int]) -> None:
        """Store one finished stream's output (an output longer than `capacity` keeps its
        last `capacity` tokens)."""
        output = list(output)[-self.capacity :]
        if len(output) < self.min_ngram + 1:
            return
        if self._size + len(output) > self.capacity:
            while self._outputs and self._size + len(output) > self.capacity // 2:
                self._size -= len(self._outputs.popleft())
            self._tokens, self._starts = [], {}
            for kept in self._outputs:
                self._index(kept)
        self._outputs.append(output)
        self._size += len(output)
        self._index(output)

    def _index(self, output: list[int]) -> None:
        base = len(self._tokens)
        self._tokens += output
        self._tokens.append(None)
        for end in range(self.min_ngram, len(output)):  # the n-grams ending before `end`, with a follower
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                self._starts[tuple(output[end - n : end])] = base + end

    def propose(self, context: Sequence[int], k: int, count: bool = True) -> list[int]:
        """Up to `k` tokens that followed the latest stored occurrence of the longest
        suffix of `context` (n from `max_ngram` down to `min_ngram`); [] without one.
        `count`: whether the lookup counts in `stats` (a peek does not)."""
        self.last_match = 0
        if k <= 0:
            return []
        out = []
        tail = list(context[-self.max_ngram :])
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            at = self._starts.get(tuple(tail[-n:]))
            if at is not None:
                self.last_match = n
                for token in self._tokens[at : at + k]:
                    if token is None:
                        break
                    out.append(token)
                break
        if count:
            self.count(self.last_match > 0)
        return out

    def count(self, hit: bool) -> None:
        """One proposal in `stats` (a hit: its suffix matched); a peek
        (`propose(..., count=False)`) is counted this way once it is used."""
        self.num_proposals += 1
        self.num_hits += hit

    def stats(self) -> dict:
        return {
            "tokens": self._size,
            "outputs": len(self._outputs),
            "proposals": self.num_proposals,
            "hits": self.num_hits,
        }
