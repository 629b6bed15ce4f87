"""Table tests for the pure scheduling policies."""

import pytest

from scheduler.request import Lane
from scheduler.rules import (
    Action,
    Decision,
    GrantView,
    SpecStep,
    batch_allows_speculation,
    can_join_backlog,
    decide,
    grant_expired,
    next_grant_index,
    num_to_admit,
    parse_grant_budget,
    parse_tick_slice,
    slice_takes_tick,
)

H, N, L = int(Lane.HIGH), int(Lane.NORMAL), int(Lane.LOW)


@pytest.mark.parametrize(
    "raw, expected",
    [
        (None, 8),
        ("", 8),
        ("   ", 8),
        ("abc", 8),
        ("-3", 8),
        ("8.5", 8),
        ("+5", 8),
        ("1e3", 8),
        ("8", 8),
        ("12", 12),
        (" 12 ", 12),
        ("\t3\n", 3),
        ("0", 0),
        ("1", 1),
        ("007", 7),
    ],
)
def test_parse_grant_budget(raw, expected):
    assert parse_grant_budget(raw) == expected


def test_parse_grant_budget_custom_default():
    assert parse_grant_budget("garbage", default=5) == 5
    assert parse_grant_budget(None, default=3) == 3


@pytest.mark.parametrize(
    "raw, default, expected",
    [
        (None, True, True),
        ("", True, True),
        ("0", True, False),
        (" 0 ", True, False),
        ("1", True, True),
        ("abc", True, True),
        ("abc", False, False),
        ("off", True, False),
        ("ON", False, True),
        ("false", True, False),
        ("2", False, False),
    ],
)
def test_parse_tick_slice(raw, default, expected):
    assert parse_tick_slice(raw, default=default) is expected


@pytest.mark.parametrize(
    "num_others, threshold, expected",
    [
        (0, 0, True),
        (100, 0, True),  # 0 = the rule is off
        (0, 1, True),
        (1, 1, False),
        (5, 1, False),  # 1: only a lone request speculates
        (0, 3, True),
        (2, 3, True),
        (3, 3, False),
        (4, 3, False),
    ],
)
def test_batch_allows_speculation(num_others, threshold, expected):
    assert batch_allows_speculation(num_others, threshold) is expected


@pytest.mark.parametrize(
    "slices_run, budget, backlog_nonempty, expected",
    [
        (8, 8, True, True),
        (100, 8, True, True),
        (7, 8, True, False),
        (100, 8, False, False),
        (100, 0, True, False),
        (1, 1, True, True),
        (0, 1, True, False),
        (2, 2, False, False),
    ],
)
def test_grant_expired(slices_run, budget, backlog_nonempty, expected):
    assert grant_expired(slices_run, budget, backlog_nonempty) is expected


@pytest.mark.parametrize(
    "backlog_len, cap, budget, expected",
    [
        (0, 2, 8, True),
        (1, 2, 8, True),
        (2, 2, 8, False),
        (5, 2, 8, False),
        (0, 2, 0, False),
        (1, 2, 0, False),
        (0, 0, 8, False),
        (2, 3, 1, True),
    ],
)
def test_can_join_backlog(backlog_len, cap, budget, expected):
    assert can_join_backlog(backlog_len, cap, budget) is expected


@pytest.mark.parametrize(
    "entries, expected",
    [
        ([GrantView(N, 0, 0)], 0),
        ([GrantView(N, 0, 0), GrantView(N, 1, 0)], 0),  # FIFO within a lane
        ([GrantView(N, 5, 0), GrantView(N, 2, 0)], 1),  # FIFO is by ring arrival, not position
        ([GrantView(N, 0, 0), GrantView(H, 1, 0)], 1),  # lane first
        ([GrantView(L, 0, 0), GrantView(N, 1, 0), GrantView(H, 2, 0)], 2),
        ([GrantView(L, 0, 1), GrantView(H, 1, 0)], 1),  # skipped once: not overdue yet
        ([GrantView(L, 0, 2), GrantView(H, 1, 0)], 0),  # overdue beats lane
        ([GrantView(N, 0, 2), GrantView(L, 1, 3), GrantView(H, 2, 0)], 1),  # most-skipped overdue
        ([GrantView(L, 0, 3), GrantView(N, 1, 3), GrantView(H, 2, 4)], 2),
        ([GrantView(L, 0, 3), GrantView(N, 1, 3), GrantView(H, 2, 0)], 0),  # earliest on ties
        ([GrantView(N, 4, 2), GrantView(L, 3, 2)], 1),  # earliest = ring arrival
    ],
)
def test_next_grant_index(entries, expected):
    assert next_grant_index(entries, skip_cap=2) == expected


def test_next_grant_index_rejects_empty():
    with pytest.raises(ValueError):
        next_grant_index([], skip_cap=2)


def test_endless_high_lane_stream_selects_normal_entry_at_decision_3():
    normal = GrantView(N, 0, 0)
    seq = 1
    for decision in range(1, 10):
        high = GrantView(H, seq, 0)  # a fresh high-lane waiter every decision
        seq += 1
        entries = [normal, high]
        chosen = next_grant_index(entries, skip_cap=2)
        if entries[chosen] is normal:
            break
        normal = normal._replace(skipped_grants=normal.skipped_grants + 1)
    assert decision == 3


@pytest.mark.parametrize(
    "yielded_last, others_have_work, expected",
    [
        (False, False, True),
        (True, False, True),
        (False, True, True),
        (True, True, False),
    ],
)
def test_slice_takes_tick(yielded_last, others_have_work, expected):
    assert slice_takes_tick(yielded_last, others_have_work) is expected


def _alternation_run(num_ticks, classic_work):
    yielded_last, kinds = False, []
    for _ in range(num_ticks):
        d = decide(
            spec_step=SpecStep.ROUND,
            yielded_last=yielded_last,
            num_queued=0,
            num_rows=1 if classic_work else 0,
            max_rows=16,
            prefill_batch=8,
        )
        kinds.append(d.action)
        if d.action is not Action.IDLE:
            yielded_last = d.action is Action.SPECULATIVE
    return kinds


def test_alternation_with_classic_work_never_two_speculative_in_a_row():
    kinds = _alternation_run(20, classic_work=True)
    assert all(not (a is b is Action.SPECULATIVE) for a, b in zip(kinds, kinds[1:]))
    assert kinds == [Action.SPECULATIVE, Action.DECODE] * 10


def test_alternation_without_classic_work_slice_takes_every_tick():
    assert _alternation_run(20, classic_work=False) == [Action.SPECULATIVE] * 20


def test_tick_after_classic_action_goes_to_slice():
    for step in SpecStep:
        d = decide(spec_step=step, yielded_last=False, num_queued=3, num_rows=4, max_rows=16, prefill_batch=8)
        assert d == Decision(Action.SPECULATIVE, spec_step=step)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        (dict(spec_step=None, yielded_last=False, num_queued=0, num_rows=0), Decision(Action.IDLE)),
        (dict(spec_step=None, yielded_last=True, num_queued=3, num_rows=0), Decision(Action.PREFILL, num_prefill=3)),
        (dict(spec_step=None, yielded_last=False, num_queued=0, num_rows=2), Decision(Action.DECODE)),
        (dict(spec_step=None, yielded_last=False, num_queued=20, num_rows=0), Decision(Action.PREFILL, num_prefill=8)),
        (dict(spec_step=None, yielded_last=False, num_queued=5, num_rows=16), Decision(Action.DECODE)),  # full
        (dict(spec_step=None, yielded_last=False, num_queued=5, num_rows=14), Decision(Action.PREFILL, num_prefill=2)),
        (
            dict(spec_step=SpecStep.PROMOTE, yielded_last=True, num_queued=1, num_rows=0),
            Decision(Action.PREFILL, num_prefill=1),
        ),
        (
            dict(spec_step=SpecStep.PROMOTE, yielded_last=True, num_queued=0, num_rows=0),
            Decision(Action.SPECULATIVE, spec_step=SpecStep.PROMOTE),
        ),
        (dict(spec_step=SpecStep.BEGIN, yielded_last=True, num_queued=0, num_rows=3), Decision(Action.DECODE)),
    ],
)
def test_decide(kwargs, expected):
    assert decide(max_rows=16, prefill_batch=8, **kwargs) == expected


@pytest.mark.parametrize(
    "queued, rows, max_rows, batch, expected",
    [
        (0, 0, 16, 8, 0),
        (3, 0, 16, 8, 3),
        (20, 0, 16, 8, 8),
        (20, 12, 16, 8, 4),
        (5, 16, 16, 8, 0),
        (5, 17, 16, 8, 0),
    ],
)
def test_num_to_admit(queued, rows, max_rows, batch, expected):
    assert num_to_admit(queued, rows, max_rows, batch) == expected


def test_backlog_reports_its_depth_after_every_change():
    from scheduler.backlog import EntryKind, GrantBacklog
    from scheduler.counters import Counters
    from scheduler.request import Request, SamplingParams

    counters = Counters()
    seen: list[int] = []

    def observe(depth: int) -> None:
        seen.append(depth)
        counters.observe_backlog(depth)

    backlog = GrantBacklog(on_depth=observe)
    for i, lane in enumerate([Lane.NORMAL, Lane.HIGH, Lane.LOW]):
        backlog.push(Request(f"r{i}", [1, 2], SamplingParams(max_tokens=4), lane=lane), EntryKind.WAITING)
    entry, _ = backlog.grant(skip_cap=2)
    assert entry.request.request_id == "r1"  # the high lane first
    assert backlog.remove("r2") is not None and backlog.remove("missing") is None
    assert seen == [1, 2, 3, 2, 1]  # a failed remove changes nothing and reports nothing
    assert (counters.backlog_depth, counters.backlog_peak) == (1, 3)
