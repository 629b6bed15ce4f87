"""Token events leaving the scheduler, and the per-tick sink that builds them.

The sink is the only place that appends to a request's `output_ids`, stamps its first
and last token times and marks it finished, so every path (classic, slot, cancellation)
reports through the same bookkeeping. Events are merged per request per tick.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

from scheduler.counters import Counters, cancel_phase
from scheduler.request import Request, RequestStatus, SpecStats, TokenLogprob

_STATUS_FOR_FINISH = {
    "stop": RequestStatus.FINISHED,
    "length": RequestStatus.FINISHED,
    "cancelled": RequestStatus.CANCELLED,
    "error": RequestStatus.FAILED,
}


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's phases on the scheduler's clock, in seconds (None: the
    phase was never reached). Intervals are taken inside the scheduler's process
    because monotonic clocks of different processes do not compare.

    queue: arrival -> first scheduled; prefill: first scheduled -> first token;
    decode: first token -> last token; inference: first scheduled -> last token.
    """

    queue_s: float | None = None
    prefill_s: float | None = None
    decode_s: float | None = None
    inference_s: float | None = None

    @classmethod
    def of(cls, request: Request) -> "RequestTimes":
        """E.g. arrival 1.0, scheduled 1.5, first token 2.0, last token 3.0: queue 0.5,
        prefill 0.5, decode 1.0, inference 1.5."""
        scheduled, first, last = request.scheduled_time, request.first_token_time, request.last_token_time
        if scheduled is None:
            return cls()
        if first is None:
            return cls(queue_s=scheduled - request.arrival_time)
        return cls(scheduled - request.arrival_time, first - scheduled, last - first, last - scheduled)


@dataclass
class TokenEvent:
    request_id: str
    token_ids: list[int]  # may be empty (e.g. a pure finish/error event)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error" | None
    error: str | None = None  # message for finish_reason == "error"
    stats: SpecStats | None = None  # set on the event that finishes a request
    prompt_tokens: int = 0  # set on the finishing event
    num_cached_tokens: int = 0  # set on the finishing event: prompt tokens the prefix cache held
    times: RequestTimes | None = None  # set on the finishing event
    logprobs: list[TokenLogprob] | None = None  # one per token, for a request that asked


class EventSink:
    """Collects one tick's events; `drain()` hands them out in first-touch order."""

    def __init__(
        self, counters: Counters, clock: Callable[[], float], on_finish: Callable[[Request], None] | None = None
    ) -> None:
        self._counters = counters
        self._clock = clock
        self._on_finish = on_finish
        self._events: dict[str, TokenEvent] = {}

    def _event(self, request_id: str) -> TokenEvent:
        event = self._events.get(request_id)
        if event is None:
            event = self._events[request_id] = TokenEvent(request_id, [])
        return event

    def tokens(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> None:
        """`logprobs`: one per token, where the request asked for them."""
        if not token_ids or request.status.is_done:
            return
        request.output_ids.extend(token_ids)
        request.last_token_time = self._clock()
        if request.first_token_time is None:
            request.first_token_time = request.last_token_time
            self._counters.record_ttft(request.lane, request.first_token_time - request.arrival_time)
        event = self._event(request.request_id)
        event.token_ids.extend(token_ids)
        if logprobs is not None:
            event.logprobs = (event.logprobs or []) + list(logprobs)

    def finish(self, request: Request, reason: str, error: str | None = None, phase: str | None = None) -> None:
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
        event.num_cached_tokens = request.num_cached_tokens
        event.times = RequestTimes.of(request)
        if self._on_finish is not None:
            self._on_finish(request)

    def drain(self) -> list[TokenEvent]:
        events = list(self._events.values())
        self._events.clear()
        return events
