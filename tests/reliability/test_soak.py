"""Cancellation soak, CI-sized: in-process engine (every phase, exactly checked) and
real HTTP clients hanging up through Ray Serve. `python -m scripts.bench.soak` is the full one."""

from __future__ import annotations

import pytest
from rel_helpers import AUTH, drained, state
from serve_helpers import wait_until

from scheduler.counters import CANCEL_PHASES

ENGINE_REQUESTS = 200
HTTP_REQUESTS = 48


@pytest.mark.model
@pytest.mark.parametrize("tick_mode", ["alternate", "fused"])
def test_engine_soak_cancels_in_every_phase_and_loses_nothing(tiny_pair, tick_mode):
    from scripts.bench.soak import run_engine

    num_requests = ENGINE_REQUESTS if tick_mode == "alternate" else ENGINE_REQUESTS // 2
    report = run_engine(
        *tiny_pair, num_requests=num_requests, concurrency=10, cancel_fraction=0.6, seed=7, tick_mode=tick_mode
    )
    print(f"\nengine soak ({tick_mode}): {report}")
    assert report.problems() == []
    assert report.completed + report.cancelled == num_requests
    assert report.completed >= num_requests // 4 and report.peak_live_sessions <= 3
    # The fused tick's ring entries are classic rows (or queued for prefill) while they
    # wait, so their cancellations are counted as those phases.
    phases = CANCEL_PHASES if tick_mode == "alternate" else [p for p in CANCEL_PHASES if p not in ("waiting", "parked")]
    missing = [p for p in phases if report.cancelled_by_phase[p] == 0]
    assert not missing, report.cancelled_by_phase


@pytest.mark.serve
def test_http_soak_random_hang_ups_lose_nothing(rel_app):
    from scripts.bench.soak_http import http_soak

    report = http_soak(rel_app, HTTP_REQUESTS, concurrency=5, seed=3, headers=AUTH)
    print(f"\nhttp soak: {report}")
    assert report.problems() == [], report
    assert report.completed >= HTTP_REQUESTS // 4
    assert report.targets["hung_up"] >= HTTP_REQUESTS // 4
    assert report.cancelled >= 5  # hang-ups reached the scheduler as cancellations
    wait_until(lambda: drained(rel_app), 10)


def cancellations(base: str) -> int:
    return sum(state(base)["counters"]["cancelled_by_phase"].values())


@pytest.mark.serve
def test_every_hang_up_reaches_the_scheduler_as_a_cancellation(rel_app):
    """A client that hangs up mid-stream must free its request at once, not leave it
    generating to max_tokens (the cancel RPC must survive Serve cancelling the request)."""
    import httpx

    before = cancellations(rel_app)
    for _ in range(8):
        with httpx.stream(
            "POST",
            f"{rel_app}/v1/completions",
            headers=AUTH,
            timeout=30,
            json={"prompt": "import os\nimport ", "max_tokens": 300, "temperature": 0, "stream": True},
        ) as r:
            lines = r.iter_lines()
            for _ in range(4):
                next(lines)
    wait_until(lambda: drained(rel_app), 20)
    assert cancellations(rel_app) - before == 8
