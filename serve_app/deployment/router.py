"""Serve's request router for specslot: a conversation stays on the replica holding its
prefix cache, within a load bound (the policy is `serve_app.deployment.affinity`).

The affinity key is the request's Serve session id (`metadata.session_id`): Serve's session
header where the HTTP proxy routes (`affinity_key: session`; it routes before the body is
read), or behind `SpecslotIngress` (`affinity_key: prompt`) that header or else the prompt's
key (`serve_app.deployment.prompt_key`). Requests without a key go to the shorter queue of
two random replicas, as with Serve's default router. There is one router per HTTP proxy and
one per `SpecslotIngress` replica, each with its own pins (`SessionPins`); the replicas'
routing stats (`serve_app.deployment.served_keys`) are their shared record, so a key placed
by one router is known to the others only after its replica's next report.
See docs/configuration.md, "Prefix cache".
"""

from __future__ import annotations

import asyncio
import logging
import random
import time

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from serve_app.deployment.affinity import DEFAULT_MAX_PINS, SessionPins, UnreportedPins, home_replica, rank_replicas
from serve_app.deployment.served_keys import key_digest, read_report

logger = logging.getLogger("ray.serve")

ROUTER_PATH = "serve_app.deployment.router.PrefixAffinityRouter"
PROBE_DEADLINE_S = 0.1


class PrefixAffinityRouter(RequestRouter):
    load_margin = 4

    def initialize_state(self, load_margin: int = 4, max_pins: int = DEFAULT_MAX_PINS, **kwargs) -> None:
        if not isinstance(load_margin, int) or load_margin < 0:
            raise ValueError(f"load_margin must be a non-negative int, got {load_margin!r}")
        self.load_margin = load_margin
        self.pins = SessionPins(max_pins)
        self.unreported = UnreportedPins(max_pins)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """One replica per rank, best first; Serve tries them in order."""
        if not candidate_replicas:
            return []
        if pending_request is not None:
            # Every rank is tried each pass: back off before the next pass (all were full).
            pending_request.routing_context.should_backoff = True
        key = affinity_key(pending_request)
        if key is None or len(candidate_replicas) < 2:
            # Power of two choices, as Serve's default: Serve sends to the shorter queue.
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        queue_lens = await self._queue_lens(candidate_replicas)
        # No await from here on: concurrent new sessions see each other's pins.
        now = time.time()
        digest = key_digest(key)
        reports = {rid: read_report(replica.routing_stats) for rid, replica in by_id.items()}
        served_at = {rid: t for rid, report in reports.items() if (t := report.served_at(digest)) is not None}
        home = home_replica(self.pins.lookup(key), served_at, by_id)
        self.unreported.retain(by_id)
        num_sessions = {
            rid: report.num_sessions + self.unreported.count(rid, report.served, report.reported_at)
            for rid, report in reports.items()
        }
        ranked = rank_replicas(key, queue_lens, self.load_margin, home, num_sessions)
        self.pins.pin(key, ranked[0], now)
        self.unreported.note(ranked[0], digest, now, reports[ranked[0]].served)
        return [[by_id[rid]] for rid in ranked]

    async def _queue_lens(self, replicas: list[RunningReplica]) -> dict[str, int]:
        """Ongoing requests per replica; one that does not answer in time counts as idle
        (Serve's own selection probes it again before sending)."""
        cache = self.replica_queue_len_cache
        lens = {r.replica_id.unique_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if lens[r.replica_id.unique_id] is None]
        if missing:
            answers = await asyncio.gather(*(_probe(r) for r in missing))
            for replica, queue_len in zip(missing, answers):
                if queue_len is not None:
                    cache.update(replica.replica_id, queue_len)
                lens[replica.replica_id.unique_id] = queue_len
        return {rid: n or 0 for rid, n in lens.items()}


def affinity_key(pending_request: PendingRequest | None) -> str | None:
    """The request's Serve session id (the session header, or the ingress's prompt key);
    None without one."""
    if pending_request is None:
        return None
    return pending_request.metadata.session_id or None


async def _probe(replica: RunningReplica) -> int | None:
    try:
        return await asyncio.wait_for(replica.get_queue_len(deadline_s=PROBE_DEADLINE_S), PROBE_DEADLINE_S)
    except Exception:  # noqa: BLE001 - a dead or slow replica: Serve's own probe decides
        return None
