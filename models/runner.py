"""`MlxRunner`: the `scheduler.model_api.ModelRunner` protocol over mlx-lm.

Classic rows go through `models.batch.generator_batch.GeneratorBatch`; speculative requests get a
`SpeculativeSession` each, and the one drafter handle moves between them through a
`DrafterSlot`. All calls must come from one thread (MLX streams are thread-local).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from models import runner_build
from models.batch.protocol import ClassicRows
from models.forward import bucketed, ragged, slab, tick_costs
from models.loading import dense_weights, draft_vocab, fused_projections
from models.loading.loader import LoadedModel, load_pair
from models.platform import _blas, device_memory, startup
from models.runner_build import hardware_name  # noqa: F401 (re-exported)
from models.runner_config import RunnerConfig
from models.sampling.grammar import Grammars
from models.sampling.samplers import supports_sampling
from models.speculative import cache_rollback
from models.speculative.drafter_kinds import DRAFTERS
from models.speculative.drafters import Drafter, DrafterSlot, NgramIndex
from models.speculative.replica_index import ReplicaIndex
from models.speculative.session import SpeculativeSession
from scheduler.costs import TickCosts
from scheduler.model_api import RoundOutcome, TokenBatch
from scheduler.request import Request

log = logging.getLogger(__name__)

SPEC_OFF_NO_ROLLBACK = "the target's cache cannot be rolled back"
DRAFT_WARM_POSITIONS = 2048  # `draft_compiled`: buckets compiled at load, up to this many positions


CPU_DRAFT_CONFIDENCE = 0.2  # `draft_confidence` on a CPU (docs/models.md, "Draft length by confidence")


def _draft_confidence(setting: float | None) -> float:
    """`draft_confidence`'s None: on a CPU, where a draft step's wait costs nothing."""
    if setting is not None:
        return setting
    return CPU_DRAFT_CONFIDENCE if mx.default_device() == mx.cpu else 0.0


def _draft_compiled(setting: bool | None) -> bool:
    """`draft_compiled`'s None: on a CPU, where compiling the draft's buckets takes a
    fraction of a second; a GPU builds kernels for each (`fast_verify` does that there)."""
    return mx.default_device() == mx.cpu if setting is None else setting


class MlxRunner:
    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None,
        config: RunnerConfig | None = None,
        *,
        draft_fingerprint: str = "",
        **knobs,
    ):
        """`config` (`models.runner_config.RunnerConfig`, which documents each knob), with
        `knobs` (its field names) overriding it: `MlxRunner(target, drafter,
        num_draft_tokens=3)`. `draft_fingerprint`: the draft model's content hash
        (`LoadedModel.fingerprint`), naming it in `policy_key`. `fast_verify` puts the
        speculative rounds through `models.forward.bucketed`; with `slab_batch` None classic rows and
        sessions share one slab whenever the verify can ride in the batch's forward."""
        config = dataclasses.replace(config or RunnerConfig(), **knobs)
        self.config = config
        num_draft_tokens, max_batch_size = config.num_draft_tokens, config.max_batch_size
        fast_verify, prefill_chunk = config.fast_verify, config.prefill_chunk
        self.target = target
        self.tokenizer = target.tokenizer
        self.eos_token_ids: list[int] = sorted(self.tokenizer.eos_token_ids)
        self.grammars = Grammars.for_tokenizer(self.tokenizer, self.eos_token_ids)  # constrained requests' compiler
        tic = time.perf_counter()
        with startup.phase("grammar index"):
            self.grammars.index()  # here, not at the first constrained request on the engine thread
        log.debug("grammar index of %d tokens built in %.2f s", len(self.tokenizer.vocab), time.perf_counter() - tic)
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
        # Why the verify cannot ride in the classic batch's forward (None: it can).
        self.fuse_blocker: str | None = self.spec_off_reason
        if fast_verify and self._slot is not None and bucketed.supports(target.model):
            self._verifier = bucketed.BucketedForward(target.model, prefill_chunk=prefill_chunk)
            drafter.compile_forwards(prefill_chunk)
        if self._verifier is None and self._slot is not None and drafter.kind == "draft_model":
            # Before the compile: its warm-up covers the heads the rounds will use.
            drafter.min_confidence = _draft_confidence(config.draft_confidence)
            if _draft_compiled(config.draft_compiled):
                with startup.phase("draft compile"):
                    drafter.compile_forwards(0)
                    drafter.warm((1, 2), min(self.max_context, DRAFT_WARM_POSITIONS))
        if self._verifier is not None:
            self.fuse_blocker = "the slot verifies through the compiled GPU path (fast_verify)"
        elif self.fuse_blocker is None:
            with startup.phase("slab check"):
                self.fuse_blocker = slab.check_support(target.model, token_ids=target.tokenizer.encode(slab.CHECK_TEXT))
        self._classic: ClassicRows = runner_build.make_classic_batch(
            target.model,
            config,
            self.fuse_blocker,
            self._slot.drafter if self._slot else None,
            self.eos_token_ids,
            self.grammars,
        )
        if self._classic.row_drafts:
            self._classic.costs = self.tick_costs()  # what a verify position costs, at load
            self._classic.price_by_steps = True  # ... kept true to the steps served
            self.draft_step_share = config.draft_step_share
            self.replica_drafts = config.replica_drafts
            self.sampled_row_drafts = config.sampled_row_drafts
        elif config.replica_drafts:
            log.info("replica drafts off: rows do not draft here (%s)", self.fuse_blocker or "no drafter")
        if self._classic.shares_slab and config.warm_session and mx.default_device() == mx.gpu:
            # On a GPU the sampler's and the verify's kernels compile on first use (seconds
            # for the first sampled request without this; the kernel cache keeps them).
            tic = time.perf_counter()
            with startup.phase("warm requests"):
                runner_build.run_warm_batch(self)
            log.info("warm requests ran in %.1f s", time.perf_counter() - tic)
        if self._verifier is not None:
            warm_positions = config.warm_positions
            if warm_positions is None:
                warm_positions = min(self.max_context, 2048)
            if warm_positions > 0:
                with startup.phase("compiled verify"):
                    self.warm(warm_positions)

    @property
    def fast_verify(self) -> bool:
        return self._verifier is not None

    @property
    def draft_step_share(self) -> float:
        """The share of a plain step's time the rows' drafts may add (0: no limit)."""
        return self._classic.draft_step_share

    @draft_step_share.setter
    def draft_step_share(self, share: float) -> None:
        if share < 0:
            raise ValueError("draft_step_share must be >= 0")
        self._classic.draft_step_share = share

    @property
    def sampled_row_drafts(self) -> bool:
        """Whether classic rows at temperature > 0 draft (greedy rows do where rows draft)."""
        return self._classic.sampled_drafts

    @sampled_row_drafts.setter
    def sampled_row_drafts(self, on: bool) -> None:
        self._classic.sampled_drafts = on

    @property
    def _replica_index(self) -> ReplicaIndex | None:
        return self._classic.replica_index

    @property
    def replica_drafts(self) -> bool:
        """Whether classic rows (and an n-gram slot holder) may draft from the replica's
        past outputs (`models.speculative.replica_index`; a slab batch whose rows draft only)."""
        return self._replica_index is not None

    @replica_drafts.setter
    def replica_drafts(self, on: bool) -> None:
        if not self._classic.row_drafts:
            if on:
                raise ValueError("replica drafts need the slab batch with row drafts")
            return
        if on != self.replica_drafts:
            index = ReplicaIndex() if on else None
            self._classic.replica_index = index
            if self._slot is not None and self._slot.drafter.drafts_like_rows:
                self._slot.drafter.replica = index

    def warm(self, max_positions: int) -> int:
        """Compile the fast path's shapes for contexts up to `max_positions`
        (`runner_build.warm_compiled`); returns the shape count. With `warm_session`, then
        also runs throwaway requests through begin, a probe round and full rounds (greedy
        and sampled), so what the shapes do not cover (library handles, kernels of the
        first use, the sampler) is paid here and not by the first real request."""
        if self._verifier is None:
            return 0
        count = runner_build.warm_compiled(self._verifier, self._slot.drafter, self.num_draft_tokens, max_positions)
        if self.config.warm_session:
            tic = time.perf_counter()
            runner_build.run_warm_requests(self)
            log.info("warm requests ran in %.1f s", time.perf_counter() - tic)
        return count

    @classmethod
    def from_paths(
        cls, target_path: str, *, drafter_kind: str | None = "draft_model", drafter_path: str | None = None, **knobs
    ) -> "MlxRunner":
        """Load models and build the runner: `drafter_kind` is a key of
        `models.speculative.drafter_kinds.DRAFTERS` (None: no drafter), `knobs` are `RunnerConfig`'s
        fields. Raises `ModelLoadError` / `ValueError`."""
        config = RunnerConfig(**knobs)
        kind = None if drafter_kind is None else DRAFTERS.get(drafter_kind)
        if drafter_kind is not None and kind is None:
            raise ValueError(f"drafter_kind must be one of {tuple(DRAFTERS)} or None, got {drafter_kind!r}")
        if kind is not None and kind.needs_weights and not drafter_path:
            raise ValueError(f"drafter_kind {drafter_kind!r} needs drafter_path")
        device_memory.bound_cache()
        with startup.phase("weights"):
            target, draft = load_pair(target_path, drafter_path if kind is not None and kind.needs_weights else None)
            for loaded in (target, draft):
                if loaded is not None:
                    dense_weights.apply(loaded.model, loaded.name, config.dense_weights)
                    fused_projections.apply(loaded.model, loaded.name, config.fused_projections)
            if draft is not None:
                draft_vocab.apply(draft.model, draft.path, draft.name, config.draft_vocab)
        if mx.default_device() == mx.cpu:
            changed = _blas.fit_threads(sum(v.nbytes for _, v in tree_flatten(target.model.parameters())))
            if changed:
                log.info("%s", changed)
            state = _blas.loaded()
            if state is not None and state.rows:
                log.info("CPU BLAS: few-row products %s", state.rows)
        drafter: Drafter | None = None if kind is None else kind.load_class().load(draft)
        return cls(target, drafter, config, draft_fingerprint=draft.fingerprint if draft is not None else "")

    # -- classic --------------------------------------------------------------------
    def classic_prefill(
        self, requests: Sequence[Request], between: Callable[[], None] | None = None, piece: int = 0
    ) -> list[TokenBatch]:
        return self._classic.prefill(requests, between=between, piece=piece)

    def classic_prefill_fits(self, request: Request, piece: int) -> bool:
        return self._classic.prefill_fits(request.prompt_ids, piece)

    def classic_decode(
        self, drafts: bool = False, skip_cap: int = 2, interrupt: Callable[[], bool] | None = None
    ) -> list[TokenBatch]:
        self._classic.skip_cap = skip_cap
        return self._classic.decode(drafts=drafts, interrupt=interrupt)

    def classic_remove(self, request_id: str) -> None:
        self._classic.remove(request_id)

    def num_classic_rows(self) -> int:
        return self._classic.num_rows()

    def classic_step_stats(self) -> dict | None:
        return self._classic.step_stats()

    def prefix_cache_stats(self) -> dict | None:
        """The target's prefix cache counters; with a draft model's own prefixes, theirs
        under "draft"."""
        cache = self._classic.prefix_cache
        if cache is None:
            return None
        stats = cache.stats()
        draft_cache = self._slot.drafter.prefix_cache if self._slot is not None else None
        if draft_cache is not None:
            stats["draft"] = draft_cache.stats()
        return stats

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
            new_cache=self._session_cache_for(request) if self._classic.shares_slab else None,
            grammars=self.grammars,
            lane=int(request.lane),
        )
        session.bind(self._slot.take(request.request_id))
        self._sessions[request.request_id] = session
        first = session.begin()
        if session.cache is not None:
            self._classic.keep_prompt(session.cache, request.prompt_ids)  # for requests sharing it meanwhile
        return TokenBatch(request.request_id, first.token_ids, first.finish_reason, logprobs=first.logprobs)

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
        outcome = session.step(probe=probe)  # ends in .tolist(): outputs are evaluated
        return dataclasses.replace(outcome, drafter=self._slot.drafter.kind)

    def can_fuse(self) -> bool:
        return self.fuse_blocker is None

    def rows_draft_like_slot(self, greedy: bool) -> bool:
        return self._classic.drafts_rows_of(greedy) and self._slot.drafter.drafts_like_rows

    def slot_drafts_vary(self) -> bool:
        return self._slot is not None and getattr(self._slot.drafter, "min_confidence", 0.0) > 0

    def shadow_index(self, history: Sequence[int]) -> NgramIndex | None:
        """The slot drafter's prompt lookup over `history`, for the scheduler's shadow
        rounds (its own text only: the replica's outputs, `replica_drafts`, are not looked up);
        None for a draft model, whose drafts only running it would show."""
        return self._slot.drafter.shadow_index(history) if self._slot is not None else None

    def tick_costs(self) -> TickCosts | None:
        """Decode and fused forward costs on this machine (`models.forward.tick_costs`),
        measured once, on the first call (a load-time cost: see that module)."""
        if not self.can_fuse():
            return None
        if self._tick_costs is None:
            cache_dir, key = self.config.policy_cache_dir, self._tick_costs_key()
            store = tick_costs.TickCostStore(cache_dir) if cache_dir else None
            self._tick_costs = store.load(key) if store else None
            vocab = getattr(getattr(self.target.model, "args", None), "vocab_size", 256)
            if self._tick_costs is not None:
                with startup.phase("tick costs"):
                    now = tick_costs.spot_check(self.target.model, self._tick_costs, vocab)
                if now is None:
                    log.info("tick costs read from %s", store.path)
                    return self._tick_costs
                log.info(
                    "tick costs in %s were measured on a busier machine (a one-row step %.1f ms, now %.1f): "
                    "measuring again",
                    store.path,
                    self._tick_costs.decode[1] * 1e3,
                    now * 1e3,
                )
            with startup.phase("tick costs"):
                self._tick_costs = tick_costs.measure(
                    self.target.model, self._slot.drafter, self.num_draft_tokens, self._classic_rows_cap, vocab
                )
            if store:
                store.save(key, self._tick_costs)
        return self._tick_costs

    def _tick_costs_key(self) -> str:
        """What the measured costs depend on: the models and machine (`policy_key`), the
        runner's knobs (batch sizes, weights' form), the weights' dtype and MLX."""
        knobs = dataclasses.replace(self.config, policy_cache_dir=None)
        dtype = next((v.dtype for _, v in tree_flatten(self.target.model.parameters())), None)
        return f"{self.policy_key()}|{knobs!r}|{dtype}|mlx {mx.__version__}"

    def spec_round_with_decode(
        self, request_id: str, drafts: bool = False, skip_cap: int = 2
    ) -> tuple[RoundOutcome, list[TokenBatch]]:
        """The holder's round and one decode step of every classic row in one forward:
        the verify tokens ride in the batch's step (`models.forward.ragged.Rider`). When the
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
        self._classic.skip_cap = skip_cap
        rows = self._classic.decode(rider, drafts=drafts)
        logits = rider.extra_logits
        if logits is None:
            logits = session.forward(tokens)
        outcome = session.complete_round(tokens, logits, tic)  # timed from `tic`: the whole forward
        return dataclasses.replace(outcome, fused=True, drafter=self._slot.drafter.kind), rows

    def spec_park_to_classic(self, request_id: str) -> list[TokenBatch]:
        """Park the holder into the classic batch (the fused tick's park): its stream
        goes on as a classic row (`spec_to_classic`), and its draft state is kept for
        its next grant, which catches the drafter up on what the row decoded."""
        session = self._sessions[request_id]
        draft_state = session.draft_state if session._draft_ready else None
        moved = self._to_classic(request_id, keep_draft=False)
        if draft_state is not None:
            self._parked_drafts[request_id] = draft_state
        return moved

    def classic_to_spec(self, request: Request) -> tuple[list[TokenBatch], bool]:
        """Promote a classic row into the slot: the row leaves the batch (its next token
        is emitted on the way, `GeneratorBatch.extract`) and a session continues it with
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
            request_id,
            self.target.model,
            request.prompt_ids,
            [*request.output_ids, *emitted.token_ids],
            request.sampling,
            live.cache,
            live.sampler,
            num_draft_tokens=self.num_draft_tokens,
            eos_token_ids=self.eos_token_ids,
            draft_state=draft_state,
            lane=int(request.lane),
        )
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
            self._keep_draft(session)
            if session.cache is not None:
                self._classic.release(session.cache, session.history)
            if self._replica_index is not None and session.num_emitted:
                self._replica_index.add(session.history[-session.num_emitted :])
            session.finish()
        if self._slot is not None:
            self._slot.return_(request_id)

    def spec_to_classic(self, request_id: str) -> list[TokenBatch]:
        """Demote a live session (active or parked) to a classic row: the drafter goes
        back to the slot and the draft state is dropped (the drafter keeps its KV as a
        prefix); the target cache, the sampler and the pending token become the row
        (`GeneratorBatch.adopt`), so the stream goes on exactly where it was. Returns
        tokens other rows emitted on the way."""
        return self._to_classic(request_id, keep_draft=True)

    def _to_classic(self, request_id: str, keep_draft: bool) -> list[TokenBatch]:
        """`spec_to_classic`; `keep_draft` False: the caller keeps the draft state."""
        session = self._sessions[request_id]
        if session.cache is None or session.finished:
            raise RuntimeError(f"session {request_id!r} is not running")
        if keep_draft:
            self._keep_draft(session)
        moved = self._classic.adopt(
            request_id,
            session.cache,
            session.sampler,
            session.history[-1],
            max_tokens=session.max_tokens,
            num_emitted=session.num_emitted,
            stop_ids=session.stop_ids,
            history=session.history[:-1],
            lane=session.lane,
        )
        del self._sessions[request_id]
        session.cache = None  # the classic row owns it now
        session.finish()
        self._slot.return_(request_id)
        return moved

    def _keep_draft(self, session: SpeculativeSession) -> None:
        """The drafter keeps what a leaving session's draft state can give later prompts."""
        if self._slot is not None and session._draft_ready:
            self._slot.drafter.keep(session.draft_state, session.history)

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
        key = f"{target}|{drafter}|{hardware_name()}|K={self.num_draft_tokens}"
        # a CPU's costs depend on the code its products run on (models/platform/_blas.py)
        return key + (f"|blas {_blas.products_key()}" if mx.default_device() == mx.cpu else "")

    def close(self) -> None:
        for request_id in list(self._sessions):
            self.spec_finish(request_id)
        self._classic.close()
