"""The engine thread around a `Scheduler`.

All model work runs on one dedicated thread (MLX streams are thread-local): the
runner is built there, and every tick runs there. Other threads talk to it through
the scheduler's `RequestLedger` (`submit` / `cancel`), a queue of `reconfigure`
changes, and `get_events` out. When there is no work the thread blocks on a condition
until something arrives.

A failed step fails its requests and the engine keeps serving (an out-of-memory prefill
is one such step). A device error that leaves the GPU context unusable is different:
after "an illegal memory access was encountered" every later MLX call in the process
fails the same way. When a tick's error events carry one of those (`device_lost`), the
engine fails every unfinished request, stops ticking and reports `fatal_error`; the
process has to be replaced (the scheduler actor exits and its replica starts a fresh
one: `serve_app.deployment.actor`).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Callable

from scheduler.config import SchedulerConfig
from scheduler.core import Scheduler
from scheduler.events import TokenEvent
from scheduler.ledger import RequestLedger
from scheduler.model_api import ModelRunner
from scheduler.request import Request

log = logging.getLogger(__name__)

# CUDA's messages for errors that leave the process's context unusable (cudaGetErrorString:
# illegal address, launch failure, device assert, illegal instruction, misaligned address,
# invalid program counter, hardware stack error, launch timeout, uncorrectable ECC error).
# Out of memory is not among them: the next step may fit.
DEVICE_LOST_MARKERS = (
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "device-side assert triggered",
    "an illegal instruction was encountered",
    "misaligned address",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
    "uncorrectable ECC error encountered",
)


def device_lost(events: list[TokenEvent]) -> str | None:
    """The first error among `events` that says the device is lost (`DEVICE_LOST_MARKERS`).

    >>> device_lost([TokenEvent("a", [], finish_reason="error", error="classic_prefill failed: "
    ...     "cudaMallocAsync(&data, size, stream) failed: out of memory")]) is None
    True
    >>> device_lost([TokenEvent("b", [], finish_reason="error", error="classic_prefill failed: "
    ...     "cudaMallocManaged(&data, size) failed: an illegal memory access was encountered")])
    'classic_prefill failed: cudaMallocManaged(&data, size) failed: an illegal memory access was encountered'
    """
    for event in events:
        if event.error and any(marker in event.error for marker in DEVICE_LOST_MARKERS):
            return event.error
    return None


def freeze_heap() -> None:
    """Collect once, then leave every object the process holds after loading out of later
    garbage collections (`gc.freeze`). A full collection walks every tracked object, and
    a loaded replica holds many (the libraries, the tokenizer, the runner's tables), and
    one landing inside a tick stalls every stream (docs/history/gpu-2026-12.md, "The service
    over HTTP, against mlx_lm.server")."""
    gc.collect()
    gc.freeze()


class Engine:
    def __init__(
        self,
        runner_factory: Callable[[], ModelRunner],
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._runner_factory = runner_factory
        self._config = config
        self._clock = clock
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)  # engine thread waits here when idle
        self._ledger = RequestLedger(clock)  # shared with the scheduler
        self._reconfigs: list[dict] = []
        self._stopping = False
        self._events: list[TokenEvent] = []
        self._events_ready = threading.Condition()
        self._state_lock = threading.Lock()  # held by the engine thread during a tick
        self._tick_gap_s = 0.0  # engine-thread time between ticks while work waited (`snapshot`)
        self._scheduler: Scheduler | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._stopped = threading.Event()  # the loop has ended; the thread stays parked
        self._fatal: str | None = None  # the device-lost error that ended the loop

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; returns once the runner is built there. A load
        error is re-raised here."""
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = threading.Thread(target=self._run, name="specslot-engine", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._load_error is not None:
            self._stopped.wait()
            raise self._load_error

    def stop(self) -> None:
        """Stop the thread; every unfinished request gets a "cancelled" finish event."""
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._stopped.wait()

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stopped.is_set()

    @property
    def fatal_error(self) -> str | None:
        """The error that lost the device and stopped the engine (None while it serves)."""
        return self._fatal

    # -- thread-safe inputs ------------------------------------------------------------
    def submit(self, request: Request) -> None:
        """Raises `QueueFull` at `max_queue_depth` unfinished requests, ValueError on a
        duplicate id, RuntimeError when the engine is not running."""
        with self._lock:
            if self._stopping or not self._ready.is_set() or self._load_error is not None or self._fatal:
                raise RuntimeError("engine is not running")
            self._ledger.admit(request, max_unfinished=self._config.max_queue_depth)
            self._wake.notify()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            if self._ledger.cancel(request_id):
                self._wake.notify()

    def reconfigure(self, **changes) -> None:
        """Validate now (raises ValueError), apply on the engine thread before the
        next tick; grant-scoped knobs take effect at the next grant."""
        with self._lock:
            self._config = self._config.replace(**changes)
            self._reconfigs.append(changes)
            self._wake.notify()

    # -- thread-safe outputs -----------------------------------------------------------
    def get_events(self, timeout: float | None = None) -> list[TokenEvent]:
        with self._events_ready:
            if not self._events:
                self._events_ready.wait_for(lambda: bool(self._events), timeout)
            events, self._events = self._events, []
        return events

    def snapshot(self) -> dict:
        """Scheduler state between ticks (waits for a tick in progress to end)."""
        with self._state_lock:
            scheduler = self._scheduler
            state = scheduler.snapshot() if scheduler is not None else {}
        with self._lock:
            state["pending_submissions"] = self._ledger.num_untaken
            if scheduler is None:  # the ledger's requests wait for the scheduler
                state["num_waiting"] = state["unfinished"] = self._ledger.num_unfinished
            state["running"] = self.running
            state["tick_gap_seconds"] = self._tick_gap_s
            state["config"] = self._config.to_dict()
        return state

    def snapshot_in_tick(self) -> dict:
        """The scheduler's state for code that runs on the engine thread inside a tick
        (a runner wrapper, such as the soak's cancel injector): no lock is taken."""
        return self._scheduler.snapshot() if self._scheduler is not None else {}

    # -- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        """The engine thread's body. It never returns: once the loop has ended it parks.

        A thread that has run MLX work and then exits leaves MLX's thread-local stream
        state to be torn down later, and the process then often aborts at exit
        ("terminate called without an active exception", mlx 0.32.4 + mlx-lm 0.32.2).
        A parked daemon thread holds no model (the runner is closed and dropped) and
        ends with the process.
        """
        try:
            self._loop()
        finally:
            self._scheduler = None
            self._stopped.set()
        threading.Event().wait()

    def _loop(self) -> None:
        try:
            runner = self._runner_factory()
            scheduler = Scheduler(runner, self._config, clock=self._clock, ledger=self._ledger)
            scheduler.publish = self._publish  # rows stepped inside a long prefill stream at once
            freeze_heap()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            self._load_error = exc
            self._ready.set()
            return
        with self._state_lock:
            self._scheduler = scheduler
        self._ready.set()
        idle = False
        ended = None  # when the last tick ended, unless the loop waited idle since
        while True:
            with self._lock:
                while idle and not (self._stopping or self._ledger.has_inputs() or self._reconfigs):
                    self._wake.wait()
                    ended = None
                if self._stopping:
                    break
                reconfigs, self._reconfigs = self._reconfigs, []
            with self._state_lock:
                if ended is not None:
                    self._tick_gap_s += time.perf_counter() - ended
                for changes in reconfigs:
                    scheduler.reconfigure(**changes)
                try:
                    events = scheduler.tick()
                except Exception as exc:  # noqa: BLE001 - a scheduler bug must not hang clients
                    log.exception("scheduler tick failed; failing unfinished requests")
                    events = self._fail_everything(scheduler, exc)
                lost = device_lost(events)
                if lost is not None:
                    log.error("the device is lost (%s): failing every request; this engine stops", lost)
                    with self._lock:  # no submission lands between the failures and the flag
                        events = events + self._fail_everything(scheduler, f"the device is lost ({lost})")
                        self._fatal = lost
                idle = not scheduler.has_work()
            self._publish(events)
            if self._fatal:
                return  # every later MLX call in this process would fail the same way
            ended = time.perf_counter()
        with self._state_lock:
            events = scheduler.cancel_all()
        self._publish(events)
        close = getattr(runner, "close", None)
        if callable(close):
            close()

    def _fail_everything(self, scheduler: Scheduler, exc: Exception | str) -> list[TokenEvent]:
        # The failed tick's events never go out: a request it finished fails as well.
        finished = [e for e in scheduler.sink.drain() if e.finish_reason is not None]
        requests = self._ledger.unfinished()
        # One error each: a request the tick finished may still be on the ledger.
        failed = {e.request_id: (e.stats, e.prompt_tokens) for e in finished}
        for r in requests:
            failed.setdefault(r.request_id, (r.spec, len(r.prompt_ids)))
        events = [
            TokenEvent(
                request_id,
                [],
                finish_reason="error",
                error=f"scheduler failure: {exc}",
                stats=stats,
                prompt_tokens=prompt_tokens,
            )
            for request_id, (stats, prompt_tokens) in failed.items()
        ]
        try:
            scheduler.cancel_all()  # releases sessions and rows; these events are superseded
        except Exception:  # noqa: BLE001
            log.exception("cleanup after a scheduler failure failed")
        for request in requests:  # failed above, whatever the cleanup managed
            self._ledger.finish(request)
        return events

    def _publish(self, events: list[TokenEvent]) -> None:
        if not events:
            return
        with self._events_ready:
            self._events.extend(events)
            self._events_ready.notify_all()
