"""How the HTTP layer talks to a scheduler: `EngineClient`.

The HTTP layer only needs: submit a request and read its events, cancel it, take a
snapshot, reconfigure. `EngineClient` implements that over a *source* of per-tick event
batches; `LocalSource` wraps an in-process `Engine` (tests, tools) and
`serve_app.deployment.actor.ActorSource` the replica's scheduler actor. One pump task per client
polls the source and fans batches out to per-request queues, so the replica pays one
hop per tick, not one per token or per request.
"""

from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator, Protocol

from scheduler.request import Request
from serve_app.deployment.events import EventRouter, iterate

logger = logging.getLogger(__name__)

POLL_TIMEOUT_S = 0.1  # how long one poll blocks waiting for events
SCHEDULER_LOST = "the scheduler stopped while generating; please retry"


class SchedulerLost(Exception):
    """The scheduler died; the source has been (or is being) restarted."""


class EventSource(Protocol):
    async def start(self) -> dict: ...  # returns runner info (max_context, eos ids, ...)
    async def poll(self, timeout: float) -> list: ...  # raises SchedulerLost
    async def submit(self, request: Request) -> None: ...  # raises QueueFull, SchedulerLost
    async def cancel(self, request_id: str) -> None: ...
    async def snapshot(self) -> dict: ...
    async def reconfigure(self, changes: dict) -> None: ...
    async def restart(self) -> dict: ...
    async def close(self) -> None: ...


class EngineClient:
    """Async facade over one scheduler; every coroutine runs on the replica's loop."""

    def __init__(self, source: EventSource) -> None:
        self._source = source
        self._router = EventRouter()
        self._pump: asyncio.Task | None = None
        self._cancel_sender: asyncio.Task | None = None
        self._cancel_queue: asyncio.Queue = asyncio.Queue()
        self._live_changes: dict = {}
        self._started = False
        self.info: dict = {}
        self.num_restarts = 0
        self.num_events_merged = 0  # events read together with an earlier one (`events.iterate`)

    async def start(self) -> None:
        self.info = await self._source.start()
        self._started = True
        if self._live_changes:  # user_config that arrived while the scheduler was starting
            await self._source.reconfigure(self._live_changes)
        loop = asyncio.get_running_loop()
        self._pump = loop.create_task(self._pump_events())
        self._cancel_sender = loop.create_task(self._send_cancels())

    async def close(self) -> None:
        """Safe before or during `start` (a replica deleted while loading)."""
        for task in (self._pump, self._cancel_sender):
            if task is not None:
                task.cancel()
        self._router.fail_all(SCHEDULER_LOST)
        await self._source.close()

    @property
    def healthy(self) -> bool:
        return self._pump is not None and not self._pump.done()

    @property
    def num_open_streams(self) -> int:
        return self._router.num_open

    async def submit(self, request: Request) -> AsyncIterator:
        """Submit and return the request's event stream; raises `QueueFull`.

        The caller must iterate the stream to its end or call `cancel` + `release`.
        """
        queue = self._router.open(request.request_id)
        try:
            await self._source.submit(request)
        except BaseException:
            self._router.close(request.request_id)
            raise
        return self._stream(request.request_id, queue)

    async def _stream(self, request_id: str, queue: asyncio.Queue):
        try:
            async for event in iterate(queue, self._count_merged):
                yield event
        finally:
            self._router.close(request_id)

    def _count_merged(self, n: int) -> None:
        self.num_events_merged += n

    async def cancel(self, request_id: str) -> None:
        """Cancel `request_id` in the scheduler; returns once the cancel is sent.

        The call is made by this client's own long-lived task, not the caller's: when
        Serve cancels an HTTP request whose client went away, Ray also cancels every
        actor call made from that request's task, which would drop the cancel itself
        and leave the request generating to max_tokens.
        """
        if self._cancel_sender is None or self._cancel_sender.done():
            await self._send_cancel(request_id)
            return
        sent = asyncio.get_running_loop().create_future()
        self._cancel_queue.put_nowait((request_id, sent))
        await sent

    async def _send_cancels(self) -> None:
        while True:
            request_id, sent = await self._cancel_queue.get()
            try:
                await self._send_cancel(request_id)
            finally:
                if not sent.done():
                    sent.set_result(None)

    async def _send_cancel(self, request_id: str) -> None:
        try:
            await self._source.cancel(request_id)
        except SchedulerLost:
            pass  # a dead scheduler holds nothing to cancel
        except Exception:  # the request still ends (its client is gone); keep sending others
            logger.exception("cancelling %s failed", request_id)

    def release(self, request_id: str) -> None:
        self._router.close(request_id)

    async def snapshot(self) -> dict:
        return await self._source.snapshot()

    async def reconfigure(self, changes: dict) -> None:
        """Apply live changes now and again whenever the scheduler is re-created."""
        self._live_changes.update(changes)
        if changes and self._started:  # else start() applies them
            await self._source.reconfigure(changes)

    async def _pump_events(self) -> None:
        while True:
            try:
                events = await self._source.poll(POLL_TIMEOUT_S)
            except asyncio.CancelledError:
                raise
            except SchedulerLost:
                await self._recover()
                continue
            except Exception:  # keep pumping: one bad poll must not wedge every stream
                logger.exception("polling the scheduler failed")
                await asyncio.sleep(POLL_TIMEOUT_S)
                continue
            if events:
                self._router.deliver(events)

    async def _recover(self) -> None:
        """End in-flight streams with an error event and bring up a fresh scheduler."""
        self._router.fail_all(SCHEDULER_LOST)
        while True:
            try:
                self.info = await self._source.restart()
                if self._live_changes:
                    await self._source.reconfigure(self._live_changes)
                self.num_restarts += 1
                logger.warning("scheduler re-created (restart #%d)", self.num_restarts)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("re-creating the scheduler failed; retrying")
                await asyncio.sleep(1.0)


class LocalSource:
    """An in-process `Engine` as an `EventSource` (no Ray); blocking calls use threads.

    `engine_factory()` returns `(engine, info)` like `serve_app.deployment.actor.build_engine`:
    an unstarted Engine and a dict the runner factory fills with runner info.
    """

    def __init__(self, engine_factory) -> None:
        self._engine_factory = engine_factory
        self._engine = None

    async def start(self) -> dict:
        self._engine, info = self._engine_factory()
        await asyncio.to_thread(self._engine.start)
        return dict(info)

    async def poll(self, timeout: float) -> list:
        events = await asyncio.to_thread(self._engine.get_events, timeout)
        if not events and self._engine.fatal_error:
            # As the scheduler actor's process ends (serve_app.deployment.actor): the engine is lost.
            raise SchedulerLost(f"the device is lost ({self._engine.fatal_error})")
        return events

    async def submit(self, request: Request) -> None:
        self._engine.submit(request)

    async def cancel(self, request_id: str) -> None:
        self._engine.cancel(request_id)

    async def snapshot(self) -> dict:
        return self._engine.snapshot()

    async def reconfigure(self, changes: dict) -> None:
        self._engine.reconfigure(**changes)

    async def restart(self) -> dict:
        await self.close()
        return await self.start()

    async def close(self) -> None:
        if self._engine is not None:
            await asyncio.to_thread(self._engine.stop)
