"""Which replica serves a request: conversation affinity under a load bound.

Pure functions over plain data (no ray), used by `serve_app.router`. A conversation's
turns share an affinity key; the key's preferred replica is the one with the highest
rendezvous score `hash(key, replica_id)`, so a key keeps its replica while replicas are
added or removed elsewhere (only keys whose replica left move). The preferred replica
is used unless its queue is longer than the least loaded replica's by more than
`load_margin` requests; a request without a key goes to the least loaded replica.

Worked example, margin 4, queues {a: 9, b: 3}: a key preferring `a` goes to `b`
(9 - 3 = 6 > 4); with {a: 7, b: 3} it stays on `a` (7 - 3 = 4, within the margin).
"""

from __future__ import annotations

import hashlib
from typing import Mapping


def rendezvous_score(key: str, replica_id: str) -> int:
    """A stable pseudo-random score of (key, replica); the same in every process."""
    digest = hashlib.blake2b(f"{key}\x00{replica_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def preferred_replica(key: str, replica_ids: list[str]) -> str:
    """The replica `key` belongs to: the highest rendezvous score (ties: the larger id)."""
    return max(replica_ids, key=lambda rid: (rendezvous_score(key, rid), rid))


def least_loaded(queue_lens: Mapping[str, int]) -> str:
    """The replica with the shortest queue (ties: the smaller id, so the choice is stable)."""
    return min(queue_lens, key=lambda rid: (queue_lens[rid], rid))


def choose_replica(key: str | None, queue_lens: Mapping[str, int], load_margin: int) -> str:
    """The replica for one request, given every candidate's queue length.

    >>> choose_replica(None, {"a": 2, "b": 1}, 4)
    'b'
    """
    if not queue_lens:
        raise ValueError("no replica to choose from")
    fallback = least_loaded(queue_lens)
    if key is None:
        return fallback
    preferred = preferred_replica(key, list(queue_lens))
    if queue_lens[preferred] - queue_lens[fallback] > load_margin:
        return fallback
    return preferred


def rank_replicas(key: str | None, queue_lens: Mapping[str, int], load_margin: int) -> list[str]:
    """Every candidate, best first: `choose_replica`'s choice, then the rest by queue
    length (what the router tries when the first refuses the request)."""
    first = choose_replica(key, queue_lens, load_margin)
    rest = sorted((rid for rid in queue_lens if rid != first), key=lambda rid: (queue_lens[rid], rid))
    return [first, *rest]
