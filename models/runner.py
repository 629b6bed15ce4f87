"""`MlxRunner`: the `scheduler.runner.ModelRunner` protocol over mlx-lm.

Classic rows go through `models.batch_adapter.ClassicBatch`; speculative requests get a
`SpeculativeSession` each, and the one drafter handle moves between them through a
`DrafterSlot`. All calls must come from one thread (MLX streams are thread-local).
"""

from __future__ import annotations

import logging
import platform
import time
from typing import Sequence

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from models import bucketed, cache_rollback, prefix_cache, ragged, slab, tick_costs
from models.batch_adapter import ClassicBatch
from models.ragged_batch import RaggedBatch
from models.drafters import Drafter, DraftModelDrafter, DrafterSlot, NgramDrafter
from models.grammar import Grammars
from models.loader import LoadedModel, load_pair
from models.sampling import supports_sampling
from models.session import PROBE_TOKENS, SpeculativeSession
from scheduler.request import Request, SamplingParams
from scheduler.costs import TickCosts
from scheduler.runner import RoundOutcome, TokenBatch

log = logging.getLogger(__name__)

DRAFTER_KINDS = ("draft_model", "ngram")
SPEC_OFF_NO_ROLLBACK = "the target's cache cannot be rolled back"
# Per-tick time a lone classic row may keep decoding: on an H200 a bundled-model step is
# ~1.4 ms and an engine tick's own work ~0.05-0.1 ms, so ~3 steps per tick make that
# overhead a few percent; on CPU a step takes longer than this and a tick stays one step.
DEFAULT_CLASSIC_BURST_MS = 4.0


def hardware_name() -> str:
    """e.g. "cpu-x86_64" or "gpu-arm64"."""
    device = mx.default_device()
    kind = getattr(getattr(device, "type", None), "name", None) or str(device)
    return f"{kind}-{platform.machine()}"


class MlxRunner:
    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None,
        *,
        num_draft_tokens: int = 4,
        max_batch_size: int = 16,
        prefill_batch_size: int = 8,
        fast_verify: bool = False,
        warm_positions: int | None = None,
        prefill_chunk: int = bucketed.DEFAULT_PREFILL_CHUNK,
        warm_session: bool = True,
        classic_burst_ms: float = DEFAULT_CLASSIC_BURST_MS,
        draft_fingerprint: str = "",
        ragged: bool | None = None,
        row_drafts: bool = True,
        prefix_cache_bytes: int | None = 0,
    ):
        """`fast_verify`: speculative rounds through `models.bucketed` (shape-stable,
        compiled forwards; one host sync per round): the fastest lone stream on a GPU,
        but its verify cannot ride in the batch's forward, so classic rows stall behind
        it (mlx-lm's `BatchGenerator` and the alternating tick). Off by default: the
        slab's grid forwards keep shapes stable on a GPU too (docs/gpu.md).
        `warm_positions`: with fast_verify, compile the shapes of contexts up to this
        many positions at load (None = min(max_context, 2048); 0 = lazily).
        `prefill_chunk`: with fast_verify, a session's prefill (target and draft model)
        runs in compiled chunks of this many positions (0 = plain mlx-lm prefill).
        `warm_session`: `warm` also runs throwaway requests end to end (see there).
        `classic_burst_ms`: a classic row decoding alone keeps stepping within one
        `classic_decode` call until this much time has passed (several tokens per tick
        when steps are fast; 0 = one token per call). `draft_fingerprint`: the draft
        model's content hash (`LoadedModel.fingerprint`), naming it in `policy_key`.
        `ragged`: classic rows and sessions in one slab (`models.ragged_batch`); None =
        whenever the verify can ride in the batch's forward (`fuse_blocker` is None),
        False = mlx-lm's `BatchGenerator` (`models.batch_adapter`) in every case.
        `row_drafts`: in a ragged batch, classic rows verify their own n-gram drafts
        where the measured costs say they pay (on only with a drafter configured).
        `prefix_cache_bytes`: budget of the KV prefix cache that classic rows and
        sessions of the ragged batch start from (`models.prefix_cache`); 0 = off (the
        default here, so scripts opt in), None = sized from the memory available now."""
        if num_draft_tokens < 1:
            raise ValueError("num_draft_tokens must be >= 1")
        self.target = target
        self.tokenizer = target.tokenizer
        self.eos_token_ids: list[int] = sorted(self.tokenizer.eos_token_ids)
        self.grammars = Grammars.for_tokenizer(self.tokenizer, self.eos_token_ids)  # constrained requests' compiler
        self.max_context = target.max_context
        self.num_draft_tokens = num_draft_tokens
        self._draft_fingerprint = draft_fingerprint
        # Rejected drafts must leave the target cache exactly; state-space and
        # recurrent layers (hybrid models) cannot give them back, so those decode classically.
        self.spec_off_reason: str | None = None  # why the slot serves nobody, when it does not
        if drafter is None:
            self.spec_off_reason = "no drafter configured"
        elif not cache_rollback.can_roll_back(make_prompt_cache(target.model)):
            self.spec_off_reason = SPEC_OFF_NO_ROLLBACK
            log.warning("speculation off: %s (target %s)", SPEC_OFF_NO_ROLLBACK, target.name)
        self._slot = DrafterSlot(drafter) if self.spec_off_reason is None else None
        self._sessions: dict[str, SpeculativeSession] = {}
        # Draft states of streams parked into the classic batch (fused tick), by request.
        self._parked_drafts: dict[str, object] = {}
        self._tick_costs: TickCosts | None = None
        self._classic_rows_cap = max_batch_size
        self._verifier = None
        self._warm_session = warm_session
        # Why the verify cannot ride in the classic batch's forward (None: it can).
        self.fuse_blocker: str | None = self.spec_off_reason
        if fast_verify and self._slot is not None and bucketed.supports(target.model):
            self._verifier = bucketed.BucketedForward(target.model, prefill_chunk=prefill_chunk)
            if isinstance(drafter, DraftModelDrafter) and drafter.fast is None:
                if bucketed.supports(drafter.model):
                    drafter.fast = bucketed.BucketedForward(drafter.model, prefill_chunk=prefill_chunk)
        if self._verifier is not None:
            self.fuse_blocker = "the slot verifies through the compiled GPU path (fast_verify)"
        elif self.fuse_blocker is None:
            self.fuse_blocker = slab.check_support(target.model)
        # Where the verify can ride in the batch's forward, classic rows and sessions
        # share one slab (`models.ragged_batch`): moving a stream between them moves no keys.
        if ragged and self.fuse_blocker is not None:
            raise ValueError(f"a ragged batch needs a verify that rides in it: {self.fuse_blocker}")
        batch_kind = RaggedBatch if self.fuse_blocker is None and ragged is not False else ClassicBatch
        extra = {}
        if batch_kind is RaggedBatch:
            extra = dict(row_drafts=row_drafts and self._slot is not None, num_draft_tokens=num_draft_tokens,
                         prefix_cache=_make_prefix_cache(prefix_cache_bytes))
        elif prefix_cache_bytes != 0:
            log.info("prefix cache off: it needs the slab batch (%s)", self.fuse_blocker)
        self._classic = batch_kind(
            target.model,
            eos_token_ids=self.eos_token_ids,
            max_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
            solo_burst_s=classic_burst_ms / 1000.0,
            grammars=self.grammars,
            **extra,
        )
        if batch_kind is RaggedBatch and self._classic.row_drafts:
            self._classic.costs = self.tick_costs()  # what a verify position costs, at load
        if self._verifier is not None:
            if warm_positions is None:
                warm_positions = min(self.max_context, 2048)
            if warm_positions > 0:
                self.warm(warm_positions)

    @property
    def _ragged(self) -> bool:
        return isinstance(self._classic, RaggedBatch)

    @property
    def fast_verify(self) -> bool:
        return self._verifier is not None

    def warm(self, max_positions: int) -> int:
        """Compile the fast path's shapes for contexts up to `max_positions`: verifies of
        1 and K + 1 positions (logits for sampled requests, greedy tokens for greedy
        ones), draft steps (greedy tokens, and logits for sampled drafts), prefill chunks of target and draft. Returns the shape count. With `warm_session`, then also runs
        throwaway requests through begin, a probe round and full rounds (greedy and
        sampled), so what the shapes do not cover (library handles, kernels of the first
        use, the sampler) is paid here and not by the first real request."""
        if self._verifier is None:
            return 0
        tic = time.perf_counter()
        log.info("warming the compiled verify for contexts up to %d positions (MLX compiles each shape once)",
                 max_positions)
        verify_widths = (1, self.num_draft_tokens + 1)  # 1: a request's last-token round
        count = self._verifier.warm(verify_widths, max_positions)  # sampled requests
        count += self._verifier.warm(verify_widths, max_positions, head="every")  # greedy ones
        chunk = self._verifier.prefill_chunk
        if chunk:
            count += self._verifier.warm((chunk,), max_positions, head="last")
        drafter = self._slot.drafter
        if isinstance(drafter, DraftModelDrafter) and drafter.fast is not None:
            # Catch-up feeds: 1-2 tokens after a round, PROBE_TOKENS + 1-2 after a probe.
            lengths = (1, 2, PROBE_TOKENS + 1, PROBE_TOKENS + 2)
            if drafter.sample_drafts:  # sampled requests draft from the logits
                count += drafter.fast.warm(lengths, max_positions)
            lengths += (drafter.fast.prefill_chunk,) if drafter.fast.prefill_chunk else ()
            count += drafter.fast.warm(lengths, max_positions, head="last")
        log.info("compiled %d shapes in %.1f s", count, time.perf_counter() - tic)
        if self._warm_session:
            tic = time.perf_counter()
            self._run_warm_requests()
            log.info("warm requests ran in %.1f s", time.perf_counter() - tic)
        return count

    def _run_warm_requests(self) -> None:
        if self._slot.holder is not None:  # only at load, before any request holds the slot
            return
        prompt = list(self.tokenizer.encode("def warm(x):\n    return x + 1\n"))[:16] or [1]
        n = 2 * (self.num_draft_tokens + 1) + 2
        for i, params in enumerate((SamplingParams(max_tokens=n),
                                    SamplingParams(max_tokens=n, temperature=0.7, top_p=0.9, seed=0))):
            request = Request(f"__warm{i}", prompt, params)
            if not self.spec_supports(request):
                return
            try:
                if self.spec_begin(request).finish_reason is None:
                    reason = self.spec_round(request.request_id, probe=True).finish_reason
                    while reason is None:
                        reason = self.spec_round(request.request_id).finish_reason
            finally:
                self.spec_finish(request.request_id)

    @classmethod
    def from_paths(
        cls,
        target_path: str,
        *,
        drafter_kind: str | None = "draft_model",
        drafter_path: str | None = None,
        num_draft_tokens: int = 4,
        max_batch_size: int = 16,
        prefill_batch_size: int = 8,
        fast_verify: bool = False,
        warm_positions: int | None = None,
        classic_burst_ms: float = DEFAULT_CLASSIC_BURST_MS,
        ragged: bool | None = None,
        row_drafts: bool = True,
        prefix_cache_bytes: int | None = 0,
    ) -> "MlxRunner":
        """Load models and build the runner; raises `ModelLoadError` / `ValueError`."""
        if drafter_kind not in (None, *DRAFTER_KINDS):
            raise ValueError(f"drafter_kind must be one of {DRAFTER_KINDS} or None, got {drafter_kind!r}")
        if drafter_kind == "draft_model" and not drafter_path:
            raise ValueError("drafter_kind 'draft_model' needs drafter_path")
        target, draft = load_pair(target_path, drafter_path if drafter_kind == "draft_model" else None)
        drafter: Drafter | None = None
        if drafter_kind == "draft_model":
            drafter = DraftModelDrafter(draft.model, draft.name)
        elif drafter_kind == "ngram":
            drafter = NgramDrafter()
        return cls(
            target,
            drafter,
            num_draft_tokens=num_draft_tokens,
            max_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
            fast_verify=fast_verify,
            warm_positions=warm_positions,
            classic_burst_ms=classic_burst_ms,
            draft_fingerprint=draft.fingerprint if draft is not None else "",
            ragged=ragged,
            row_drafts=row_drafts,
            prefix_cache_bytes=prefix_cache_bytes,
        )

    # -- classic --------------------------------------------------------------------
    def classic_prefill(self, requests: Sequence[Request]) -> list[TokenBatch]:
        return self._classic.prefill(requests)

    def classic_decode(self, drafts: bool = False) -> list[TokenBatch]:
        return self._classic.decode(drafts=drafts)

    def classic_remove(self, request_id: str) -> None:
        self._classic.remove(request_id)

    def num_classic_rows(self) -> int:
        return self._classic.num_rows()

    def prefix_cache_stats(self) -> dict | None:
        cache = getattr(self._classic, "prefix_cache", None)
        return None if cache is None else cache.stats()

    # -- speculative ----------------------------------------------------------------
    def spec_supports(self, request: Request) -> bool:
        """False without a drafter, for an empty prompt, unsupported sampling options, or
        when prompt + max_tokens (+ one round's drafts) would exceed the context."""
        p = request.sampling
        return (
            self._slot is not None
            and len(request.prompt_ids) > 0
            and supports_sampling(p)
            and len(request.prompt_ids) + p.max_tokens + self.num_draft_tokens <= self.max_context
        )

    def spec_begin(self, request: Request) -> TokenBatch:
        if not self.spec_supports(request):
            raise ValueError(f"request {request.request_id!r} cannot take the speculative slot")
        if request.request_id in self._sessions:
            raise ValueError(f"request {request.request_id!r} already has a session")
        session = SpeculativeSession(
            request.request_id,
            self.target.model,
            request.prompt_ids,
            request.sampling,
            num_draft_tokens=self.num_draft_tokens,
            eos_token_ids=self.eos_token_ids,
            verifier=self._verifier,
            new_cache=self._session_cache_for(request) if self._ragged else None,
            grammars=self.grammars,
        )
        session.bind(self._slot.take(request.request_id))
        self._sessions[request.request_id] = session
        result = session.begin()
        return TokenBatch(request.request_id, result.token_ids, result.finish_reason)

    def _session_cache_for(self, request: Request):
        """A session's `new_cache`: a slab row starting from the prompt's cached prefix."""
        def new_cache() -> list:
            cache = self._classic.new_session_cache(request.prompt_ids)
            request.num_cached_tokens = cache[0].offset
            return cache
        return new_cache

    def spec_round(self, request_id: str, probe: bool = False) -> RoundOutcome:
        session = self._sessions[request_id]
        if not probe and self._slot.holder != request_id:
            raise RuntimeError(f"session {request_id!r} does not hold the drafter")
        tic = time.perf_counter()
        result = session.step(probe=probe)  # ends in .tolist(): outputs are evaluated
        seconds = time.perf_counter() - tic
        return RoundOutcome(
            request_id,
            result.token_ids,
            result.finish_reason,
            result.num_drafted,
            result.num_accepted,
            probe,
            seconds,
            result.seconds_per_token,
            drafter=self._slot.drafter.kind,
        )

    def can_fuse(self) -> bool:
        return self.fuse_blocker is None

    def rows_draft_like_slot(self) -> bool:
        return (self._ragged and self._classic.row_drafts
                and isinstance(self._slot.drafter, NgramDrafter))

    def tick_costs(self) -> TickCosts | None:
        """Decode and fused forward costs on this machine (`models.tick_costs`),
        measured on the first call (about a second on a CPU with the bundled pair)."""
        if not self.can_fuse():
            return None
        if self._tick_costs is None:
            vocab = getattr(getattr(self.target.model, "args", None), "vocab_size", 256)
            self._tick_costs = tick_costs.measure(self.target.model, self._slot.drafter, self.num_draft_tokens,
                                                  self._classic_rows_cap, vocab)
        return self._tick_costs

    def spec_round_with_decode(self, request_id: str, drafts: bool = False) -> tuple[RoundOutcome, list[TokenBatch]]:
        """The holder's round and one decode step of every classic row in one forward:
        the verify tokens ride in the batch's step (`models.ragged.Rider`). When the
        batch runs no forward (a lone row emitting its last token), the verify runs
        alone."""
        if not self.can_fuse():
            raise RuntimeError(f"the verify cannot ride in the batch: {self.fuse_blocker}")
        session = self._sessions[request_id]
        if self._slot.holder != request_id:
            raise RuntimeError(f"session {request_id!r} does not hold the drafter")
        tic = time.perf_counter()
        tokens = session.prepare_round()
        rider = ragged.Rider(self.target.model, ragged.Group(session.cache, mx.array(tokens, dtype=mx.int32)))
        rows = self._classic.decode(rider, drafts=drafts)
        logits = rider.extra_logits
        if logits is None:
            logits = session.forward(tokens)
        result = session.complete_round(tokens, logits, tic)
        outcome = RoundOutcome(request_id, result.token_ids, result.finish_reason, result.num_drafted,
                               result.num_accepted, False, time.perf_counter() - tic, fused=True,
                               drafter=self._slot.drafter.kind)
        return outcome, rows

    def spec_park_to_classic(self, request_id: str) -> list[TokenBatch]:
        """Park the holder into the classic batch (the fused tick's park): its stream
        goes on as a classic row (`spec_to_classic`), and its draft state is kept for
        its next grant, which catches the drafter up on what the row decoded."""
        session = self._sessions[request_id]
        draft_state = session.draft_state if session._draft_ready else None
        moved = self.spec_to_classic(request_id)
        if draft_state is not None:
            self._parked_drafts[request_id] = draft_state
        return moved

    def classic_to_spec(self, request: Request) -> tuple[list[TokenBatch], bool]:
        """Promote a classic row into the slot: the row leaves the batch (its next token
        is emitted on the way, `ClassicBatch.extract`) and a session continues it with
        the drafter, from its parked draft state if it has one. Returns the tokens
        emitted on the way and whether the session started (False: that token ended
        the request, which is then no longer a row). Not a model action."""
        request_id = request.request_id
        if self._slot is None:
            raise RuntimeError("no drafter: a classic row cannot take the slot")
        emitted, live = self._classic.extract(request_id)
        draft_state = self._parked_drafts.pop(request_id, None)
        if live is None:
            return [emitted], False
        session = SpeculativeSession.from_live(
            request_id, self.target.model, request.prompt_ids, [*request.output_ids, *emitted.token_ids],
            request.sampling, live.cache, live.sampler, num_draft_tokens=self.num_draft_tokens,
            eos_token_ids=self.eos_token_ids, draft_state=draft_state)
        session.bind(self._slot.take(request_id))
        self._sessions[request_id] = session
        return [emitted], True

    def spec_park(self, request_id: str) -> None:
        self._sessions[request_id].unbind()
        self._slot.return_(request_id)

    def spec_resume(self, request_id: str) -> None:
        session = self._sessions[request_id]
        session.bind(self._slot.take(request_id))

    def spec_finish(self, request_id: str) -> None:
        self._parked_drafts.pop(request_id, None)
        session = self._sessions.pop(request_id, None)
        if session is not None:
            if self._ragged and session.cache is not None:
                self._classic.release(session.cache, session.history)
            session.finish()
        if self._slot is not None:
            self._slot.return_(request_id)

    def spec_to_classic(self, request_id: str) -> list[TokenBatch]:
        """Demote a live session (active or parked) to a classic row: the drafter goes
        back to the slot and the draft state is dropped; the target cache, the sampler
        and the pending token become the row (`ClassicBatch.adopt`), so the stream goes
        on exactly where it was. Returns tokens other rows emitted on the way."""
        session = self._sessions[request_id]
        if session.cache is None or session.finished:
            raise RuntimeError(f"session {request_id!r} is not running")
        moved = self._classic.adopt(
            request_id, session.cache, session.sampler, session.history[-1],
            max_tokens=session.max_tokens, num_emitted=session.num_emitted, stop_ids=session.stop_ids,
            history=session.history[:-1])
        del self._sessions[request_id]
        session.cache = None  # the classic row owns it now
        session.finish()
        self._slot.return_(request_id)
        return moved

    def num_live_sessions(self) -> int:
        """Sessions plus the draft states of streams parked into the classic batch."""
        return len(self._sessions) + len(self._parked_drafts)

    def session(self, request_id: str) -> SpeculativeSession:
        return self._sessions[request_id]

    def policy_key(self) -> str:
        """Names models by content, so a verdict survives moving or renaming a model
        directory and is not reused for a different model under the same name."""
        if self._slot is None:
            drafter = "none:none"
        else:
            kind, name = self._slot.drafter.kind, self._slot.drafter.name
            drafter = f"{kind}:{self._draft_fingerprint or name}"
        target = self.target.fingerprint or self.target.name
        return f"{target}|{drafter}|{hardware_name()}|K={self.num_draft_tokens}"

    def close(self) -> None:
        for request_id in list(self._sessions):
            self.spec_finish(request_id)
        self._classic.close()


def _make_prefix_cache(budget_bytes: int | None) -> prefix_cache.PrefixCache | None:
    """None when off (0); None as the budget: sized from the memory available now."""
    if budget_bytes is None:
        budget_bytes = prefix_cache.default_budget(prefix_cache.available_memory())
        log.info("prefix cache: %.2f GiB (1/%d of the memory available, at most %d GiB)", budget_bytes / 2**30,
                 prefix_cache.DEFAULT_BUDGET_SHARE, prefix_cache.DEFAULT_BUDGET_CAP >> 30)
    return prefix_cache.PrefixCache(budget_bytes) if budget_bytes > 0 else None
