"""Cancellation soak, CI-sized: in-process engine (every phase, exactly checked) and
real HTTP clients hanging up through Ray Serve. `python -m scripts.soak` is the full one."""

from __future__ import annotations

import pytest

from rel_helpers import AUTH, drained
from scheduler.counters import CANCEL_PHASES
from serve_helpers import wait_until

ENGINE_REQUESTS = 200
HTTP_REQUESTS = 48


@pytest.mark.model
def test_engine_soak_cancels_in_every_phase_and_loses_nothing(tiny_pair):
    from scripts.soak import run_engine

    report = run_engine(*tiny_pair, num_requests=ENGINE_REQUESTS, concurrency=10,
                        cancel_fraction=0.6, seed=7)
    print(f"\nengine soak: {report}")
    assert report.problems() == []
    assert report.completed + report.cancelled == ENGINE_REQUESTS
    assert report.completed >= ENGINE_REQUESTS // 4 and report.peak_live_sessions <= 3
    missing = [p for p in CANCEL_PHASES if report.cancelled_by_phase[p] == 0]
    assert not missing, report.cancelled_by_phase


@pytest.mark.serve
def test_http_soak_random_hang_ups_lose_nothing(rel_app):
    from scripts.soak_http import http_soak

    report = http_soak(rel_app, HTTP_REQUESTS, concurrency=5, seed=3, headers=AUTH)
    print(f"\nhttp soak: {report}")
    assert report.problems() == [], report
    assert report.completed >= HTTP_REQUESTS // 4
    assert report.targets["hung_up"] >= HTTP_REQUESTS // 4
    assert report.cancelled >= 5  # hang-ups reached the scheduler as cancellations
    wait_until(lambda: drained(rel_app), 10)
