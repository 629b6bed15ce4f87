"""The fused tick over the scripted fake runner: one model action per tick, classic rows
advance in the same tick as the slot's verify, and the seed's grant schedules, ring
bound and skip cap are the same in both tick modes."""

import dataclasses

import pytest

from scheduler.costs import TickCosts
from scheduler.request import Lane
from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import MODEL_ACTIONS, FakeRunner, token_at

MODES = ["fused", "alternate"]


def isolated_stream(request):
    return [token_at(request, i) for i in range(request.sampling.max_tokens)]


def fused_scheduler(mode="fused", **overrides):
    return make_scheduler(FakeRunner(fuse=True), tick_mode=mode, **overrides)


def test_rows_advance_in_the_tick_where_the_slot_verifies():
    scheduler = fused_scheduler(grant_rounds=8)
    spec = make_request("S", rounds=6)
    rows = [make_request(f"c{i}", rounds=8, prompt_ids=[i, 9]) for i in range(2)]
    runner = scheduler.runner
    runner.unsupported = {"c0", "c1"}  # classic rows beside one speculative stream
    trace = Trace()
    for r in [spec, *rows]:
        scheduler.submit(r)
    run_until_idle(scheduler, trace)
    fused = [t for t in trace.ticks if t.model_actions and t.model_actions[0][0] == "spec_round_with_decode"]
    assert fused, [t.model_actions for t in trace.ticks]
    for record in fused:
        emitted = {e.request_id for e in record.events if e.token_ids}
        assert "S" in emitted and emitted & {"c0", "c1"}, record
    # Every tick is one model action; no classic decode tick while the slot holds a job
    # with rows live: they ride along instead of waiting.
    assert all(len(t.model_actions) <= 1 for t in trace.ticks)
    assert all(a[0] in MODEL_ACTIONS for t in trace.ticks for a in t.model_actions)
    streams = trace.streams()
    for r in [spec, *rows]:
        assert streams[r.request_id] == isolated_stream(r)
    assert scheduler.counters.actions["fused"] == len(fused)


def test_alternate_mode_stalls_rows_for_every_round():
    """The seed's tick: with the same work, rows and rounds never share a tick."""
    scheduler = fused_scheduler("alternate", grant_rounds=8)
    scheduler.runner.unsupported = {"c0"}
    trace = Trace()
    for r in [make_request("S", rounds=6), make_request("c0", rounds=8, prompt_ids=[3, 9])]:
        scheduler.submit(r)
    run_until_idle(scheduler, trace)
    kinds = [t.model_actions[0][0] for t in trace.ticks if t.model_actions]
    assert "spec_round_with_decode" not in kinds and "classic_decode" in kinds
    assert scheduler.counters.actions["fused"] == 0


def test_runner_that_cannot_fuse_keeps_the_alternating_tick():
    scheduler = make_scheduler(FakeRunner(fuse=False), tick_mode="fused", grant_rounds=8)
    scheduler.runner.unsupported = {"c0"}
    for r in [make_request("S", rounds=4), make_request("c0", rounds=4, prompt_ids=[3, 9])]:
        scheduler.submit(r)
    run_until_idle(scheduler)
    assert scheduler.counters.actions["fused"] == 0


@pytest.mark.parametrize(
    "mode, budget, expected",
    [
        # The seed's schedules: B waits in the ring without progress.
        ("alternate", 2, [("A", 2), ("B", 2), ("A", 2), ("B", 1)]),
        ("alternate", 1, [("A", 2), ("B", 1), ("A", 1), ("B", 1), ("A", 1), ("B", 1)]),
        # Fused: B decodes as a classic row while it waits, and A after it parks, so each
        # needs fewer speculative slices (B's first round ends it; A's second grant too).
        ("fused", 2, [("A", 2), ("B", 1), ("A", 1)]),
        ("fused", 1, [("A", 2), ("B", 1), ("A", 1)]),
    ],
)
def test_seed_grant_schedules_with_classic_rows_live(mode, budget, expected):
    scheduler = fused_scheduler(mode, grant_rounds=budget)
    scheduler.runner.unsupported = {"c0"}
    a, b, row = make_request("A", rounds=3), make_request("B", rounds=2), make_request("c0", rounds=12, prompt_ids=[5])
    trace = Trace()
    scheduler.submit(a)
    scheduler.submit(row)
    tick(scheduler, trace)
    scheduler.submit(b)
    run_until_idle(scheduler, trace)
    assert scheduler.grant_log == expected
    streams = trace.streams()
    for r in (a, b, row):
        assert streams[r.request_id] == isolated_stream(r)
    assert all(len(t.model_actions) <= 1 for t in trace.ticks)
    assert scheduler.counters.backlog_peak <= 3
    if mode == "fused":  # every live stream advanced in every fused tick
        for record in trace.ticks:
            if record.model_actions and record.model_actions[0][0] == "spec_round_with_decode":
                live = set(record.model_actions[0][1])
                assert live <= {e.request_id for e in record.events if e.token_ids}


def test_fused_ring_entries_decode_while_they_wait():
    """Three speculative-eligible streams and a budget of 1: the two waiting in the ring
    are classic rows meanwhile, every stream gets grants, and none is ever stalled."""
    scheduler = fused_scheduler(grant_rounds=1)
    requests = [make_request(f"s{i}", rounds=6, prompt_ids=[i + 2, 5]) for i in range(3)]
    trace = Trace()
    for r in requests:
        scheduler.submit(r)
    run_until_idle(scheduler, trace)
    streams = trace.streams()
    for r in requests:
        assert streams[r.request_id] == isolated_stream(r)
        assert r.spec.num_grants >= 1 and r.spec.num_rounds >= 1, (r.request_id, r.spec)
    assert scheduler.runner.sessions == {} and scheduler.runner.rows == {}
    assert scheduler.counters.backlog_peak <= 3
    # Once all three are prefilled, a tick is never a speculative round alone: the
    # rows ride in it or decode on their own.
    first_prefill = next(i for i, t in enumerate(trace.ticks) if t.decision.action.value == "prefill")
    kinds = [t.model_actions[0][0] for t in trace.ticks[first_prefill:] if t.model_actions]
    assert "spec_round_with_decode" in kinds
    assert kinds.count("spec_round") <= 1  # at most the last stream's rounds, once it is alone


@pytest.mark.parametrize("mode", MODES)
def test_skip_cap_bounds_a_low_lane_waiter_under_high_lane_pressure(mode):
    scheduler = fused_scheduler(mode, grant_rounds=1, skip_cap=2)
    scheduler.runner.unsupported = {"c0"}
    low = make_request("low", rounds=40, lane=Lane.LOW)  # long enough to still be live when granted
    highs = [make_request(f"h{i}", rounds=2, lane=Lane.HIGH, prompt_ids=[i + 1, 7]) for i in range(6)]
    scheduler.submit(make_request("c0", rounds=30, prompt_ids=[4]))
    scheduler.submit(highs[0])
    tick(scheduler)
    scheduler.submit(low)
    feed = iter(highs[1:])

    def keep_high_pressure(_):
        if len(scheduler.slot.backlog) < 2:
            nxt = next(feed, None)
            if nxt is not None:
                scheduler.submit(nxt)

    run_until_idle(scheduler, before_tick=keep_high_pressure)
    grants = [rid for rid, _ in scheduler.grant_log]
    assert "low" in grants
    # Skipped at most skip_cap times: granted within the first skip_cap + 1 decisions
    # after it joined (the holder's first grant is not a decision it was part of).
    assert grants.index("low") <= 1 + 2


def test_fused_round_failure_fails_the_rows_it_carried_and_keeps_serving():
    scheduler = fused_scheduler(grant_rounds=8)
    scheduler.runner.unsupported = {"c0"}
    scheduler.runner.fail_on.add(("spec_round_with_decode", "S"))
    for r in [make_request("S", rounds=4), make_request("c0", rounds=4, prompt_ids=[3, 9])]:
        scheduler.submit(r)
    trace = run_until_idle(scheduler)
    finishes = trace.finishes()
    assert finishes["S"].finish_reason == "error" and finishes["c0"].finish_reason == "error"
    later = make_request("later", rounds=2, prompt_ids=[8])
    scheduler.submit(later)
    trace = run_until_idle(scheduler)
    assert trace.streams()["later"] == isolated_stream(later)
    assert scheduler.runner.sessions == {} and scheduler.runner.rows == {}


def test_rows_decoded_in_a_fused_round_are_applied_before_a_park_moves_a_row():
    """A park into the batch can make a lone row emit its next token on the way; the
    round's own decode tokens for that row must already be in its stream by then."""
    runner = FakeRunner(fuse=True)
    runner.adopt_moves_lone_row = True
    scheduler = make_scheduler(runner, tick_mode="fused", grant_rounds=1)
    a, b = make_request("A", rounds=5), make_request("B", rounds=5, prompt_ids=[7, 2])
    trace = Trace()
    scheduler.submit(a)
    tick(scheduler, trace)
    scheduler.submit(b)
    run_until_idle(scheduler, trace)
    assert scheduler.counters.parks > 0
    streams = trace.streams()
    assert streams["A"] == isolated_stream(a) and streams["B"] == isolated_stream(b)


# Forward costs (seconds) where speculating pays beside 0-1 rows and loses beside 3+
# (accepting about one draft a round, as the fake runner's rounds do).
COSTS = TickCosts({1: 5.0, 2: 5.5, 4: 6.0, 8: 8.0}, {0: 6.0, 1: 7.5, 3: 11.0, 8: 16.0}, 0.0)


@pytest.mark.parametrize("policy", ["auto", "on"])
def test_cost_gate_parks_the_holder_where_speculating_loses_and_resumes_when_the_batch_shrinks(policy):
    runner = FakeRunner(fuse=True, tick_costs=COSTS)
    scheduler = make_scheduler(runner, tick_mode="fused", grant_rounds=8, b1_policy=policy)
    spec = make_request("S", rounds=20)
    rows = [make_request(f"c{i}", rounds=3, prompt_ids=[i + 3, 1]) for i in range(3)]
    runner.unsupported = {r.request_id for r in rows}
    trace = Trace()
    for r in [spec, *rows]:
        scheduler.submit(r)
    run_until_idle(scheduler, trace)
    streams = trace.streams()
    for r in [spec, *rows]:
        assert streams[r.request_id] == isolated_stream(r)
    counters = scheduler.counters
    if policy == "on":  # no gate: the holder verifies beside every batch size
        assert counters.cost_parks == 0
        return
    assert counters.cost_parks >= 1
    assert spec.spec.num_rounds > 0 and spec.spec.num_grants >= 2  # resumed once the rows finished
    snapshot = scheduler.snapshot()["slot"]
    assert snapshot["tick_costs"]["fused_ms"][3] == 11000.0


def test_cost_gate_keeps_a_newcomer_classic_beside_a_large_batch():
    runner = FakeRunner(fuse=True, tick_costs=COSTS)
    scheduler = make_scheduler(runner, tick_mode="fused", grant_rounds=8, b1_policy="auto")
    rows = [make_request(f"c{i}", rounds=10, prompt_ids=[i + 3, 1]) for i in range(4)]
    runner.unsupported = {r.request_id for r in rows}
    for r in rows:
        scheduler.submit(r)
    tick(scheduler)  # the four rows are prefilled
    late = make_request("late", rounds=4, prompt_ids=[9, 9])
    scheduler.submit(late)
    trace = Trace()
    tick(scheduler, trace)
    assert scheduler.slot.active is None  # beside four rows it would not pay: it queues as a row
    run_until_idle(scheduler, trace)
    assert trace.streams()["late"] == isolated_stream(late)


def test_greedy_rounds_do_not_admit_a_sampled_newcomer_its_own_kinds_rounds_say_would_lose():
    """The gate judges a newcomer by the rounds of its own kind on this replica: greedy
    streams that accept every draft do not let a sampled one into the slot beside rows
    where sampled rounds have accepted nothing (a verify at T > 0 accepts less), and a
    greedy newcomer is still admitted."""
    from scheduler.gate import CostGate
    from scheduler.model_api import RoundOutcome
    from scheduler.request import Request, SamplingParams

    runner = FakeRunner(fuse=True, tick_costs=COSTS)
    scheduler = make_scheduler(runner, tick_mode="fused", b1_policy="auto")
    gate = CostGate(runner, lambda: scheduler.config)
    greedy = Request("g", [1, 2], SamplingParams(max_tokens=50))
    sampled = Request("s", [1, 2], SamplingParams(max_tokens=50, temperature=0.7, seed=1))
    for _ in range(40):
        gate.record(greedy, RoundOutcome("g", [5] * 5, None, 4, 4, False, 0.01))
        gate.record(sampled, RoundOutcome("s", [5], None, 4, 0, False, 0.01))
    new_greedy = Request("g2", [1, 2], SamplingParams(max_tokens=50))
    new_sampled = Request("s2", [1, 2], SamplingParams(max_tokens=50, temperature=0.7, seed=2))
    acceptance = gate.snapshot()["acceptance_per_round"]
    assert acceptance["greedy"] > 3.9 and acceptance["sampled"] < 0.1
    assert gate.admits_newcomer(new_greedy, 1)
    assert not gate.admits_newcomer(new_sampled, 1)


def test_snapshot_says_which_tick_runs_and_why():
    fused = make_scheduler(FakeRunner(fuse=True), tick_mode="fused").snapshot()["speculation"]
    assert fused == {"off_reason": None, "tick": "fused", "fused_off_reason": None}
    runner = FakeRunner(fuse=False)
    runner.spec_off_reason = "the target's cache cannot be rolled back"
    plain = make_scheduler(runner, tick_mode="fused").snapshot()["speculation"]
    assert plain["tick"] == "alternate" and plain["fused_off_reason"].startswith("a fake runner")
    assert plain["off_reason"] == "the target's cache cannot be rolled back"


def test_batch_size_rule_keeps_parked_rows_in_the_batch_instead_of_churning():
    """Fused ring entries are rows; once the rule says no, a parked one is not promoted
    only to be demoted at its next boundary."""
    scheduler = fused_scheduler(grant_rounds=1, speculative_disable_by_batch_size=2)
    early = [make_request(f"e{i}", rounds=12, prompt_ids=[i + 4, 2]) for i in range(2)]
    late = [make_request(f"l{i}", rounds=12, prompt_ids=[i + 8, 3]) for i in range(2)]
    trace = Trace()
    for r in early:
        scheduler.submit(r)
    for _ in range(6):
        tick(scheduler, trace)
    assert scheduler.counters.parks >= 1  # the two early ones rotated
    for r in late:
        scheduler.submit(r)
    run_until_idle(scheduler, trace)
    streams = trace.streams()
    for r in early + late:
        assert streams[r.request_id] == isolated_stream(r)
    counters = scheduler.counters
    assert counters.demotions <= 1 and counters.classic_fallbacks["batch_size_at_promotion"] >= 1
    assert scheduler.runner.sessions == {}


def test_rows_draft_in_every_decode_step_unless_speculation_is_off():
    """`row_drafts` reaches every decode step (plain or fused); `b1_policy: off` and
    `row_drafts: false` keep rows to one token a step; row verifies are counted."""
    for config, expect in ((dict(), True), (dict(row_drafts=False), False), (dict(b1_policy="off"), False)):
        runner = FakeRunner(fuse=True, tick_costs=COSTS)
        runner.row_draft_tokens = 2
        scheduler = make_scheduler(runner, tick_mode="fused", grant_rounds=2, **config)
        rows = [make_request(f"c{i}", rounds=6, prompt_ids=[i + 3, 1]) for i in range(2)]
        runner.unsupported = {r.request_id for r in rows}  # rows only: no slot
        trace = Trace()
        for r in rows:
            scheduler.submit(r)
        run_until_idle(scheduler, trace)
        assert set(runner.draft_flags) == {expect}, config
        for r in rows:  # the fake's extra tokens are the stream's next ones: nothing lost
            assert trace.streams()[r.request_id] == isolated_stream(r)
            assert (r.spec.num_rounds > 0 and 0 < r.spec.num_accepted <= 2 * r.spec.num_rounds) is expect
        assert (scheduler.counters.row_rounds > 0) is expect
        assert scheduler.counters.accepted_tokens == sum(r.spec.num_accepted for r in rows)


def holder_then_a_row(row_drafts: bool = True, sampled_row_drafts: bool = False, temperature: float = 0.0):
    """A fused-tick scheduler over rows that draft like the slot (n-gram rows beside an
    n-gram slot): "S" arrives alone and runs a tick, then classic row "c0" arrives; run
    until idle. Returns (scheduler, trace, S)."""
    runner = FakeRunner(fuse=True, tick_costs=TickCosts({1: 5.0, 2: 5.2}, {0: 5.5, 1: 5.6}, 0.0))
    runner.row_drafts_like_slot = True
    runner.sampled_row_drafts = sampled_row_drafts
    scheduler = make_scheduler(runner, tick_mode="fused", grant_rounds=8, b1_policy="auto", row_drafts=row_drafts)
    spec = make_request("S", rounds=12)
    spec.sampling = dataclasses.replace(spec.sampling, temperature=temperature, seed=1 if temperature else None)
    row = make_request("c0", rounds=4, prompt_ids=[5, 1])
    runner.unsupported = {row.request_id}
    trace = Trace()
    scheduler.submit(spec)
    tick(scheduler, trace)
    scheduler.submit(row)
    run_until_idle(scheduler, trace)
    return scheduler, trace, spec


def test_a_request_that_drafts_as_a_row_never_takes_an_ngram_slot():
    """Rows that draft like the slot's drafter make the slot worth nothing, alone or
    beside other rows: the request decodes as a row (and drafts there) from its first
    token; with `row_drafts: false` the measured costs decide as before (alone, it holds
    the slot)."""
    for row_drafts in (True, False):
        scheduler, trace, spec = holder_then_a_row(row_drafts=row_drafts)
        assert trace.streams()["S"] == isolated_stream(spec)
        assert (spec.spec.num_grants == 0) is row_drafts


@pytest.mark.parametrize("sampled_row_drafts", [False, True])
def test_a_sampled_request_takes_the_slot_unless_rows_draft_sampled_streams(sampled_row_drafts):
    """Rows draft sampled streams only with `sampled_row_drafts`: without it a sampled
    request speculates in the slot (priced like any stream, and here it pays), with it
    the request speculates as a row, as a greedy one does."""
    scheduler, trace, spec = holder_then_a_row(sampled_row_drafts=sampled_row_drafts, temperature=0.7)
    assert trace.streams()["S"] == isolated_stream(spec)
    assert (spec.spec.num_grants == 0) is sampled_row_drafts
    assert (scheduler.counters.actions["fused"] > 1) is not sampled_row_drafts


def test_without_shadow_rounds_a_streams_estimate_is_a_slower_average():
    """With a draft model nothing measures a stream between its rounds, and a round accepts
    0 to K drafts: its estimate averages more of them, so a few misses in a row after rounds
    that paid do not park it (for HOLD_TURNS tokens or more) the way the faster average of
    a shadow-measured stream would."""
    from scheduler.costs import EMA_WEIGHT, UNSHADOWED_EMA_WEIGHT
    from scheduler.gate import CostGate
    from scheduler.model_api import RoundOutcome
    from scheduler.request import Request, SamplingParams

    class NgramRunner(FakeRunner):
        def shadow_index(self, history):
            return object()  # a lookup exists: classic rows' shadow rounds keep estimates current

    gates = {}
    for name, runner in (("draft_model", FakeRunner(fuse=True, tick_costs=COSTS)), ("ngram", NgramRunner(fuse=True))):
        scheduler = make_scheduler(runner, tick_mode="fused", b1_policy="auto")
        gates[name] = CostGate(runner, lambda: scheduler.config)
    assert (
        gates["ngram"].acceptance.weight == EMA_WEIGHT > UNSHADOWED_EMA_WEIGHT == gates["draft_model"].acceptance.weight
    )
    stream = Request("a", [1, 2], SamplingParams(max_tokens=500))
    for accepted in [1] * 20 + [0, 0, 0]:  # a stream at one draft a round, then three misses
        for gate in gates.values():
            gate.record(stream, RoundOutcome("a", [5] * (1 + accepted), None, 2, accepted, False, 0.01))
    fast, slow = (gates[name].acceptance.estimate("a") for name in ("ngram", "draft_model"))
    assert fast < 0.4 < 0.8 < slow
