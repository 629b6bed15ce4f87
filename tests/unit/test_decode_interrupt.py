"""`interrupt_decode`: a request that arrives while a classic decode step runs stops that
step (the runner raises `Interrupted` between layers), its prefill runs at the next tick,
and the stopped step runs again whole after it. Over the fake runner, which stops where
it is offered an interrupt that says so."""

import pytest

from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import FakeRunner, token_at


def isolated_stream(request):
    return [token_at(request, i) for i in range(request.sampling.max_tokens)]


def classic_scheduler(**overrides):
    runner = FakeRunner()
    runner.interruptible = True
    return make_scheduler(runner, b1_policy="off", **overrides), runner


def arrive_during_next_decode(scheduler, runner, request):
    """`request` is submitted while the next decode step runs (once)."""

    def submit():
        runner.on_decode = None
        scheduler.submit(request)

    runner.on_decode = submit


def test_an_arrival_stops_the_decode_step_and_is_prefilled_next():
    scheduler, runner = classic_scheduler()
    a, b, c = (make_request(r, rounds=6) for r in "abc")
    trace = Trace()
    scheduler.submit(a)
    scheduler.submit(b)
    assert tick(scheduler, trace).model_actions == [("classic_prefill", ("a", "b"))]
    assert tick(scheduler, trace).model_actions == [("classic_decode", ("a", "b"))]  # nobody arrives: whole
    arrive_during_next_decode(scheduler, runner, c)
    stopped = tick(scheduler, trace)
    assert stopped.model_actions == [("classic_decode_interrupted", ("a", "b"))]
    assert stopped.events == []  # no row gained a token
    assert scheduler.counters.decode_interrupts == 1
    assert scheduler.counters.actions["decode"] == 2  # the stopped step's tick counts as a decode tick
    assert tick(scheduler, trace).model_actions == [("classic_prefill", ("c",))]
    run_until_idle(scheduler, trace)
    streams = trace.streams()
    for r in (a, b, c):  # nothing lost or repeated by the stopped step
        assert streams[r.request_id] == isolated_stream(r)


def test_the_step_after_a_stopped_one_runs_whole():
    """At most every other decode step stops: the rows always progress, however often
    requests arrive."""
    scheduler, runner = classic_scheduler()
    scheduler.submit(make_request("a", rounds=20))
    tick(scheduler)  # prefill a
    arrivals = iter(make_request(f"r{i}", rounds=20) for i in range(6))
    offered_before = len(runner.interrupts_offered)

    def always_arrive():
        request = next(arrivals, None)
        if request is not None:
            scheduler.submit(request)

    runner.on_decode = always_arrive
    kinds = []
    for _ in range(12):
        record = tick(scheduler)
        kinds += [name for name, _ in record.model_actions]
    decodes = [k for k in kinds if k.startswith("classic_decode")]
    for first, second in zip(decodes, decodes[1:]):
        assert not (first == second == "classic_decode_interrupted")
    assert "classic_decode" in decodes and "classic_decode_interrupted" in decodes
    offered = runner.interrupts_offered[offered_before:]
    # a decode step right after a stopped one is not offered an interrupt
    for stopped_first, nxt in zip(decodes, offered[1:]):
        if stopped_first == "classic_decode_interrupted":
            assert nxt is False


@pytest.mark.parametrize(
    "overrides, why",
    [
        ({"interrupt_decode": False}, "switched off"),
        ({"max_batch_size": 2}, "the batch has no row for the arrival"),
    ],
)
def test_no_interrupt(overrides, why):
    scheduler, runner = classic_scheduler(**overrides)
    a, b, c = (make_request(r, rounds=4) for r in "abc")
    scheduler.submit(a)
    scheduler.submit(b)
    tick(scheduler)
    arrive_during_next_decode(scheduler, runner, c)
    assert tick(scheduler).model_actions == [("classic_decode", ("a", "b"))], why
    assert scheduler.counters.decode_interrupts == 0
    trace = run_until_idle(scheduler)
    assert trace.streams()["c"] == isolated_stream(c)


def test_a_stopped_step_teaches_the_cost_gate_nothing():
    """The cost gate learns decode costs from whole steps only."""
    observed = []
    scheduler, runner = classic_scheduler()
    scheduler._observe_tick = lambda kind, rows, seconds: observed.append(kind)
    scheduler.submit(make_request("a", rounds=6))
    tick(scheduler)
    arrive_during_next_decode(scheduler, runner, make_request("b", rounds=6))
    tick(scheduler)
    assert runner.actions[-1][0] == "classic_decode_interrupted"
    assert observed[-1] is None
    tick(scheduler)  # b's prefill
    tick(scheduler)
    assert runner.actions[-1][0] == "classic_decode" and observed[-1] == "decode"
