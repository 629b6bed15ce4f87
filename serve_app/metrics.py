"""Prometheus metrics of one replica, served at GET /metrics.

Per-request figures seen by clients (TTFT as the replica sees it, inter-token latency,
acceptance length, outcomes, speculative counters) are recorded by the HTTP layer as
streams finish; scheduler-wide state (backlog depth, live sessions, grants, parks, skip
escalations, per-lane queue wait and TTFT inside the scheduler) is read from the engine
snapshot at scrape time. Each replica has its own registry.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest)
from prometheus_client.core import GaugeMetricFamily, SummaryMetricFamily

disable_created_metrics()  # `_created` series double the output for no operator value

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 16.0)


class ReplicaMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specslot_requests", "Finished requests.",
                                ["lane", "finish_reason"], registry=r)
        self.rejected = Counter("specslot_rejected_requests", "Requests refused before scheduling.",
                                ["status"], registry=r)
        self.ttft = Histogram("specslot_ttft_seconds", "Time to first token.", ["lane"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specslot_itl_seconds", "Mean inter-token latency per request.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.acceptance = Histogram(
            "specslot_acceptance_length", "Tokens per speculative round (accepted / rounds + 1).",
            buckets=_ACCEPT_BUCKETS, registry=r)
        self.drafted = Counter("specslot_drafted_tokens", "Drafted tokens.", registry=r)
        self.accepted = Counter("specslot_accepted_tokens", "Accepted draft tokens.", registry=r)
        self.grants = Counter("specslot_request_grants", "Slot grants received by requests.", registry=r)
        self.parks = Counter("specslot_request_parks", "Times requests were parked.", registry=r)
        self.generated = Counter("specslot_generated_tokens", "Completion tokens.", registry=r)
        # vLLM's speculative-decoding counters under our prefix (vllm:spec_decode_* there),
        # so a vLLM dashboard needs only the prefix changed; slot rounds and row verifies alike.
        self.spec_drafts = Counter("specslot:spec_decode_num_drafts", "Verifies that checked drafts.",
                                   registry=r)
        self.spec_draft_tokens = Counter("specslot:spec_decode_num_draft_tokens", "Draft tokens verified.",
                                         registry=r)
        self.spec_accepted_tokens = Counter("specslot:spec_decode_num_accepted_tokens",
                                            "Draft tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter(
            "specslot:spec_decode_num_accepted_tokens_per_pos",
            "Verifies whose draft at this position (0-based) was accepted.", ["position"], registry=r)

    def record_finish(self, lane: str, finish_reason: str, stats, num_tokens: int,
                      ttft_s: float | None, decode_s: float | None) -> None:
        self.requests.labels(lane, finish_reason).inc()
        self.generated.inc(num_tokens)
        if ttft_s is not None:
            self.ttft.labels(lane).observe(ttft_s)
        if decode_s is not None and num_tokens > 1:
            self.itl.observe(decode_s / (num_tokens - 1))
        if stats is not None:
            self.drafted.inc(stats.num_drafted)
            self.accepted.inc(stats.num_accepted)
            self.grants.inc(stats.num_grants)
            self.parks.inc(stats.num_parks)
            if stats.num_rounds:
                self.acceptance.observe(stats.num_accepted / stats.num_rounds + 1)
            self.spec_drafts.inc(stats.num_drafts)
            self.spec_draft_tokens.inc(stats.num_drafted)
            self.spec_accepted_tokens.inc(stats.num_accepted)
            for position, count in enumerate(stats.accepted_by_position):
                self.spec_accepted_per_pos.labels(str(position)).inc(count)

    def render(self, snapshot: dict | None) -> bytes:
        text = generate_latest(self.registry)
        if snapshot is not None:
            text += _render_families(scheduler_families(snapshot))
        return text


def scheduler_families(snapshot: dict) -> list:
    """Families from an engine snapshot's `counters`: numbers become gauges, labelled
    tallies (`actions`, `classic_fallbacks`) labelled gauges, and per-lane latency
    samples (`queue_wait`, `ttft`: count and sum per lane) summaries."""
    families = []
    for name, value in sorted((snapshot.get("counters") or {}).items()):
        metric = f"specslot_scheduler_{name}"
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            families.append(GaugeMetricFamily(metric, f"Scheduler {name}.", value=value))
        elif isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):
            fam = SummaryMetricFamily(f"{metric}_seconds", f"Scheduler {name} per lane.",
                                      labels=["lane"])
            for lane, sample in sorted(value.items()):
                fam.add_metric([lane], count_value=sample.get("count", 0),
                               sum_value=sample.get("sum_s", 0.0))
            families.append(fam)
        elif isinstance(value, dict):
            fam = GaugeMetricFamily(metric, f"Scheduler {name} by kind.", labels=["kind"])
            for kind, count in sorted(value.items()):
                fam.add_metric([str(kind)], count)
            families.append(fam)
    return families


def _render_families(families) -> bytes:
    registry = CollectorRegistry(auto_describe=False)

    class _Fixed:
        def collect(self):
            return families

    registry.register(_Fixed())
    return generate_latest(registry)
