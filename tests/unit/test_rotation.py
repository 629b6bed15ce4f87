"""Protocol harness: the real scheduler and slot over the scripted fake runner."""

import pytest

from scheduler.request import Lane, RequestStatus
from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import FakeRunner, token_at


def isolated_stream(request):
    return [token_at(request, i) for i in range(request.sampling.max_tokens)]


def run_a_then_b(grant_rounds, *, b_rounds=2, **overrides):
    """A admitted directly (first token + 3 rounds); B joins the backlog right after
    A's slice 0 (first token + `b_rounds` rounds)."""
    scheduler = make_scheduler(grant_rounds=grant_rounds, **overrides)
    a, b = make_request("A", rounds=3), make_request("B", rounds=b_rounds)
    trace = Trace()
    scheduler.submit(a)
    tick(scheduler, trace)
    assert a.status is RequestStatus.ACTIVE and scheduler.grant_log == []
    scheduler.submit(b)
    run_until_idle(scheduler, trace)
    return scheduler, trace, a, b


@pytest.mark.parametrize(
    "budget, expected",
    [
        (2, [("A", 2), ("B", 2), ("A", 2), ("B", 1)]),
        (1, [("A", 2), ("B", 1), ("A", 1), ("B", 1), ("A", 1), ("B", 1)]),
    ],
)
def test_grant_schedule(budget, expected):
    scheduler, trace, a, b = run_a_then_b(budget)
    assert scheduler.grant_log == expected
    streams = trace.streams()
    assert streams["A"] == isolated_stream(a) and streams["B"] == isolated_stream(b)
    assert all(len(r.model_actions) <= 1 for r in trace.ticks)  # HOL bound, incl. promotion ticks
    assert scheduler.runner.sessions == {} and scheduler.runner.drafter_holder is None
    assert a.spec.num_rounds == 3 and b.spec.num_rounds == 2  # same rounds as isolated runs
    assert (a.spec.num_drafted, a.spec.num_accepted) == (12, 3)
    assert a.spec.num_grants == sum(1 for rid, _ in expected if rid == "A")
    assert a.spec.num_parks == a.spec.num_grants - 1
    assert trace.finishes()["A"].stats.num_parks == a.spec.num_parks


def test_lone_request_never_parks():
    scheduler = make_scheduler(grant_rounds=1)
    scheduler.submit(make_request("A", rounds=3))
    run_until_idle(scheduler)
    assert scheduler.grant_log == [("A", 4)]
    assert scheduler.counters.parks == 0


def test_default_budget_rotates_after_eight_slices():
    scheduler, _, _, _ = run_a_then_b(8, b_rounds=2)
    assert scheduler.grant_log == [("A", 4), ("B", 3)]  # no contention reaches the budget


def test_overrun_job_parks_at_first_round_boundary_after_contention():
    scheduler = make_scheduler(grant_rounds=2)
    a, b = make_request("A", rounds=8), make_request("B", rounds=1)
    scheduler.submit(a)
    for _ in range(5):
        tick(scheduler)
    scheduler.submit(b)
    tick(scheduler)  # one more round of A, then it parks
    assert scheduler.grant_log == [("A", 6)] and a.status is RequestStatus.PARKED
    run_until_idle(scheduler)
    assert scheduler.grant_log == [("A", 6), ("B", 2), ("A", 3)]


def test_budget_zero_is_the_legacy_hold_with_classic_fallback():
    scheduler = make_scheduler(grant_rounds=0)
    a, b = make_request("A", rounds=3), make_request("B", rounds=2)
    scheduler.submit(a)
    tick(scheduler)
    scheduler.submit(b)
    trace = run_until_idle(scheduler)
    assert scheduler.grant_log == [("A", 4)]
    assert b.spec.num_rounds == 0 and ("classic_prefill", ("B",)) in scheduler.runner.actions
    assert scheduler.counters.classic_fallbacks["slot_busy"] == 1
    assert trace.streams()["B"] == isolated_stream(b)
    assert scheduler.counters.backlog_peak == 0


def test_ring_full_goes_to_classic_and_bounds_hold():
    scheduler = make_scheduler(grant_rounds=1)
    reqs = [make_request(rid, rounds=3) for rid in "ABCD"]
    scheduler.submit(reqs[0])
    tick(scheduler)
    for r in reqs[1:]:
        scheduler.submit(r)
    tick(scheduler)
    assert [r.status for r in reqs[1:]] == [RequestStatus.WAITING, RequestStatus.WAITING, RequestStatus.CLASSIC]
    peak_sessions = 0
    while scheduler.has_work():
        tick(scheduler)
        peak_sessions = max(peak_sessions, scheduler.runner.num_live_sessions())
        assert len(scheduler.slot.backlog) <= 3
    assert scheduler.counters.backlog_peak == 3  # cap + 1 between a park and a promotion
    assert peak_sessions == 3 == scheduler.counters.live_sessions_peak  # 1 active + 2 parked
    assert scheduler.counters.classic_fallbacks["backlog_full"] == 1
    assert all(r.status is RequestStatus.FINISHED for r in reqs)


def test_promotion_ticks_obey_alternation_with_classic_work():
    runner = FakeRunner(unsupported=("C",))
    scheduler = make_scheduler(runner, grant_rounds=1)
    a, b = make_request("A", rounds=3), make_request("B", rounds=2)
    c = make_request("C", max_tokens=40)  # a long classic row
    scheduler.submit(a)
    tick(scheduler)
    scheduler.submit(b)
    scheduler.submit(c)
    trace = run_until_idle(scheduler)
    kinds = trace.spec_kinds()
    while kinds and not kinds[-1]:
        kinds.pop()  # C's tail after the slot drained
    assert all(not (x and y) for x, y in zip(kinds, kinds[1:])), kinds
    assert scheduler.grant_log == [("A", 2), ("B", 1), ("A", 1), ("B", 1), ("A", 1), ("B", 1)]
    assert all(len(r.model_actions) <= 1 for r in trace.ticks)
    assert scheduler.counters.promotions == 5


def test_cancelled_parked_job_resolves_without_wedging():
    scheduler, trace = make_scheduler(grant_rounds=1), Trace()
    a, b = make_request("A", rounds=3), make_request("B", rounds=2)
    scheduler.submit(a)
    tick(scheduler, trace)
    scheduler.submit(b)
    tick(scheduler, trace)  # A parks
    assert a.status is RequestStatus.PARKED and "A" in scheduler.runner.sessions
    scheduler.cancel("A")
    run_until_idle(scheduler, trace)
    assert trace.finishes()["A"].finish_reason == "cancelled"
    assert trace.finishes()["B"].finish_reason == "length"
    assert trace.streams()["B"] == isolated_stream(b)
    assert scheduler.runner.sessions == {} and scheduler.runner.drafter_holder is None
    assert scheduler.grant_log[-1] == ("B", 3)


def test_cancelled_parked_job_seen_at_promotion_is_dropped_and_next_entry_runs_same_tick():
    scheduler = make_scheduler(grant_rounds=1)
    a, b = make_request("A", rounds=3), make_request("B", rounds=3)
    scheduler.submit(a)
    tick(scheduler)
    scheduler.submit(b)
    tick(scheduler)  # A parks: ring [B, A]
    tick(scheduler)  # B's slice 0, then B parks at once (budget 1): ring [A, B]
    assert [e["request_id"] for e in scheduler.snapshot()["slot"]["backlog"]] == ["A", "B"]
    a.cancel_requested = True  # a cancel that lands after the drain of the next tick
    record = tick(scheduler)
    assert record.model_actions == [("spec_round", ("B",))]
    assert [e.finish_reason for e in record.events if e.request_id == "A"] == ["cancelled"]
    assert "A" not in scheduler.runner.sessions and scheduler.counters.backlog_aborts == 1
    run_until_idle(scheduler)
    assert scheduler.runner.sessions == {} and b.status is RequestStatus.FINISHED


def test_cancelled_waiter_is_skipped():
    scheduler, trace = make_scheduler(grant_rounds=1), Trace()
    a, b, c = make_request("A", rounds=3), make_request("B", rounds=2), make_request("C", rounds=1)
    scheduler.submit(a)
    tick(scheduler, trace)
    scheduler.submit(b)
    scheduler.submit(c)
    tick(scheduler, trace)  # A parks: ring [B, C, A]
    b.cancel_requested = True  # lands mid-tick, before the promotion
    record = tick(scheduler, trace)
    assert record.model_actions == [("spec_begin", ("C",))]  # next entry tried in the same tick
    # both decisions (B cancelled, then C) counted a skip for A; C parked with 0
    assert [(e["request_id"], e["skipped_grants"]) for e in scheduler.snapshot()["slot"]["backlog"]] == [
        ("A", 2),
        ("C", 0),
    ]
    run_until_idle(scheduler, trace)
    assert trace.finishes()["B"].finish_reason == "cancelled" and trace.streams().get("B", []) == []
    assert "B" not in [rid for rid, _ in scheduler.grant_log]
    assert scheduler.counters.backlog_aborts == 1
    assert scheduler.runner.sessions == {}


def test_declined_waiter_goes_to_classic_and_is_not_aborted():
    scheduler, trace = make_scheduler(grant_rounds=1), Trace()
    a, b = make_request("A", rounds=3), make_request("B", rounds=2)
    scheduler.submit(a)
    tick(scheduler, trace)
    scheduler.submit(b)
    tick(scheduler, trace)  # A parks, B waits
    scheduler.policy.mode = "off"  # the policy settled to decline while B waited
    record = tick(scheduler, trace)
    assert record.model_actions == [("spec_round", ("A",))]  # B declined, A promoted in the same tick
    run_until_idle(scheduler, trace)
    assert ("classic_prefill", ("B",)) in scheduler.runner.actions
    assert trace.finishes()["B"].finish_reason == "length"
    assert trace.streams()["B"] == isolated_stream(b)
    assert scheduler.counters.backlog_aborts == 0
    assert scheduler.counters.classic_fallbacks["declined_at_promotion"] == 1
    assert b.spec.num_grants == 0


def test_high_lane_pressure_bounds_normal_job_gap():
    scheduler = make_scheduler(grant_rounds=1)
    a = make_request("A", rounds=12, lane=Lane.NORMAL)
    scheduler.submit(a)
    tick(scheduler)
    counter = iter(range(1000))

    def keep_ring_full_of_high(_):
        if a.status.is_done:
            return
        while len(scheduler.slot.backlog) + scheduler.ledger.num_untaken < 2:
            scheduler.submit(make_request(f"H{next(counter)}", rounds=2, lane=Lane.HIGH))

    keep_ring_full_of_high(0)
    run_until_idle(scheduler, before_tick=keep_ring_full_of_high)
    owners = [rid for rid, _ in scheduler.grant_log]
    a_positions = [i for i, rid in enumerate(owners) if rid == "A"]
    assert len(a_positions) >= 3
    gaps = [j - i - 1 for i, j in zip(a_positions, a_positions[1:])]
    assert max(gaps) <= 3, gaps  # the acceptance bound
    assert set(gaps) == {2}, gaps  # what the skip cap of 2 actually gives with a full ring
    assert scheduler.counters.skip_escalations >= 1
    assert a.status is RequestStatus.FINISHED


def test_high_lane_waiter_is_granted_before_earlier_normal_waiter():
    scheduler = make_scheduler(grant_rounds=1)
    scheduler.submit(make_request("A", rounds=3))
    tick(scheduler)
    scheduler.submit(make_request("N", rounds=1))
    scheduler.submit(make_request("H", rounds=0, lane=Lane.HIGH))  # done after slice 0
    run_until_idle(scheduler)
    assert [rid for rid, _ in scheduler.grant_log][:3] == ["A", "H", "N"]


@pytest.mark.parametrize("phase", ["queued", "classic", "waiting", "parked", "active", "installed"])
def test_cancellation_at_every_phase(phase):
    runner = FakeRunner(unsupported=("X",) if phase in ("queued", "classic") else ())
    scheduler, trace = make_scheduler(runner, grant_rounds=1), Trace()
    a = make_request("A", rounds=3)
    x = make_request("X", rounds=3)
    if phase in ("queued", "classic", "waiting", "parked"):
        scheduler.submit(a)
        tick(scheduler, trace)
    scheduler.submit(x)
    if phase == "installed":
        scheduler.cancel("X")  # arrives with the request: never runs
    else:
        ticks = {"queued": 0, "classic": 1, "waiting": 0, "parked": 3, "active": 1}[phase]
        for _ in range(ticks):
            tick(scheduler, trace)
        expected = {
            "queued": RequestStatus.QUEUED,
            "classic": RequestStatus.CLASSIC,
            "waiting": RequestStatus.WAITING,
            "parked": RequestStatus.PARKED,
            "active": RequestStatus.ACTIVE,
        }[phase]
        if phase in ("queued", "waiting"):
            scheduler._drain()  # route it without running an action
        assert x.status is expected
        scheduler.cancel("X")
    run_until_idle(scheduler, trace)
    assert trace.finishes()["X"].finish_reason == "cancelled"
    assert x.status is RequestStatus.CANCELLED
    assert runner.sessions == {} and runner.rows == {} and runner.drafter_holder is None
    if phase in ("queued", "classic", "waiting", "parked"):
        assert trace.finishes()["A"].finish_reason == "length"
    assert not scheduler.has_work() and scheduler.num_unfinished() == 0


def test_burst_mode_runs_whole_generation_in_one_tick():
    scheduler = make_scheduler(tick_slice=False)
    a = make_request("A", rounds=3)
    scheduler.submit(a)
    record = tick(scheduler)
    assert [kind for kind, _ in record.model_actions] == ["spec_begin"] + ["spec_round"] * 3
    assert record.events[0].finish_reason == "length"
    assert record.events[0].token_ids == isolated_stream(a)


def test_burst_mode_concurrent_request_goes_classic_and_streams_match_sliced():
    streams = {}
    for tick_slice in (True, False):
        scheduler = make_scheduler(tick_slice=tick_slice, grant_rounds=1)
        reqs = [make_request(rid, rounds=3) for rid in "AB"]
        for r in reqs:
            scheduler.submit(r)
        streams[tick_slice] = run_until_idle(scheduler).streams()
    assert streams[True] == streams[False]


def test_reconfigure_takes_effect_at_next_grant():
    scheduler = make_scheduler(grant_rounds=8)
    a, b = make_request("A", rounds=6), make_request("B", rounds=4)
    scheduler.submit(a)
    tick(scheduler)
    scheduler.submit(b)
    scheduler.reconfigure(grant_rounds=1)
    tick(scheduler)  # A keeps its cached budget of 8
    assert a.status is RequestStatus.ACTIVE
    run_until_idle(scheduler)
    # A (7 slices) never reaches its cached budget of 8; a live read of budget 1 would
    # have parked it at the tick after B arrived.
    assert scheduler.grant_log == [("A", 7), ("B", 5)]


def test_reconfigure_budget_applies_to_following_grants():
    scheduler = make_scheduler(grant_rounds=3)
    a, b = make_request("A", rounds=5), make_request("B", rounds=3)
    scheduler.submit(a)
    tick(scheduler)
    scheduler.submit(b)
    tick(scheduler)
    scheduler.reconfigure(grant_rounds=1)
    run_until_idle(scheduler)
    assert scheduler.grant_log[0] == ("A", 3)  # cached budget 3
    assert all(n == 1 for _, n in scheduler.grant_log[1:-1])


def test_runner_error_fails_only_that_request_and_frees_slot():
    runner = FakeRunner()
    runner.fail_on.add(("spec_round", "A"))
    scheduler, trace = make_scheduler(runner, grant_rounds=1), Trace()
    scheduler.submit(make_request("A", rounds=3))
    tick(scheduler, trace)
    b = make_request("B", rounds=2)
    scheduler.submit(b)
    run_until_idle(scheduler, trace)
    assert trace.finishes()["A"].finish_reason == "error" and "spec_round" in trace.finishes()["A"].error
    assert trace.streams()["B"] == isolated_stream(b)
    assert runner.sessions == {}


def test_classic_admission_strict_lanes_fifo_and_row_cap():
    runner = FakeRunner(unsupported=tuple(f"r{i}" for i in range(6)))
    scheduler = make_scheduler(runner, max_batch_size=4, prefill_batch_size=2)
    lanes = [Lane.LOW, Lane.NORMAL, Lane.HIGH, Lane.NORMAL, Lane.HIGH, Lane.LOW]
    for i, lane in enumerate(lanes):
        scheduler.submit(make_request(f"r{i}", max_tokens=3, lane=lane))
    trace = run_until_idle(scheduler)
    prefills = [ids for kind, ids in runner.actions if kind == "classic_prefill"]
    assert prefills[:2] == [("r2", "r4"), ("r1", "r3")]
    assert max(len(r.model_actions) for r in trace.ticks) == 1
    assert set(trace.finishes()) == {f"r{i}" for i in range(6)}


def test_events_merge_per_tick_and_carry_stats():
    scheduler = make_scheduler()
    a = make_request("A", rounds=1)
    scheduler.submit(a)
    first = tick(scheduler).events
    last = tick(scheduler).events
    assert [(e.request_id, len(e.token_ids)) for e in first] == [("A", 1)]
    assert last[0].finish_reason == "length" and last[0].stats.num_rounds == 1
    assert last[0].prompt_tokens == len(a.prompt_ids)
    assert scheduler.counters.ttft.count["normal"] == 1
