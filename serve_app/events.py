"""Per-request event streams on the replica's event loop.

The scheduler emits `TokenEvent`s for all of its requests in per-tick batches; an
`EventRouter` fans a batch out to one asyncio queue per open request. A stream ends with
the event that carries a `finish_reason`. `fail_all` ends every open stream with an
error event (used when the scheduler actor dies) so no client waits forever.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

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


async def iterate(queue: asyncio.Queue) -> AsyncIterator[TokenEvent]:
    """Events of one request, ending after the finishing event."""
    while True:
        event = await queue.get()
        yield event
        if event.finish_reason is not None:
            return
