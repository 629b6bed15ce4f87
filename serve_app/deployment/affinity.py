"""Which replica serves a request: conversation affinity under a load bound.

Pure functions over plain data (no ray), plus the router's one piece of state, `SessionPins`;
used by `serve_app.deployment.router`. A known key goes to its home (`home_replica`: this
router's pin, or a replica that reports serving the key after that pin), where its prefix
cache is. A new key goes to the replica with the fewest sessions, reported plus this router's
unreported placements (`UnreportedPins`); ties: the shorter queue, then the rendezvous score
`hash(key, replica_id)`. Either way, a replica whose queue exceeds the least loaded one's by
more than `load_margin` loses the request, and the pin, to the least loaded replica, where a
request without a key goes too. Times come from several machines' clocks: skew far below
the time between a conversation's turns changes no choice. Worked example, margin 4, queues
{a: 9, b: 3}: a key pinned to `a` goes to `b` (9 - 3 = 6 > 4) and is pinned to `b`; with
{a: 7, b: 3} it stays on `a` (7 - 3 = 4). A new key with pins {a: 3, b: 2} goes to `b`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Container, Mapping, NamedTuple

DEFAULT_MAX_PINS = 4096
ARRIVAL_GRACE_S = 10.0  # a routed request reaches its replica well within this


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
    return min(queue_lens, key=lambda rid: (pin_counts.get(rid, 0), queue_lens[rid], -rendezvous_score(key, rid), rid))


def home_replica(pin: Pin | None, served_at: Mapping[str, float], candidates: Container[str]) -> str | None:
    """Where a key's latest turn went, among `candidates`: this router's `pin`, unless a
    replica reports serving the key later than the pin was made (another router sent it
    there since); without a pin, the replica that served it last (ties: the larger id).
    `served_at` maps replica ids to when each last served the key, from their reports.

    >>> home_replica(Pin("a", 5.0), {"a": 5.1, "b": 3.0}, "ab")
    'a'
    >>> home_replica(Pin("a", 5.0), {"b": 6.0}, "ab")
    'b'
    >>> home_replica(None, {"a": 1.0, "b": 2.0}, "ab")
    'b'
    """
    reported = {rid: t for rid, t in served_at.items() if rid in candidates}
    latest = max(reported, key=lambda rid: (reported[rid], rid)) if reported else None
    if pin is not None and pin.replica_id in candidates:
        if latest is None or reported[latest] <= pin.pinned_at or latest == pin.replica_id:
            return pin.replica_id
    return latest


def choose_replica(
    key: str | None,
    queue_lens: Mapping[str, int],
    load_margin: int,
    pinned: str | None = None,
    pin_counts: Mapping[str, int] | None = None,
) -> str:
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


def rank_replicas(
    key: str | None,
    queue_lens: Mapping[str, int],
    load_margin: int,
    pinned: str | None = None,
    pin_counts: Mapping[str, int] | None = None,
) -> list[str]:
    """Every candidate, best first: `choose_replica`'s choice, then the rest by queue
    length (what the router tries when the first refuses the request)."""
    first = choose_replica(key, queue_lens, load_margin, pinned, pin_counts)
    rest = sorted((rid for rid in queue_lens if rid != first), key=lambda rid: (queue_lens[rid], rid))
    return [first, *rest]


class Pin(NamedTuple):
    """A key's replica in this router, and when the router last sent the key there."""

    replica_id: str
    pinned_at: float


class SessionPins:
    """Which replica each recently seen key is pinned to, and since when: at most
    `capacity` keys, the least recently used forgotten first (a forgotten key is placed
    anew, like a new one, unless a replica reports it).

    >>> pins = SessionPins(capacity=2)
    >>> pins.pin("x", "a"); pins.pin("y", "b"); pins.pin("z", "a", now=7.0)
    >>> pins.get("x"), pins.lookup("z"), pins.counts(["a", "b"])
    (None, Pin(replica_id='a', pinned_at=7.0), {'a': 1, 'b': 1})
    """

    def __init__(self, capacity: int = DEFAULT_MAX_PINS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._pins: OrderedDict[str, Pin] = OrderedDict()  # least recently used first
        self._num_pins: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def lookup(self, key: str) -> Pin | None:
        """`key`'s pin (marking it used), or None."""
        pin = self._pins.get(key)
        if pin is not None:
            self._pins.move_to_end(key)
        return pin

    def get(self, key: str) -> str | None:
        """The replica `key` is pinned to (marking it used), or None."""
        pin = self.lookup(key)
        return None if pin is None else pin.replica_id

    def pin(self, key: str, replica_id: str, now: float = 0.0) -> None:
        """Pin `key` to `replica_id` as of `now` (0.0: older than any replica's report)."""
        old = self._pins.pop(key, None)
        if old is not None:
            self._drop(old.replica_id)
        elif len(self._pins) >= self.capacity:
            _, evicted = self._pins.popitem(last=False)
            self._drop(evicted.replica_id)
        self._pins[key] = Pin(replica_id, now)
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


class UnreportedPins:
    """This router's placements that replicas have not reported yet: per replica, the
    digests of keys pinned there that its reports do not hold, with when. A placement
    leaves the count once a report of its replica holds the key, or once a report taken
    `ARRIVAL_GRACE_S` after it still does not (its request never arrived); a report taken
    while the request is on its way changes nothing. Each replica keeps at most `capacity`.

    >>> unreported = UnreportedPins()
    >>> unreported.note("a", "k1", 5.0, served=()); unreported.note("a", "k2", 6.0, served=())
    >>> unreported.note("a", "k3", 6.5, served={"k3"})  # already in a's report
    >>> unreported.count("a", served={"k1"}, reported_at=6.2), unreported.count("b", served=(), reported_at=0.0)
    (1, 0)
    """

    def __init__(self, capacity: int = DEFAULT_MAX_PINS) -> None:
        self.capacity = capacity
        self._pinned_at: dict[str, OrderedDict[str, float]] = {}  # per replica, oldest first
        self._reported_at: dict[str, float] = {}  # per replica, the report last applied

    def note(self, replica_id: str, digest: str, now: float, served: Container[str]) -> None:
        """This router pinned the key `digest` to `replica_id` at `now`; `served` holds
        the digests in that replica's last report."""
        if digest in served:
            return
        pinned = self._pinned_at.setdefault(replica_id, OrderedDict())
        pinned.pop(digest, None)
        pinned[digest] = now
        if len(pinned) > self.capacity:
            pinned.popitem(last=False)

    def count(self, replica_id: str, served: Container[str], reported_at: float) -> int:
        """Placements on `replica_id` that its report (the digests `served`, taken at
        `reported_at`) does not cover."""
        pinned = self._pinned_at.get(replica_id)
        if not pinned:
            return 0
        if self._reported_at.get(replica_id) != reported_at:  # a new report: apply it once
            self._reported_at[replica_id] = reported_at
            for digest in [d for d, t in pinned.items() if d in served or t < reported_at - ARRIVAL_GRACE_S]:
                del pinned[digest]
        return len(pinned)

    def retain(self, replica_ids: Container[str]) -> None:
        """Forget replicas that are gone."""
        for rid in [rid for rid in self._pinned_at if rid not in replica_ids]:
            del self._pinned_at[rid]
            self._reported_at.pop(rid, None)
