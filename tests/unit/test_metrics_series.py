"""/metrics series: fixed names, types and labels from the first scrape, counters that
never go back, per-token inter-token gaps, and the scheduler's per-request phases."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.counters import CANCEL_PHASES, FALLBACK_REASONS, TICK_ACTIONS, Counters
from scheduler.events import RequestTimes
from scheduler.request import Lane, RequestStatus
from serve_app.deployment import scheduler_metrics
from serve_app.deployment.metrics import ReplicaMetrics, StreamTimes
from tests.unit.factories import FakeClock, make_request, make_scheduler, tick
from tests.unit.fakes import FakeRunner

MONOTONE_TYPES = ("counter", "histogram", "summary")  # every sample of these only grows


def families(text: str) -> dict:
    return {fam.name: fam for fam in text_string_to_metric_families(text)}


def series(text: str) -> dict[tuple, tuple[str, float]]:
    """(sample name, labels) -> (family type, value)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): (fam.type, s.value)
        for fam in families(text).values()
        for s in fam.samples
    }


class HttpFeed:
    """Records a scheduler's events the way the HTTP layer does, one stream per request."""

    def __init__(self, metrics: ReplicaMetrics, clock: FakeClock) -> None:
        self.metrics, self.clock = metrics, clock
        self.times: dict[str, StreamTimes] = {}

    def submit(self, scheduler, request) -> None:
        self.times[request.request_id] = StreamTimes(arrival=self.clock())
        scheduler.submit(request)

    def deliver(self, events, lanes: dict[str, str]) -> None:
        for event in events:
            times = self.times[event.request_id]
            if event.token_ids:
                self.metrics.record_tokens(times, len(event.token_ids), 2, self.clock())
            if event.finish_reason is not None:
                outcome = event.finish_reason if event.finish_reason in ("stop", "length") else "error"
                self.metrics.record_finish(
                    lanes[event.request_id], outcome, times, self.clock(), event.stats, event.times
                )


def run_rotation_with_fallbacks(metrics: ReplicaMetrics, on_tick):
    """Four speculative requests on a ring of two (one falls back: backlog_full) and a
    classic-only one; `on_tick(scheduler)` after every tick."""
    clock = FakeClock()
    scheduler = make_scheduler(FakeRunner(unsupported=("E",)), clock=clock, grant_rounds=1)
    feed = HttpFeed(metrics, clock)
    requests = [make_request(rid, rounds=3) for rid in "ABCDE"]
    lanes = {r.request_id: r.lane.name.lower() for r in requests}
    on_tick(scheduler)
    feed.submit(scheduler, requests[0])
    while scheduler.has_work() or len(feed.times) < len(requests):
        if len(feed.times) < len(requests) and len(scheduler.runner.actions) >= 1:
            feed.submit(scheduler, requests[len(feed.times)])
        clock.advance(0.01)
        feed.deliver(tick(scheduler).events, lanes)
        on_tick(scheduler)
    assert scheduler.counters.classic_fallbacks["backlog_full"] >= 1
    return scheduler


def test_every_scheduler_tally_is_declared_as_a_series():
    declared = {
        key
        for key, *_ in scheduler_metrics.COUNTERS
        + scheduler_metrics.LABELLED_COUNTERS
        + scheduler_metrics.GAUGES
        + scheduler_metrics.SUMMARIES
        + (scheduler_metrics.TICK_TIMES,)
    }
    assert set(Counters().to_dict()) == declared | set(scheduler_metrics.NOT_EXPORTED)


def test_labelled_tallies_have_every_key_before_any_event():
    plain = Counters().to_dict()
    assert plain["classic_fallbacks"] == dict.fromkeys(FALLBACK_REASONS, 0)
    assert plain["actions"] == dict.fromkeys(TICK_ACTIONS, 0)
    assert plain["tick_seconds"] == dict.fromkeys(TICK_ACTIONS, 0)
    assert plain["cancelled_by_phase"] == dict.fromkeys(CANCEL_PHASES, 0)
    with pytest.raises(ValueError):
        Counters().record_fallback("no_such_reason")


def test_names_types_and_labels_are_the_same_from_the_first_scrape():
    metrics = ReplicaMetrics("tiny", num_draft_tokens=4)
    scrapes = []
    scheduler = run_rotation_with_fallbacks(metrics, lambda s: scrapes.append(metrics.render(s.snapshot()).decode()))
    first, last = scrapes[0], scrapes[-1]
    assert {k: v[0] for k, v in series(first).items()} == {k: v[0] for k, v in series(last).items()}
    fallbacks = series(last)[("specslot_scheduler_classic_fallbacks_total", (("reason", "backlog_full"),))]
    assert fallbacks == ("counter", scheduler.counters.classic_fallbacks["backlog_full"])
    kinds = {name: fam.type for name, fam in families(first).items()}
    for name in (
        "specslot:time_to_first_token_seconds",
        "specslot:inter_token_latency_seconds",
        "specslot:e2e_request_latency_seconds",
        "specslot:request_queue_time_seconds",
        "specslot:request_prefill_time_seconds",
        "specslot:request_decode_time_seconds",
    ):
        assert kinds[name] == "histogram", name
    for name in (
        "specslot:prompt_tokens",
        "specslot:generation_tokens",
        "specslot:request_success",
        "specslot:spec_decode_num_drafts",
        "specslot:spec_decode_num_accepted_tokens_per_pos",
        "specslot_scheduler_spec_rounds",
        "specslot_scheduler_classic_fallbacks",
        "specslot_scheduler_actions",
        "specslot_scheduler_cancelled_by_phase",
    ):
        assert kinds[name] == "counter", name
    for name in ("specslot:num_requests_running", "specslot:num_requests_waiting"):
        assert kinds[name] == "gauge", name
    for fam in families(first).values():
        if fam.name.startswith("specslot:"):
            assert {s.labels["model_name"] for s in fam.samples} == {"tiny"}, fam.name


def test_counters_never_go_back_between_scrapes():
    metrics = ReplicaMetrics("tiny", num_draft_tokens=4)
    scrapes = []
    run_rotation_with_fallbacks(metrics, lambda s: scrapes.append(series(metrics.render(s.snapshot()).decode())))
    for before, after in zip(scrapes, scrapes[1:]):
        for key, (kind, value) in before.items():
            if kind in MONOTONE_TYPES:
                assert after[key][1] >= value, key
    grown = {key for key, (kind, value) in scrapes[-1].items() if kind in MONOTONE_TYPES and value > scrapes[0][key][1]}
    for key in (
        ("specslot_scheduler_grants_total", ()),
        ("specslot_scheduler_parks_total", ()),
        ("specslot:generation_tokens_total", (("model_name", "tiny"),)),
        ("specslot:request_success_total", (("finished_reason", "length"), ("model_name", "tiny"))),
    ):
        assert key in grown, key


@pytest.mark.parametrize(
    "chunks, gaps",
    [
        # (tokens, arrival time) per chunk -> (count, seconds each) each chunk closes
        ([(1, 0.5), (1, 0.75), (1, 1.0)], [(0, 0.0), (1, 0.25), (1, 0.25)]),
        ([(1, 0.5), (4, 1.5)], [(0, 0.0), (4, 0.25)]),
        ([(3, 0.5), (2, 1.0)], [(2, 0.0), (2, 0.25)]),  # the first chunk's extra tokens: gaps of 0
        ([(5, 2.0)], [(4, 0.0)]),  # a whole generation at once (burst mode)
        ([(1, 0.5), (0, 0.75), (1, 1.0)], [(0, 0.0), (0, 0.0), (1, 0.5)]),  # empty events close nothing
    ],
)
def test_stream_times_close_one_gap_per_token_after_the_first(chunks, gaps):
    times = StreamTimes(arrival=0.0)
    assert [times.add(n, now) for n, now in chunks] == gaps
    tokens = sum(n for n, _ in chunks)
    assert sum(count for count, _ in gaps) == tokens - 1
    assert sum(count * gap for count, gap in gaps) == pytest.approx(times.last_token - times.first_token)


class SlowPrefillRunner(FakeRunner):
    """Every prefill (classic or slot slice 0) takes `seconds` on the scheduler's clock."""

    def __init__(self, clock: FakeClock, seconds: float, **kw) -> None:
        super().__init__(**kw)
        self.clock, self.seconds = clock, seconds

    def classic_prefill(self, requests, between=None, piece=0):
        self.clock.advance(self.seconds)
        return super().classic_prefill(requests, between, piece)

    def spec_begin(self, request):
        self.clock.advance(self.seconds)
        return super().spec_begin(request)


@pytest.mark.parametrize("classic", [False, True])
def test_finishing_event_carries_queue_prefill_and_decode_times(classic):
    clock = FakeClock(100.0)
    runner = SlowPrefillRunner(clock, 0.5, unsupported=("A",) if classic else ())
    scheduler = make_scheduler(runner, clock=clock)
    scheduler.submit(make_request("A", rounds=2, max_tokens=5))  # arrival 100
    clock.advance(2.0)
    finish = None
    while scheduler.has_work():
        events = tick(scheduler).events
        finish = next((e for e in events if e.finish_reason), finish)
        clock.advance(1.0)
    # scheduled at 102, first token 102.5; the other 4 tokens over the next ticks.
    decode = 2.0 if not classic else 4.0  # slot: 2 rounds of 2 tokens; classic: 4 decode steps
    assert finish.times == RequestTimes(queue_s=2.0, prefill_s=0.5, decode_s=decode, inference_s=0.5 + decode)


def test_a_request_cancelled_in_the_queue_has_no_phases():
    scheduler = make_scheduler(FakeRunner(unsupported=("A", "B")), max_batch_size=1)
    scheduler.submit(make_request("A", max_tokens=8))
    scheduler.submit(make_request("B", max_tokens=8))
    tick(scheduler)
    scheduler.cancel("B")
    finish = next(e for e in tick(scheduler).events if e.request_id == "B")
    assert finish.finish_reason == "cancelled" and finish.times == RequestTimes()


def test_running_and_waiting_split_the_unfinished_requests():
    scheduler = make_scheduler(FakeRunner(unsupported=tuple("CDE")), max_batch_size=2, grant_rounds=8)
    for rid in "ABCDE":
        scheduler.submit(make_request(rid, rounds=4, max_tokens=9))
    state = scheduler.snapshot()
    assert (state["num_running"], state["num_waiting"]) == (0, 5)  # none routed yet
    tick(scheduler)  # A installed in the slot, B waits in the backlog, C-E queue for prefill
    tick(scheduler)  # a classic prefill admits C and D; E waits for a row
    state = scheduler.snapshot()
    assert (state["num_running"], state["num_waiting"]) == (3, 2)
    while scheduler.has_work():  # parks and promotions move requests between the two
        tick(scheduler)
        state = scheduler.snapshot()
        running = [
            r for r in scheduler.ledger.unfinished() if r.status in (RequestStatus.CLASSIC, RequestStatus.ACTIVE)
        ]
        assert state["num_running"] == len(running) <= 3
        assert state["num_running"] + state["num_waiting"] == state["unfinished"]
    assert (state["num_running"], state["num_waiting"]) == (0, 0)


def test_running_and_waiting_gauges_read_the_snapshot():
    text = ReplicaMetrics("tiny").render({"num_running": 1, "num_waiting": 3, "counters": {}}).decode()
    values = series(text)
    assert values[("specslot:num_requests_running", (("model_name", "tiny"),))] == ("gauge", 1.0)
    assert values[("specslot:num_requests_waiting", (("model_name", "tiny"),))] == ("gauge", 3.0)


def test_scheduler_series_are_left_out_without_a_snapshot():
    text = ReplicaMetrics("tiny").render(None).decode()
    assert "specslot:time_to_first_token_seconds_count" in text
    assert "specslot_scheduler_" not in text and "num_requests_running" not in text


def test_lanes_are_declared_for_the_per_lane_series():
    text = ReplicaMetrics("tiny").render({"counters": Counters().to_dict()}).decode()
    for lane in Lane:
        name = lane.name.lower()
        assert f'specslot_ttft_seconds_count{{lane="{name}"}} 0.0' in text
        assert f'specslot_scheduler_queue_wait_seconds_count{{lane="{name}"}} 0.0' in text


def test_prefix_cache_series_read_the_snapshot_and_read_zero_without_a_cache():
    runner = FakeRunner()
    scheduler = make_scheduler(runner)
    metrics = ReplicaMetrics("tiny")
    off = series(metrics.render(scheduler.snapshot()).decode())
    runner.prefix_stats = {
        "budget_bytes": 1 << 30,
        "bytes": 4096,
        "entries": 2,
        "block_size": 64,
        "hits": 3,
        "misses": 5,
        "query_tokens": 900,
        "hit_tokens": 600,
        "stores": 4,
        "evictions": 1,
        "draft": {
            "budget_bytes": 1 << 29,
            "bytes": 1024,
            "entries": 1,
            "block_size": 64,
            "hits": 2,
            "misses": 1,
            "query_tokens": 300,
            "hit_tokens": 200,
            "stores": 3,
            "evictions": 0,
        },
    }
    state = scheduler.snapshot()
    assert state["prefix_cache"] == runner.prefix_stats
    on = series(metrics.render(state).decode())
    model = (("model_name", "tiny"),)
    expected = {
        ("specslot:prefix_cache_queries_total", model): ("counter", 900.0),
        ("specslot:prefix_cache_hits_total", model): ("counter", 600.0),
        ("specslot_prefix_cache_hits_total", ()): ("counter", 3.0),
        ("specslot_prefix_cache_misses_total", ()): ("counter", 5.0),
        ("specslot_prefix_cache_stores_total", ()): ("counter", 4.0),
        ("specslot_prefix_cache_evictions_total", ()): ("counter", 1.0),
        ("specslot_prefix_cache_bytes", ()): ("gauge", 4096.0),
        ("specslot_prefix_cache_budget_bytes", ()): ("gauge", float(1 << 30)),
        ("specslot_prefix_cache_entries", ()): ("gauge", 2.0),
        ("specslot_prefix_cache_draft_hits_total", ()): ("counter", 2.0),
        ("specslot_prefix_cache_draft_stores_total", ()): ("counter", 3.0),
        ("specslot_prefix_cache_draft_bytes", ()): ("gauge", 1024.0),
        ("specslot_prefix_cache_draft_budget_bytes", ()): ("gauge", float(1 << 29)),
    }
    assert {key: on[key] for key in expected} == expected
    assert {key: off[key] for key in expected} == {key: (kind, 0.0) for key, (kind, _) in expected.items()}


def test_classic_step_series_read_the_snapshot_and_read_zero_without_counts():
    runner = FakeRunner()
    scheduler = make_scheduler(runner)
    metrics = ReplicaMetrics("tiny")
    off = series(metrics.render(scheduler.snapshot()).decode())
    runner.step_stats = {"steps": 40, "pipelined": 31}
    state = scheduler.snapshot()
    assert state["classic_steps"] == {"steps": 40, "pipelined": 31}
    on = series(metrics.render(state).decode())
    keys = [("specslot_scheduler_classic_steps_total", ()), ("specslot_scheduler_pipelined_steps_total", ())]
    assert [on[k] for k in keys] == [("counter", 40.0), ("counter", 31.0)]
    assert [off[k] for k in keys] == [("counter", 0.0), ("counter", 0.0)]


def test_tick_seconds_sum_each_ticks_wall_time_by_action():
    """The tick summary's sums are the scheduler clock's time inside each tick, drain to
    events, under the action the tick ran; its counts are the `actions` tally."""
    clock = FakeClock()
    runner = FakeRunner(unsupported=("A", "B"))  # both go classic: prefill, then decode ticks
    spent = {"classic_prefill": 0.030, "classic_decode": 0.007}
    for name, seconds in spent.items():
        method = getattr(runner, name)

        def timed(*args, _method=method, _seconds=seconds, **kwargs):
            clock.advance(_seconds)
            return _method(*args, **kwargs)

        setattr(runner, name, timed)
    scheduler = make_scheduler(runner, clock=clock)
    for rid in "AB":
        scheduler.submit(make_request(rid, rounds=3))
    while scheduler.has_work():
        tick(scheduler)
        clock.advance(1.0)  # between ticks: never counted
    plain = scheduler.counters.to_dict()
    assert plain["actions"]["decode"] >= 2
    for action, name in (("prefill", "classic_prefill"), ("decode", "classic_decode")):
        assert plain["tick_seconds"][action] == pytest.approx(plain["actions"][action] * spent[name])
    text = ReplicaMetrics("tiny", num_draft_tokens=4).render(scheduler.snapshot()).decode()
    assert series(text)[("specslot_scheduler_tick_seconds_sum", (("action", "decode"),))] == (
        "summary",
        pytest.approx(plain["tick_seconds"]["decode"]),
    )
    assert (
        series(text)[("specslot_scheduler_tick_seconds_count", (("action", "decode"),))][1]
        == plain["actions"]["decode"]
    )
