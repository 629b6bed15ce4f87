"""A lost device (a CUDA error that breaks the process's context) stops the engine:
every request gets an error, the engine reports it, and whoever owns the engine
replaces it; an out-of-memory step fails only its own requests and serving goes on."""

import asyncio
import time

import pytest

from scheduler.config import SchedulerConfig
from scheduler.engine import Engine
from serve_app.deployment.actor import EXIT_DEVICE_LOST, SchedulerActor
from serve_app.deployment.client import EngineClient, LocalSource
from tests.unit.factories import collect, make_request
from tests.unit.fakes import SlowRunner

ILLEGAL = "cudaMallocManaged(&data, size) failed: an illegal memory access was encountered"
OOM = "cudaMallocAsync(&data, size, stream) failed: out of memory"
METHODS = ("classic_prefill", "spec_begin", "spec_round", "spec_round_with_decode")


class FaultRunner(SlowRunner):
    """Raises `message` in any model action on the request ids in `faulty`."""

    def __init__(self, message: str, faulty: set[str], **kw):
        super().__init__(**kw)
        self.message = message
        self.fail_on = {(method, rid) for method in METHODS for rid in faulty}

    def _maybe_fail(self, method, request_id):
        if (method, request_id) in self.fail_on:
            raise RuntimeError(self.message)


def started(runner) -> Engine:
    engine = Engine(lambda: runner, SchedulerConfig(b1_policy="on"))
    engine.start()
    return engine


def test_an_illegal_address_fails_every_request_and_stops_the_engine():
    runner = FaultRunner(ILLEGAL, {"C"}, delay=0.01)
    engine = started(runner)
    try:
        for rid in "ABC":  # A takes the slot, B and C are prefilled as rows
            engine.submit(make_request(rid, rounds=50))
        _, finishes = collect(engine, "ABC")
        assert {e.finish_reason for e in finishes.values()} == {"error"}
        assert all("illegal memory access" in e.error for e in finishes.values())
        assert engine.fatal_error and "illegal memory access" in engine.fatal_error
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.running  # no more ticks on a broken device
        with pytest.raises(RuntimeError, match="not running"):
            engine.submit(make_request("D"))
    finally:
        engine.stop()


def test_out_of_memory_fails_its_request_and_serving_goes_on():
    runner = FaultRunner(OOM, {"B"})
    engine = started(runner)
    try:
        for rid in "AB":
            engine.submit(make_request(rid, rounds=3))
        _, finishes = collect(engine, "AB")
        assert finishes["B"].finish_reason == "error" and finishes["A"].finish_reason != "error"
        engine.submit(make_request("C", rounds=3))
        _, finishes = collect(engine, "C")
        assert finishes["C"].finish_reason != "error" and engine.fatal_error is None and engine.running
    finally:
        engine.stop()


def test_the_client_replaces_a_lost_engine_and_serves_again():
    """In-process (`LocalSource`) as through the actor: the lost engine's streams end
    with an error, then a fresh engine serves the next request."""
    runners = [FaultRunner(ILLEGAL, {"X"}), SlowRunner()]

    def factory():
        runner = runners.pop(0)
        return Engine(lambda: runner, SchedulerConfig(b1_policy="on")), {"max_context": 64, "eos_token_ids": []}

    async def scenario():
        client = EngineClient(LocalSource(factory))
        await client.start()
        try:
            errors = [e.error async for e in await client.submit(make_request("X", rounds=5)) if e.error]
            assert errors and "illegal memory access" in errors[-1]
            for _ in range(200):  # the pump sees the lost engine and starts another
                if client.num_restarts:
                    break
                await asyncio.sleep(0.01)
            assert client.num_restarts == 1
            finish = [e async for e in await client.submit(make_request("Y", rounds=2))][-1]
            assert finish.finish_reason not in (None, "error")
        finally:
            await client.close()

    asyncio.run(scenario())


class _LostEngine:
    def __init__(self, pending):
        self.pending = pending
        self.fatal_error = ILLEGAL

    def get_events(self, timeout):
        events, self.pending = self.pending, []
        return events


def test_the_scheduler_actor_hands_out_the_failures_then_exits(monkeypatch):
    actor = object.__new__(SchedulerActor)
    actor._engine = _LostEngine(["the last error events"])
    exits = []
    monkeypatch.setattr(SchedulerActor, "_exit", staticmethod(exits.append))
    assert actor.poll(0.1) == ["the last error events"] and exits == []
    actor.poll(0.1)
    assert exits == [EXIT_DEVICE_LOST]
