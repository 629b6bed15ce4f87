"""The `ModelRunner` protocol: what the scheduler asks of the model side.

The scheduler decides one action per tick and calls exactly one of the action methods
below (`classic_prefill`, `classic_decode`, `spec_begin`, `spec_round`,
`spec_round_with_decode`); the others are bookkeeping that runs no model forward. `models.runner.MlxRunner`
implements it over
mlx-lm; tests use scripted fakes. Every method is called from the engine thread only.

Token conventions: every token a method returns is final (already clipped to the
request's `max_tokens` and cut after a stop token) and `finish_reason` is set on the
batch that ends the request ("stop" or "length"). After a finished batch the scheduler
still calls `classic_remove` / `spec_finish` to release resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from scheduler.costs import TickCosts
from scheduler.request import Request, TokenLogprob


class Interrupted(Exception):
    """`classic_decode` gave up its step part-way because `interrupt` said so (a request
    arrived that can be admitted): no row gained a token or changed otherwise, and the
    same step runs again at a later tick."""


@dataclass
class TokenBatch:
    """Tokens one action produced for one request; a classic row that verified its own
    drafts in the step (`models.batch.slab_batch`) reports how many it drafted and accepted."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_drafted: int = 0
    num_accepted: int = 0
    drafter: str = ""  # the kind of drafter the row's drafts came from ("ngram")
    # One per token, for a request that asked (`SamplingParams.logprobs`); else None.
    logprobs: list[TokenLogprob] | None = None

    def extend(self, more: "TokenBatch") -> None:
        """Append a later step's batch of the same row (a burst of steps)."""
        self.token_ids += more.token_ids
        if more.logprobs is not None:
            self.logprobs = (self.logprobs or []) + more.logprobs
        self.finish_reason = more.finish_reason
        self.num_drafted += more.num_drafted
        self.num_accepted += more.num_accepted


@dataclass
class RoundOutcome:
    """Result of one speculative round (or probe round) of one session: the one record
    of a round, built by the session (`models.speculative.session`) and completed by the runner
    with what only it knows (`drafter`, `fused`); `Counters.record_round` tallies it.

    A round drafts `num_drafted` tokens, verifies them with one target forward and
    emits the `num_accepted` matching prefix plus one target token, so
    `len(token_ids) == num_accepted + 1` unless clipped by `max_tokens` or a stop token.
    A probe round drafts nothing and measures classic decode instead: it emits one or
    more tokens, decoded the classic way, and `seconds_per_token` is its steady-state
    time per token (None: use `seconds / len(token_ids)`).
    """

    request_id: str
    token_ids: list[int]
    finish_reason: str | None
    num_drafted: int
    num_accepted: int
    probe: bool
    seconds: float  # wall time of the round's model work, for the adaptive policy
    seconds_per_token: float | None = None
    fused: bool = False  # the verify rode in the classic batch's forward (its time is shared)
    drafter: str = ""  # the slot drafter's kind ("draft_model", "ngram")
    logprobs: list[TokenLogprob] | None = None  # one per token, for a request that asked


class ModelRunner(Protocol):
    # Why the slot serves nobody (None: it can), and why a verify cannot ride in the
    # batch's forward (None: it can); both shown in the scheduler snapshot.
    spec_off_reason: str | None
    fuse_blocker: str | None

    # -- classic continuous batching ------------------------------------------------
    def classic_prefill(
        self, requests: Sequence[Request], between: Callable[[], None] | None = None, piece: int = 0
    ) -> list[TokenBatch]:
        """Admit `requests` as classic rows and prefill them: one model action.

        Returns each new row's first token. May also return a token for existing rows
        if the backend's prefill step decodes them too. `between` (with `piece` > 0): a
        runner that can runs the prompts in forwards of at most `piece` positions a row
        (more while no earlier rows exist) and calls it between two of them; the caller
        steps earlier rows and a started session there (`classic_decode`, `spec_round`,
        `spec_round_with_decode`, and what a round boundary calls) and may admit others
        (`classic_prefill` of other requests, whose rows are in before these; a prefill
        called from `between` gets a `between` that admits nobody). The new rows are
        not rows until their prompts are in.
        """

    def classic_prefill_fits(self, request: Request, piece: int) -> bool:
        """Whether `classic_prefill` would compute `request`'s prompt (less the longest
        prefix the runner holds for it) in one forward of `piece` positions, or of the
        runner's shortest chunk where it does not split prompts that finely (a GPU's).
        Bookkeeping."""

    def classic_decode(
        self, drafts: bool = False, skip_cap: int = 2, interrupt: Callable[[], bool] | None = None
    ) -> list[TokenBatch]:
        """One batched decode step over all active classic rows: one model action.
        A runner may return several tokens for a row decoding alone (a short burst of
        steps that amortizes the per-tick overhead); each row's tokens are in order.
        With `drafts`, rows that can may verify their own drafts in the step and emit
        the accepted ones too (`TokenBatch.num_drafted` / `num_accepted`); where the
        step's draft budget cannot carry them all, rows share it in lane order, and a
        row denied drafts `skip_cap` steps running goes first. With `interrupt`, a
        runner may call it between the step's layers and, where it returns True, stop
        and raise `Interrupted` (the rows exactly as before the call); a runner that
        cannot stop part-way ignores it."""

    def classic_remove(self, request_id: str) -> None:
        """Drop a row (finished or cancelled). Idempotent."""

    def num_classic_rows(self) -> int: ...

    def classic_step_stats(self) -> dict | None:
        """The classic batch's decode steps so far and how many of them a step queued
        before them had drawn (`pipelined`: a grid slab's plain steps), for the snapshot;
        None for a batch that counts neither."""

    def prefix_cache_stats(self) -> dict | None:
        """The KV prefix cache's counters and bytes in use, for the snapshot; None
        without a cache. A runner with one sets `Request.num_cached_tokens` at admission."""

    # -- speculative slot -----------------------------------------------------------
    def spec_supports(self, request: Request) -> bool:
        """Whether the slot can serve this request at all (sampler options, prompt)."""

    def spec_begin(self, request: Request) -> TokenBatch:
        """Slice 0: create a session, take the drafter, prefill, return the first token."""

    def spec_round(self, request_id: str, probe: bool = False) -> RoundOutcome:
        """Run exactly one round of the session that holds the drafter."""

    def tick_costs(self) -> "TickCosts | None":
        """What a decode step and a fused step cost on this machine (measured once, on
        first use), for the fused tick's cost gate; None when the runner cannot fuse."""

    def can_fuse(self) -> bool:
        """Whether `spec_round_with_decode` runs one forward for both (the model passed
        the packed-forward check and the slot verifies on the plain path)."""

    def rows_draft_like_slot(self, greedy: bool) -> bool:
        """Whether classic rows of this kind (greedy, or sampled) verify drafts of the
        slot drafter's own kind in their decode steps (n-gram rows beside an n-gram
        slot): then the slot adds nothing beside rows for such a stream, and the fused
        tick's gate keeps it a row. Sampled rows draft only with `sampled_row_drafts`."""

    def slot_drafts_vary(self) -> bool:
        """Whether the slot drafter's rounds stop short of K by themselves (a draft model
        with `draft_confidence`), so the gate prices a round by the drafts rounds verify."""

    def shadow_index(self, history: Sequence[int]):
        """An index over `history` that proposes what the slot's drafter would (`extend`
        it with tokens, `propose(k)` drafts), for the scheduler's shadow rounds
        (`scheduler.shadow`); None when the drafter's drafts are not fixed tokens read off
        the text (a draft model): then the scheduler runs no shadow rounds."""

    def spec_round_with_decode(
        self, request_id: str, drafts: bool = False, skip_cap: int = 2
    ) -> tuple[RoundOutcome, list[TokenBatch]]:
        """One round of the drafter's holder and one decode step of every classic row,
        in one model forward: the fused tick's single model action. Returns the round
        (never a probe) and the rows' tokens, as `spec_round` and `classic_decode(drafts)` would."""

    def spec_park_to_classic(self, request_id: str) -> list[TokenBatch]:
        """The fused tick's park: the holder's stream goes on as a classic row, exactly
        (as `spec_to_classic`), and its draft state is kept for its next grant. Returns
        tokens other rows emitted on the way. Not a model action."""

    def classic_to_spec(self, request: Request) -> tuple[list[TokenBatch], bool]:
        """The fused tick's promotion of a classic row: it leaves the batch (emitting
        the token it had already drawn) and continues as the drafter's session, from
        its kept draft state if it was parked. Returns (tokens emitted on the way,
        started); started is False when that token ended the request. Not a model
        action."""

    def spec_park(self, request_id: str) -> None:
        """Return the drafter handle; the session keeps all its own state."""

    def spec_resume(self, request_id: str) -> None:
        """Re-take the drafter for a parked session and re-bind it."""

    def spec_finish(self, request_id: str) -> None:
        """Release a session (and the drafter if it holds it). Idempotent."""

    def spec_to_classic(self, request_id: str) -> list[TokenBatch]:
        """Demote a started, unfinished session (active or parked) to a classic row,
        exactly: its cache, sampler state and pending (already emitted) token become
        the row, the drafter returns to the slot, and the row's next token is the one
        the stream would have had as a classic row all along. Not a model action: it
        may queue the row's next forward, and may return tokens of another row that
        had to move on the way (apply them like `classic_decode`'s). The request is a
        classic row afterwards (`classic_decode`, `classic_remove`)."""

    def num_live_sessions(self) -> int: ...

    def policy_key(self) -> str:
        """`target|drafter|hardware|K`: the adaptive policy's persistence key."""
