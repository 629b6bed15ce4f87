"""The affinity keys a replica served recently, published to every router through Serve's
routing stats, so that routers share one view of where each conversation lives.

A replica records the key (its Serve session id) of every request it receives in
`ServedKeys`, an LRU of the `capacity` most recent keys, and Serve polls
`ServedKeys.report()` every `request_routing_stats_period_s` through the deployment's
`record_routing_stats`; each router then reads it as `RunningReplica.routing_stats`
(`read_report`). Keys travel as 64-bit digests (`key_digest`), so a session id of any
length costs the same. No ray here: plain data in, plain data out.

Cost: a full report is 4,096 entries of (16-character digest, float time), about
120 KB pickled. Serve's controller sends every replica's report to every router (one per
HTTP proxy and one per `SpecslotIngress` replica) when any report changes, so a busy
deployment of N replicas sends about N x 120 KB to each router per stats period. A
replica that served no new request since its last report returns the same report, and
an unchanged report is not sent again.

>>> served = ServedKeys(capacity=2)
>>> served.record("a", now=1.0); served.record("b", now=2.0); served.record("a", now=3.0)
>>> report = read_report(served.report(now=4.0))
>>> report.num_sessions, report.served_at(key_digest("a")), report.reported_at
(2, 3.0, 4.0)
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Any, Mapping, NamedTuple

DEFAULT_CAPACITY = 4096  # as many as a router pins (`affinity.DEFAULT_MAX_PINS`)


def key_digest(key: str) -> str:
    """The key as it is published: 16 hex characters of blake2b (collisions among a few
    thousand keys per replica: about 1 in 10**12)."""
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


class Report(NamedTuple):
    """One replica's report, as a router reads it. `served_at` maps a key's digest to when
    the replica last received a request with that key (the replica's wall clock);
    `reported_at` is when the report was taken (0.0: no report yet)."""

    served: Mapping[str, float]
    num_sessions: int
    reported_at: float

    def served_at(self, digest: str) -> float | None:
        return self.served.get(digest)


NO_REPORT = Report({}, 0, 0.0)


def read_report(routing_stats: Mapping[str, Any] | None) -> Report:
    """A replica's routing stats as a `Report`; anything else (no stats yet, another
    deployment's shape) reads as an empty report. Reads, never copies the keys."""
    if not routing_stats or not isinstance(routing_stats.get("served_keys"), Mapping):
        return NO_REPORT
    return Report(
        routing_stats["served_keys"],
        int(routing_stats.get("num_sessions", 0)),
        float(routing_stats.get("reported_at", 0.0)),
    )


class ServedKeys:
    """The replica's side: the `capacity` most recently served keys and when each was last
    served. `report()` is the payload of `record_routing_stats`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity!r}")
        self.capacity = capacity
        self._served: OrderedDict[str, float] = OrderedDict()  # least recently served first
        self._report: dict = {}
        self._changed = False

    def __len__(self) -> int:
        return len(self._served)

    def record(self, key: str | None, now: float) -> None:
        """A request with affinity key `key` (None or "": no key, nothing recorded) arrived."""
        if not key:
            return
        digest = key_digest(key)
        self._served.pop(digest, None)
        self._served[digest] = now
        if len(self._served) > self.capacity:
            self._served.popitem(last=False)
        self._changed = True

    def report(self, now: float) -> dict:
        """The routing stats to publish: the served keys (digest -> last served), their
        count and when the report was taken. Nothing served since the last report: that
        same report, which Serve does not broadcast again."""
        if self._changed or not self._report:
            self._report = {"served_keys": dict(self._served), "num_sessions": len(self._served), "reported_at": now}
            self._changed = False
        return self._report
