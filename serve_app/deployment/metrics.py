"""Prometheus metrics of one replica, served at GET /metrics.

Request series are recorded by the HTTP layer as tokens stream and requests finish:
vLLM's v1 names under our prefix (`specslot:` for `vllm:`) with a `model_name` label,
so a vLLM dashboard needs only the prefix changed, plus the older per-lane `specslot_*`
series. Scheduler series (`serve_app.deployment.scheduler_metrics`) are read from the engine
snapshot at scrape time. Every series is declared up front, so a scrape shows the same
names, types and label sets from the first one on. Each replica has its own registry;
docs/metrics.md lists the series and how to scrape them.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest

from scheduler.events import RequestTimes
from scheduler.request import Lane, SpecStats
from serve_app.deployment.scheduler_metrics import scheduler_families

disable_created_metrics()  # `_created` series double the output for no operator value

# Per token gap, and per request (TTFT, phases, end to end).
_TOKEN_GAP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_ACCEPT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 16.0)

# The HTTP layer's outcome -> vLLM's `finished_reason` label value.
FINISHED_REASONS = {"stop": "stop", "length": "length", "disconnected": "abort", "error": "error"}
_LANES = tuple(lane.name.lower() for lane in Lane)


@dataclass
class StreamTimes:
    """When one request's tokens reached the replica (monotonic seconds).

    `add(n, now)` returns the inter-token gaps that `n` tokens arriving at `now` close,
    as (count, seconds each): a chunk of n tokens g seconds after the previous chunk
    closes n gaps of g/n, and tokens that arrive with the first token close gaps of 0.
    Over a request the counts sum to tokens - 1 and the gaps to last - first token.

    >>> t = StreamTimes(arrival=0.0)
    >>> t.add(1, 0.5), t.add(3, 1.25), t.add(1, 1.5)
    ((0, 0.0), (3, 0.25), (1, 0.25))
    """

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0

    def add(self, n: int, now: float) -> tuple[int, float]:
        if n <= 0:
            return 0, 0.0
        self.num_tokens += n
        if self.first_token is None:
            self.first_token = self.last_token = now
            return n - 1, 0.0
        gap = (now - self.last_token) / n
        self.last_token = now
        return n, gap


class ReplicaMetrics:
    def __init__(self, model_name: str = "specslot", num_draft_tokens: int = 0) -> None:
        """`model_name` labels the `specslot:` series (the served model id);
        `num_draft_tokens` declares that many draft positions up front."""
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        r, m, by_model = self.registry, model_name, ["model_name"]

        def histogram(name, doc, buckets=_LATENCY_BUCKETS):
            return Histogram(name, doc, by_model, buckets=buckets, registry=r).labels(m)

        def counter(name, doc):
            return Counter(name, doc, by_model, registry=r).labels(m)

        # -- vLLM's names ------------------------------------------------------------
        self.ttft = histogram(
            "specslot:time_to_first_token_seconds", "Replica arrival to first token reaching the replica."
        )
        self.itl = histogram(
            "specslot:inter_token_latency_seconds",
            "Gap between consecutive output tokens, one observation per token "
            "(a chunk of n tokens after a gap g counts n gaps of g/n).",
            _TOKEN_GAP_BUCKETS,
        )
        self.tpot = histogram(
            "specslot:request_time_per_output_token_seconds",
            "Per request: first to last token over tokens - 1.",
            _TOKEN_GAP_BUCKETS,
        )
        self.e2e = histogram(
            "specslot:e2e_request_latency_seconds", "Replica arrival to the finishing event (stop, length or error)."
        )
        self.queue_time = histogram(
            "specslot:request_queue_time_seconds",
            "Scheduler arrival to first scheduled (classic prefill or slot slice 0).",
        )
        self.prefill_time = histogram(
            "specslot:request_prefill_time_seconds", "First scheduled to first token, on the scheduler's clock."
        )
        self.decode_time = histogram(
            "specslot:request_decode_time_seconds", "First to last token, on the scheduler's clock."
        )
        self.inference_time = histogram(
            "specslot:request_inference_time_seconds", "First scheduled to last token, on the scheduler's clock."
        )
        self.prompt_tokens = counter(
            "specslot:prompt_tokens", "Prompt tokens of requests that reached their first token."
        )
        self.generation_tokens = counter("specslot:generation_tokens", "Output tokens streamed.")
        self.success = Counter(
            "specslot:request_success",
            "Finished requests by finished_reason (abort: the client went away).",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in FINISHED_REASONS.values():
            self.success.labels(m, reason)
        # Speculative decoding, slot rounds and row verifies alike.
        self.spec_drafts = counter("specslot:spec_decode_num_drafts", "Verifies that checked drafts.")
        self.spec_draft_tokens = counter("specslot:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted_tokens = counter("specslot:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = Counter(
            "specslot:spec_decode_num_accepted_tokens_per_pos",
            "Verifies whose draft at this position (0-based) was accepted.",
            ["model_name", "position"],
            registry=r,
        )
        for position in range(num_draft_tokens):
            self.spec_accepted_per_pos.labels(m, str(position))

        # -- specslot's own, per lane --------------------------------------------------
        self.requests = Counter("specslot_requests", "Finished requests.", ["lane", "finish_reason"], registry=r)
        self.rejected = Counter(
            "specslot_rejected_requests", "Requests refused before scheduling.", ["status"], registry=r
        )
        self.lane_ttft = Histogram(
            "specslot_ttft_seconds", "Time to first token.", ["lane"], buckets=_LATENCY_BUCKETS, registry=r
        )
        for lane in _LANES:
            self.lane_ttft.labels(lane)
            for outcome in FINISHED_REASONS:
                self.requests.labels(lane, outcome)
        self.rejected.labels("503")
        self.acceptance = Histogram(
            "specslot_acceptance_length",
            "Tokens per speculative round (accepted / rounds + 1).",
            buckets=_ACCEPT_BUCKETS,
            registry=r,
        )
        self.drafted = Counter("specslot_drafted_tokens", "Drafted tokens.", registry=r)
        self.accepted = Counter("specslot_accepted_tokens", "Accepted draft tokens.", registry=r)
        self.grants = Counter("specslot_request_grants", "Slot grants received by requests.", registry=r)
        self.parks = Counter("specslot_request_parks", "Times requests were parked.", registry=r)

    def record_tokens(self, times: StreamTimes, n: int, num_prompt: int, now: float) -> None:
        """`n` output tokens of one request reached the replica at `now`."""
        first = times.first_token is None
        count, gap = times.add(n, now)
        if first and n > 0:
            self.ttft.observe(now - times.arrival)
            self.prompt_tokens.inc(num_prompt)
        self.generation_tokens.inc(n)
        for _ in range(count):
            self.itl.observe(gap)

    def record_finish(
        self,
        lane: str,
        outcome: str,
        times: StreamTimes,
        now: float,
        stats: SpecStats | None,
        phases: RequestTimes | None,
    ) -> None:
        """A request ended with `outcome` ("stop", "length", "error"); `stats` and
        `phases` come with the scheduler's finishing event (None when it was lost)."""
        self.requests.labels(lane, outcome).inc()
        self.success.labels(self.model_name, FINISHED_REASONS[outcome]).inc()
        self.e2e.observe(now - times.arrival)
        if times.first_token is not None:
            self.lane_ttft.labels(lane).observe(times.first_token - times.arrival)
        if times.num_tokens > 1:
            self.tpot.observe((times.last_token - times.first_token) / (times.num_tokens - 1))
        if phases is not None:
            for histogram, seconds in (
                (self.queue_time, phases.queue_s),
                (self.prefill_time, phases.prefill_s),
                (self.decode_time, phases.decode_s),
                (self.inference_time, phases.inference_s),
            ):
                if seconds is not None:
                    histogram.observe(seconds)
        if stats is not None:
            self._record_spec(stats)

    def record_abort(self, lane: str) -> None:
        """The client went away before the request finished."""
        self.requests.labels(lane, "disconnected").inc()
        self.success.labels(self.model_name, FINISHED_REASONS["disconnected"]).inc()

    def _record_spec(self, stats: SpecStats) -> None:
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
            self.spec_accepted_per_pos.labels(self.model_name, str(position)).inc(count)

    def render(self, snapshot: dict | None) -> bytes:
        """Prometheus text: the request series, then the scheduler's when `snapshot`
        is available (None while the model loads or the scheduler is unreachable:
        those series are left out rather than reported as zeros)."""
        text = generate_latest(self.registry)
        if snapshot is not None:
            text += generate_latest(_Fixed(scheduler_families(snapshot, self.model_name)))
        return text


class _Fixed:
    """A ready list of families, in the shape `generate_latest` reads."""

    def __init__(self, families: list) -> None:
        self._families = families

    def collect(self):
        return self._families
