"""A scripted fake `ModelRunner`: no model, deterministic tokens, strict protocol checks.

Tokens are a function of (prompt, position) on every path, so classic, sliced, burst
and rotated streams of one request are comparable. The fake enforces the drafter
handoff: `spec_begin` / `spec_resume` need a free drafter, `spec_round` / `spec_park`
need the caller to hold it, so a wedged or double-booked slot fails the test.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from scheduler.model_api import Interrupted, RoundOutcome, TokenBatch
from scheduler.request import Request

MODEL_ACTIONS = ("classic_prefill", "classic_decode", "spec_begin", "spec_round", "spec_round_with_decode")


def token_at(request: Request, position: int) -> int:
    return (sum(request.prompt_ids) * 31 + 7 * position) % 997 + 3


class ProtocolError(AssertionError):
    pass


@dataclass
class FakeSession:
    request: Request
    parked: bool = False


class FakeRunner:
    def __init__(
        self,
        *,
        round_tokens: int = 2,
        num_draft_tokens: int = 4,
        unsupported: tuple[str, ...] = (),
        round_seconds: float = 0.010,
        probe_seconds: float = 0.010,
        key: str = "fake|fake|cpu|4",
        fuse: bool = False,
        tick_costs=None,
    ) -> None:
        """`fuse`: the runner can carry the classic decode in a round's forward;
        `tick_costs`: what it reports as measured forward costs (None: not measured)."""
        self.round_tokens = round_tokens
        self.num_draft_tokens = num_draft_tokens
        self.unsupported = set(unsupported)
        self.round_seconds = round_seconds
        self.probe_seconds = probe_seconds
        self.key = key
        self.sessions: dict[str, FakeSession] = {}
        self.drafter_holder: str | None = None
        self.rows: dict[str, Request] = {}
        self.actions: list[tuple[str, tuple[str, ...]]] = []  # model actions, in order
        self.calls: list[tuple[str, str]] = []  # bookkeeping calls (park/resume/finish/remove)
        self.fail_on: set[tuple[str, str]] = set()  # (method, request_id) that raise
        self.adopt_moves_lone_row = False
        self.fuse = fuse
        self.costs = tick_costs
        self.spec_off_reason = None
        self.fuse_blocker = None if fuse else "a fake runner built without fuse"
        # Rows that draft: with `row_draft_tokens` > 0 and a step asked for drafts, every
        # row emits that many tokens more, reported as accepted drafts.
        self.row_draft_tokens = 0
        # Decode steps that stop part-way (`classic_decode`'s `interrupt`).
        self.interruptible = False
        self.on_decode = None
        self.interrupts_offered: list[bool] = []  # per decode call: was `interrupt` given
        self.row_drafts_like_slot = False
        self.sampled_row_drafts = False
        self.draft_flags: list[bool] = []  # the `drafts` argument of every decode step
        self.prefix_stats: dict | None = None  # what `prefix_cache_stats` reports
        self.step_stats: dict | None = None  # what `classic_step_stats` reports
        # A prefill given `between` and a piece runs this many forwards, calling
        # `on_prefill_forward` (what happens while one runs) then `between` after each
        # but the last; its rows join `rows` after the last.
        self.prefill_forwards = 1
        self.on_prefill_forward = None
        self.cached_prompt: dict[str, int] = {}  # request id -> prompt positions held (`classic_prefill_fits`)

    # -- helpers ------------------------------------------------------------------------
    def _emit(self, request: Request, count: int) -> tuple[list[int], str | None]:
        done = len(request.output_ids)
        room = request.sampling.max_tokens - done
        tokens = []
        for i in range(min(count, room)):
            token = token_at(request, done + i)
            tokens.append(token)
            if token in request.sampling.stop_token_ids:
                return tokens, "stop"
        finish = "length" if done + len(tokens) >= request.sampling.max_tokens else None
        return tokens, finish

    def _maybe_fail(self, method: str, request_id: str) -> None:
        if (method, request_id) in self.fail_on:
            raise RuntimeError(f"scripted failure in {method}({request_id})")

    # -- classic ----------------------------------------------------------------------
    def classic_prefill(self, requests, between=None, piece=0):
        self.actions.append(("classic_prefill", tuple(r.request_id for r in requests)))
        out = []
        for request in requests:
            if request.request_id in self.rows or request.request_id in self.sessions:
                raise ProtocolError(f"{request.request_id} admitted twice")
        for _ in range(self.prefill_forwards - 1 if between is not None and piece > 0 else 0):
            if self.on_prefill_forward is not None:
                self.on_prefill_forward()
            between()
        for request in requests:
            self._maybe_fail("classic_prefill", request.request_id)
            self.rows[request.request_id] = request
            tokens, finish = self._emit(request, 1)
            out.append(TokenBatch(request.request_id, tokens, finish))
        return out

    def classic_prefill_fits(self, request, piece):
        return len(request.prompt_ids) - self.cached_prompt.get(request.request_id, 0) <= piece

    def classic_decode(self, drafts=False, skip_cap=2, interrupt=None):
        """With `interruptible`, stops where `interrupt` (asked once, after `on_decode`,
        which stands for whatever happens while the step's first layers run) says so."""
        self.interrupts_offered.append(interrupt is not None)
        if self.on_decode is not None:
            self.on_decode()
        if not self.rows:
            raise ProtocolError("decode without rows")
        if self.interruptible and interrupt is not None and interrupt():
            self.actions.append(("classic_decode_interrupted", tuple(self.rows)))
            raise Interrupted
        self.actions.append(("classic_decode", tuple(self.rows)))
        return self._rows_step(drafts)

    def _rows_step(self, drafts):
        self.draft_flags.append(drafts)
        extra = self.row_draft_tokens if drafts else 0
        out = []
        for request in self.rows.values():
            tokens, finish = self._emit(request, 1 + extra)
            accepted = len(tokens) - 1
            out.append(TokenBatch(request.request_id, tokens, finish, extra, accepted))
        return out

    def classic_remove(self, request_id):
        self.calls.append(("classic_remove", request_id))
        self.rows.pop(request_id, None)

    def num_classic_rows(self):
        return len(self.rows)

    def prefix_cache_stats(self):
        return self.prefix_stats

    def classic_step_stats(self):
        return self.step_stats

    # -- speculative --------------------------------------------------------------------
    def spec_supports(self, request):
        return request.request_id not in self.unsupported

    def spec_begin(self, request):
        self.actions.append(("spec_begin", (request.request_id,)))
        self._maybe_fail("spec_begin", request.request_id)
        if self.drafter_holder is not None:
            raise ProtocolError(f"spec_begin({request.request_id}) while {self.drafter_holder} holds the drafter")
        if request.request_id in self.sessions:
            raise ProtocolError(f"second session for {request.request_id}")
        self.sessions[request.request_id] = FakeSession(request)
        self.drafter_holder = request.request_id
        tokens, finish = self._emit(request, 1)
        return TokenBatch(request.request_id, tokens, finish)

    def spec_round(self, request_id, probe=False):
        self.actions.append(("spec_round", (request_id,)))
        self._maybe_fail("spec_round", request_id)
        if self.drafter_holder != request_id:
            raise ProtocolError(f"spec_round({request_id}) but {self.drafter_holder} holds the drafter")
        request = self.sessions[request_id].request
        tokens, finish = self._emit(request, 1 if probe else self.round_tokens)
        drafted = 0 if probe else self.num_draft_tokens
        accepted = max(0, len(tokens) - 1) if not probe else 0
        seconds = self.probe_seconds if probe else self.round_seconds
        return RoundOutcome(request_id, tokens, finish, drafted, accepted, probe, seconds)

    def can_fuse(self):
        return self.fuse

    def rows_draft_like_slot(self, greedy):
        return self.row_drafts_like_slot and (greedy or self.sampled_row_drafts)

    def slot_drafts_vary(self):
        return False

    def shadow_index(self, history):
        return None  # no shadow rounds unless a test sets one

    def tick_costs(self):
        return self.costs if self.fuse else None

    def spec_round_with_decode(self, request_id, drafts=False, skip_cap=2):
        """A round and a decode step as ONE model action (one entry in `actions`)."""
        if not self.fuse:
            raise ProtocolError("spec_round_with_decode on a runner that cannot fuse")
        if not self.rows:
            raise ProtocolError("spec_round_with_decode without rows")
        self.actions.append(("spec_round_with_decode", (request_id, *self.rows)))
        self._maybe_fail("spec_round_with_decode", request_id)
        before = len(self.actions)
        outcome = self.spec_round(request_id)
        rows = self.classic_decode(drafts)
        del self.actions[before:]  # the two halves are the one action recorded above
        outcome.fused = True
        return outcome, rows

    def spec_park(self, request_id):
        self.calls.append(("spec_park", request_id))
        if self.drafter_holder != request_id:
            raise ProtocolError(f"spec_park({request_id}) but {self.drafter_holder} holds the drafter")
        self.drafter_holder = None
        self.sessions[request_id].parked = True

    def spec_resume(self, request_id):
        self.calls.append(("spec_resume", request_id))
        self._maybe_fail("spec_resume", request_id)
        session = self.sessions.get(request_id)
        if session is None or not session.parked:
            raise ProtocolError(f"spec_resume({request_id}) of a session that is not parked")
        if self.drafter_holder is not None:
            raise ProtocolError(f"spec_resume({request_id}) while {self.drafter_holder} holds the drafter")
        session.parked = False
        self.drafter_holder = request_id

    def spec_finish(self, request_id):
        self.calls.append(("spec_finish", request_id))
        self.sessions.pop(request_id, None)
        if self.drafter_holder == request_id:
            self.drafter_holder = None

    def spec_to_classic(self, request_id):
        """Demote a started session to a classic row. With `adopt_moves_lone_row`, a
        lone classic row emits its next token on the way, like the real adapter's
        lone row moving into the batch."""
        self.calls.append(("spec_to_classic", request_id))
        self._maybe_fail("spec_to_classic", request_id)
        session = self.sessions.get(request_id)
        if session is None:
            raise ProtocolError(f"spec_to_classic({request_id}) without a session")
        if request_id in self.rows:
            raise ProtocolError(f"{request_id} admitted twice")
        if not session.parked and self.drafter_holder != request_id:
            raise ProtocolError(f"spec_to_classic({request_id}) of an active session without the drafter")
        moved = []
        if self.adopt_moves_lone_row and len(self.rows) == 1:
            (other,) = self.rows.values()
            tokens, finish = self._emit(other, 1)
            moved.append(TokenBatch(other.request_id, tokens, finish))
        del self.sessions[request_id]
        if self.drafter_holder == request_id:
            self.drafter_holder = None
        self.rows[request_id] = session.request
        return moved

    def spec_park_to_classic(self, request_id):
        self.calls.append(("spec_park_to_classic", request_id))
        self._maybe_fail("spec_park_to_classic", request_id)
        if self.drafter_holder != request_id:
            raise ProtocolError(f"spec_park_to_classic({request_id}) but {self.drafter_holder} holds the drafter")
        return self.spec_to_classic(request_id)

    def classic_to_spec(self, request):
        """Promote a row: it emits the token it had drawn, then holds the drafter."""
        request_id = request.request_id
        self.calls.append(("classic_to_spec", request_id))
        self._maybe_fail("classic_to_spec", request_id)
        if request_id not in self.rows:
            raise ProtocolError(f"classic_to_spec({request_id}) of a request that is not a row")
        if self.drafter_holder is not None:
            raise ProtocolError(f"classic_to_spec({request_id}) while {self.drafter_holder} holds the drafter")
        tokens, finish = self._emit(request, 1)
        del self.rows[request_id]
        if finish:
            return [TokenBatch(request_id, tokens, finish)], False
        self.sessions[request_id] = FakeSession(request)
        self.drafter_holder = request_id
        return [TokenBatch(request_id, tokens, None)], True

    def num_live_sessions(self):
        return len(self.sessions)

    def policy_key(self):
        return self.key


class SlowRunner(FakeRunner):
    """Each model action takes a little wall time, so requests overlap."""

    def __init__(self, delay=0.002, **kw):
        super().__init__(**kw)
        self.delay = delay
        self.thread_ids = set()

    def _note(self):
        self.thread_ids.add(threading.get_ident())
        time.sleep(self.delay)

    def spec_begin(self, request):
        self._note()
        return super().spec_begin(request)

    def spec_round(self, request_id, probe=False):
        self._note()
        return super().spec_round(request_id, probe)

    def classic_decode(self, drafts=False, skip_cap=2, interrupt=None):
        self._note()
        return super().classic_decode(drafts, skip_cap, interrupt)
