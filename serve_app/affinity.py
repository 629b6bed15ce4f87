"""Which replica serves a request: conversation affinity under a load bound.

Pure functions over plain data (no ray), plus the router's one piece of state,
`SessionPins`; used by `serve_app.router`. A conversation's turns share an affinity
key. A key seen before goes to the replica it is pinned to, where its prefix cache is.
A new key is placed on the replica with the fewest pinned keys (ties: the shorter
queue, then the highest rendezvous score `hash(key, replica_id)`), so conversations
spread evenly however their keys hash: 8 conversations on 2 replicas split 4 / 4.
Either way the replica is used unless its queue is longer than the least loaded
replica's by more than `load_margin` requests; then the least loaded replica serves
the request and the key is pinned there (it now holds the longer prefix). A request
without a key goes to the least loaded replica.

Worked example, margin 4, queues {a: 9, b: 3}: a key pinned to `a` goes to `b`
(9 - 3 = 6 > 4) and is pinned to `b`; with {a: 7, b: 3} it stays on `a` (7 - 3 = 4,
within the margin). A new key with pins {a: 3, b: 2} goes to `b`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Mapping

DEFAULT_MAX_PINS = 4096


def rendezvous_score(key: str, replica_id: str) -> int:
    """A stable pseudo-random score of (key, replica); the same in every process."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred_replica(key: str, replica_ids: list[str]) -> str:
    """The replica `key` hashes to: the highest rendezvous score (ties: the larger id)."""
    return max(replica_ids, key=lambda rid: (rendezvous_score(key, rid), rid))


def least_loaded(queue_lens: Mapping[str, int]) -> str:
    """The replica with the shortest queue (ties: the smaller id, so the choice is stable)."""
    return min(queue_lens, key=lambda rid: (queue_lens[rid], rid))


def place_key(key: str, pin_counts: Mapping[str, int], queue_lens: Mapping[str, int]) -> str:
    """The replica for a key not pinned to any candidate: the fewest pinned keys, then
    the shorter queue, then the key's rendezvous preference.

    >>> place_key("k", {"a": 3, "b": 2}, {"a": 0, "b": 5})
    'b'
    """
    return min(queue_lens, key=lambda rid: (pin_counts.get(rid, 0), queue_lens[rid],
                                            -rendezvous_score(key, rid), rid))


def choose_replica(key: str | None, queue_lens: Mapping[str, int], load_margin: int,
                   pinned: str | None = None, pin_counts: Mapping[str, int] | None = None) -> str:
    """The replica for one request, given every candidate's queue length, the replica
    `key` is pinned to (None: not pinned, or pinned to a replica that is gone) and how
    many keys each replica holds pinned.

    >>> choose_replica(None, {"a": 2, "b": 1}, 4)
    'b'
    >>> choose_replica("k", {"a": 2, "b": 1}, 4, pinned="a")
    'a'
    """
    if not queue_lens:
        raise ValueError("no replica to choose from")
    fallback = least_loaded(queue_lens)
    if key is None:
        return fallback
    home = pinned if pinned in queue_lens else place_key(key, pin_counts or {}, queue_lens)
    if queue_lens[home] - queue_lens[fallback] > load_margin:
        return fallback
    return home


def rank_replicas(key: str | None, queue_lens: Mapping[str, int], load_margin: int,
                  pinned: str | None = None, pin_counts: Mapping[str, int] | None = None) -> list[str]:
    """Every candidate, best first: `choose_replica`'s choice, then the rest by queue
    length (what the router tries when the first refuses the request)."""
    first = choose_replica(key, queue_lens, load_margin, pinned, pin_counts)
    rest = sorted((rid for rid in queue_lens if rid != first), key=lambda rid: (queue_lens[rid], rid))
    return [first, *rest]


class SessionPins:
    """Which replica each recently seen key is pinned to: at most `capacity` keys, the
    least recently used forgotten first (a forgotten key is placed anew, like a new one).

    >>> pins = SessionPins(capacity=2)
    >>> pins.pin("x", "a"); pins.pin("y", "b"); pins.pin("z", "a")
    >>> pins.get("x"), pins.counts(["a", "b"])
    (None, {'a': 1, 'b': 1})
    """

    def __init__(self, capacity: int = DEFAULT_MAX_PINS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._replica_of: OrderedDict[str, str] = OrderedDict()  # least recently used first
        self._num_pins: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._replica_of)

    def get(self, key: str) -> str | None:
        """The replica `key` is pinned to (marking it used), or None."""
        replica_id = self._replica_of.get(key)
        if replica_id is not None:
            self._replica_of.move_to_end(key)
        return replica_id

    def pin(self, key: str, replica_id: str) -> None:
        old = self._replica_of.pop(key, None)
        if old is not None:
            self._drop(old)
        elif len(self._replica_of) >= self.capacity:
            _, evicted = self._replica_of.popitem(last=False)
            self._drop(evicted)
        self._replica_of[key] = replica_id
        self._num_pins[replica_id] = self._num_pins.get(replica_id, 0) + 1

    def counts(self, replica_ids: list[str]) -> dict[str, int]:
        """Pinned keys per replica, for these replicas (pins to others are not counted)."""
        return {rid: self._num_pins.get(rid, 0) for rid in replica_ids}

    def _drop(self, replica_id: str) -> None:
        left = self._num_pins[replica_id] - 1
        if left:
            self._num_pins[replica_id] = left
        else:
            del self._num_pins[replica_id]
