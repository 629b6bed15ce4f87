"""Scheduler series, read from an engine snapshot at each scrape.

Every series is declared here with its type: tallies that only grow are counters
(rendered `..._total`), levels are gauges, and the per-lane latency samples are
summaries (count and sum). A key the snapshot lacks reads 0 and every declared label
value is emitted, so a scrape shows the same names, types and label sets before the
first request as after a thousand. docs/metrics.md lists the series.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from scheduler.counters import CANCEL_PHASES, FALLBACK_REASONS, TICK_ACTIONS
from scheduler.request import Lane

PREFIX = "specslot_scheduler_"

# `counters` key -> help; each only grows while the scheduler lives (an actor restart
# starts it from 0, which Prometheus reads as a counter reset).
COUNTERS = (
    ("grants", "Slot grants (a request installed as the slot holder)."),
    ("parks", "Slot holders parked: grant expired, or moved to the classic batch by the cost gate."),
    ("promotions", "Backlog entries granted the slot (parked resumes and waiters)."),
    ("skip_escalations", "Grant decisions made by the skip cap."),
    ("backlog_aborts", "Cancelled entries dropped from the grant backlog."),
    ("demotions", "Started sessions moved into the classic batch by the batch-size rule."),
    ("cost_parks", "Fused tick: holders parked because speculating no longer paid."),
    ("decode_interrupts", "Classic decode steps stopped part-way by an arrival (interrupt_decode)."),
    ("prefill_yields", "Steps (the slot holder's rounds, classic decode steps) run between two forwards of a prefill."),
    ("prefill_overtakes", "Requests prefilled between two forwards of another prefill (prefill_yield_tokens)."),
    ("spec_rounds", "Speculative rounds of the slot holder (probes included)."),
    ("row_rounds", "Classic rows' verifies of their own drafts."),
    ("probe_rounds", "Probe rounds of the B=1 policy."),
    ("drafted_tokens", "Draft tokens verified (slot rounds and row verifies)."),
    ("accepted_tokens", "Draft tokens accepted (slot rounds and row verifies)."),
)
# `counters` key -> label name, declared label values, help
LABELLED_COUNTERS = (
    (
        "classic_fallbacks",
        "reason",
        FALLBACK_REASONS,
        "Requests the slot could serve that went to the classic batch, by reason.",
    ),
    ("cancelled_by_phase", "phase", CANCEL_PHASES, "Cancellations by the phase they took effect in."),
    ("actions", "action", TICK_ACTIONS, "Scheduler ticks by the action they ran."),
)
GAUGES = (
    ("backlog_depth", "Entries in the grant backlog."),
    ("backlog_peak", "Largest grant backlog seen."),
    ("live_sessions", "Speculative sessions alive (the holder and parked ones)."),
    ("live_sessions_peak", "Most speculative sessions alive at once."),
)
# `counters` key -> help; per lane {count, sum_s}
SUMMARIES = (
    ("queue_wait", "Arrival to first scheduled, per lane, on the scheduler's clock."),
    ("ttft", "Arrival to first token, per lane, on the scheduler's clock."),
)
# `counters` key -> help; per action, its count the `actions` tally
TICK_TIMES = (
    "tick_seconds",
    "Scheduler ticks' wall time (drain to events), by the action they ran; "
    "a fused tick counts under speculative and under fused.",
)
# The `prefix_cache` snapshot (the runner's `PrefixCache.stats()`, None when off; every
# series reads 0 then). vLLM's token counters, under our prefix with `model_name`:
PREFIX_CACHE_TOKEN_COUNTERS = (
    ("query_tokens", "specslot:prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("hit_tokens", "specslot:prefix_cache_hits", "Prompt tokens the prefix cache held (not prefilled)."),
)
PREFIX_CACHE = "specslot_prefix_cache_"
PREFIX_CACHE_DRAFT = "specslot_prefix_cache_draft_"
PREFIX_CACHE_COUNTERS = (
    ("hits", "Admissions (classic rows and sessions) that started from a cached prefix."),
    ("misses", "Admissions that found no cached prefix."),
    ("stores", "Entries stored: a prompt once prefilled, a leaving stream's prompt and output."),
    ("evictions", "Entries dropped, least recently used first, to stay within the byte budget."),
)
PREFIX_CACHE_GAUGES = (
    ("bytes", "Bytes of KV the prefix cache holds."),
    ("budget_bytes", "The prefix cache's byte budget (0: off)."),
    ("entries", "Entries the prefix cache holds."),
)
# The `classic_steps` snapshot (the runner's `classic_step_stats()`, None for a batch
# that counts neither; both read 0 then): key -> series, help.
CLASSIC_STEPS = (
    ("steps", "classic_steps", "Classic decode steps (a slot verify riding in one included)."),
    (
        "pipelined",
        "pipelined_steps",
        "Classic decode steps whose tokens a step queued before them had drawn (a grid slab's plain steps, GPU).",
    ),
)
# Snapshot keys that are not series: a sum of a labelled counter (sum() it in PromQL).
NOT_EXPORTED = ("classic_fallbacks_total",)
LANES = tuple(lane.name.lower() for lane in Lane)


def scheduler_families(snapshot: dict, model_name: str) -> list:
    """The families of one engine snapshot (`Engine.snapshot()`)."""
    counters = snapshot.get("counters") or {}
    families = [
        _gauge(
            "specslot:num_requests_running",
            "Requests in a model forward each step (classic rows and the slot holder).",
            model_name,
            snapshot.get("num_running", 0),
        ),
        _gauge(
            "specslot:num_requests_waiting",
            "Requests waiting: queued for prefill, in the grant backlog (parked included), or not yet routed.",
            model_name,
            snapshot.get("num_waiting", 0),
        ),
    ]
    for key, doc in COUNTERS:
        families.append(CounterMetricFamily(PREFIX + key, doc, value=counters.get(key, 0)))
    for key, label, declared, doc in LABELLED_COUNTERS:
        values = counters.get(key) or {}
        fam = CounterMetricFamily(PREFIX + key, doc, labels=[label])
        for name in _ordered(declared, values):
            fam.add_metric([name], values.get(name, 0))
        families.append(fam)
    for key, doc in GAUGES:
        families.append(GaugeMetricFamily(PREFIX + key, doc, value=counters.get(key, 0)))
    families += _prefix_cache_families(snapshot.get("prefix_cache") or {}, model_name)
    steps = snapshot.get("classic_steps") or {}
    for key, name, doc in CLASSIC_STEPS:
        families.append(CounterMetricFamily(PREFIX + name, doc, value=steps.get(key, 0)))
    key, doc = TICK_TIMES
    fam = SummaryMetricFamily(PREFIX + key, doc, labels=["action"])
    seconds = counters.get(key) or {}
    actions = counters.get("actions") or {}
    for name in _ordered(TICK_ACTIONS, seconds):
        fam.add_metric([name], count_value=actions.get(name, 0), sum_value=seconds.get(name, 0.0))
    families.append(fam)
    families.append(
        CounterMetricFamily(
            PREFIX + "tick_gap_seconds",
            "Engine thread time between consecutive "
            "ticks while work was waiting (handing events out, reconfiguring, locks).",
            value=snapshot.get("tick_gap_seconds", 0.0),
        )
    )
    for key, doc in SUMMARIES:
        samples = counters.get(key) or {}
        fam = SummaryMetricFamily(f"{PREFIX}{key}_seconds", doc, labels=["lane"])
        for lane in _ordered(LANES, samples):
            sample = samples.get(lane) or {}
            fam.add_metric([lane], count_value=sample.get("count", 0), sum_value=sample.get("sum_s", 0.0))
        families.append(fam)
    return families


def _prefix_cache_families(stats: dict, model_name: str) -> list:
    families = []
    for key, name, doc in PREFIX_CACHE_TOKEN_COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=["model_name"])
        fam.add_metric([model_name], stats.get(key, 0))
        families.append(fam)
    # The draft model's own prefixes (`prefix_cache.draft`; 0 without a draft model) as the
    # same series under `PREFIX_CACHE_DRAFT`.
    for prefix, part, owner in (
        (PREFIX_CACHE, stats, ""),
        (PREFIX_CACHE_DRAFT, stats.get("draft") or {}, "The draft model's: "),
    ):
        for key, doc in PREFIX_CACHE_COUNTERS:
            families.append(CounterMetricFamily(prefix + key, owner + doc, value=part.get(key, 0)))
        for key, doc in PREFIX_CACHE_GAUGES:
            families.append(GaugeMetricFamily(prefix + key, owner + doc, value=part.get(key, 0)))
    return families


def _gauge(name: str, doc: str, model_name: str, value: float) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, doc, labels=["model_name"])
    fam.add_metric([model_name], value)
    return fam


def _ordered(declared: tuple[str, ...], present: dict) -> list[str]:
    """The declared label values, then any the snapshot has beyond them (a newer
    scheduler than this replica), so nothing counted is dropped."""
    return list(declared) + sorted(str(k) for k in present if k not in declared)
