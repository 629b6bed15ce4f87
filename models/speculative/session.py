"""`SpeculativeSession`: one request's speculative decode as explicit, resumable state.

State: the target KV cache (holds every token but the pending one), the drafter's
per-session state (for a draft model: its own KV cache), the token history (prompt +
emitted; the last is the pending token), counters, per-round timings and the stop
conditions. Nothing lives in a suspended generator, so any number of other sessions'
rounds may run between two `step()` calls. Every emitted token is distributed as a target
sample given the emitted prefix, drawn from the request's seeded keys. Drafts that come with
their distribution q are accepted by rejection sampling (`models.speculative.rejection`:
same distribution, another sample path); others by token equality, which draws output
position p with p's key as classic decode does, so a seeded stream is the same token for
token with speculation on or off; at temperature 0 draws and drafts are greedy, so the stream
is classic greedy decoding's. Logprobs come from the verify position that produced each
token, as classic's do. See docs/configuration.md, "Speculation at temperature > 0".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from models.batch.solo import SoloRow
from models.forward.bucketed import BucketedForward
from models.forward.prefill import PREFILL_STEP, prefill_chunks
from models.forward.slab_forward import last_positions
from models.sampling.grammar import Grammars
from models.sampling.samplers import ROUNDS, LogprobArrays, RequestSampler, stop_token_ids
from models.speculative.cache_rollback import trim_exact
from models.speculative.drafters import Drafter
from models.speculative.rejection import verify_drafts, with_bonus_row
from models.speculative.round_math import accept_count, clip_tokens, draft_budget, target_cache_trim
from scheduler.model_api import RoundOutcome
from scheduler.request import SamplingParams, TokenLogprob

PROBE_TOKENS = 8  # classic steps per probe round: a steady-state rate, not one cold step


@dataclass
class SessionCounters:
    num_rounds: int = 0
    num_probe_rounds: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    total_round_seconds: float = 0.0  # wall time of every round, summed
    # Host wall time per round phase, summed: "draft" (proposing; includes its sync on
    # the plain path), "verify" (building/dispatching the target forward), "sync"
    # (waiting for the round's tokens), "rollback" (trims and bookkeeping).
    phase_seconds: dict = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0, "sync": 0.0, "rollback": 0.0})


class SpeculativeSession:
    def __init__(
        self,
        request_id: str,
        target: nn.Module,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        num_draft_tokens: int,
        eos_token_ids: Sequence[int],
        verifier: BucketedForward | None = None,
        new_cache: Callable[[], list] | None = None,
        grammars: Grammars | None = None,
        lane: int = 1,
    ):
        """`verifier`: the shape-stable compiled target forward (GPU path); None runs
        the plain mlx-lm forward, whose CPU results the tests pin exactly. `new_cache`
        makes the target cache `begin` fills (default: mlx-lm's prompt cache; the
        fused tick passes a row of its slab, `models.batch.slab_batch`). `lane`: the
        request's (`scheduler.request.Lane`), which its row keeps if it parks or is
        demoted into the batch."""
        if not prompt_ids:
            raise ValueError("a speculative session needs a non-empty prompt")
        self.request_id = request_id
        self.target = target
        self.prompt_ids = list(prompt_ids)
        self.max_tokens = sampling.max_tokens
        self.stop_ids = stop_token_ids(eos_token_ids, sampling)
        self.num_draft_tokens = num_draft_tokens
        self.lane = lane
        self.verifier = verifier
        self._new_cache = new_cache or (lambda: make_prompt_cache(target))
        self.sampler = RequestSampler(sampling, prompt_ids, grammars)
        self.counters = SessionCounters()
        self.history: list[int] = []
        self.num_emitted = 0
        self.finish_reason: str | None = None
        self.cache: list | None = None
        self.draft_state: object = None
        self.drafter: Drafter | None = None  # bound handle; None while parked
        self._draft_ready = False  # draft_state built (lazily if begun unbound)
        # Drafts the drafter proposed this round (more than the verify checks when the
        # grammar cut them): the drafter rolls back all it proposed.
        self._num_proposed = 0
        # The rows q of this round's sampled drafts (`models.speculative.rejection`); None: equality.
        self._draft_probs: mx.array | None = None
        self._vocab = getattr(getattr(target, "args", None), "vocab_size", None)

    @classmethod
    def from_live(
        cls,
        request_id: str,
        target: nn.Module,
        prompt_ids: Sequence[int],
        output_ids: Sequence[int],
        sampling: SamplingParams,
        cache: list,
        sampler: RequestSampler,
        *,
        num_draft_tokens: int,
        eos_token_ids: Sequence[int],
        draft_state: object = None,
        lane: int = 1,
    ) -> "SpeculativeSession":
        """A session continuing a stream decoded elsewhere (a classic row): `cache` holds
        every token of prompt + `output_ids` but the last output token (the pending
        one), `sampler` has accepted every emitted token (its position and the tokens its
        processors read are where that path left them). `draft_state` is the
        drafter state this stream had when it last held the drafter (None: built from
        the history at the first round); the drafter catches up on what it missed."""
        if not output_ids:
            raise ValueError("a live stream has emitted at least one token")
        session = cls(
            request_id,
            target,
            prompt_ids,
            replace(sampling, grammar=None),
            num_draft_tokens=num_draft_tokens,
            eos_token_ids=eos_token_ids,
            lane=lane,
        )
        session.cache = cache
        session.sampler = sampler
        session.history = list(prompt_ids) + list(output_ids)
        session.num_emitted = len(output_ids)
        session.draft_state = draft_state
        session._draft_ready = draft_state is not None
        return session

    # -- binding -------------------------------------------------------------------
    def bind(self, drafter: Drafter) -> None:
        self.drafter = drafter

    def unbind(self) -> None:
        self.drafter = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    # -- life ----------------------------------------------------------------------
    def _emit(self, tokens: list[int], accepted: bool = False) -> tuple[list[int], str | None]:
        """Emit what clipping leaves of `tokens`; the sampler takes them as the stream's
        unless it has already (`accepted`: a probe's row accepts what it draws)."""
        tokens, reason = clip_tokens(tokens, self.max_tokens - self.num_emitted, self.stop_ids)
        if not accepted:
            self.sampler.accept(tokens)
        self.history.extend(tokens)
        self.num_emitted += len(tokens)
        self.finish_reason = reason
        return tokens, reason

    def _sample(self, logits: mx.array, drafts: Sequence[int] = ()) -> tuple[list[int], list[TokenLogprob] | None]:
        """The target's token at each of the (n, V) `logits`' positions, position i
        after `drafts[:i]`, and their logprobs (None unless the request asked)."""
        tokens, report = self.sampler.sample_with_logprobs(logits, drafts)
        if report is None:
            return tokens.tolist(), None
        mx.eval(tokens, *report.arrays())
        return tokens.tolist(), report.tolist()

    def begin(self) -> RoundOutcome:
        """Prefill target (and draft state, if bound) and emit the first token.

        Like classic prefill: the prompt in chunks, the last token in the last one,
        whose logits (the output head runs on that position alone) give the first
        token. A cache that `new_cache` hands over already holding a prefix of the
        prompt (its offset, at most all but the last token) is prefilled from there.
        """
        tic = time.perf_counter()
        self.cache = self._new_cache()
        if self.verifier is not None and self.verifier.prefill_chunk:
            # Shape-stable and lazy: one host sync for the whole begin.
            self.verifier.prefill(self.cache, self.prompt_ids[self.cache[0].offset : -1])
            logits = self.verifier.logits(self.cache, mx.array([self.prompt_ids[-1:]], dtype=mx.int32))[0]
        else:
            rest = self.prompt_ids[self.cache[0].offset :]
            cut = max(0, len(rest) - PREFILL_STEP)  # the last chunk carries the last token
            prefill_chunks(self.target, self.cache, rest[:cut], forward=self.forward)
            logits = self.forward(rest[cut:], last_only=True)
        first, logprobs = self._sample(logits)
        if self.drafter is not None:
            self.draft_state = self.drafter.new_state(self.prompt_ids)
            self._draft_ready = True
        self.history = list(self.prompt_ids)
        tokens, reason = self._emit(first)
        return RoundOutcome(
            self.request_id, tokens, reason, 0, 0, False, time.perf_counter() - tic, logprobs=_clip(logprobs, tokens)
        )

    def step(self, probe: bool = False) -> RoundOutcome:
        """Exactly one round: draft K, verify K + 1 positions in one target forward,
        emit the accepted drafts plus one target token, roll both caches back.

        A probe round measures classic decode instead (`_probe_tokens`): it needs no
        bound drafter and emits up to `PROBE_TOKENS` tokens.
        """
        if self.cache is None or self.finished:
            raise RuntimeError(f"session {self.request_id!r} is not running")
        if probe:
            tic = time.perf_counter()
            tokens, per_token, logprobs = self._probe_tokens()
            tokens, reason = self._emit(tokens, accepted=True)
            seconds = time.perf_counter() - tic
            self._count_round(True, 0, 0, seconds)
            return RoundOutcome(
                self.request_id, tokens, reason, 0, 0, True, seconds, per_token, logprobs=_clip(logprobs, tokens)
            )
        if self.drafter is None:
            raise RuntimeError(f"session {self.request_id!r} does not hold the drafter")
        if self.verifier is not None and self.sampler.grammar is None:  # grammars: plain path
            return self._step_bucketed()
        tic = time.perf_counter()
        tokens = self.prepare_round()
        t1 = time.perf_counter()
        logits = self.forward(tokens)
        self.counters.phase_seconds["verify"] += time.perf_counter() - t1
        return self.complete_round(tokens, logits, tic)

    def forward(self, tokens: list[int], last_only: bool = False) -> mx.array:
        """The target's (lazy) logits, (n, V), for `tokens` appended to the session's
        cache (`last_only`: (1, V) at the last token, the output head run on it alone):
        through the slab when the cache is a row of a grid slab (bucketed shapes: the
        GPU reuses its kernels and attention plans round after round), else the plain
        mlx-lm forward."""
        row = getattr(self.cache[0], "row", None) if self.cache else None
        if row is not None and row.slab.grid:
            return row.slab.forward(self.target, [(row, list(tokens))], last_only=last_only)[0]
        with last_positions(self.target, [len(tokens) - 1] if last_only else None) as gathered:
            logits = self.target(mx.array([tokens], dtype=mx.int32), cache=self.cache)[0]
        return logits[-1:] if last_only and not gathered else logits

    def prepare_round(self) -> list[int]:
        """The first half of a round on the plain path: draft, and return the tokens
        the target must verify, [pending] + drafts. Their forward may run alone
        (`step`) or ride in the classic batch's forward (`models.forward.ragged.Rider`); either
        way `complete_round` takes the logits of exactly these tokens."""
        if self.cache is None or self.finished:
            raise RuntimeError(f"session {self.request_id!r} is not running")
        if self.drafter is None:
            raise RuntimeError(f"session {self.request_id!r} does not hold the drafter")
        t0 = time.perf_counter()
        k = self._draft_budget()
        q = None
        if k and self._samples_drafts():
            drafts, q = self.drafter.propose_sampled(self.draft_state, self.history, k, self.sampler, self._vocab)
            proposed = drafts.tolist()
        else:
            proposed = self.drafter.propose(self.draft_state, self.history, k) if k else []
        self._num_proposed = len(proposed)
        draft = self.sampler.allowed_drafts(proposed)
        # A cut keeps the cut draft's row: that draft counts as rejected (p masks it).
        self._draft_probs = None if q is None else with_bonus_row(q, len(draft))
        self.counters.phase_seconds["draft"] += time.perf_counter() - t0
        return [self.history[-1]] + draft

    def complete_round(self, tokens: list[int], logits: mx.array, tic: float) -> RoundOutcome:
        """The second half: sample the verify positions, accept, roll both caches back,
        emit. `logits` (1 + K, V) are the target's for `tokens`, already in the cache;
        `tic` is when the round began (its wall time is reported)."""
        phases = self.counters.phase_seconds
        t2 = time.perf_counter()
        num_accepted, logprobs = None, None
        if self._draft_probs is not None:
            drafts = tokens[1:]
            target, accepted, report = self._verify_sampled(logits, mx.array(drafts, dtype=mx.int32), self._draft_probs)
            mx.eval(target, accepted, *(() if report is None else report.arrays()))
            verified, num_accepted = target.tolist(), accepted.item()
            logprobs = None if report is None else report.tolist()
        else:
            verified, logprobs = self._sample(logits, tokens[1:])
        phases["sync"] += time.perf_counter() - t2
        return self._finish_round(
            tokens[1:], verified, len(tokens) - 1, tic, self._num_proposed, num_accepted, logprobs
        )

    def _samples_drafts(self) -> bool:
        """Whether this round's drafts are sampled and accepted by rejection sampling."""
        return not self.sampler.is_greedy and self.drafter.sample_drafts

    def _verify_sampled(
        self, logits: mx.array, drafts: mx.array, q: mx.array
    ) -> tuple[mx.array, mx.array, LogprobArrays | None]:
        """Rejection sampling (lazy) of the n = len(drafts) sampled drafts against the
        target's distribution at `logits`' first n + 1 positions; `q` as
        `models.speculative.rejection.verify_drafts` takes it. Returns the target tokens, the drafts
        accepted and the tokens' report (None unless the request asked), read from the
        same processed log-probabilities as the distribution."""
        n = drafts.shape[0]
        logprobs = self.sampler.log_probs(logits[: n + 1].astype(mx.float32), drafts)
        round_key = self.sampler.keys(1, stream=ROUNDS)[0]  # the round's first position's
        target, accepted = verify_drafts(self.sampler.probs(logprobs), q, drafts, round_key)
        return target, accepted, self.sampler.report(logprobs, target)

    def _step_bucketed(self) -> RoundOutcome:
        tic = time.perf_counter()
        draft, verified, width, num_accepted, logprobs = self._verify_bucketed(
            self._draft_budget(), self.counters.phase_seconds
        )
        return self._finish_round(draft, verified, width, tic, num_accepted=num_accepted, logprobs=logprobs)

    def _draft_budget(self) -> int:
        """Drafts this round may propose; builds the draft state on the first round
        that drafts (a session begun or resumed without it)."""
        k = draft_budget(self.num_draft_tokens, self.max_tokens - self.num_emitted)
        if k and not self._draft_ready:
            self.draft_state = self.drafter.new_state(self.history[:-1])
            self._draft_ready = True
        return k

    def _finish_round(
        self,
        draft: list[int],
        verified: list[int],
        width: int,
        tic: float,
        num_proposed: int | None = None,
        num_accepted: int | None = None,
        logprobs: list[TokenLogprob] | None = None,
    ) -> RoundOutcome:
        """The verify added `width` positions after the pending token (the drafts, and
        on the bucketed path their padding): roll back all but the accepted ones and the
        drafter (`num_proposed` drafts, default `len(draft)`), emit, count.
        `num_accepted`: decided by rejection sampling (None: the equality rule).
        `logprobs`: each verify position's, where the request asked (the emitted tokens'
        are kept)."""
        num_drafted = len(draft)
        if num_accepted is None:
            num_accepted = accept_count(draft, verified)
        trim = target_cache_trim(width, num_accepted)  # padding is rejected like a draft
        t3 = time.perf_counter()
        # The verify appended its 1 + K positions in one multi-token update, which every
        # cache the runner speculates on (sliding windows too) gives back exactly, or raises.
        trim_exact(self.cache, trim)
        num_proposed = num_drafted if num_proposed is None else num_proposed
        if num_proposed:
            self.drafter.rollback(self.draft_state, num_proposed, num_accepted)
        self.counters.phase_seconds["rollback"] += time.perf_counter() - t3
        tokens, reason = self._emit(verified[: num_accepted + 1])
        seconds = time.perf_counter() - tic
        self._count_round(False, num_drafted, num_accepted, seconds)
        return RoundOutcome(
            self.request_id, tokens, reason, num_drafted, num_accepted, False, seconds, logprobs=_clip(logprobs, tokens)
        )

    def _count_round(self, probe: bool, num_drafted: int, num_accepted: int, seconds: float) -> None:
        c = self.counters
        c.num_rounds += 1
        c.num_probe_rounds += int(probe)
        c.num_drafted += num_drafted
        c.num_accepted += num_accepted
        c.total_round_seconds += seconds

    def _probe_tokens(self) -> tuple[list[int], float, list[TokenLogprob] | None]:
        """Classic decode of up to `PROBE_TOKENS` tokens, run by a lone classic row
        (`models.batch.solo.SoloRow`) over this session's cache and sampler, pipelined as
        classic decode is: the forward for token i + 1 is queued before the host reads
        token i. Returns the tokens and the steady-state seconds per token (first read
        to last read, over the tokens in between), which is what the adaptive policy
        compares a round against, and the tokens' logprobs (where asked).

        The plain model forward works on both paths' caches (the bucketed path keeps
        ordinary `KVCache`s). The row stops at a stop token or after n tokens without
        queueing more, so the cache then holds every token but the last one, the new
        pending token, as between rounds.
        """
        n = max(1, min(PROBE_TOKENS, self.max_tokens - self.num_emitted))
        tic = time.perf_counter()
        row = SoloRow.resume(
            self.request_id,
            self.target,
            self.cache,
            self.sampler,
            self.stop_ids,
            max_tokens=n,
            next_input=self.history[-1],
        )
        tokens: list[int] = []
        logprobs: list[TokenLogprob] | None = [] if self.sampler.wants_logprobs else None
        reads: list[float] = []
        while True:
            step = row.step()
            tokens += step.token_ids
            if logprobs is not None:
                logprobs += step.logprobs
            reads.append(time.perf_counter())
            if step.finish_reason is not None:
                break
        if len(reads) > 1:
            return tokens, (reads[-1] - reads[0]) / (len(reads) - 1), logprobs
        return tokens, reads[0] - tic, logprobs

    def _verify_bucketed(
        self, k: int, phases: dict
    ) -> tuple[list[int], list[int], int, int | None, list[TokenLogprob] | None]:
        """Draft and verify with one host sync: (drafts, target tokens, positions added,
        drafts accepted by rejection sampling or None for the equality rule, each
        position's logprobs where the request asked).

        The verify covers 1 + K positions whenever k > 0 (K = num_draft_tokens; a
        shorter draft, e.g. near max_tokens or from the n-gram drafter, is padded and the
        padding trimmed like rejected drafts), and 1 position when no draft fits (a
        request's last token), so its shape
        depends only on K and the cache bucket and was compiled at load. A drafter with
        `propose_array` drafts lazily on the device, and its tokens feed the verify
        without a round trip through the host.
        """
        t0 = time.perf_counter()
        width = self.num_draft_tokens if k > 0 else 0
        sampled = k > 0 and self._samples_drafts()
        lazy = k > 0 and self.drafter.drafts_on_device
        if sampled:
            drafts, q = self.drafter.propose_sampled(self.draft_state, self.history, k, self.sampler, self._vocab)
        elif lazy:
            drafts = self.drafter.propose_array(self.draft_state, self.history, k)
        if lazy or sampled:
            num_drafts = drafts.shape[0]  # sampled drafts may stop short of k (`min_confidence`)
            parts = [mx.array([self.history[-1]], dtype=mx.int32), drafts]
            if width > num_drafts:
                parts.append(mx.zeros((width - num_drafts,), dtype=mx.int32))
            tokens = mx.concatenate(parts)
        else:
            draft = self.drafter.propose(self.draft_state, self.history, k) if k else []
            tokens = mx.array([self.history[-1]] + draft + [0] * (width - len(draft)), dtype=mx.int32)
        t1 = time.perf_counter()
        report = None
        if self.sampler.is_greedy and not self.sampler.has_processors and not self.sampler.wants_logprobs:
            # the argmax inside the compiled forward: fewer host ops
            target = self.verifier.greedy_every(self.cache, tokens[None])[0]
        else:
            logits = self.verifier.logits(self.cache, tokens[None])[0]
            if sampled:  # positions past the k drafts are padding
                target, accepted, report = self._verify_sampled(logits, drafts, with_bonus_row(q, num_drafts))
            else:
                target, report = self.sampler.sample_with_logprobs(logits, tokens[1:])
        t2 = time.perf_counter()
        num_accepted = None
        mx.eval(
            target,
            *([drafts] if lazy or sampled else []),
            *([accepted] if sampled else []),
            *([] if report is None else report.arrays()),
        )  # one sync
        if sampled:
            num_accepted = accepted.item()
        if lazy or sampled:
            draft = drafts.tolist()
        verified = target.tolist()
        logprobs = None if report is None else report.tolist()
        phases["draft"] += t1 - t0
        phases["verify"] += t2 - t1
        phases["sync"] += time.perf_counter() - t2
        return draft, verified, width, num_accepted, logprobs

    def finish(self) -> None:
        """Release caches and draft state. Idempotent."""
        self.cache = None
        self.draft_state = None
        self._draft_ready = False
        self.drafter = None
        if self.finish_reason is None:
            self.finish_reason = "cancelled"


def _clip(logprobs: list[TokenLogprob] | None, tokens: list[int]) -> list[TokenLogprob] | None:
    """The logprobs of the emitted `tokens` (a prefix of the positions sampled)."""
    return None if logprobs is None else logprobs[: len(tokens)]
