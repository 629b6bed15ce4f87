"""Factories for scheduler unit tests: requests, schedulers, a tick driver, and a reader
of a started engine's events."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.events import TokenEvent
from scheduler.request import Lane, Request, SamplingParams
from scheduler.rules import Decision
from tests.unit.fakes import FakeRunner


class FakeClock:
    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make_request(
    request_id: str,
    *,
    rounds: int = 3,
    lane: Lane = Lane.NORMAL,
    round_tokens: int = 2,
    max_tokens: int | None = None,
    prompt_ids: list[int] | None = None,
) -> Request:
    """A request that needs its first token plus `rounds` full rounds of the fake runner."""
    if max_tokens is None:
        max_tokens = 1 + rounds * round_tokens
    return Request(
        request_id,
        prompt_ids or [len(request_id), ord(request_id[0])],
        SamplingParams(max_tokens=max_tokens),
        lane=lane,
    )


def make_scheduler(runner: FakeRunner | None = None, clock=None, **overrides) -> Scheduler:
    """A scheduler over a fake runner; the B=1 policy defaults to "on" (no probes)."""
    overrides.setdefault("b1_policy", "on")
    return Scheduler(runner or FakeRunner(), SchedulerConfig(**overrides), clock=clock or FakeClock())


@dataclass
class TickRecord:
    decision: Decision
    model_actions: list[tuple[str, tuple[str, ...]]]
    events: list[TokenEvent]


@dataclass
class Trace:
    ticks: list[TickRecord] = field(default_factory=list)

    def streams(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for record in self.ticks:
            for event in record.events:
                out.setdefault(event.request_id, []).extend(event.token_ids)
        return out

    def finishes(self) -> dict[str, TokenEvent]:
        return {e.request_id: e for r in self.ticks for e in r.events if e.finish_reason is not None}

    def spec_kinds(self) -> list[bool]:
        """Per tick that ran a model action: whether it was speculative."""
        return [r.model_actions[0][0].startswith("spec") for r in self.ticks if r.model_actions]


def tick(scheduler: Scheduler, trace: Trace | None = None) -> TickRecord:
    runner = scheduler.runner
    before = len(runner.actions)
    events = scheduler.tick()
    record = TickRecord(scheduler.last_decision, runner.actions[before:], events)
    if trace is not None:
        trace.ticks.append(record)
    return record


def run_until_idle(scheduler: Scheduler, trace: Trace | None = None, max_ticks: int = 500, before_tick=None) -> Trace:
    """Tick until the scheduler has no work; `before_tick(i)` may submit or cancel."""
    trace = trace or Trace()
    for i in range(max_ticks):
        if before_tick is not None:
            before_tick(i)
        if not scheduler.has_work():
            return trace
        tick(scheduler, trace)
    raise AssertionError(f"scheduler still busy after {max_ticks} ticks")


def collect(engine, ids, timeout=10.0):
    """(tokens by request id, finishing event by request id) for `ids`, read from a
    started `Engine` until every one has finished (fails after `timeout` seconds)."""
    streams, finishes = {}, {}
    deadline = time.monotonic() + timeout
    while set(finishes) != set(ids):
        assert time.monotonic() < deadline, f"timed out; finished {sorted(finishes)}"
        for event in engine.get_events(timeout=0.5):
            streams.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason:
                finishes[event.request_id] = event
    return streams, finishes
