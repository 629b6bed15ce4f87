"""The Scheduler: one tick = drain inbox and cancellations -> decide exactly one model
action (`policy.decide`) -> run it through the `ModelRunner` -> finalize -> events.

Single-threaded but for `self.ledger`, which other threads admit to and cancel
through; `engine.Engine` owns the thread. Routing of a new request: speculative if the
runner supports it, the B=1 policy runs it, fewer than
`speculative_disable_by_batch_size` other requests are live (when set) and the slot
has room (free, or a backlog place); otherwise a classic row. Classic admission is
strict lane order (high first), FIFO within a lane.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable

from scheduler.adaptive import B1Policy
from scheduler.config import SchedulerConfig
from scheduler.counters import Counters
from scheduler.events import EventSink, TokenEvent
from scheduler.ledger import RequestLedger
from scheduler.model_api import Interrupted, ModelRunner, TokenBatch
from scheduler.request import Lane, Request, RequestStatus
from scheduler.rules import Action, Decision, decide, num_to_admit
from scheduler.shadow import ShadowRounds
from scheduler.slot import ROW_IN_RING, SpecSlot

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        config: SchedulerConfig,
        clock: Callable[[], float] = time.monotonic,
        policy: B1Policy | None = None,
        ledger: RequestLedger | None = None,
    ) -> None:
        self.runner = runner
        self.config = config
        self.clock = clock
        self.counters = Counters()
        self.policy = policy or B1Policy.from_config(config, runner.policy_key(), clock=clock)
        self.ledger = ledger or RequestLedger(clock)  # every unfinished request
        self.sink = EventSink(self.counters, clock, on_finish=self._forget)
        self.slot = SpecSlot(runner, self, lambda: self.config, self.policy, self.counters, self.sink, clock)
        # Classic rows' shadow rounds for the cost gate (None: the drafter proposes no
        # fixed tokens, e.g. a draft model, so a row's acceptance cannot be read off it).
        self._shadow = (
            ShadowRounds(runner.shadow_index, lambda: self.config.num_draft_tokens, self.slot.gate.record_shadow)
            if runner.shadow_index(()) is not None
            else None
        )
        self._queues: dict[Lane, deque[Request]] = {lane: deque() for lane in Lane}
        self._rows: dict[str, Request] = {}
        self._cancelled_in_prefill: set[str] = set()  # rows whose cancel arrived mid-prefill
        self._in_prefill: dict[str, Request] = {}  # rows whose prompts are being prefilled now
        self._held_cancels: list[str] = []  # cancels taken inside a prefill, applied at the next drain
        self._yielded_last = False  # the last model action was speculative
        self._interrupted_last = False  # the last decode step was given up part-way
        self._last_tick_kind: str | None = None  # for `_observe_tick`
        self.last_decision: Decision | None = None
        # Hands events out before the tick ends (the Engine's publish); None: they wait
        # for the tick's end. Used by the decode steps a long prefill lets run.
        self.publish: Callable[[list[TokenEvent]], None] | None = None

    # -- inputs (applied at the next tick's drain) ------------------------------------
    def submit(self, request: Request) -> None:
        """Raises ValueError on a duplicate id (no depth limit: `Engine.submit` has it)."""
        self.ledger.admit(request)

    def cancel(self, request_id: str) -> None:
        self.ledger.cancel(request_id)

    def reconfigure(self, **changes) -> None:
        """Change live knobs; the slot reads them at the next grant."""
        self.config = self.config.replace(**changes)

    @property
    def grant_log(self) -> list[tuple[str, int]]:
        return list(self.slot.grant_log)

    def has_work(self) -> bool:
        return bool(
            self.ledger.has_inputs() or self._rows or self.slot.busy or any(self._queues.values()) or self._held_cancels
        )

    def num_rows(self) -> int:
        """Classic rows (`SlotHost`)."""
        return len(self._rows)

    def num_unfinished(self) -> int:
        return self.ledger.num_unfinished

    # -- the tick --------------------------------------------------------------------
    def tick(self) -> list[TokenEvent]:
        start = self.clock()
        self._drain()
        decision = self._decide(allow_spec=True)
        num_rows, tic = len(self._rows), self.clock()
        kind = None  # what the cost gate may learn from this tick
        fused = False
        if decision.action is Action.SPECULATIVE:
            step = self.slot.step(fuse=self._fusing())
            if step.ran:
                self._yielded_last = True
                fused = step.fused
                kind = "fused" if step.round else None
                num_rows = num_rows if step.fused else 0  # a round alone rode with no rows
            else:  # nothing runnable in the slot: the tick goes to classic work
                decision = self._decide(allow_spec=False)
        if decision.action is Action.PREFILL:
            self._prefill(decision.num_prefill)
        elif decision.action is Action.DECODE:
            tic, kind = self.clock(), "decode"
            if not self._decode():
                kind = None  # a step given up part-way: no cost to learn from
        self._observe_tick(kind, num_rows, self.clock() - tic)
        if decision.action in (Action.PREFILL, Action.DECODE):
            self._yielded_last = False
        self.last_decision = decision
        self.counters.observe_sessions(self.runner.num_live_sessions())
        events = self.sink.drain()
        self.counters.record_tick(decision.action.value, self.clock() - start, fused=fused)
        return events

    def _observe_tick(self, kind: str | None, num_rows: int, seconds: float) -> None:
        """Feed the cost gate steady-state ticks only: a tick of the same kind as the
        one before (the first decode after a row moved in also runs that row's first
        forward, which is the move's cost, not a decode step's)."""
        last, self._last_tick_kind = self._last_tick_kind, kind
        if kind is None or kind != last or not self._gating() or self.slot.gate.costs is None:
            return
        self.slot.gate.costs.observe(kind, num_rows, seconds)

    def _fusing(self) -> bool:
        return self.config.tick_mode == "fused" and self.runner.can_fuse()

    def _gating(self) -> bool:
        """The fused tick's cost gate is on (`SpecSlot.pays`): tick times are fed to it."""
        return self._fusing() and self.config.b1_policy == "auto"

    def _decide(self, allow_spec: bool) -> Decision:
        return decide(
            spec_step=self.slot.pending_step() if allow_spec else None,
            yielded_last=self._yielded_last,
            num_queued=self._num_queued(),
            num_rows=len(self._rows),
            max_rows=self.config.max_batch_size,
            prefill_batch=self.config.prefill_batch_size,
            fused=self._fusing(),
        )

    def _drain(self, inside_prefill: bool = False) -> None:
        """Route the new requests and apply the cancels. `inside_prefill` (between two
        forwards of a prefill): a free slot is not taken (`_route`), and the cancels wait
        for the next drain (a row in flight is not the runner's row yet)."""
        inbox, cancel_ids = self.ledger.take()
        for request in inbox:
            self._route(request, install=not inside_prefill)
        if inside_prefill:
            self._held_cancels += cancel_ids
            return
        cancel_ids, self._held_cancels = self._held_cancels + cancel_ids, []
        for request_id in cancel_ids:
            self._cancel_now(request_id)

    def _route(self, request: Request, install: bool = True) -> None:
        """`install`: a free slot may take the request now; else (inside a prefill, where
        the slot cannot run) it waits in the ring or goes classic."""
        if request.cancel_requested:
            self.sink.finish(request, "cancelled", phase="inbox")
            return
        if not self.runner.spec_supports(request):
            self.to_classic(request, None)
        elif not (self.slot.gate.policy_allows if self._fusing() else self.policy.should_run()):
            self.to_classic(request, "policy_declined")
        elif not self.slot.batch_allows():
            self.to_classic(request, "batch_size")
        else:
            reason = self.slot.try_admit(request, as_row=self._fusing(), install=install)
            if reason is not None:
                self.to_classic(request, None if reason == ROW_IN_RING else reason)

    def to_classic(self, request: Request, reason: str | None) -> None:
        """Queue for classic prefill; `reason` counts a speculative-eligible fallback."""
        if reason is not None:
            self.counters.record_fallback(reason)
        request.status = RequestStatus.QUEUED
        self._queues[request.lane].append(request)

    def adopt_row(self, request: Request, batches: list[TokenBatch]) -> None:
        """A speculative request demoted by the slot continues as a classic row."""
        request.status = RequestStatus.CLASSIC
        self._rows[request.request_id] = request
        self._apply_classic(batches)

    def release_row(self, request: Request, batches: list[TokenBatch], started: bool, error: str | None) -> None:
        """A row promoted into the slot (fused tick): its tokens emitted on the way are
        applied; it leaves the rows when its session started."""
        if error is not None:
            self._fail_rows([request], error)
            return
        self._apply_classic(batches)
        if started:
            self._rows.pop(request.request_id, None)

    def rows_done(self, batches: list[TokenBatch], error: str | None) -> None:
        """The classic rows' decode step ran inside a fused round (rows whose prompts
        are still being prefilled were not in it)."""
        if error is not None:
            self._fail_rows([r for r in self._rows.values() if r.request_id not in self._in_prefill], error)
        else:
            self._apply_classic(batches)

    def unqueue(self, request: Request) -> None:
        self._queues[request.lane].remove(request)

    def _cancel_now(self, request_id: str) -> None:
        request = self.ledger.get(request_id)
        if request is None:  # unknown or already finished
            return
        request.cancel_requested = True
        phase = None
        if request.status in (RequestStatus.QUEUED, RequestStatus.CLASSIC):
            self.slot.forget_row(request)  # a fused-tick ring entry, if it has one
        if request.status is RequestStatus.QUEUED:
            self._queues[request.lane].remove(request)
        elif request.status is RequestStatus.CLASSIC:
            self._rows.pop(request_id, None)
            self.runner.classic_remove(request_id)
            if request_id in self._cancelled_in_prefill:
                phase = "prefill"
        elif self.slot.cancel(request):
            return
        self.sink.finish(request, "cancelled", phase=phase)

    # -- classic actions -------------------------------------------------------------
    def _prefill(self, count: int) -> None:
        # Between the prompts' forwards (where the runner splits them) earlier rows step
        # and arrivals that will not hold the prompts up long are admitted.
        self._run_prefill(self._take_queued(count), self._step_within_prefill)

    def _take_queued(self, count: int, admits: Callable[[Lane, Request], bool] | None = None) -> list[Request]:
        """Up to `count` queued requests, taken from their queues in strict lane order,
        FIFO within a lane; the first that `admits(lane, request)` refuses ends it."""
        taken: list[Request] = []
        for lane in Lane:
            queue = self._queues[lane]
            while queue and len(taken) < count:
                if admits is not None and not admits(lane, queue[0]):
                    return taken
                taken.append(queue.popleft())
        return taken

    def _run_prefill(self, admitted: list[Request], between: Callable[[], None]) -> None:
        now = self.clock()
        for request in admitted:
            request.status = RequestStatus.CLASSIC
            self._rows[request.request_id] = request
            self._in_prefill[request.request_id] = request
            request.mark_scheduled(now)
            self.counters.record_queue_wait(request.lane, now - request.arrival_time)
        try:
            batches = self.runner.classic_prefill(admitted, between=between, piece=self.config.prefill_yield_tokens)
        except Exception as exc:  # noqa: BLE001 - fail these rows, keep serving
            self._fail_rows(admitted, f"classic_prefill failed: {exc}")
            return
        finally:
            for request in admitted:
                self._in_prefill.pop(request.request_id, None)
        # A cancel flagged while the prefill ran is applied at the next drain; remember
        # it happened mid-prefill so the cancellation is counted under that phase.
        self._cancelled_in_prefill.update(r.request_id for r in admitted if r.cancel_requested)
        self._apply_classic(batches, first_tokens=True)

    def _decode(self) -> bool:
        """One decode step over the classic rows; False where an arrival stopped it
        (`interrupt_decode`): nothing changed, and the next decode step runs whole."""
        interrupt = None
        if self.config.interrupt_decode and not self._interrupted_last:
            interrupt = self._admittable_arrival
        self._interrupted_last = False
        try:
            batches = self.runner.classic_decode(
                drafts=self.config.rows_draft, skip_cap=self.config.skip_cap, interrupt=interrupt
            )
        except Interrupted:
            self._interrupted_last = True
            self.counters.decode_interrupts += 1
            return False
        except Exception as exc:  # noqa: BLE001
            self._fail_rows(list(self._rows.values()), f"classic_decode failed: {exc}")
            return True
        self._apply_classic(batches)
        return True

    def _step_within_prefill(self) -> None:
        """Called by the runner between two forwards of a prefill (`prefill_yield_tokens`):
        the requests that arrived since are routed, those that may overtake the prompts
        in flight are prefilled (`_overtaking`; their first tokens go out at once), then
        the rows decoding beside it take a step (`_decode_within_prefill`). Cancels taken
        here wait for the next drain (a row in flight is not the runner's row yet)."""
        self._drain(inside_prefill=True)
        admitted = self._overtaking()
        if admitted:
            self.counters.prefill_overtakes += len(admitted)
            self._run_prefill(admitted, self._decode_within_prefill)
            self._publish()
        self._decode_within_prefill()

    def _overtaking(self) -> list[Request]:
        """The queued requests a prefill in flight lets in between its forwards, taken
        from their queues: in lane order and FIFO within a lane, as free rows and
        `prefill_batch_size` allow, each either of a higher lane than every prompt in
        flight or whose prompt, its longest cached prefix aside, fits one forward of
        `prefill_yield_tokens` positions (`classic_prefill_fits`: on a GPU one chunk);
        the first that is neither ends the admission (no request overtakes an earlier
        one of its lane)."""
        count = num_to_admit(
            self._num_queued(), len(self._rows), self.config.max_batch_size, self.config.prefill_batch_size
        )
        first_lane = min(r.lane for r in self._in_prefill.values())
        piece = self.config.prefill_yield_tokens
        return self._take_queued(
            count, lambda lane, request: lane < first_lane or self.runner.classic_prefill_fits(request, piece)
        )

    def _decode_within_prefill(self) -> None:
        """One step of the streams beside the prefill in flight: a round of the slot's
        started holder (`SpecSlot.round_within`), which carries the decode step of the
        classic rows on a fused tick, and otherwise their own decode step; the tokens go
        out at once where `publish` is set. A failure of the rows' step propagates: the
        prefill fails its new rows, and the earlier rows meet the error again at their
        next step (a round's failure ends the holder, as in any tick)."""
        decoding = len(self._rows) > len(self._in_prefill)
        step = self.slot.round_within(fuse=decoding and self._fusing())
        if step.ran:
            self.counters.prefill_yields += 1
            decoding = decoding and not step.fused
            self._publish()
        if not decoding:
            return
        batches = self.runner.classic_decode(drafts=self.config.rows_draft, skip_cap=self.config.skip_cap)
        self.counters.prefill_yields += 1
        self._apply_classic(batches)
        self._publish()

    def _publish(self) -> None:
        """Hand the events so far out now (inside a tick), where `publish` is set."""
        if self.publish is not None:
            self.publish(self.sink.drain())

    def _admittable_arrival(self) -> bool:
        """Called inside a decode step, between its layers: a request waits to be taken
        that a prefill would admit now (a free row)."""
        return self.ledger.num_untaken > 0 and len(self._rows) + self._num_queued() < self.config.max_batch_size

    def _num_queued(self) -> int:
        """Requests waiting in the classic admission queues, every lane."""
        return sum(len(q) for q in self._queues.values())

    def _shadowing(self) -> bool:
        return self._shadow is not None and self.config.shadow_rounds and self._gating()

    def _apply_classic(self, batches: list[TokenBatch], first_tokens: bool = False) -> None:
        """Emit the rows' tokens and finish the rows that ended. `first_tokens`: a prefill's,
        which shadow rounds leave to the row's next step (a row's first observation builds
        its index over the prompt, which would hold back the first tokens of the group)."""
        shadowing = self._shadowing() and not first_tokens
        for batch in batches:
            request = self._rows.get(batch.request_id)
            if request is None:  # a row dropped this tick (cancelled)
                continue
            if batch.num_drafted:  # the row verified its own drafts in this step
                self.counters.record_round(
                    request.spec, batch.num_drafted, batch.num_accepted, row=True, drafter=batch.drafter
                )
            self.sink.tokens(request, batch.token_ids, batch.logprobs)
            # A row that drafts like the slot never takes it beside rows (`CostGate.pays`).
            if (
                shadowing
                and batch.token_ids
                and not batch.num_drafted
                and not batch.finish_reason
                and not self.runner.rows_draft_like_slot(request.sampling.is_greedy)
            ):
                self._shadow.observe(request, len(batch.token_ids))
            if batch.finish_reason:
                self._rows.pop(batch.request_id)
                self.runner.classic_remove(batch.request_id)
                self.slot.forget_row(request)
                self.sink.finish(request, batch.finish_reason)

    def _fail_rows(self, requests: list[Request], message: str) -> None:
        log.error("%s", message)
        for request in requests:
            self._rows.pop(request.request_id, None)
            self.slot.forget_row(request)
            try:
                self.runner.classic_remove(request.request_id)
            except Exception:  # noqa: BLE001 - best effort after a failure
                log.exception("classic_remove(%s) failed", request.request_id)
            self.sink.finish(request, "error", error=message)

    # -- lifecycle -------------------------------------------------------------------
    def _forget(self, request: Request) -> None:
        self.ledger.finish(request)
        if self._shadow is not None:
            self._shadow.forget(request.request_id)
        self._cancelled_in_prefill.discard(request.request_id)

    def cancel_all(self) -> list[TokenEvent]:
        """Cancel every unfinished request now (shutdown); returns their events."""
        self._drain()
        for request_id in self.ledger.unfinished_ids():
            self._cancel_now(request_id)
        # A tick that failed may have finished requests and left their rows or sessions.
        unfinished = lambda request_id: self.ledger.get(request_id) is not None  # noqa: E731
        for request_id in [r for r in self._rows if not unfinished(r)]:
            self._rows.pop(request_id)
            self.runner.classic_remove(request_id)
        self.slot.release_finished(unfinished)
        return self.sink.drain()

    def snapshot(self) -> dict:
        requests = self.ledger.unfinished()
        num_running = sum(r.status.is_running for r in requests)
        return {
            "slot": self.slot.snapshot(),
            "queue_depth": {lane.name.lower(): len(q) for lane, q in self._queues.items()},
            "queued_ids": [r.request_id for lane in Lane for r in self._queues[lane]],
            "classic_rows": len(self._rows),
            "classic_row_ids": list(self._rows),
            "unfinished": len(requests),
            "num_running": num_running,
            "num_waiting": len(requests) - num_running,
            "last_action": None if self.last_decision is None else self.last_decision.action.value,
            "counters": self.counters.to_dict(),
            "policy": self.policy.snapshot(),
            "prefix_cache": self.runner.prefix_cache_stats(),
            "classic_steps": self.runner.classic_step_stats(),
            "shadow": None if self._shadow is None else {"rows": len(self._shadow), "rounds": self._shadow.num_rounds},
            "config": self.config.to_dict(),
            "speculation": {
                # why the slot serves no request at all (None: it can), e.g. a target
                # whose cache cannot roll back a rejected draft
                "off_reason": self.runner.spec_off_reason,
                "tick": "fused" if self._fusing() else "alternate",
                # why the verify cannot ride in the batch's forward, when it cannot
                "fused_off_reason": self.runner.fuse_blocker,
            },
        }
