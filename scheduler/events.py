"""Token events leaving the scheduler, and the per-tick sink that builds them.

The sink is the only place that appends to a request's `output_ids`, stamps its first
token time and marks it finished, so every path (classic, slot, cancellation) reports
through the same bookkeeping. Events are merged per request per tick.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from scheduler.counters import Counters, cancel_phase
from scheduler.request import Request, RequestStatus, SpecStats

_STATUS_FOR_FINISH = {
    "stop": RequestStatus.FINISHED,
    "length": RequestStatus.FINISHED,
    "cancelled": RequestStatus.CANCELLED,
    "error": RequestStatus.FAILED,
}


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]  # may be empty (e.g. a pure finish/error event)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" | None
    error: str | None = None  # message for finish_reason == "error"
    stats: SpecStats | None = None  # set on the event that finishes a request
    prompt_tokens: int = 0  # set on the finishing event


class EventSink:
    """Collects one tick's events; `drain()` hands them out in first-touch order."""

    def __init__(self, counters: Counters, clock: Callable[[], float],
                 on_finish: Callable[[Request], None] | None = None) -> None:
        self._counters = counters
        self._clock = clock
        self._on_finish = on_finish
        self._events: dict[str, TokenEvent] = {}

    def _event(self, request_id: str) -> TokenEvent:
        event = self._events.get(request_id)
        if event is None:
            event = self._events[request_id] = TokenEvent(request_id, [])
        return event

    def tokens(self, request: Request, token_ids: list[int]) -> None:
        if not token_ids or request.status.is_done:
            return
        request.output_ids.extend(token_ids)
        if request.first_token_time is None:
            request.first_token_time = self._clock()
            self._counters.record_ttft(request.lane, request.first_token_time - request.arrival_time)
        self._event(request.request_id).token_ids.extend(token_ids)

    def finish(self, request: Request, reason: str, error: str | None = None,
               phase: str | None = None) -> None:
        """Mark `request` done and emit its finishing event. Idempotent.

        A cancellation is counted by phase: `phase` if given, else derived from the
        request's status (still the pre-cancel one here)."""
        if request.status.is_done:
            return
        if reason == "cancelled":
            self._counters.cancelled_by_phase[cancel_phase(request.status, phase)] += 1
        request.status = _STATUS_FOR_FINISH[reason]
        request.finish_reason = reason
        event = self._event(request.request_id)
        event.finish_reason = reason
        event.error = error
        event.stats = copy.copy(request.spec)
        event.prompt_tokens = len(request.prompt_ids)
        if self._on_finish is not None:
            self._on_finish(request)

    def drain(self) -> list[TokenEvent]:
        events = list(self._events.values())
        self._events.clear()
        return events
