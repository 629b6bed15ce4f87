"""`CancelInjector`: cancels soak requests from inside the engine's tick (scripts/bench/soak.py)."""

from __future__ import annotations


class CancelInjector:
    """A `ModelRunner` wrapper that cancels chosen requests from inside the tick.

    `engine.cancel` only flags the request and queues the id (it takes the engine's
    input lock, not the tick's state lock), so calling it on the engine thread mid-tick
    is the same as a client's cancel arriving at that instant; it takes effect at the
    next tick's drain. Prefill targets are cancelled while their prefill runs. Classic
    row, active, parked, waiting and queued targets are cancelled during a classic
    action, which leaves the slot and the queues untouched, so they are still in that
    phase at the drain (waiters and queued requests are read from the scheduler's
    state, on the engine thread). Also tracks the peak number of live speculative
    sessions after every slot call.
    """

    def __init__(self, runner) -> None:
        self._runner = runner
        self.engine = None
        self.targets: dict[str, str] = {}  # request id -> phase still to cancel it in
        self._rows: set[str] = set()
        self._active: str | None = None
        self._parked: set[str] = set()
        self.peak_live_sessions = 0

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def try_cancel(self, request_id: str, phase: str) -> None:
        """Cancel `request_id` if it is still targeted at `phase` (once; thread-safe)."""
        if self.targets.get(request_id) == phase and self.targets.pop(request_id, None):
            self.engine.cancel(request_id)

    def _classic_tick(self) -> None:
        for rid in list(self._rows):
            self.try_cancel(rid, "classic")
        for rid in list(self._parked):
            self.try_cancel(rid, "parked")
        if self._active is not None:
            self.try_cancel(self._active, "active")
        if self.engine is not None and {"waiting", "queued"} & set(self.targets.values()):
            state = self.engine.snapshot_in_tick()
            for entry in state.get("slot", {}).get("backlog", []):
                if entry["kind"] == "waiting":
                    self.try_cancel(entry["request_id"], "waiting")
            for rid in state.get("queued_ids", []):
                self.try_cancel(rid, "queued")

    def _observe(self) -> None:
        self.peak_live_sessions = max(self.peak_live_sessions, self._runner.num_live_sessions())

    def classic_prefill(self, requests, between=None, piece=0):
        self._classic_tick()
        for r in requests:
            self.try_cancel(r.request_id, "prefill")
        self._rows.update(r.request_id for r in requests)
        return self._runner.classic_prefill(requests, between, piece)

    def classic_decode(self, drafts=False, skip_cap=2, interrupt=None):
        self._classic_tick()
        return self._runner.classic_decode(drafts, skip_cap, interrupt)

    def classic_remove(self, request_id):
        self._rows.discard(request_id)
        return self._runner.classic_remove(request_id)

    def spec_begin(self, request):
        self.try_cancel(request.request_id, "prefill")
        out = self._runner.spec_begin(request)
        self._active = request.request_id
        self._observe()
        return out

    def spec_park(self, request_id):
        self._runner.spec_park(request_id)
        self._active = None
        self._parked.add(request_id)

    def spec_resume(self, request_id):
        self._runner.spec_resume(request_id)
        self._parked.discard(request_id)
        self._active = request_id
        self._observe()

    def spec_finish(self, request_id):
        self._runner.spec_finish(request_id)
        self._parked.discard(request_id)
        if self._active == request_id:
            self._active = None
