"""Requests that arrive while a prefill runs (`prefill_yield_tokens`): between two of its
forwards they are routed, and those of a higher lane than every prompt in flight, or
with at most `prefill_yield_tokens` prompt positions to compute, are prefilled there and
their first tokens go out at once; the others wait for the next tick, in lane order and
FIFO within a lane. Over the fake runner, whose prefills run `prefill_forwards` forwards
and call `between` after each but the last."""

import pytest

from scheduler.request import Lane
from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import FakeRunner, token_at

PIECE = 256


def isolated_stream(request):
    return [token_at(request, i) for i in range(request.sampling.max_tokens)]


def prompt(n, seed=1):
    return [seed] + [5] * (n - 1)


def classic_scheduler(forwards=3, **overrides):
    runner = FakeRunner()
    runner.prefill_forwards = forwards
    scheduler = make_scheduler(runner, b1_policy="off", prefill_yield_tokens=PIECE, **overrides)
    published = []
    scheduler.publish = published.append
    return scheduler, runner, published


def arrive_during_prefill(scheduler, runner, *requests, at_forward=1):
    """Submit `requests` while the `at_forward`-th forward of the next prefill runs."""
    count = [0]

    def submit():
        count[0] += 1
        if count[0] == at_forward:
            runner.on_prefill_forward = None
            for request in requests:
                scheduler.submit(request)

    runner.on_prefill_forward = submit


def first_token_order(published, events):
    """Request ids in the order their first tokens went out (published, then the tick's)."""
    order = []
    for event in [e for batch in published for e in batch] + list(events):
        if event.token_ids and event.request_id not in order:
            order.append(event.request_id)
    return order


def test_a_short_arrival_is_prefilled_between_a_long_prompts_forwards():
    scheduler, runner, published = classic_scheduler()
    long = make_request("long", rounds=3, prompt_ids=prompt(1000))
    short = make_request("short", rounds=3, prompt_ids=prompt(20, seed=2))
    scheduler.submit(long)
    arrive_during_prefill(scheduler, runner, short)
    trace = Trace()
    record = tick(scheduler, trace)
    # admitted at the first boundary, then a row: it steps at both
    assert record.model_actions == [
        ("classic_prefill", ("long",)),
        ("classic_prefill", ("short",)),
        ("classic_decode", ("short",)),
        ("classic_decode", ("short",)),
    ]
    assert first_token_order(published, record.events) == ["short", "long"]
    assert published and published[0][0].request_id == "short"  # out before the tick ends
    assert scheduler.counters.prefill_overtakes == 1
    assert scheduler.counters.prefill_yields == 2
    run_until_idle(scheduler, trace)
    merged = {}
    for event in [e for batch in published for e in batch] + [e for r in trace.ticks for e in r.events]:
        merged.setdefault(event.request_id, []).extend(event.token_ids)
    for r in (long, short):  # nothing lost or repeated
        assert merged[r.request_id] == isolated_stream(r)


def test_a_long_arrival_of_the_same_lane_waits_for_the_next_tick():
    scheduler, runner, published = classic_scheduler()
    scheduler.submit(make_request("first", prompt_ids=prompt(1000)))
    arrive_during_prefill(scheduler, runner, make_request("second", prompt_ids=prompt(600, seed=2)))
    record = tick(scheduler)
    assert record.model_actions == [("classic_prefill", ("first",))]
    assert scheduler.counters.prefill_overtakes == 0
    assert scheduler.snapshot()["queued_ids"] == ["second"]
    runner.prefill_forwards = 1
    assert tick(scheduler).model_actions == [("classic_prefill", ("second",))]


def test_a_higher_lane_overtakes_whatever_its_length():
    scheduler, runner, published = classic_scheduler()
    scheduler.submit(make_request("normal", prompt_ids=prompt(1000)))
    arrive_during_prefill(scheduler, runner, make_request("high", lane=Lane.HIGH, prompt_ids=prompt(900, seed=2)))
    record = tick(scheduler)
    assert record.model_actions[:2] == [("classic_prefill", ("normal",)), ("classic_prefill", ("high",))]
    assert first_token_order(published, record.events) == ["high", "normal"]


def test_no_request_overtakes_an_earlier_one_of_its_lane():
    """A short request behind a long one of the same lane waits with it; a short one of
    a higher lane still goes."""
    scheduler, runner, published = classic_scheduler()
    scheduler.submit(make_request("first", prompt_ids=prompt(1000)))
    arrive_during_prefill(
        scheduler,
        runner,
        make_request("long", prompt_ids=prompt(700, seed=2)),
        make_request("short", prompt_ids=prompt(10, seed=3)),
        make_request("urgent", lane=Lane.HIGH, prompt_ids=prompt(10, seed=4)),
    )
    record = tick(scheduler)
    assert record.model_actions[:2] == [("classic_prefill", ("first",)), ("classic_prefill", ("urgent",))]
    assert scheduler.snapshot()["queued_ids"] == ["long", "short"]


def test_a_long_prompt_whose_prefix_is_cached_overtakes():
    """What counts is what the prefill computes: a long prompt with all but a few
    positions cached (a chat's next turn) runs in one forward."""
    scheduler, runner, published = classic_scheduler()
    scheduler.submit(make_request("fresh", prompt_ids=prompt(1000)))
    turn = make_request("turn", prompt_ids=prompt(900, seed=2))
    runner.cached_prompt["turn"] = 900 - PIECE
    arrive_during_prefill(scheduler, runner, turn)
    record = tick(scheduler)
    assert record.model_actions[:2] == [("classic_prefill", ("fresh",)), ("classic_prefill", ("turn",))]
    runner.cached_prompt["turn"] = 0


def test_at_most_the_free_rows_are_admitted():
    scheduler, runner, published = classic_scheduler(max_batch_size=3)
    scheduler.submit(make_request("long", prompt_ids=prompt(1000)))
    arrive_during_prefill(
        scheduler, runner, *(make_request(f"s{i}", prompt_ids=prompt(10, seed=i + 2)) for i in range(4))
    )
    record = tick(scheduler)
    assert record.model_actions[:2] == [("classic_prefill", ("long",)), ("classic_prefill", ("s0", "s1"))]
    assert scheduler.snapshot()["queued_ids"] == ["s2", "s3"]


def test_arrivals_during_an_overtaking_prefill_wait_for_the_next_tick():
    """A prefill run between another's forwards admits nobody between its own (its rows
    decode there, nothing more)."""
    scheduler, runner, published = classic_scheduler()
    scheduler.submit(make_request("long", prompt_ids=prompt(1000)))
    late = make_request("late", prompt_ids=prompt(10, seed=3))
    calls = [0]

    def on_forward():
        calls[0] += 1
        if calls[0] == 1:
            scheduler.submit(make_request("high", lane=Lane.HIGH, prompt_ids=prompt(800, seed=2)))
        elif calls[0] == 2:  # a forward of the high request's prefill
            scheduler.submit(late)

    runner.on_prefill_forward = on_forward
    record = tick(scheduler)
    prefills = [ids for name, ids in record.model_actions if name == "classic_prefill"]
    assert prefills[:2] == [("long",), ("high",)]
    # "late" came during the high prefill's forwards: admitted at the long prompt's next between
    assert ("late",) in prefills[2:]
    assert scheduler.counters.prefill_overtakes == 2


def test_cancels_taken_inside_a_prefill_are_applied_at_the_next_drain():
    scheduler, runner, published = classic_scheduler()
    long = make_request("long", prompt_ids=prompt(1000))
    short = make_request("short", rounds=10, prompt_ids=prompt(10, seed=2))
    scheduler.submit(long)
    count = [0]

    def on_forward():
        count[0] += 1
        if count[0] == 1:
            scheduler.submit(short)
        elif count[0] == 2:
            scheduler.cancel("long")
            scheduler.cancel("short")

    runner.on_prefill_forward = on_forward
    trace = Trace()
    tick(scheduler, trace)
    assert set(runner.rows) == {"long", "short"}  # both prompts in: nothing released mid-prefill
    run_until_idle(scheduler, trace)
    finishes = trace.finishes()
    assert finishes["long"].finish_reason == "cancelled"
    assert finishes["short"].finish_reason == "cancelled"
    assert runner.rows == {}
    # each cancelled while its prefill ran (the short one's, inside the long one's)
    assert scheduler.counters.cancelled_by_phase["prefill"] == 2


def test_an_overtaking_prefill_that_fails_fails_its_rows_only():
    scheduler, runner, published = classic_scheduler()
    long = make_request("long", rounds=2, prompt_ids=prompt(1000))
    bad = make_request("bad", prompt_ids=prompt(10, seed=2))
    runner.fail_on.add(("classic_prefill", "bad"))
    scheduler.submit(long)
    arrive_during_prefill(scheduler, runner, bad)
    trace = Trace()
    tick(scheduler, trace)
    failed = [e for batch in published for e in batch if e.request_id == "bad"]
    assert failed and failed[-1].finish_reason == "error"
    run_until_idle(scheduler, trace)
    assert trace.streams()["long"] == isolated_stream(long)


@pytest.mark.parametrize("piece", [0])
def test_without_pieces_nobody_overtakes(piece):
    """`prefill_yield_tokens: 0`: a prefill runs whole, arrivals wait for it."""
    scheduler, runner, published = classic_scheduler()
    scheduler.reconfigure(prefill_yield_tokens=piece)
    scheduler.submit(make_request("long", prompt_ids=prompt(1000)))
    arrive_during_prefill(scheduler, runner, make_request("short", prompt_ids=prompt(10, seed=2)))
    record = tick(scheduler)
    assert record.model_actions == [("classic_prefill", ("long",))]
    assert runner.on_prefill_forward is not None  # no forward boundary was offered


def test_a_free_slot_is_not_taken_inside_a_prefill():
    """A request the slot could serve, arriving while a prefill runs, joins the ring as
    a row (and overtakes as one) instead of being installed on the free slot, whose
    slice 0 could not run before the prefill ends; the slot grants it next."""
    runner = FakeRunner(fuse=True, unsupported=("long",))
    runner.prefill_forwards = 3
    scheduler = make_scheduler(runner, prefill_yield_tokens=PIECE)
    scheduler.publish = lambda events: None
    scheduler.submit(make_request("long", rounds=8, prompt_ids=prompt(1000)))
    arrive_during_prefill(scheduler, runner, make_request("spec", rounds=8, prompt_ids=prompt(10, seed=2)))
    record = tick(scheduler)
    assert record.model_actions[:2] == [("classic_prefill", ("long",)), ("classic_prefill", ("spec",))]
    assert scheduler.slot.active is None
    grants = scheduler.counters.grants
    tick(scheduler)
    assert scheduler.counters.grants == grants + 1
    assert scheduler.slot.active is not None and scheduler.slot.active.request.request_id == "spec"


def holder_and_row(mode="fused", forwards=3, spec_rounds=8):
    """A started slot holder "S" and a classic row "c" decoding, on a fused-capable
    fake; returns (scheduler, runner, events: every event in the order handed out, and
    a tick function that appends its tick's events there)."""
    runner = FakeRunner(fuse=True, unsupported=("c", "long"))
    scheduler = make_scheduler(runner, tick_mode=mode, prefill_yield_tokens=PIECE, grant_rounds=100)
    events = []
    scheduler.publish = events.extend

    def step():
        record = tick(scheduler)
        events.extend(record.events)
        return record

    scheduler.submit(make_request("S", rounds=spec_rounds))
    scheduler.submit(make_request("c", rounds=8, prompt_ids=prompt(10, seed=3)))
    for _ in range(4):
        step()
    assert scheduler.slot.active is not None and scheduler.slot.active.started
    runner.prefill_forwards = forwards
    return scheduler, runner, events, step


def streams_of(events):
    out = {}
    for event in events:
        out.setdefault(event.request_id, []).extend(event.token_ids)
    return out


def until_prefill(step):
    record = step()
    while not record.model_actions or record.model_actions[0][0] != "classic_prefill":
        record = step()
    return record


def finish(scheduler, step):
    for _ in range(500):
        if not scheduler.has_work():
            return
        step()
    raise AssertionError("still busy")


@pytest.mark.parametrize("mode", ["fused", "alternate"])
def test_the_slot_holder_rounds_between_a_prefills_forwards(mode):
    scheduler, runner, events, step = holder_and_row(mode)
    long = make_request("long", rounds=3, prompt_ids=prompt(1000))
    scheduler.submit(long)
    before = len(events)
    record = until_prefill(step)
    names = [name for name, _ in record.model_actions]
    if mode == "fused":  # the holder's round carries the row's step: one forward each time
        assert names[1:] == ["spec_round_with_decode"] * 2
    else:
        assert names[1:] == ["spec_round", "classic_decode"] * 2
    assert scheduler.counters.prefill_yields == (2 if mode == "fused" else 4)
    first_long = next(k for k, e in enumerate(events) if e.request_id == "long" and e.token_ids)
    assert {e.request_id for e in events[before:first_long] if e.token_ids} == {"S", "c"}
    finish(scheduler, step)
    streams = streams_of(events)
    for r in (long, make_request("S", rounds=8), make_request("c", rounds=8, prompt_ids=prompt(10, seed=3))):
        assert streams[r.request_id] == isolated_stream(r)


def test_a_holder_that_finishes_between_two_forwards_leaves_the_prefill_intact():
    scheduler, runner, events, step = holder_and_row(spec_rounds=4, forwards=8)
    long = make_request("long", rounds=3, prompt_ids=prompt(1000))
    scheduler.submit(long)
    before = len(events)
    record = until_prefill(step)
    finished = [e for e in events[before:] if e.finish_reason]
    assert [e.request_id for e in finished] == ["S"] and finished[0].finish_reason == "length"
    assert scheduler.slot.active is None
    assert "classic_decode" in [name for name, _ in record.model_actions]  # the row steps on alone
    finish(scheduler, step)
    assert runner.rows == {}
    streams = streams_of(events)
    assert streams["long"] == isolated_stream(long)
    assert streams["S"] == isolated_stream(make_request("S", rounds=4))


def test_a_failed_round_between_forwards_fails_the_rows_not_the_prompt_in_flight():
    scheduler, runner, events, step = holder_and_row()
    runner.fail_on.add(("spec_round_with_decode", "S"))
    long = make_request("long", rounds=3, prompt_ids=prompt(1000))
    scheduler.submit(long)
    until_prefill(step)
    assert {e.request_id for e in events if e.error} == {"S", "c"}
    finish(scheduler, step)
    assert streams_of(events)["long"] == isolated_stream(long)
    assert runner.rows == {}


def test_no_slice_zero_runs_inside_a_prefill():
    """A holder that has not started (its slice 0 is a prefill of its own), or none, is
    left for the next tick: `round_within` runs nothing."""
    runner = FakeRunner(fuse=True)
    scheduler = make_scheduler(runner, prefill_yield_tokens=PIECE)
    assert not scheduler.slot.round_within(fuse=True).ran
    assert scheduler.slot.try_admit(make_request("S", rounds=3)) is None  # installed, not begun
    assert not scheduler.slot.active.started
    assert not scheduler.slot.round_within(fuse=True).ran
    assert runner.actions == []
