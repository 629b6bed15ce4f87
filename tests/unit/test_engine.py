"""The engine thread over the fake runner: lifecycle, queues, snapshot, reconfigure."""

import threading
import time

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from scheduler.ledger import QueueFull
from tests.unit.factories import collect, make_request
from tests.unit.fakes import SlowRunner, token_at


@pytest.fixture
def engine_factory():
    engines = []

    def make(runner=None, **overrides):
        overrides.setdefault("b1_policy", "on")
        runner = runner or SlowRunner()
        holder = {}

        def factory():
            holder["thread"] = threading.get_ident()
            return runner

        engine = Engine(factory, SchedulerConfig(**overrides))
        engine.start()
        engines.append(engine)
        return engine, runner, holder

    yield make
    for engine in engines:
        engine.stop()


def test_runner_built_on_engine_thread_and_all_model_work_there(engine_factory):
    engine, runner, holder = engine_factory(grant_rounds=1)
    reqs = [make_request(rid, rounds=4) for rid in "ABC"]
    for r in reqs:
        engine.submit(r)
    streams, finishes = collect(engine, "ABC")
    assert holder["thread"] != threading.get_ident()
    assert runner.thread_ids == {holder["thread"]}
    for r in reqs:
        assert streams[r.request_id] == [token_at(r, i) for i in range(r.sampling.max_tokens)]
        assert finishes[r.request_id].finish_reason == "length"
    snap = engine.snapshot()
    assert snap["counters"]["grants"] >= 3 and snap["unfinished"] == 0 and snap["slot"]["owner"] is None


def test_load_error_reraised_by_start():
    def broken():
        raise OSError("no weights here")

    engine = Engine(broken, SchedulerConfig())
    with pytest.raises(OSError, match="no weights"):
        engine.start()
    with pytest.raises(RuntimeError):
        engine.submit(make_request("A"))


def test_queue_full_and_duplicate_ids(engine_factory):
    engine, runner, _ = engine_factory(runner=SlowRunner(delay=0.05), max_queue_depth=2)
    engine.submit(make_request("A", rounds=5))
    engine.submit(make_request("B", rounds=5))
    with pytest.raises(QueueFull):
        engine.submit(make_request("C"))
    engine.cancel("B")
    collect(engine, "B")
    with pytest.raises(ValueError):
        engine.submit(make_request("A"))
    engine.submit(make_request("C", rounds=1))
    collect(engine, "AC")


def test_cancel_from_another_thread(engine_factory):
    engine, runner, _ = engine_factory(runner=SlowRunner(delay=0.01), grant_rounds=1)
    engine.submit(make_request("A", rounds=50))
    engine.submit(make_request("B", rounds=3))
    first = engine.get_events(timeout=5.0)
    assert first
    engine.cancel("A")
    engine.cancel("nope")  # unknown ids are ignored
    streams, finishes = collect(engine, "AB")
    assert finishes["A"].finish_reason == "cancelled" and finishes["B"].finish_reason == "length"
    deadline = time.monotonic() + 2
    while engine.snapshot()["counters"]["live_sessions"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runner.sessions == {} and runner.drafter_holder is None


def test_idle_engine_blocks_and_wakes(engine_factory):
    engine, runner, _ = engine_factory()
    time.sleep(0.1)
    idle_ticks = engine.snapshot()["counters"]["actions"].get("idle", 0)
    time.sleep(0.2)
    assert engine.snapshot()["counters"]["actions"].get("idle", 0) == idle_ticks  # not spinning
    engine.submit(make_request("A", rounds=1))
    collect(engine, "A")


def test_stop_cancels_pending_requests(engine_factory):
    engine, runner, _ = engine_factory(runner=SlowRunner(delay=0.02))
    engine.submit(make_request("A", rounds=100))
    engine.submit(make_request("B", rounds=100))
    engine.get_events(timeout=5.0)
    engine.stop()
    events = engine.get_events(timeout=0)
    finishes = {e.request_id: e.finish_reason for e in events if e.finish_reason}
    assert finishes == {"A": "cancelled", "B": "cancelled"}
    assert runner.sessions == {} and runner.rows == {}
    assert not engine.running


def test_reconfigure_validates_and_applies(engine_factory):
    engine, _, _ = engine_factory()
    with pytest.raises(ValueError):
        engine.reconfigure(max_batch_size=3)
    with pytest.raises(ValueError):
        engine.reconfigure(grant_rounds=-1)
    engine.reconfigure(grant_rounds=3, skip_cap=4)
    deadline = time.monotonic() + 2
    while engine.snapshot()["config"]["grant_rounds"] != 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    engine.submit(make_request("A", rounds=1))
    collect(engine, "A")
    snap = engine.snapshot()
    assert snap["config"]["skip_cap"] == 4
    assert {"slot", "queue_depth", "classic_rows", "counters", "policy", "config"} <= set(snap)
    assert set(snap["queue_depth"]) == {"high", "normal", "low"}


def test_snapshot_is_json_serializable(engine_factory):
    import json

    engine, _, _ = engine_factory(grant_rounds=1)
    for rid in "AB":
        engine.submit(make_request(rid, rounds=2))
    collect(engine, "AB")
    snap = json.loads(json.dumps(engine.snapshot()))
    assert snap["counters"]["ttft"]["normal"]["count"] == 2
    assert snap["policy"]["mode"] == "on"


def test_a_failed_tick_fails_every_unfinished_request_and_any_it_finished(engine_factory, monkeypatch):
    """A tick that raises loses its events, so a request it had finished gets an error
    too; the ledger is left empty and the engine keeps serving."""
    import scheduler.engine as engine_module
    from scheduler.core import Scheduler

    class CrashOnce(Scheduler):
        armed = True

        def tick(self):
            requests = self.ledger.unfinished()
            if CrashOnce.armed and len(requests) == 2:
                CrashOnce.armed = False
                self.sink.finish(requests[0], "stop")  # finished inside the failing tick
                raise RuntimeError("boom")
            return super().tick()

    monkeypatch.setattr(engine_module, "Scheduler", CrashOnce)
    engine, runner, _ = engine_factory(runner=SlowRunner(delay=0.05))
    engine.submit(make_request("A", rounds=20))
    engine.submit(make_request("B", rounds=20))
    _, finishes = collect(engine, "AB")
    assert {rid: (e.finish_reason, e.error) for rid, e in finishes.items()} == {
        "A": ("error", "scheduler failure: boom"),
        "B": ("error", "scheduler failure: boom"),
    }
    assert engine.snapshot()["unfinished"] == 0
    engine.submit(make_request("C", rounds=1))
    assert collect(engine, "C")[1]["C"].finish_reason == "length"
