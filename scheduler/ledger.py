"""The request ledger: the one owner of every admitted, unfinished request.

A request enters at `admit` (any thread), is handed to the scheduler once by `take`
(with the cancels queued since), and leaves at `finish`, when its finishing event is
emitted. `admit` is where a full queue is refused, as `QueueFull`, the one exception
that travels from the engine to the HTTP layer's 503.

Thread-safe: the serving threads admit and cancel while the engine thread takes and
finishes. Nothing here waits; the engine's own condition wakes its thread.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from scheduler.request import Request


class QueueFull(Exception):
    """`admit` when `max_queue_depth` requests are unfinished."""


class RequestLedger:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._unfinished: dict[str, Request] = {}  # admitted, no finishing event yet
        self._inbox: list[Request] = []  # admitted, not yet taken by the scheduler
        self._cancel_ids: list[str] = []  # cancelled, not yet taken by the scheduler
        self._next_seq = 0

    def admit(self, request: Request, max_unfinished: int | None = None) -> None:
        """Raises `QueueFull` when `max_unfinished` requests are unfinished, ValueError
        on a duplicate id. Stamps arrival order (and time, when unset)."""
        with self._lock:
            if max_unfinished is not None and len(self._unfinished) >= max_unfinished:
                raise QueueFull(f"{len(self._unfinished)} requests pending (max_queue_depth)")
            if request.request_id in self._unfinished:
                raise ValueError(f"duplicate request id {request.request_id!r}")
            request.arrival_seq = self._next_seq
            self._next_seq += 1
            request.arrival_time = request.arrival_time or self._clock()
            self._unfinished[request.request_id] = request
            self._inbox.append(request)

    def cancel(self, request_id: str) -> bool:
        """Flag and queue the cancel of an unfinished request; False if there is none.

        The flag lets a tick already in progress see it (e.g. at a promotion); the
        queued id makes the next `take` release whatever the request holds."""
        with self._lock:
            request = self._unfinished.get(request_id)
            if request is None:
                return False
            request.cancel_requested = True
            self._cancel_ids.append(request_id)
            return True

    def take(self) -> tuple[list[Request], list[str]]:
        """The requests admitted and the ids cancelled since the last `take`."""
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancel_ids, self._cancel_ids = self._cancel_ids, []
        return inbox, cancel_ids

    def finish(self, request: Request) -> None:
        with self._lock:
            self._unfinished.pop(request.request_id, None)

    def get(self, request_id: str) -> Request | None:
        with self._lock:
            return self._unfinished.get(request_id)

    def has_inputs(self) -> bool:
        """Admissions or cancels wait for the next `take`."""
        with self._lock:
            return bool(self._inbox or self._cancel_ids)

    @property
    def num_untaken(self) -> int:
        with self._lock:
            return len(self._inbox)

    @property
    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._unfinished)

    def unfinished(self) -> list[Request]:
        """A copy, in admission order."""
        with self._lock:
            return list(self._unfinished.values())

    def unfinished_ids(self) -> list[str]:
        with self._lock:
            return list(self._unfinished)
