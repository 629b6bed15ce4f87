"""Demotion: a started speculative session moves into the classic batch once the
batch-size rule no longer allows it (`policy.should_demote`), over the protocol
harness (the real scheduler and slot on the scripted fake runner)."""

import pytest

from scheduler.request import RequestStatus
from scheduler.rules import should_demote
from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import FakeRunner, token_at


def isolated_stream(request):
    return [token_at(request, i) for i in range(request.sampling.max_tokens)]


@pytest.mark.parametrize(
    "num_others, knob, num_rows, max_rows, expected",
    [
        (0, 0, 0, 16, False),
        (5, 0, 5, 16, False),  # off: never
        (0, 1, 0, 16, False),  # alone
        (1, 1, 0, 16, True),  # one other (queued, not yet a row)
        (1, 1, 1, 16, True),
        (1, 2, 1, 16, False),
        (2, 2, 2, 16, True),
        (3, 1, 15, 16, True),
        (3, 1, 16, 16, False),  # no free row: keep speculating rather than stall
    ],
)
def test_should_demote(num_others, knob, num_rows, max_rows, expected):
    assert should_demote(num_others, knob, num_rows, max_rows) is expected


def start_a_then_b(knob, *, runner=None, b_tokens=6, max_batch_size=16):
    """A speculates alone for two ticks, then B arrives (a classic request)."""
    runner = runner or FakeRunner()
    runner.unsupported.add("B")  # B is classic whatever the knob: only A's fate varies
    scheduler, trace = (
        make_scheduler(runner, grant_rounds=8, speculative_disable_by_batch_size=knob, max_batch_size=max_batch_size),
        Trace(),
    )
    a, b = make_request("A", rounds=6), make_request("B", max_tokens=b_tokens)
    scheduler.submit(a)
    tick(scheduler, trace)  # slice 0
    tick(scheduler, trace)  # one round
    scheduler.submit(b)
    return scheduler, trace, a, b


@pytest.mark.parametrize(
    "knob, max_batch_size, demoted",
    [
        (0, 16, False),  # off: A keeps the slot to its end
        (1, 16, True),
        (2, 16, False),  # one other < 2
        (1, 1, False),  # B fills the batch: no row for A
    ],
)
def test_holder_demoted_when_the_rule_stops_allowing_it(knob, max_batch_size, demoted):
    scheduler, trace, a, b = start_a_then_b(knob, max_batch_size=max_batch_size)
    assert tick(scheduler, trace).model_actions == [("classic_prefill", ("B",))]  # alternation
    record = tick(scheduler, trace)  # A's next slice boundary
    if demoted:
        # Nothing speculative ran: the tick went to the batch, A's row included.
        assert record.model_actions == [("classic_decode", ("B", "A"))]
        assert a.status is RequestStatus.CLASSIC and scheduler.slot.active is None
        assert list(scheduler.grant_log) == [("A", 2)]
    else:
        assert record.model_actions == [("spec_round", ("A",))]
    rounds_before = a.spec.num_rounds
    run_until_idle(scheduler, trace)
    c = scheduler.counters
    assert c.demotions == int(demoted)
    assert a.spec.num_grants == 1 and c.grants == 1
    assert (a.spec.num_rounds == rounds_before) is demoted  # no round after the demotion
    assert a.spec.num_rounds >= 1  # what it did before stays in its stats
    for r in (a, b):  # no token lost or duplicated
        assert trace.streams()[r.request_id] == isolated_stream(r)
        assert r.status is RequestStatus.FINISHED
    finish = trace.finishes()["A"]
    assert finish.finish_reason == "length" and finish.stats.num_rounds == a.spec.num_rounds
    assert scheduler.runner.sessions == {} and scheduler.runner.drafter_holder is None
    assert scheduler.snapshot()["counters"]["demotions"] == int(demoted)


def test_knob_zero_never_calls_spec_to_classic():
    scheduler, trace, a, b = start_a_then_b(0)
    run_until_idle(scheduler, trace)
    assert not [call for call in scheduler.runner.calls if call[0] == "spec_to_classic"]
    assert trace.spec_kinds().count(True) == 1 + 6  # slice 0 + every round of A


@pytest.mark.parametrize("b_tokens", [6, 2])
def test_lone_row_moving_on_the_way_emits_its_token(b_tokens):
    """The real adapter moves a lone classic row into the batch when a second row comes:
    its token emitted on the way reaches the client once (and may finish it)."""
    runner = FakeRunner()
    runner.adopt_moves_lone_row = True
    scheduler, trace, a, b = start_a_then_b(1, runner=runner, b_tokens=b_tokens)
    tick(scheduler, trace)  # B prefilled: one token
    record = tick(scheduler, trace)  # demotion (B's second token) + a decode
    b_tokens_in_tick = sum(len(e.token_ids) for e in record.events if e.request_id == "B")
    assert b_tokens_in_tick == 2 if b_tokens > 2 else 1
    run_until_idle(scheduler, trace)
    for r in (a, b):
        assert trace.streams()[r.request_id] == isolated_stream(r)
    assert trace.finishes()["B"].finish_reason == "length"
    assert scheduler.counters.demotions == 1


def test_cancel_after_demotion_is_a_classic_cancel():
    scheduler, trace, a, b = start_a_then_b(1)
    tick(scheduler, trace)
    tick(scheduler, trace)  # A demoted
    assert a.status is RequestStatus.CLASSIC
    scheduler.cancel("A")
    run_until_idle(scheduler, trace)
    assert trace.finishes()["A"].finish_reason == "cancelled"
    assert scheduler.counters.cancelled_by_phase["classic"] == 1
    assert ("classic_remove", "A") in scheduler.runner.calls and "A" not in scheduler.runner.rows
    assert trace.streams()["B"] == isolated_stream(b)
    assert trace.streams()["A"] == isolated_stream(a)[: len(trace.streams()["A"])]


def test_cancelled_holder_is_not_demoted():
    scheduler, trace, a, b = start_a_then_b(1)
    tick(scheduler, trace)
    a.cancel_requested = True  # flagged after the drain, before A's boundary
    tick(scheduler, trace)
    assert scheduler.counters.demotions == 0 and trace.finishes()["A"].finish_reason == "cancelled"
    run_until_idle(scheduler, trace)
    assert scheduler.runner.sessions == {} and "A" not in scheduler.runner.rows


def test_failed_demotion_fails_only_that_request():
    runner = FakeRunner()
    runner.fail_on.add(("spec_to_classic", "A"))
    scheduler, trace, a, b = start_a_then_b(1, runner=runner)
    run_until_idle(scheduler, trace)
    finishes = trace.finishes()
    assert finishes["A"].finish_reason == "error" and "spec_to_classic" in finishes["A"].error
    assert finishes["B"].finish_reason == "length" and trace.streams()["B"] == isolated_stream(b)
    assert scheduler.counters.demotions == 0
    assert runner.sessions == {} and runner.drafter_holder is None and "A" not in runner.rows


@pytest.mark.parametrize("extra_ticks", [3, 4, 5])
def test_parked_jobs_are_demoted_at_promotion(extra_ticks):
    """knob 3, budget 1: A, B and C rotate (each parks after one slice), then D
    arrives. The next promotion finds each parked job with three others: it moves
    each into the batch (a parked job has a session; it does not restart), all in
    that one tick, and nobody speculates again."""
    scheduler, trace = make_scheduler(grant_rounds=1, backlog_cap=3, speculative_disable_by_batch_size=3), Trace()
    reqs = [make_request(rid, rounds=5) for rid in "ABC"]
    for r in reqs:
        scheduler.submit(r)
        tick(scheduler, trace)
    for _ in range(extra_ticks):
        tick(scheduler, trace)
    assert [r.status for r in reqs] == [RequestStatus.PARKED] * 3
    d = make_request("D", max_tokens=12)
    scheduler.submit(d)  # each of A, B, C now has three others
    assert tick(scheduler, trace).model_actions == [("classic_prefill", ("D",))]  # alternation
    record = tick(scheduler, trace)
    assert record.model_actions[0][0] == "classic_decode" and len(record.model_actions[0][1]) == 4
    assert scheduler.counters.demotions == 3 and len(scheduler.slot.backlog) == 0
    run_until_idle(scheduler, trace)
    assert not any(Trace(trace.ticks[3 + extra_ticks :]).spec_kinds())
    for r in reqs + [d]:
        assert trace.streams()[r.request_id] == isolated_stream(r)
        assert r.spec.num_parks >= 1 or r is d
    assert scheduler.runner.sessions == {} and scheduler.runner.drafter_holder is None
