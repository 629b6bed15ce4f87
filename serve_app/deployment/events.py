"""Per-request event streams on the replica's event loop.

The scheduler emits `TokenEvent`s for all of its requests in per-tick batches; an
`EventRouter` fans a batch out to one asyncio queue per open request. A stream ends with
the event that carries a `finish_reason`. `fail_all` ends every open stream with an
error event (used when the scheduler actor dies) so no client waits forever. A stream
whose events queued up while its last piece was being sent reads them as one
(`iterate`): a replica that falls behind its scheduler sends fewer, larger chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import AsyncIterator, Callable

from scheduler.events import TokenEvent


class EventRouter:
    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue] = {}

    def open(self, request_id: str) -> asyncio.Queue:
        if request_id in self._queues:
            raise ValueError(f"duplicate request id {request_id!r}")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    @property
    def num_open(self) -> int:
        return len(self._queues)

    def deliver(self, events: list[TokenEvent]) -> None:
        """Route a batch; events of closed or unknown requests are dropped."""
        for event in events:
            queue = self._queues.get(event.request_id)
            if queue is not None:
                queue.put_nowait(event)

    def fail_all(self, message: str) -> None:
        for request_id, queue in list(self._queues.items()):
            queue.put_nowait(TokenEvent(request_id, [], finish_reason="error", error=message))


def merged(first: TokenEvent, later: TokenEvent) -> TokenEvent:
    """One event for two consecutive events of a request (`first` does not finish it):
    both events' tokens and logprobs, and `later`'s finish with what comes with it."""
    logprobs = (
        None if first.logprobs is None and later.logprobs is None else (first.logprobs or []) + (later.logprobs or [])
    )
    return dataclasses.replace(later, token_ids=first.token_ids + later.token_ids, logprobs=logprobs)


async def iterate(queue: asyncio.Queue, on_merge: Callable[[int], None] | None = None) -> AsyncIterator[TokenEvent]:
    """Events of one request, ending after the finishing event; the events waiting in
    the queue when one is read come merged into it (`on_merge(n)`: n events were)."""
    while True:
        event = await queue.get()
        waiting = 0
        while event.finish_reason is None and not queue.empty():
            event = merged(event, queue.get_nowait())
            waiting += 1
        if waiting and on_merge is not None:
            on_merge(waiting)
        yield event
        if event.finish_reason is not None:
            return
