"""The fused tick's cost arithmetic (scheduler.costs), by tables."""

import pytest

from scheduler.costs import (
    BATCH_MARGIN,
    HOLD_TURNS,
    LIVE_CLIP,
    LIVE_MIN_DRAFTING,
    AcceptanceTracker,
    DraftFit,
    LiveCosts,
    LiveDraftFit,
    TickCosts,
    draft_net,
    drafts_pay,
    row_draft_budget,
    share_drafts,
    speculation_pays,
    step_draft_budget,
    verify_costs,
)

COSTS = TickCosts(decode={1: 4.0, 2: 5.0, 4: 6.0, 8: 8.0}, fused={0: 6.0, 1: 7.0, 4: 9.0, 8: 12.0}, draft=1.0)


@pytest.mark.parametrize(
    "table, x, expected",
    [
        ({1: 4.0, 2: 5.0, 4: 6.0}, 2, 5.0),  # measured
        ({1: 4.0, 2: 5.0, 4: 6.0}, 3, 5.5),  # between two sizes
        ({1: 4.0, 2: 5.0, 4: 6.0}, 8, 8.0),  # past the largest: the last two extrapolate
        ({1: 4.0, 2: 5.0}, 0, 3.0),  # below the smallest
        ({2: 7.0}, 5, 7.0),  # one size only
        ({1: 4.0, 2: 1.0}, 9, 0.0),  # never negative
    ],
)
def test_interpolation(table, x, expected):
    assert TickCosts(table, {0: 1.0}, 0.0).decode_s(x) == pytest.approx(expected)


@pytest.mark.parametrize(
    "rows, accepted, pays",
    [
        (0, 2.0, True),  # (1 + 2) / 7 = 0.43 vs 1 / 4 = 0.25
        (0, 0.5, False),  # 1.5 / 7 = 0.21 vs 0.25
        (1, 3.0, True),  # 5 / 8 = 0.63 vs 2 / 5 = 0.40
        (4, 1.0, False),  # 6 / 10 = 0.6 vs 5 / 6.5 = 0.77
        (4, 4.0, True),  # 9 / 10 = 0.9 vs 0.77
    ],
)
def test_speculation_pays_compares_the_two_rates(rows, accepted, pays):
    assert speculation_pays(rows, accepted, COSTS) is pays


def test_live_costs_learn_each_kinds_extra_time_and_keep_the_margin_beside_rows():
    live = LiveCosts(COSTS, weight=0.5)
    assert live.tick_s("decode", 2) == 5.0 and live.tick_s("fused", 1) == 8.0  # forward (+ draft)
    live.observe("decode", 2, 7.0)  # 2 s more than the forward: half of it, at weight 0.5
    assert live.tick_s("decode", 4) == pytest.approx(7.0)
    live.observe("decode", 2, 100.0)  # an outlier counts at most its predicted time
    assert live.extra["decode"] == pytest.approx(0.5 * 1.0 + 0.5 * 5.0)
    live.observe("fused", 0, 0.0)  # a clock that does not move teaches nothing
    live.observe("decode", 0, 3.0)  # nor does a decode of no rows
    assert live.num_observed == {"decode": 2, "fused": 0}
    # Alone, the plain comparison; beside rows, speculation must win by BATCH_MARGIN.
    fresh = LiveCosts(COSTS)
    with_slot, without = (1 + 1 + 3.0) / 8.0, (1 + 1) / 5.0
    assert with_slot > without and (with_slot > BATCH_MARGIN * without) is fresh.pays(1, 3.0)
    assert fresh.pays(0, 2.0) is speculation_pays(0, 2.0, TickCosts(COSTS.decode, COSTS.fused, 1.0))


def test_live_costs_price_a_round_by_the_drafts_rounds_verify():
    k = 4
    live = LiveCosts(COSTS, weight=0.5, num_draft_tokens=k)
    assert live.tick_s("fused", 1) == 8.0  # no round seen yet: all K
    live.observe_width(2)
    assert live.width == 2.0
    decode, per_position = COSTS.decode_s(2), (COSTS.fused_s(1) - COSTS.decode_s(2)) / k
    expected = decode + per_position * 2 + COSTS.draft * 3 / k  # 2 drafts, 3 draft steps
    assert live.tick_s("fused", 1) == pytest.approx(expected) and expected < 8.0
    live.observe_width(0)  # a round that drafted nothing: its pending token alone
    assert live.width == pytest.approx(1.0)
    assert live.snapshot()["drafts_per_round"] == 1.0
    live.observe_width(k)
    live.observe_width(k)
    live.observe_width(k)  # at K again: the table's price
    assert live.tick_s("fused", 1) < 8.0
    assert LiveCosts(COSTS, weight=0.5, num_draft_tokens=k).tick_s("fused", 1) == 8.0
    # Cheaper rounds can pay where full ones do not: 1.2 accepted a round alone.
    full = LiveCosts(COSTS, num_draft_tokens=k)
    assert not full.pays(0, 0.4)
    full.observe_width(1)
    assert full.pays(0, 0.4)


def test_the_gate_prices_widths_only_for_a_drafter_that_varies_them():
    from scheduler.config import SchedulerConfig
    from scheduler.gate import CostGate
    from scheduler.model_api import RoundOutcome
    from scheduler.request import Request, SamplingParams

    from .fakes import FakeRunner

    class Varying(FakeRunner):
        def slot_drafts_vary(self):
            return True

    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=8))
    outcome = RoundOutcome("a", [5, 6], None, 1, 1, False, 0.01)
    for runner, k in ((FakeRunner(fuse=True, tick_costs=COSTS), 0), (Varying(fuse=True, tick_costs=COSTS), 3)):
        gate = CostGate(runner, lambda: SchedulerConfig(num_draft_tokens=3))
        assert gate.costs.num_draft_tokens == k
        gate.record(request, outcome)
        assert gate.costs.width == (1.0 if k else None)


def test_acceptance_is_the_requests_own_and_newcomers_start_from_the_replica():
    tracker = AcceptanceTracker(optimistic=4.0)
    assert tracker.estimate("a") == 4.0  # before any round: all K
    tracker.record("a", 0)
    assert tracker.estimate("a") == pytest.approx(0.7 * 4.0)
    assert tracker.estimate("new") == tracker.replica[True] == 0.0  # the replica's first round
    for _ in range(30):
        tracker.record("b", 3)
    assert tracker.estimate("b") == pytest.approx(3.0, abs=0.01)
    assert tracker.estimate("a") == pytest.approx(2.8)  # b's rounds do not move a's estimate
    before = tracker.replica[True]
    tracker.relax()  # a newcomer turned away: the replica's estimate moves back toward K
    assert before < tracker.replica[True] < 4.0
    tracker.relax("a")
    assert 2.8 < tracker.estimate("a") < 4.0
    tracker.forget("a")
    assert tracker.estimate("a") == tracker.replica[True]


def test_greedy_and_sampled_newcomers_start_from_their_own_kinds_rounds():
    """A verify at T > 0 accepts less than a greedy one of the same drafts: a replica's
    greedy rounds do not set the prior of its sampled newcomers, nor the other way."""
    tracker = AcceptanceTracker(optimistic=4.0)
    for _ in range(30):
        tracker.record("g", 4, greedy=True)
        tracker.record("s", 0, greedy=False)
    assert tracker.estimate("new") == pytest.approx(4.0, abs=0.01)
    assert tracker.estimate("new", greedy=False) < 0.5
    assert tracker.estimate("s", greedy=True) == tracker.estimate("s", greedy=False)  # its own rounds decide
    tracker.record_shadow("row", 0, greedy=False)  # shadow rounds count toward their kind too
    assert tracker.replica[False] < 0.5 and tracker.replica[True] > 3.9
    sampled = tracker.replica[False]
    tracker.relax(greedy=False)  # a sampled newcomer turned away relaxes the sampled prior only
    assert sampled < tracker.replica[False] and tracker.estimate("new") == pytest.approx(4.0, abs=0.01)
    fresh = AcceptanceTracker(optimistic=4.0)
    fresh.record("g", 1)
    assert fresh.estimate("new", greedy=False) == 4.0  # a kind with no rounds yet: all K


def test_a_stream_parked_for_cost_waits_longer_each_time_before_its_estimate_relaxes():
    tracker = AcceptanceTracker(optimistic=4.0)
    tracker.record("a", 0)
    low = tracker.estimate("a")
    for parks in (1, 2, 3):
        tracker.parked_for_cost("a")
        for _ in range(HOLD_TURNS * (1 << (parks - 1))):
            tracker.relax("a")
        assert tracker.estimate("a") == low  # held: no turn-away moved it
        tracker.relax("a")
        assert tracker.estimate("a") > low
        tracker.record("a", 0)  # tried again, accepted nothing
        low = tracker.estimate("a")
    tracker.relax("b")  # no hold on other streams (none of its own yet: nothing to move)
    tracker.forget("a")
    tracker.record("a", 0)
    before = tracker.estimate("a")
    tracker.relax("a")  # forgotten: the hold went with it
    assert tracker.estimate("a") > before


@pytest.mark.parametrize(
    "rows, fit, budget",
    [
        (4, (3.5, 0.5, 0.625), 4),  # 0.5 * (3.5 + 2) / 0.625
        (16, (20.0, 0.45, 0.35), 38),  # the CPU's fit: 16 rows of 4 drafts do not fit
        (8, (20.0, 0.45, 0.35), 33),  # 8 rows of 4 drafts do
        (8, (10.0, 0.5, 0.0), None),  # drafts cost nothing measurable: no limit
    ],
)
def test_step_draft_budget_bounds_what_drafts_add_to_a_step(rows, fit, budget):
    assert step_draft_budget(rows, fit, 0.5) == budget


@pytest.mark.parametrize(
    "wants, lanes, denied, budget, given",
    [
        ([4, 4, 4], [1, 1, 1], [0, 0, 0], None, [4, 4, 4]),  # no limit
        ([4, 4, 4], [1, 1, 1], [0, 0, 0], 12, [4, 4, 4]),  # it all fits
        ([4, 4, 4], [1, 1, 1], [0, 0, 0], 6, [4, 2, 0]),  # one lane: row order (FIFO)
        ([4, 4, 4], [1, 0, 2], [0, 0, 0], 6, [2, 4, 0]),  # high, then normal, then low
        ([4, 4, 4], [2, 2, 0], [0, 1, 0], 5, [1, 0, 4]),  # denied once: not yet overdue
        ([4, 4, 4], [2, 2, 0], [0, 2, 0], 5, [0, 4, 1]),  # denied skip_cap times: goes first
        ([4, 4, 4], [2, 2, 0], [2, 3, 0], 5, [1, 4, 0]),  # the most denied first
        ([0, 3, 1], [0, 1, 2], [0, 0, 0], 2, [0, 2, 0]),  # a row that wants none takes none
        ([4, 4], [1, 0], [0, 0], 0, [0, 0]),  # no budget: nobody drafts
    ],
)
def test_share_drafts_serves_rows_as_grants_are_served(wants, lanes, denied, budget, given):
    assert share_drafts(wants, lanes, denied, budget, skip_cap=2) == given


# The 2-core CPU's bundled target, as measured at load (ms): a forward 7.6, a row 0.675;
# a drafting row 0.33 and a draft 0.45 more; a step's first draft 2.3 more than that
# (the packed forward's extra attention call per layer).
CPU_FIT = DraftFit(7.6, 0.675, 0.45, 2.3, 0.33)


def test_the_first_draft_and_each_drafting_row_are_fitted_apart_from_the_drafts():
    decode = {1: 8.6, 4: 10.4, 16: 17.6}
    first, row, draft = 3.05, 0.3, 0.35
    all_verify = {b: decode[b] + first + (b - 1) * row + (4 * b - 1) * draft for b in (4, 16)}
    one_draft = {b: decode[b] + first for b in (1, 16)}
    half_one = {b: decode[b] + first + (b // 2 - 1) * (row + draft) for b in (4, 16)}
    fit = verify_costs(TickCosts(decode, {0: 12.0, 4: 14.4}, 0.0, all_verify, one_draft, half_one), 4)
    assert tuple(fit) == pytest.approx((8.0, 0.6, 0.35, 2.4, 0.3, 8.6, 2.4))
    # without the half table rows cost nothing apart; without the one-draft table the
    # first draft is spread over every draft, as before it was measured
    no_rows = verify_costs(TickCosts(decode, {0: 12.0}, 0.0, all_verify, one_draft), 4)
    assert no_rows.per_row == 0.0 and no_rows.first_draft == pytest.approx(first - no_rows.per_draft)
    spread = verify_costs(TickCosts(decode, {0: 12.0}, 0.0, all_verify), 4)
    assert spread.first_draft == 0.0 and spread.per_draft > draft


@pytest.mark.parametrize(
    "alphas, rows, pays",
    [
        ([0.45, 0.45], 4, False),  # two rows whose drafts land 45 %: 2 x 0.18 tokens < 0.89
        ([0.6, 0.6], 4, True),  # two at 60 %: 2 x 0.52
        ([0.6, 0.6], 8, False),  # beside 8 rows: 2 x 0.20 < 1.42
        ([0.8], 4, True),  # one row that lands 80 % of 4 drafts pays for it alone
        ([0.8, 0.8, 0.8], 16, False),  # beside 16 rows the first draft costs 2.0 tokens: 3 x 0.51
        ([0.8] * 4, 16, True),
    ],
)
def test_a_step_drafts_only_when_its_rows_pay_for_its_first_draft(alphas, rows, pays):
    nets = [draft_net(a, row_draft_budget(a, rows, CPU_FIT, 4), rows, CPU_FIT) for a in alphas]
    assert all(n > 0 for n in nets)  # each row alone would draft by its own budget
    assert drafts_pay(nets, rows, CPU_FIT) is pays


def test_a_drafting_row_pays_its_own_cost_first():
    """At 8 rows a row landing 45 % would draft one token by the per-draft cost alone;
    with the drafting row's own cost it drafts none."""
    assert row_draft_budget(0.45, 8, CPU_FIT._replace(per_row=0.0), 4) == 1
    assert row_draft_budget(0.45, 8, CPU_FIT, 4) == 0
    assert draft_net(0.9, 0, 8, CPU_FIT) == 0.0


def test_live_draft_fit_prices_drafts_by_the_steps_the_batch_runs():
    base = DraftFit(per_forward=0.070, per_token=0.005, per_draft=0.001, first_draft=0.009, per_row=0.004)
    live = LiveDraftFit(base)
    # Plain steps 20 ms faster than the fit (a table measured on a busy machine): the fixed
    # cost follows, and with it the rate an accepted draft is worth.
    for _ in range(60):
        live.observe(4, 0, 0, 0.070)
    assert live.fit().per_forward == pytest.approx(0.050, abs=1e-3) and live.scale() == 1.0
    # Drafting steps three times the fit's draft price: no verdict before LIVE_MIN_DRAFTING of them.
    priced = base.first_draft + base.per_row + base.per_draft * 2
    for i in range(LIVE_MIN_DRAFTING - 1):
        live.observe(4, 1, 2, 0.070 + 3 * priced)
    assert live.scale() == 1.0
    for _ in range(40):
        live.observe(4, 1, 2, 0.070 + 3 * priced)
    assert live.scale() == pytest.approx(3.0, rel=0.05)
    fit = live.fit()
    assert (fit.first_draft, fit.per_row, fit.per_draft) == pytest.approx(
        (3 * base.first_draft, 3 * base.per_row, 3 * base.per_draft), rel=0.05
    )
    assert row_draft_budget(0.5, 4, fit, 4) < row_draft_budget(0.5, 4, base, 4)
    # An outlier step counts at most LIVE_CLIP times its price, and plain steps with no drafts
    # move the scale back toward the measured price.
    live.observe(4, 1, 2, 100.0)
    assert live.scale() <= LIVE_CLIP
    for _ in range(4000):
        live.observe(4, 0, 0, 0.070)
    assert live.scale() < 1.1
    live.observe(0, 0, 0, 1.0)  # a step of no rows, or a clock that does not move, teaches nothing
    live.observe(4, 0, 0, 0.0)
    assert live.snapshot()["plain_steps"] == 4060


def test_a_lone_row_is_priced_by_its_own_measured_step_and_first_draft():
    """A CPU's one-row step runs matrix-vector products and a draft turns them into matrix
    ones (models/platform/sgemm_rows.c): its step and first draft sit off the fit's line.
    The tables are SmolLM2's as measured at load on the development machine (ms)."""
    decode = {1: 55.2, 2: 79.2, 4: 76.3, 8: 92.4, 16: 123.8}
    one_draft = {1: 75.8, 2: 87.7, 4: 98.0, 8: 106.2, 16: 136.9}
    all_verify = {2: 118.8, 4: 137.5, 8: 185.7, 16: 262.7}
    half_one = {4: 111.9, 8: 119.3, 16: 156.7}
    fit = verify_costs(TickCosts(decode, {0: 85.8, 1: 97.9}, 0.0, all_verify, one_draft, half_one), 4)
    assert fit.step_s(1) == 55.2 and fit.step_s(4) == pytest.approx(fit.per_forward + 4 * fit.per_token)
    assert fit.first_s(1) == pytest.approx(75.8 - 55.2 - fit.per_row - fit.per_draft)
    assert fit.first_s(1) > fit.first_s(4) == fit.first_draft
    # drafts landing a quarter of the time: priced on the line they would pay for a lone
    # row's first draft; at its measured price (0.29 of its step) they do not
    on_line = fit._replace(lone_step=0.0, lone_first=0.0)
    assert drafts_pay([max(draft_net(0.25, k, 1, on_line) for k in range(1, 5))], 1, on_line)
    assert not drafts_pay([max(draft_net(0.25, k, 1, fit) for k in range(1, 5))], 1, fit)
    assert drafts_pay([draft_net(0.8, 4, 1, fit)], 1, fit)  # a long match of code pays alone
    live = LiveDraftFit(fit)
    for _ in range(20):
        live.observe(1, 0, 0, 0.060 * 1e3)  # plain one-row steps 4.8 ms slower than measured
    assert live.fit().step_s(1) == pytest.approx(55.2 + live.plain_extra)
