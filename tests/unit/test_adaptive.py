"""The adaptive B=1 policy: estimator, thresholds, profiling, persistence, re-checks."""

import json
import os

import pytest

from scheduler.adaptive import CACHE_FILE, B1Policy, Measurement, PolicyStore, estimate_speedup, verdict_enabled
from scheduler.model_api import RoundOutcome
from scheduler.request import RequestStatus
from tests.unit.factories import FakeClock, make_request, make_scheduler, run_until_idle, tick
from tests.unit.fakes import FakeRunner


@pytest.mark.parametrize(
    "accepted, classic_s, round_s, expected",
    [
        (0.0, 0.010, 0.010, 1.0),
        (1.0, 0.010, 0.010, 2.0),
        (3.0, 0.010, 0.020, 2.0),
        (2.0, 0.005, 0.030, 0.5),
    ],
)
def test_estimate_speedup(accepted, classic_s, round_s, expected):
    assert estimate_speedup(accepted, classic_s, round_s) == pytest.approx(expected)


@pytest.mark.parametrize(
    "speedup, default, expected",
    [
        (0.5, True, False),
        (1.0, True, False),
        (1.01, True, True),
        (1.01, False, False),
        (1.49, False, False),
        (1.49, True, True),
        (1.5, False, True),
        (3.0, False, True),
    ],
)
def test_verdict_thresholds(speedup, default, expected):
    assert verdict_enabled(speedup, default) is expected


def outcome(probe, seconds, accepted=0):
    return RoundOutcome("r", [1] * (accepted + 1), None, 0 if probe else 4, accepted, probe, seconds)


def profile(policy, *, probe_s, round_s, accepted, sessions):
    for _ in range(sessions):
        policy.record_round(outcome(True, probe_s))
        policy.record_round(outcome(False, round_s, accepted))
        policy.session_done(num_real_rounds=1)


@pytest.mark.parametrize(
    "round_s, accepted, default, settled_enabled",
    [
        (0.010, 2, False, True),  # 3.0x
        (0.040, 2, True, False),  # 0.75x
        (0.025, 2, True, True),  # 1.2x -> default
        (0.025, 2, False, False),  # 1.2x -> default
    ],
)
def test_profiling_settles_after_profile_requests(round_s, accepted, default, settled_enabled):
    policy = B1Policy("auto", "k", default_enabled=default, profile_requests=3, clock=FakeClock())
    profile(policy, probe_s=0.010, round_s=round_s, accepted=accepted, sessions=2)
    assert not policy.settled and policy.should_run()  # still profiling: the slot runs
    assert policy.wants_probe(0) and policy.wants_probe(1) and not policy.wants_probe(2)
    profile(policy, probe_s=0.010, round_s=round_s, accepted=accepted, sessions=1)
    assert policy.settled and not policy.wants_probe(0)
    assert policy.should_run() is settled_enabled


@pytest.mark.parametrize(
    "probe, expected_classic_s",
    [
        # a multi-token probe reports its steady-state time per token ...
        (RoundOutcome("r", [1] * 8, None, 0, 0, True, 0.080, seconds_per_token=0.006), 0.006),
        # ... without it, the round's time is spread over its tokens
        (RoundOutcome("r", [1] * 8, None, 0, 0, True, 0.080), 0.010),
        (RoundOutcome("r", [1], None, 0, 0, True, 0.012), 0.012),
    ],
)
def test_probe_gives_classic_time_per_token(probe, expected_classic_s):
    policy = B1Policy("auto", "k", profile_requests=1)
    policy.record_round(probe)
    policy.record_round(outcome(False, 0.020, accepted=3))
    policy.session_done(num_real_rounds=1)
    assert policy.measurement.classic_step_s == pytest.approx(expected_classic_s)
    assert policy.measurement.speedup == pytest.approx(4 * expected_classic_s / 0.020)


def test_session_without_real_rounds_does_not_count():
    policy = B1Policy("auto", "k", profile_requests=1)
    policy.record_round(outcome(True, 0.01))
    policy.session_done(num_real_rounds=0)
    assert not policy.settled


@pytest.mark.parametrize("mode, expected", [("on", True), ("off", False)])
def test_fixed_modes_never_probe(mode, expected):
    policy = B1Policy(mode, "k")
    assert policy.settled and policy.should_run() is expected and not policy.wants_probe(0)


def test_verdict_persists_atomically_keyed_and_versioned(tmp_path):
    clock = FakeClock(50.0)
    policy = B1Policy("auto", "t|d|cpu|4", profile_requests=1, cache_dir=str(tmp_path), clock=clock)
    profile(policy, probe_s=0.010, round_s=0.040, accepted=1, sessions=1)  # 0.5x: decline
    data = json.loads((tmp_path / CACHE_FILE).read_text())
    assert data["version"] == 1
    assert data["verdicts"]["t|d|cpu|4"]["speedup"] == pytest.approx(0.5)
    assert data["verdicts"]["t|d|cpu|4"]["measured_at"] == 50.0
    assert [p for p in os.listdir(tmp_path) if p != CACHE_FILE] == []  # no temp file left
    restarted = B1Policy("auto", "t|d|cpu|4", cache_dir=str(tmp_path))
    assert restarted.settled and restarted.loaded_from_cache and not restarted.should_run()
    other_key = B1Policy("auto", "t|d|cpu|8", cache_dir=str(tmp_path))
    assert not other_key.settled
    # a second key is added next to the first, not over it
    profile(other_key, probe_s=0.010, round_s=0.005, accepted=1, sessions=3)
    assert set(json.loads((tmp_path / CACHE_FILE).read_text())["verdicts"]) == {"t|d|cpu|4", "t|d|cpu|8"}


@pytest.mark.parametrize(
    "content",
    [
        "not json",
        json.dumps({"version": 99, "verdicts": {"k": {}}}),
        json.dumps({"version": 1, "verdicts": {"k": {"bogus": 1}}}),
        "[]",
    ],
)
def test_unreadable_cache_means_reprofile(tmp_path, content):
    (tmp_path / CACHE_FILE).write_text(content)
    policy = B1Policy("auto", "k", cache_dir=str(tmp_path))
    assert not policy.settled and policy.should_run()


def test_store_roundtrip(tmp_path):
    store = PolicyStore(str(tmp_path / "nested"))
    m = Measurement(0.01, 0.02, 1.5, 3, 1.25, 7.0)
    store.save("k", m)
    assert store.load("k") == m and store.load("missing") is None


def test_scheduler_probes_then_settles_and_declines_new_requests(tmp_path):
    # probe 10 ms, round 40 ms with 1 accepted: speedup 0.5 -> decline
    runner = FakeRunner(round_seconds=0.040, probe_seconds=0.010)
    scheduler = make_scheduler(
        runner, b1_policy="auto", b1_profile_requests=2, b1_probe_rounds=2, policy_cache_dir=str(tmp_path)
    )
    first = [make_request(f"p{i}", rounds=4) for i in range(2)]
    for r in first:
        scheduler.submit(r)
        run_until_idle(scheduler)
    assert all(r.spec.num_probe_rounds == 2 and r.spec.num_rounds == r.spec.num_probe_rounds + 3 for r in first)
    assert scheduler.policy.settled and not scheduler.policy.should_run()
    late = make_request("late", rounds=2)
    scheduler.submit(late)
    run_until_idle(scheduler)
    assert late.spec.num_rounds == 0 and scheduler.counters.classic_fallbacks["policy_declined"] == 1
    assert late.status is RequestStatus.FINISHED
    restarted = make_scheduler(FakeRunner(), b1_policy="auto", policy_cache_dir=str(tmp_path))
    assert restarted.policy.loaded_from_cache and not restarted.policy.should_run()


def test_policy_rechecked_at_backlog_admission():
    scheduler = make_scheduler(grant_rounds=2)
    scheduler.submit(make_request("A", rounds=3))
    tick(scheduler)
    scheduler.policy.mode = "off"
    b = make_request("B", rounds=2)
    scheduler.submit(b)
    tick(scheduler)
    assert b.status is not RequestStatus.WAITING and len(scheduler.slot.backlog) == 0
    assert scheduler.counters.classic_fallbacks["policy_declined"] == 1
