"""The speculative slot: one active job, the grant backlog, grants, parks, promotions,
and demotions (a started session moved into the classic batch by the batch-size rule).

Invariants: at most one job holds the slot (and the runner's drafter); each `step()`
runs at most one speculative model action (a slice 0, a round, or a promotion plus its
round), except in legacy burst mode where one step runs a whole generation. In the
fused tick (`step(fuse=True)`) a round also decodes every classic row in its forward
(`ModelRunner.spec_round_with_decode`); the rows' tokens are handed back in the
`SlotStep` for the scheduler to apply. A grant's
budget and mode are read from the config once, when the grant starts, and cached on
the job, so the per-round cost is a counter increment and one comparison.

Worked schedule, budget 2, A (first token + 3 rounds) installed alone, B waiting
from A's second slice, one entry per grant = (request, slices run in it):
A: slice0, round -> park (A,2) | B: slice0, round -> park (B,2) |
A: round, round -> finish (A,2) | B: round -> finish (B,1).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol

from scheduler.adaptive import B1Policy
from scheduler.backlog import BacklogEntry, EntryKind, GrantBacklog
from scheduler.config import SchedulerConfig
from scheduler.counters import Counters
from scheduler.events import EventSink
from scheduler.gate import CostGate
from scheduler.model_api import ModelRunner, TokenBatch
from scheduler.request import Request, RequestStatus
from scheduler.rules import SpecStep, batch_allows_speculation, can_join_backlog, grant_expired, should_demote

GRANT_LOG_LIMIT = 4096
# `try_admit`'s answer in the fused tick when the request joins the ring but decodes as
# a classic row while it waits for the drafter: the caller queues it for prefill.
ROW_IN_RING = "row_in_ring"


class SlotHost(Protocol):
    """What the slot asks of the scheduler that owns the classic rows and the queues."""

    def num_unfinished(self) -> int:
        """Requests not finished yet (the batch-size rule counts them)."""

    def num_rows(self) -> int:
        """Classic rows."""

    def to_classic(self, request: Request, reason: str | None) -> None:
        """Queue `request` for classic prefill; `reason` counts a fallback."""

    def adopt_row(self, request: Request, batches: list[TokenBatch]) -> None:
        """Take a demoted (or, in the fused tick, parked) request as a classic row and
        apply `batches` (other rows' tokens emitted on the way)."""

    def release_row(self, request: Request, batches: list[TokenBatch], started: bool, error: str | None) -> None:
        """A classic row was promoted into the slot (fused tick): apply `batches`; the
        request leaves the rows (`started`) or fails (`error`)."""

    def unqueue(self, request: Request) -> None:
        """Take a request out of the classic admission queue (granted before prefill)."""

    def rows_done(self, batches: list[TokenBatch], error: str | None) -> None:
        """A fused round decoded the classic rows: apply their tokens now, before anything
        else of the step moves a row (or fail them all with `error`)."""


@dataclass
class SlotStep:
    """What one `step()` did: whether a speculative action ran, whether it was a
    plain round (no slice 0, probe or promotion moves: a tick the cost model can learn
    from), and whether that round carried the classic rows' decode step (`fused`)."""

    ran: bool
    fused: bool = False
    round: bool = False


@dataclass
class ActiveJob:
    request: Request
    budget: int  # cached at grant start
    burst: bool  # cached at grant start: run the whole generation in one step
    started: bool  # slice 0 done (session exists)
    slices_run: int = 0
    cancelled_in_prefill: bool = False  # its cancel was flagged while slice 0 ran

    @property
    def cancel_phase(self) -> str | None:
        return "prefill" if not self.started or self.cancelled_in_prefill else None


class SpecSlot:
    def __init__(
        self,
        runner: ModelRunner,
        host: SlotHost,
        config: Callable[[], SchedulerConfig],
        policy: B1Policy,
        counters: Counters,
        sink: EventSink,
        clock: Callable[[], float],
    ) -> None:
        """`host`: the scheduler, for everything that touches classic rows and queues."""
        self.runner = runner
        self.host = host
        self._config = config
        self.policy = policy
        self.counters = counters
        self.sink = sink
        self._clock = clock
        self.backlog = GrantBacklog(on_depth=counters.observe_backlog)
        self.active: ActiveJob | None = None
        self.gate = CostGate(runner, config)
        self._fuse = False  # this step's rounds carry the classic decode
        self._fused = False  # this step ran a fused round
        self.grant_log: deque[tuple[str, int]] = deque(maxlen=GRANT_LOG_LIMIT)

    # -- state --------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.active is not None or len(self.backlog) > 0

    def pending_step(self) -> SpecStep | None:
        if self.active is not None:
            return SpecStep.ROUND if self.active.started else SpecStep.BEGIN
        return SpecStep.PROMOTE if len(self.backlog) else None

    # -- admission ------------------------------------------------------------------
    def try_admit(self, request: Request, as_row: bool = False, install: bool = True) -> str | None:
        """Install `request` on a free slot or add it to the backlog as a waiter.

        Returns None when admitted, else the reason it must go to classic decode.
        With `as_row` (the fused tick) a waiter decodes as a classic row until it is
        granted: the answer is then `ROW_IN_RING` and the caller queues it. Without
        `install` a free slot is not taken (the request waits in the backlog: the
        caller is inside another action). The caller has already checked
        `spec_supports` and the policy verdict.
        """
        config = self._config()
        if not self.busy and install:
            if not as_row or self.gate.admits_newcomer(request, self.host.num_rows()):
                self._install(request, started=False)
                return None
        if config.tick_slice and can_join_backlog(len(self.backlog), config.backlog_cap, config.grant_rounds):
            self.backlog.push(request, EntryKind.WAITING)
            if as_row:
                return ROW_IN_RING
            request.status = RequestStatus.WAITING
            return None
        return "slot_busy" if config.grant_rounds == 0 or not config.tick_slice else "backlog_full"

    def _install(self, request: Request, *, started: bool) -> ActiveJob:
        config = self._config()
        request.status = RequestStatus.ACTIVE
        self.active = ActiveJob(request, budget=config.grant_rounds, burst=not config.tick_slice, started=started)
        request.spec.num_grants += 1
        self.counters.grants += 1
        return self.active

    # -- the tick's speculative action ----------------------------------------------
    def step(self, fuse: bool = False) -> SlotStep:
        """Run this tick's speculative action. `ran` is False when nothing ran: a
        promotion found only cancelled or declined entries (the tick may then go
        classic). With `fuse`, a round (not a slice 0 or a probe) carries the decode
        step of the classic rows, if there are any."""
        return self._run(fuse, self._step)

    def round_within(self, fuse: bool) -> SlotStep:
        """One round of a started holder from inside another action (between two
        forwards of a classic prefill); with `fuse`, the classic rows' decode step rides
        in it. Nothing else a tick's step may do runs here (a slice 0, a promotion, a
        demotion: each prefills or moves a session); a round boundary may park the
        holder as at any round. `ran` is False where no round ran."""
        job = self.active
        if job is None or not job.started or job.burst or job.request.cancel_requested or self._demotable():
            return SlotStep(False)

        def one_round() -> bool:
            self._round(job)
            return True

        return self._run(fuse, one_round)

    def _run(self, fuse: bool, action: Callable[[], bool]) -> SlotStep:
        """Run `action` (True: something ran) with this step's fuse flag, and report it."""
        self._fuse = fuse
        self._fused = self._plain_round = False
        ran = action()
        return SlotStep(ran, self._fused, self._plain_round)

    def _step(self) -> bool:
        job = self.active
        if job is None:
            return self._promote()
        if job.request.cancel_requested:  # cancelled since the drain: stop before any work
            self._end(job, "cancelled")
            return False
        if job.started and self._demotable():  # the batch grew: the holder joins it
            self.active = None
            self.grant_log.append((job.request.request_id, job.slices_run))
            self._demote(job.request)
            return self._promote()  # the ring sees the same batch: parked jobs follow, waiters go classic
        if job.started:
            self._plain_round = True  # unless it turns out a probe or ends in a park
            self._round(job)
        else:
            self._begin(job)
        return True

    def _promote(self) -> bool:
        config = self._config()
        while len(self.backlog):
            entry, escalated = self.backlog.grant(config.skip_cap, self._eligible)
            if entry is None:  # every entry decodes as a row that would not pay
                return False
            self.counters.skip_escalations += int(escalated)
            request = entry.request
            if request.status in (RequestStatus.QUEUED, RequestStatus.CLASSIC):
                if self._promote_row(entry):  # fused tick: the stream decodes as a row
                    return True
                continue
            if request.cancel_requested:  # aborted; the next entry is tried in this tick
                self._abort(entry)
                continue
            if entry.kind is EntryKind.WAITING:
                if not self.policy.should_run():  # settled to decline while it waited
                    self.host.to_classic(request, "declined_at_promotion")
                    continue
                # The batch grew while it waited: a waiter has no session yet, so it
                # joins the classic batch instead (a parked job must resume here).
                if not self.batch_allows():
                    self.host.to_classic(request, "batch_size_at_promotion")
                    continue
                self.counters.promotions += 1
                self._begin(self._install(request, started=False))
                return True
            if self._demotable():  # a parked job has a session: it moves, it does not restart
                self._demote(request)
                continue
            self.counters.promotions += 1
            job = self._install(request, started=True)
            try:
                self.runner.spec_resume(request.request_id)
            except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
                self._end(job, "error", error=f"spec_resume failed: {exc}")
                return True
            self._round(job)
            return True
        return False

    def _eligible(self, entry: BacklogEntry) -> bool:
        """A row-form entry (fused tick) is granted only where speculating pays, beside
        the rows that would remain; the seed's entries always compete."""
        request = entry.request
        if request.status not in (RequestStatus.QUEUED, RequestStatus.CLASSIC):
            return True
        return self.gate.admits_row(request, self.host.num_rows() - (request.status is RequestStatus.CLASSIC))

    def _promote_row(self, entry: BacklogEntry) -> bool:
        """Grant the slot to a ring entry that decodes as a classic row (fused tick).
        False when it stays classic (declined, or ended on the way): the next entry is
        tried in the same tick."""
        request = entry.request
        reason = None if self.gate.policy_allows or entry.kind is EntryKind.PARKED else "declined_at_promotion"
        # The batch-size rule stops parked rows too: promoted, they would be demoted at
        # their next boundary, and each move costs a row's cache copy.
        reason = reason or (None if self.batch_allows() else "batch_size_at_promotion")
        if reason is not None:
            self.counters.record_fallback(reason)
            if entry.kind is EntryKind.PARKED:
                self.runner.spec_finish(request.request_id)  # it stays a row: drop its draft state
            return False
        self.counters.promotions += 1
        if request.status is RequestStatus.QUEUED:  # granted before its classic prefill
            self.host.unqueue(request)
            self._begin(self._install(request, started=False))
            return True
        try:
            batches, started = self.runner.classic_to_spec(request)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
            try:
                self.runner.spec_finish(request.request_id)  # whatever it kept for the request
            except Exception:  # noqa: BLE001 - best effort after a failure
                pass
            self.host.release_row(request, [], False, f"classic_to_spec failed: {exc}")
            return False
        self.host.release_row(request, batches, started, None)
        if not started:
            return False
        self._round(self._install(request, started=True))
        return True

    def forget_row(self, request: Request) -> None:
        """A classic row ended (finished, cancelled, failed): drop its ring entry and
        any draft state kept for it. Idempotent."""
        self.gate.forget(request.request_id)
        entry = self.backlog.remove(request.request_id)
        if entry is not None and entry.kind is EntryKind.PARKED:
            self.runner.spec_finish(request.request_id)

    def _begin(self, job: ActiveJob) -> None:
        """Slice 0: prefill + first token, then the immediate expiry check."""
        request = job.request
        now = self._clock()
        request.mark_scheduled(now)
        self.counters.record_queue_wait(request.lane, now - request.arrival_time)
        try:
            batch = self.runner.spec_begin(request)
        except Exception as exc:  # noqa: BLE001
            self._end(job, "error", error=f"spec_begin failed: {exc}")
            return
        job.started = True
        job.slices_run += 1
        job.cancelled_in_prefill = request.cancel_requested
        self.sink.tokens(request, batch.token_ids, batch.logprobs)
        if batch.finish_reason:
            self._end(job, batch.finish_reason)
        elif job.burst:
            self._burst(job)
        else:
            self._park_if_expired(job)

    def _round(self, job: ActiveJob) -> None:
        if not self._run_round(job):
            return
        if job.burst:
            self._burst(job)
        else:
            self._park_if_expired(job)  # a round boundary

    def _burst(self, job: ActiveJob) -> None:
        """Legacy burst: rounds until the job ends, inside this one step."""
        while self.active is job:
            if job.request.cancel_requested:
                self._end(job, "cancelled")
                return
            self._run_round(job)

    def _run_round(self, job: ActiveJob) -> bool:
        """One round; True if the job is still active after it."""
        request = job.request
        fuse = self._fuse and not job.burst and not self._fused and self.host.num_rows() > 0
        # Probes profile the B=1 policy, which the fused tick does not consult.
        probe = not self._fuse and self.policy.wants_probe(request.spec.num_probe_rounds)
        self._plain_round = self._plain_round and not probe
        try:
            if fuse:
                config = self._config()
                outcome, rows = self.runner.spec_round_with_decode(
                    request.request_id, drafts=config.rows_draft, skip_cap=config.skip_cap
                )
                self._fused = True
                self.host.rows_done(rows, None)
            else:
                outcome = self.runner.spec_round(request.request_id, probe=probe)
        except Exception as exc:  # noqa: BLE001
            if fuse:
                self._fused = True
                self.host.rows_done([], f"spec_round_with_decode failed: {exc}")
            self._end(job, "error", error=f"spec_round failed: {exc}")
            return False
        job.slices_run += 1
        self.counters.record_round(
            request.spec, outcome.num_drafted, outcome.num_accepted, probe=outcome.probe, drafter=outcome.drafter
        )
        self.gate.record(request, outcome)
        self.policy.record_round(outcome)
        self.sink.tokens(request, outcome.token_ids, outcome.logprobs)
        if outcome.finish_reason:
            self._end(job, outcome.finish_reason)
            return False
        return True

    def _park_if_expired(self, job: ActiveJob) -> None:
        request = job.request
        into_batch = self._fuse  # fused: it decodes on as a row
        costs_more = into_batch and not self.gate.pays(request, self.host.num_rows())
        if not costs_more and not grant_expired(job.slices_run, job.budget, len(self.backlog) > 0):
            return
        self.counters.cost_parks += int(costs_more)
        if costs_more:
            self.gate.parked_for_cost(request.request_id)
        try:
            if into_batch:
                moved = self.runner.spec_park_to_classic(request.request_id)
            else:
                self.runner.spec_park(request.request_id)
        except Exception as exc:  # noqa: BLE001
            self._end(job, "error", error=f"spec_park failed: {exc}")
            return
        self.grant_log.append((request.request_id, job.slices_run))
        request.spec.num_parks += 1
        self.counters.parks += 1
        self.active = None
        self._plain_round = False  # the park's moves are in this tick's time
        if into_batch:
            self.host.adopt_row(request, moved)
        else:
            request.status = RequestStatus.PARKED
        self.backlog.push(request, EntryKind.PARKED)  # may reach cap+1 until the next promotion

    def batch_allows(self) -> bool:
        """The batch-size rule for a request that has not started speculating, counted
        among the live requests itself (at admission and at its promotion)."""
        others = self.host.num_unfinished() - 1
        return batch_allows_speculation(others, self._config().speculative_disable_by_batch_size)

    def _demotable(self) -> bool:
        config = self._config()
        others, rows = self.host.num_unfinished() - 1, self.host.num_rows()
        return should_demote(others, config.speculative_disable_by_batch_size, rows, config.max_batch_size)

    def _demote(self, request: Request) -> None:
        """Move a started session (taken off the slot or out of the ring) into the
        classic batch; its SpecStats keep what it did."""
        try:
            batches = self.runner.spec_to_classic(request.request_id)
        except Exception as exc:  # noqa: BLE001 - fail this request, keep serving
            for release in (self.runner.spec_finish, self.runner.classic_remove):
                try:
                    release(request.request_id)
                except Exception:  # noqa: BLE001 - best effort after a failure
                    pass
            self.sink.finish(request, "error", error=f"spec_to_classic failed: {exc}")
            return
        self.counters.demotions += 1
        self.policy.session_done(request.spec.num_slot_rounds)
        self.host.adopt_row(request, batches)

    def _end(self, job: ActiveJob, reason: str, error: str | None = None) -> None:
        """The active job's grant ends with its request: release the session."""
        request = job.request
        self.active = None
        if job.slices_run:
            self.grant_log.append((request.request_id, job.slices_run))
        try:
            self.runner.spec_finish(request.request_id)
        except Exception as exc:  # noqa: BLE001
            reason, error = "error", error or f"spec_finish failed: {exc}"
        self.policy.session_done(request.spec.num_slot_rounds)
        self.gate.forget(request.request_id)
        self.sink.finish(request, reason, error=error, phase=job.cancel_phase)

    # -- cancellation and shutdown ---------------------------------------------------
    def release_finished(self, is_unfinished: Callable[[str], bool]) -> None:
        """Release the sessions of requests already finished (a tick that failed after
        finishing one left its session here): they must not run another round."""
        if self.active is not None and not is_unfinished(self.active.request.request_id):
            self._end(self.active, "cancelled")
        for entry in self.backlog.entries():
            if not is_unfinished(entry.request.request_id):
                self.backlog.remove(entry.request.request_id)
                self._abort(entry)

    def cancel(self, request: Request) -> bool:
        """Cancel a request the slot holds (active, parked or waiting); its session is
        released now. False if the slot does not hold it."""
        if self.active is not None and self.active.request is request:
            self._end(self.active, "cancelled")
            return True
        entry = self.backlog.remove(request.request_id)
        if entry is None:
            return False
        self._abort(entry)
        return True

    def _abort(self, entry: BacklogEntry) -> None:
        """Drop a cancelled backlog entry taken out of the ring: release its session."""
        if entry.kind is EntryKind.PARKED:
            self.runner.spec_finish(entry.request.request_id)
        self.counters.backlog_aborts += 1
        self.sink.finish(entry.request, "cancelled")

    def snapshot(self) -> dict:
        job = self.active
        return {
            "owner": None
            if job is None
            else {
                "request_id": job.request.request_id,
                "lane": job.request.lane.name.lower(),
                "slices_run": job.slices_run,
                "budget": job.budget,
                "started": job.started,
            },
            "backlog": self.backlog.snapshot(),
            **self.gate.snapshot(),
            "backlog_peak": self.counters.backlog_peak,
            "grant_log_tail": [list(item) for item in list(self.grant_log)[-32:]],
        }
