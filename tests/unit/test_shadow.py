"""Shadow rounds (`scheduler.shadow`): a classic row's acceptance read off the tokens
it emits, round by round as the slot would run them, with the accepted count's
distribution at T > 0, and the cost gate granting rows on what they measured."""

import random

import pytest

from models.speculative.drafters import NgramIndex
from scheduler.costs import HOLD_TURNS, AcceptanceTracker, TickCosts
from scheduler.request import Request, SamplingParams
from scheduler.shadow import MAX_HISTORY, ShadowRounds
from tests.unit.factories import Trace, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import FakeRunner, token_at


def watched(prompt, k=2):
    rounds: list[int] = []
    shadow = ShadowRounds(
        lambda history: NgramIndex(history, max_ngram=2), lambda: k, lambda _request_id, matched: rounds.append(matched)
    )
    return shadow, Request("r", list(prompt), SamplingParams(max_tokens=100)), rounds


def emit(shadow, request, *tokens):
    request.output_ids.extend(tokens)
    shadow.observe(request, len(tokens))


def test_a_round_ends_at_the_first_miss_or_after_the_bonus_token():
    shadow, request, rounds = watched([1, 2, 3, 4, 1, 2])  # the lookup proposes [3, 4]
    emit(shadow, request, 3, 4)
    assert rounds == []  # both drafts matched: the round waits for its bonus token
    emit(shadow, request, 8)
    assert rounds == [2]
    # History ... 3 4 8: no earlier 8, no round opens; then 1 2 -> [3, 4] again.
    emit(shadow, request, 1)  # after 8: nothing to draft, a round of one token gaining nothing
    emit(shadow, request, 2)  # after 1: drafts [2, 3]; 2 matches
    emit(shadow, request, 9)  # the miss ends it with one match
    assert rounds == [2, 0, 1]
    emit(shadow, request, 5)  # after 9: nothing to draft
    assert rounds == [2, 0, 1, 0] and shadow.num_rounds == 4


def test_a_first_token_miss_is_a_round_with_nothing_accepted():
    shadow, request, rounds = watched([1, 2, 3, 1])  # after 1: drafts [2, 3]
    emit(shadow, request, 7)
    assert rounds == [0]


def test_tokens_emitted_in_the_slot_are_folded_in_unscored():
    shadow, request, rounds = watched([5, 6, 7, 5])  # after 5: drafts [6, 7]
    emit(shadow, request, 6)  # one match, round open
    request.output_ids.extend([9, 9, 9])  # the request held the slot for three tokens
    emit(shadow, request, 1)  # the open round is dropped; a new one (after 9 9: [9, 9]) misses
    assert rounds == [0]
    emit(shadow, request, 5)  # after 1: nothing to draft, nothing gained
    emit(shadow, request, 6, 7)  # after 5: [6, 9] (its last follower, 6 9 ...): 6 matches, 7 misses
    assert rounds == [0, 0, 1]


def test_the_index_starts_from_the_recent_history_only():
    seen = []

    def make_index(history):
        seen.append(len(history))
        return NgramIndex(history)

    shadow = ShadowRounds(make_index, lambda: 4, lambda *_: None)
    request = Request("long", list(range(3 * MAX_HISTORY)), SamplingParams(max_tokens=10))
    request.output_ids.append(1)
    shadow.observe(request, 1)
    assert seen == [MAX_HISTORY]
    shadow.forget("long")
    assert len(shadow) == 0


def test_matches_have_the_accepted_count_distribution_of_a_sampled_verify():
    """Against the verify itself, sampled: a Markov chain over six tokens as the target,
    drafts from the prompt lookup (one-hot), accepted with probability p(draft) and
    else resampled from the rest. The mean matches per round of the shadow over
    sampled text agree with the verify's mean accepted drafts (a position with nothing
    to draft is a round of one token that accepts nothing, on both sides)."""
    vocab, k = 6, 3
    rng = random.Random(7)
    weights = [[rng.random() ** 3 for _ in range(vocab)] for _ in range(vocab)]
    p = [[w / sum(row) for w in row] for row in weights]

    def sample(last, exclude=None):
        row = [0.0 if t == exclude else p[last][t] for t in range(vocab)]
        return rng.choices(range(vocab), weights=row)[0]

    prompt = [rng.randrange(vocab) for _ in range(40)]
    # The verify: from a history, draft k tokens by lookup; accept each with p(d);
    # on a rejection draw the replacement from p without d (the residual of a one-hot draft).
    verify_accepted = []
    history = list(prompt)
    while len(verify_accepted) < 4000:
        drafts = NgramIndex(history[-64:]).propose(k)
        if not drafts:
            history.append(sample(history[-1]))
            verify_accepted.append(0)
            continue
        accepted = 0
        for d in drafts:
            if rng.random() < p[history[-1]][d]:
                history.append(d)
                accepted += 1
            else:
                history.append(sample(history[-1], exclude=d))
                break
        else:
            history.append(sample(history[-1]))  # the bonus token
        verify_accepted.append(accepted)
    shadow_matches: list[int] = []
    shadow = ShadowRounds(lambda h: _Windowed(h), lambda: k, lambda _r, m: shadow_matches.append(m))
    request = Request("s", list(prompt), SamplingParams(max_tokens=10**6))
    while len(shadow_matches) < 4000:
        request.output_ids.append(sample((request.output_ids or prompt)[-1]))
        shadow.observe(request, 1)
    verify_mean = sum(verify_accepted) / len(verify_accepted)
    shadow_mean = sum(shadow_matches) / len(shadow_matches)
    assert 0.3 < verify_mean < k - 0.3  # neither side trivial
    assert shadow_mean == pytest.approx(verify_mean, abs=0.08)


class _Windowed:
    """`NgramIndex` over the last 64 tokens, as the test's verify looks up."""

    def __init__(self, history):
        self.history = list(history)

    def extend(self, tokens):
        self.history.extend(tokens)

    def propose(self, k):
        return NgramIndex(self.history[-64:]).propose(k)


def test_tracker_keeps_a_measured_estimate_when_the_gate_turns_the_row_away():
    tracker = AcceptanceTracker(optimistic=4.0)
    tracker.record("b", 0)  # a slot round moves the prior by the EMA's weight
    tracker.record_shadow("a", 0)  # the first shadow round replaces it
    assert (tracker.estimate("a"), tracker.estimate("b")) == (0.0, 2.8)
    for _ in range(50):
        tracker.relax("a")
        tracker.relax("b")
    assert tracker.estimate("a") == 0.0  # measured: stays what its rounds showed
    assert tracker.estimate("b") > 2.0  # unmeasured: drifts back to be tried again
    tracker.forget("a")
    tracker.record("a", 0)
    tracker.relax("a")
    assert tracker.estimate("a") > 0.0  # a new stream of the same id starts unmeasured


def test_a_measured_stream_waits_out_its_hold_after_a_cost_park():
    tracker = AcceptanceTracker(optimistic=4.0)
    tracker.record_shadow("a", 0)
    tracker.record("b", 0)
    for request_id in ("a", "b"):
        tracker.parked_for_cost(request_id)
    assert tracker.held("a") and not tracker.held("b")  # b's estimate stays put while held
    tracker.record_shadow("a", 4)  # a lucky run right after the park
    assert tracker.estimate("a") > 1.0
    for _ in range(HOLD_TURNS - 1):
        tracker.relax("a")
    assert tracker.held("a")
    tracker.relax("a")
    assert not tracker.held("a")  # the gate may grant it again on its estimate
    tracker.parked_for_cost("a")  # a second cost park holds twice as long
    for _ in range(HOLD_TURNS * 2 - 1):
        tracker.relax("a")
    assert tracker.held("a")


# Speculating pays beside one row only from more than one accepted draft a round
# (the fake runner's rounds accept exactly one).
COSTS = TickCosts({1: 5.0, 2: 5.5, 4: 6.0}, {0: 6.0, 1: 7.5, 3: 11.0}, 0.0)


class _NeverRight:
    """Drafts the token after the one the fake runner will emit: never matches."""

    def __init__(self, history):
        self.last = history[-1] if history else 0

    def extend(self, tokens):
        self.last = tokens[-1]

    def propose(self, k):
        return [self.last] * k  # the fake's tokens step by 7: never the same twice running


def ring_scheduler(shadow_rounds: bool):
    runner = FakeRunner(fuse=True, tick_costs=COSTS)
    runner.shadow_index = lambda history: _NeverRight(list(history))
    return make_scheduler(runner, tick_mode="fused", b1_policy="auto", grant_rounds=4, shadow_rounds=shadow_rounds)


@pytest.mark.parametrize("shadow_rounds", [True, False])
def test_a_row_measured_to_accept_nothing_is_not_granted_to_find_out(shadow_rounds):
    scheduler = ring_scheduler(shadow_rounds)
    holder = make_request("A", rounds=30, prompt_ids=[3, 4])
    row = make_request("B", rounds=30, prompt_ids=[5, 6])
    trace = Trace()
    scheduler.submit(holder)
    tick(scheduler, trace)  # A takes the free slot
    scheduler.submit(row)  # B waits in the ring as a classic row
    run_until_idle(scheduler, trace, max_ticks=400)
    streams = trace.streams()
    for request in (holder, row):
        assert streams[request.request_id] == [token_at(request, i) for i in range(request.sampling.max_tokens)]
    snapshot = scheduler.snapshot()
    if shadow_rounds:
        assert row.spec.num_grants == 0  # its rows measured zero: never worth the slot
        assert snapshot["shadow"]["rounds"] > 0 and snapshot["shadow"]["rows"] == 0
    else:
        assert row.spec.num_grants >= 1  # unmeasured, it was granted to find out


def test_shadow_rounds_need_a_drafter_with_fixed_drafts():
    runner = FakeRunner(fuse=True, tick_costs=COSTS)
    runner.shadow_index = lambda history: None  # a draft model
    assert make_scheduler(runner, tick_mode="fused", b1_policy="auto").snapshot()["shadow"] is None
    assert make_scheduler(FakeRunner(fuse=True)).snapshot()["shadow"] is None  # no such method


def test_a_prefilled_rows_index_is_built_at_its_next_step_not_with_its_first_token():
    """Building a row's index reads its prompt (up to `MAX_HISTORY` positions): it is left
    out of the prefill tick, whose first tokens would wait for it, and made at the row's
    next step, its history then holding the first token (unscored)."""
    built: list[list[int]] = []
    runner = FakeRunner(fuse=True, tick_costs=COSTS)
    runner.shadow_index = lambda history: built.append(list(history)) or _NeverRight(list(history))
    scheduler = make_scheduler(runner, tick_mode="fused", b1_policy="auto", grant_rounds=4, shadow_rounds=True)
    built.clear()  # the scheduler's probe for a drafter with fixed drafts
    holder = make_request("A", rounds=30, prompt_ids=[3, 4])
    row = make_request("B", rounds=30, prompt_ids=[5, 6])
    scheduler.submit(holder)
    tick(scheduler)  # A takes the free slot
    scheduler.submit(row)
    while not row.output_ids:  # B's prefill
        tick(scheduler)
    assert built == [] and len(row.output_ids) == 1
    while len(row.output_ids) == 1:  # B's next step as a row
        tick(scheduler)
    assert built == [[5, 6, row.output_ids[0]]]
