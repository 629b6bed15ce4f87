"""Slot rotation over real mlx models (CPU): the bundled pair when present, else the
tiny random pair. Greedy streams must not depend on rotation, slicing or concurrency.

These pin the seed's ring (`tick_mode: alternate`: a waiting or parked stream makes no
progress until it is granted); the fused tick's ring, whose entries decode as classic
rows meanwhile, is covered by test_fused_real.py."""

import os

import pytest

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from tests.model.conftest import PROMPTS, make_request

pytestmark = pytest.mark.model

BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled")
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def runner(tiny_pair):
    from models.runner import MlxRunner

    if os.path.isdir(os.path.join(BUNDLED, "target")) and os.path.isdir(os.path.join(BUNDLED, "draft")):
        target, draft = os.path.join(BUNDLED, "target"), os.path.join(BUNDLED, "draft")
    else:
        target, draft = tiny_pair
    r = MlxRunner.from_paths(target, drafter_kind="draft_model", drafter_path=draft, num_draft_tokens=4)
    yield r
    r.close()


@pytest.fixture(scope="module")
def prompts(runner):
    return [runner.tokenizer.encode(PROMPTS[i]) for i in (0, 8, 21)]


def run(runner, prompts, *, stagger=True, **overrides):
    """Submit the first request, tick once (its slice 0), then submit the others and
    run to completion. Returns (streams, requests, grant log, peak live sessions)."""
    config = SchedulerConfig(**{"b1_policy": "on", "tick_mode": "alternate", **overrides})
    scheduler = Scheduler(runner, config)
    requests = [make_request(f"r{i}", p, max_tokens=MAX_TOKENS) for i, p in enumerate(prompts)]
    streams = {r.request_id: [] for r in requests}
    pending = list(requests)
    scheduler.submit(pending.pop(0))
    peak = 0
    for _ in range(2000):
        for event in scheduler.tick():
            streams[event.request_id] += event.token_ids
        peak = max(peak, runner.num_live_sessions())
        if stagger and pending:
            for r in pending:
                scheduler.submit(r)
            pending = []
        if not scheduler.has_work() and not pending:
            break
    assert not scheduler.has_work()
    assert runner.num_live_sessions() == 0 and runner.num_classic_rows() == 0
    return streams, requests, scheduler.grant_log, peak


@pytest.fixture(scope="module")
def isolated(runner, prompts):
    out = {}
    for i, p in enumerate(prompts):
        streams, requests, log, _ = run(runner, [p])
        assert log == [("r0", 1 + requests[0].spec.num_rounds)]  # alone: one grant, never parks
        out[f"r{i}"] = streams["r0"]
    return out


@pytest.mark.parametrize("count", [2, 3])
def test_concurrent_rotation_matches_isolated_runs(runner, prompts, isolated, count):
    streams, requests, log, peak = run(runner, prompts[:count], grant_rounds=2)
    print(f"\ngrant log ({count} requests, budget 2): {log}")
    for r in requests:
        assert streams[r.request_id] == isolated[r.request_id], r.request_id
        assert len(streams[r.request_id]) > 0
        assert r.spec.num_rounds > 0 and r.spec.num_grants >= 2, (r.request_id, r.spec)
    assert {rid for rid, _ in log} == {r.request_id for r in requests}
    assert peak == count  # 1 active + (count - 1) parked; never above 1 + backlog_cap = 3


def test_budget_one_rotation_matches_isolated_runs(runner, prompts, isolated):
    streams, requests, log, peak = run(runner, prompts[:2], grant_rounds=1)
    print(f"\ngrant log (2 requests, budget 1): {log}")
    assert all(n <= 2 for _, n in log)
    for r in requests:
        assert streams[r.request_id] == isolated[r.request_id]


def test_sliced_and_burst_give_identical_streams(runner, prompts, isolated):
    sliced, _, _, _ = run(runner, prompts[:2], grant_rounds=2)
    burst, requests, log, _ = run(runner, prompts[:2], tick_slice=False)
    assert sliced == burst == {r.request_id: isolated[r.request_id] for r in requests}
    print(f"\ngrant log (burst): {log}")
