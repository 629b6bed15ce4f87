"""Drafters: what proposes the K tokens a speculative round verifies.

A drafter *handle* (weights, settings) is shared by the worker; a drafter *state* (for a
draft model: its own KV cache) belongs to one session and lives in it, so a parked
session keeps its draft cache and resumes exactly. The worker holds ONE handle in a
`DrafterSlot`; `take` binds it to a session, `return_` clears only that binding.

At temperature 0 drafts are greedy and a draft is accepted when it equals the target's
argmax. At temperature > 0 a drafter that gives a distribution (the draft model,
`propose_sampled`) samples each draft from its processed distribution q and the target
accepts it by rejection sampling (`models.speculative.rejection`); one that gives none (n-gram)
proposes greedily and a draft is accepted when it equals the target's own sample
(`models.speculative.session`), the one classic decode draws at that position, so a seeded stream
keeps its tokens. Either way the draft only affects speed, never the output
distribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from models.forward import bucketed
from models.forward.bucketed import BucketedForward
from models.forward.prefill import prefill_chunks
from models.platform import cpu_math
from models.sampling.samplers import DRAFTS, RequestSampler, log_probs
from models.speculative import cache_rollback
from models.speculative.rejection import fit_vocab
from models.speculative.round_math import draft_cache_trim

if TYPE_CHECKING:
    from models.batch.prefix_cache import PrefixCache
    from models.loading.loader import LoadedModel


class Drafter(Protocol):
    """What the slot, the sessions and the runner need of a drafter. Kinds are
    registered in `models.speculative.drafter_kinds.DRAFTERS`; capabilities are members here, never
    found with isinstance or hasattr. `DrafterBase` gives every member a kind without
    the capability has; a drafter subclasses it and overrides what it can do."""

    kind: str  # its key in `models.speculative.drafter_kinds.DRAFTERS`
    name: str  # for the policy key
    # Its drafts are the n-gram lookup classic rows verify themselves (`NgramIndex`), so a
    # holder beside drafting rows may speculate on as a row.
    drafts_like_rows: bool
    # It gives a distribution: at temperature > 0 a session samples drafts from it
    # (`propose_sampled`) and accepts them by rejection sampling (`models.speculative.rejection`).
    sample_drafts: bool
    # It drafts on the device without a host sync (`propose_array`), so a session can
    # chain the verify forward onto its drafts.
    drafts_on_device: bool
    # Its own KV prefixes (`models.batch.prefix_cache`; None: it keeps none), see `keep`.
    prefix_cache: PrefixCache | None

    @classmethod
    def load(cls, draft: LoadedModel | None) -> "Drafter":
        """Build one from the loaded draft model (None for a kind without weights)."""

    def new_state(self, prompt_ids: Sequence[int]) -> object:
        """A session's fresh draft state for this prompt (prefilled where it has a cache)."""

    def propose(self, state: object, history: Sequence[int], k: int) -> list[int]:
        """Up to `k` draft tokens continuing `history` (prompt + emitted; last = pending)."""

    def rollback(self, state: object, num_drafted: int, num_accepted: int) -> None:
        """Forget what followed the accepted drafts of the round just verified."""

    def compile_forwards(self, prefill_chunk: int) -> None:
        """With fast_verify: draft through compiled shape-stable forwards where it has a
        model (`models.forward.bucketed`); a no-op for a kind without one."""

    def warm(self, feed_lengths: tuple[int, ...], max_positions: int) -> int:
        """Compile the compiled forwards' shapes for these feed lengths and contexts up
        to `max_positions`; returns the shape count (0 without compiled forwards)."""

    def kv_bytes_per_position(self) -> int:
        """Bytes one position takes in a state's KV cache, where a prefix of that cache
        can be kept for later prompts (`keep`); 0 for a kind that keeps nothing."""

    def keep(self, state: object, history: Sequence[int]) -> None:
        """A session with this state is done: keep what later prompts starting with its
        `history` (prompt + emitted) can reuse, in `prefix_cache` if one is attached."""

    def propose_array(self, state: object, history: Sequence[int], k: int) -> mx.array:
        """With `drafts_on_device`: `propose`'s drafts as a lazy int32 array of shape (k,)."""

    def propose_sampled(
        self, state: object, history: Sequence[int], k: int, sampler: RequestSampler, vocab: int | None
    ) -> tuple[mx.array, mx.array]:
        """With `sample_drafts`: k drafts sampled from the drafter's processed distribution,
        and that distribution q (k, V), for rejection sampling."""

    def shadow_index(self, history: Sequence[int]) -> NgramIndex | None:
        """Its drafts over `history` as an index the scheduler's shadow rounds can run
        without the model; None where drafts are not fixed tokens read off the text."""


class DrafterBase:
    """The members of `Drafter` for a kind without the capability: no drafts like rows',
    no distribution, host-side drafts, no compiled forwards, no KV to keep."""

    drafts_like_rows = False
    sample_drafts = False
    drafts_on_device = False
    prefix_cache: PrefixCache | None = None

    def shadow_index(self, history: Sequence[int]) -> NgramIndex | None:
        return None

    @classmethod
    def load(cls, draft: LoadedModel | None) -> "DrafterBase":
        return cls()

    def compile_forwards(self, prefill_chunk: int) -> None:
        return None

    def warm(self, feed_lengths: tuple[int, ...], max_positions: int) -> int:
        return 0

    def kv_bytes_per_position(self) -> int:
        return 0

    def keep(self, state: object, history: Sequence[int]) -> None:
        return None

    def propose_array(self, state: object, history: Sequence[int], k: int) -> mx.array:
        raise NotImplementedError(f"{type(self).__name__} drafts on the host (drafts_on_device is False)")

    def propose_sampled(
        self, state: object, history: Sequence[int], k: int, sampler: RequestSampler, vocab: int | None
    ) -> tuple[mx.array, mx.array]:
        raise NotImplementedError(f"{type(self).__name__} gives no distribution (sample_drafts is False)")


@dataclass
class DraftModelState:
    cache: list
    num_cached: int  # history[:num_cached] is in `cache`
    # A ring draft cache as it was before this round's one-token draft steps (which
    # overwrite its oldest entries); None for a cache that trims exactly.
    checkpoint: cache_rollback.Checkpoint | None = None
    # This round's drafts the cache holds (fed back for the next draft): k - 1 after k
    # drafts, one more where a round stopped early (`min_confidence`); None: no round yet.
    num_fed: int | None = None


# A round's first draft step feeds what the draft has not seen: the pending token, and
# the last round's final draft when that round accepted everything. On MLX CUDA a forward
# of several tokens runs causal attention, built per key length, which is new every
# round (an H100: 43 ms a round for SmolLM2's draft, against 4 ms fed one token at a time:
# docs/gpu.md, "Known issues"); feeds up to this long go one token at a time on a GPU.
ONE_AT_A_TIME_FEED = 4


def _end_round(state: DraftModelState, history_length: int, kept: int, k: int) -> None:
    """Record a round of `kept` drafts out of at most `k`: the cache holds every kept draft
    but the last (each step fed the one before), or all of them where the round stopped
    early (the step that made the dropped draft fed the last kept one)."""
    state.num_fed = kept if kept < k else k - 1
    state.num_cached = history_length + state.num_fed


def _unseen_first(model: nn.Module, cache: list, feed: list[int]) -> list[int]:
    """On a GPU, run all but the last of a short `feed` through `model` as one-token steps
    (lazily: their cache writes join the next forward's graph); what is left to feed."""
    if 1 < len(feed) <= ONE_AT_A_TIME_FEED and mx.default_device() == mx.gpu:
        for token in feed[:-1]:
            model(mx.array([[token]], dtype=mx.int32), cache=cache)
        return feed[-1:]
    return feed


class DraftModelDrafter(DrafterBase):
    """A small mlx-lm model sharing the target's vocabulary.

    Rollback keeps the draft cache exactly what a fresh prefill of the accepted history
    would give. A plain KV cache drops its rejected entries (`trim_exact`). A draft with
    sliding-window rings cannot (its one-token steps overwrite the ring in place), so it
    returns to the checkpoint taken before those steps, and the next round feeds the
    accepted drafts together with the new pending token in one forward.
    """

    kind = "draft_model"
    drafts_on_device = True
    # `draft_confidence`: a round stops drafting where the product of its drafts' top
    # probabilities would fall below this (0: always the k drafts asked for).
    min_confidence: float = 0.0
    # The draft's own KV prefixes (`models.batch.prefix_cache`), attached by the runner's build
    # when its prefix cache is on: a new state copies the longest cached prefix of its
    # prompt and prefills only the rest; `keep` stores a finished session's draft KV.
    prefix_cache: PrefixCache | None = None

    def __init__(self, model: nn.Module, name: str, fast: BucketedForward | None = None, sample_drafts: bool = True):
        """`fast`: compiled shape-stable forwards of `model` (GPU path), used by
        `propose_array`; None drafts with the plain forward. `sample_drafts`: at
        temperature > 0, sample drafts for rejection sampling (False: greedy drafts
        checked by token equality, as the n-gram drafter's are; for comparisons)."""
        self.model = model
        self.name = name
        self.fast = fast
        self.sample_drafts = sample_drafts
        cache = make_prompt_cache(model)
        if not cache_rollback.can_roll_back(cache):
            raise ValueError(
                f"draft model {name!r} has a cache that cannot be rolled back "
                "(state-space or recurrent layers); use another draft or ngram"
            )
        self._rings = cache_rollback.has_ring(cache)
        self._bytes_per_position: int | None = None

    @classmethod
    def load(cls, draft: LoadedModel | None) -> "DraftModelDrafter":
        return cls(draft.model, draft.name)

    def compile_forwards(self, prefill_chunk: int) -> None:
        if self.fast is None and bucketed.supports(self.model):
            self.fast = BucketedForward(self.model, prefill_chunk=prefill_chunk)

    def warm(self, feed_lengths: tuple[int, ...], max_positions: int) -> int:
        if self.fast is None:
            return 0
        # Sampled requests draft from the logits (`propose_sampled`), greedy ones from the last head.
        count = self.fast.warm(feed_lengths, max_positions) if self.sample_drafts else 0
        chunk = (self.fast.prefill_chunk,) if self.fast.prefill_chunk else ()
        if self.min_confidence > 0:  # greedy rounds that stop early read each draft's probability
            count += self.fast.warm(feed_lengths, max_positions, head="top")
        return count + self.fast.warm(feed_lengths + chunk, max_positions, head="last")

    def new_state(self, prompt_ids: Sequence[int]) -> DraftModelState:
        cache = make_prompt_cache(self.model)
        ids = list(prompt_ids)
        if self.fast is not None and self.fast.prefill_chunk:
            self.fast.prefill(cache, ids)  # lazy: evaluated with the first round's drafts
            return DraftModelState(cache, len(ids))
        prefill_chunks(self.model, cache, ids[self._reuse_prefix(cache, ids) :])
        return DraftModelState(cache, len(ids))

    def kv_bytes_per_position(self) -> int:
        """0 for ring (sliding-window) caches, which do not hold a whole prefix, and for
        compiled forwards that prefill themselves (`fast_verify`: no prefix cache there)."""
        if self._rings or (self.fast is not None and self.fast.prefill_chunk):
            return 0
        if self._bytes_per_position is None:
            probe = make_prompt_cache(self.model)
            self.model(mx.zeros((1, 1), dtype=mx.int32), cache=probe)
            self._bytes_per_position = sum((c.keys.nbytes + c.values.nbytes) // c.keys.shape[2] for c in probe)
        return self._bytes_per_position

    def keep(self, state: DraftModelState | None, history: Sequence[int]) -> None:
        """Store the draft KV of the history's first positions: those the cache holds
        (`num_cached`; after a round's rollback, never a rejected draft)."""
        if self.prefix_cache is None or state is None or not self.kv_bytes_per_position():
            return
        n = min(state.num_cached, state.cache[0].offset, len(history))
        if n < 1:
            return

        def copy_kv() -> tuple[list[mx.array], list[mx.array]]:
            # New buffers (a slice may be a view that keeps the session's buffers alive).
            keys = [mx.array(c.keys[0, :, :n, :]) for c in state.cache]
            values = [mx.array(c.values[0, :, :n, :]) for c in state.cache]
            mx.eval(keys, values)
            return keys, values

        self.prefix_cache.store(history[:n], n * self.kv_bytes_per_position(), copy_kv)

    def _reuse_prefix(self, cache: list, ids: list[int]) -> int:
        """Copy the longest cached prefix of `ids` into the empty `cache`; its length.
        The cache's arrays start as views of the entry's, which MLX never writes in
        place while the entry holds them: the cache's first write makes its own."""
        hit = self.prefix_cache.lookup(ids) if self.prefix_cache is not None and ids else None
        if hit is None:
            return 0
        n = hit.num_tokens
        for c, k, v in zip(cache, hit.keys, hit.values):
            c.keys, c.values, c.offset = k[None, :, :n, :], v[None, :, :n, :], n
        return n

    def propose(self, state: DraftModelState, history: Sequence[int], k: int) -> list[int]:
        if k <= 0:
            return []
        if self.min_confidence > 0:
            return self._propose_confident(state, history, k)
        if self.fast is not None:
            return self.propose_array(state, history, k).tolist()
        # Tokens the draft has not seen: the pending one, plus the last round's final
        # draft when that round accepted everything.
        feed = _unseen_first(self.model, state.cache, list(history[state.num_cached :]))
        logits = self.model(mx.array([feed]), cache=state.cache)[0, -1]
        token = mx.argmax(logits, axis=-1)
        self._before_steps(state)
        drafts = [token]
        for _ in range(k - 1):
            mx.async_eval(token)
            logits = self.model(token.reshape(1, 1), cache=state.cache)[0, -1]
            token = mx.argmax(logits, axis=-1)
            drafts.append(token)
        _end_round(state, len(history), k, k)
        return mx.stack(drafts).tolist()

    def _top(self, state: DraftModelState, tokens: list[int]) -> tuple[int, float]:
        """(greedy token, its probability) after feeding `tokens` to the draft's cache."""
        feed = mx.array([tokens], dtype=mx.int32)
        if self.fast is not None:
            token, top = self.fast.greedy_top(state.cache, feed).tolist()
            return int(token), top
        logits = self.model(feed, cache=state.cache)[0, -1].astype(mx.float32)
        token = mx.argmax(logits)
        top = mx.softmax(logits)[token]
        mx.eval(token, top)
        return token.item(), top.item()

    def _propose_confident(self, state: DraftModelState, history: Sequence[int], k: int) -> list[int]:
        """Greedy drafts, at most `k`, while the product of their top probabilities stays
        at `min_confidence` or above (none when the first one's is below it). A draft's
        top probability is about the chance the target agrees with it, so a round stops
        where another verify position is unlikely to be worth its cost. Each step waits
        for its draft."""
        unseen = list(history[state.num_cached :])
        if self.fast is None:
            unseen = _unseen_first(self.model, state.cache, unseen)
        token, top = self._top(state, unseen)
        self._before_steps(state)
        drafts: list[int] = []
        confidence = 1.0
        for j in range(k):
            if j:
                token, top = self._top(state, drafts[-1:])
            confidence *= top
            if confidence < self.min_confidence:
                break
            drafts.append(token)
        _end_round(state, len(history), len(drafts), k)
        return drafts

    def propose_array(self, state: DraftModelState, history: Sequence[int], k: int) -> mx.array:
        """Exactly `k` (>= 1) greedy drafts as a lazy int32 array of shape (k,): the same
        tokens as `propose`, but nothing waits for the device, so the caller can chain
        the verify forward onto them."""
        unseen = list(history[state.num_cached :])
        if self.fast is not None:
            step = self.fast.greedy
        else:
            unseen = _unseen_first(self.model, state.cache, unseen)

            def step(cache, tokens):
                logits = self.model(tokens, cache=cache)[:, -1]
                return mx.argmax(logits, axis=-1).astype(mx.int32)

        token = step(state.cache, mx.array([unseen], dtype=mx.int32))
        self._before_steps(state)
        drafts = [token]
        for _ in range(k - 1):
            mx.async_eval(token)
            token = step(state.cache, token.reshape(1, 1))
            drafts.append(token)
        _end_round(state, len(history), k, k)
        return mx.concatenate(drafts)

    def propose_sampled(
        self, state: DraftModelState, history: Sequence[int], k: int, sampler: RequestSampler, vocab: int | None = None
    ) -> tuple[mx.array, mx.array]:
        """Exactly `k` (>= 1) drafts sampled at the request's temperature > 0, lazily:
        tokens (k,) int32 and q (k, V) float32, row j the distribution draft j was drawn
        from (the draft's logits, cut or padded to the target's `vocab`, through
        `sampler.draft_logits` after the drafts before it, then its filters and
        temperature). Draft j is drawn with the sampler's `DRAFTS` key of the output
        position it proposes (`sampler.position + j`). With `min_confidence` set, fewer
        (at least one), and each step waits for its draft."""
        keys = sampler.keys(k, stream=DRAFTS)
        if self.fast is not None:

            def logits_of(tokens):
                return self.fast.logits(state.cache, tokens)[0, -1:]
        else:

            def logits_of(tokens):
                return self.model(tokens, cache=state.cache)[0, -1:]

        unseen = list(history[state.num_cached :])
        if self.fast is None:
            unseen = _unseen_first(self.model, state.cache, unseen)
        logits = logits_of(mx.array([unseen], dtype=mx.int32))
        self._before_steps(state)
        drafts, rows = [], []
        confidence = 1.0
        for j in range(k):
            if j:
                mx.async_eval(drafts[-1])
                logits = logits_of(drafts[-1].reshape(1, 1))
            before = mx.concatenate(drafts) if drafts else ()
            logits = fit_vocab(logits.astype(mx.float32), vocab)
            scaled = sampler.scaled(log_probs(sampler.draft_logits(logits, before)))
            rows.append(cpu_math.row_softmax(scaled))
            drafts.append(mx.random.categorical(scaled, key=keys[j]).astype(mx.int32))
            if self.min_confidence > 0:  # as `_propose_confident`, by q's top; the first draft stays
                confidence *= rows[-1].max().item()
                if j and confidence < self.min_confidence:
                    rows.pop()
                    drafts.pop()
                    break
        _end_round(state, len(history), len(drafts), k)
        return mx.concatenate(drafts), mx.concatenate(rows)

    def _before_steps(self, state: DraftModelState) -> None:
        # The cache now holds the history up to the pending token, all of it kept.
        state.checkpoint = cache_rollback.checkpoint(state.cache) if self._rings else None

    def rollback(self, state: DraftModelState, num_drafted: int, num_accepted: int) -> None:
        fed = num_drafted - 1 if state.num_fed is None else state.num_fed
        state.num_fed = None
        if state.checkpoint is not None:
            # Back to the pending token: every draft fed goes, accepted ones included.
            cache_rollback.restore(state.checkpoint)
            state.checkpoint = None
            state.num_cached -= fed
            return
        trim = draft_cache_trim(fed + 1, num_accepted)
        cache_rollback.trim_exact(state.cache, trim)
        state.num_cached -= trim


class NgramDrafter(DrafterBase):
    """Prompt lookup: continue the longest recent n-gram that occurred before.

    Looks for the last `n` tokens of the history (n from `max_ngram` down to
    `min_ngram`) earlier in the history and proposes what followed its most recent
    earlier occurrence, read on as a repeat where that runs into the history's end
    (`continuation`). No weights and no per-session state. With `replica` (the
    runner's `replica_drafts`), a match of the history's tail in the replica's past
    outputs comes first, as for classic rows.
    """

    kind = "ngram"
    drafts_like_rows = True

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.name = f"n{min_ngram}-{max_ngram}"
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.replica = None  # a `models.speculative.replica_index.ReplicaIndex`, shared with the batch's rows

    def shadow_index(self, history: Sequence[int]) -> NgramIndex:
        return NgramIndex(history, self.max_ngram, self.min_ngram)

    def new_state(self, prompt_ids: Sequence[int]) -> None:
        return None

    def propose(self, state: None, history: Sequence[int], k: int) -> list[int]:
        drafts = self.replica.propose(history, k) if self.replica is not None else []
        return drafts or ngram_lookup(history, k, self.max_ngram, self.min_ngram)

    def rollback(self, state: None, num_drafted: int, num_accepted: int) -> None:
        return None


def continuation(seq: Sequence[int], at: int, k: int) -> list[int]:
    """`k` tokens from `seq[at:]`, where `seq[:at]` ends with an earlier occurrence of
    `seq`'s tail. Past the end of `seq` they go on as the repeat that match implies: a
    tail that recurs `len(seq) - at` tokens after its last occurrence repeats with that
    period (a run of one token, a loop of lines), so a match near the end still drafts
    `k` tokens.

    >>> continuation([7, 7, 7], 2, 4), continuation([1, 2, 3, 1, 2, 3, 1], 4, 4)
    ([7, 7, 7, 7], [2, 3, 1, 2])
    """
    out = list(seq[at : at + k])
    period = len(seq) - at
    while 0 < period and len(out) < k:
        out.append(out[len(out) - period])
    return out


def ngram_lookup(history: Sequence[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """What followed the most recent earlier occurrence of the longest tail of `history`
    (n-grams from `max_ngram` down to `min_ngram`), `k` tokens (`continuation`).

    >>> ngram_lookup([1, 2, 3, 9, 1, 2], k=2, max_ngram=2), ngram_lookup([5, 6, 6, 6], k=3, max_ngram=3)
    ([3, 9], [6, 6, 6])
    """
    if k <= 0:
        return []
    seq = list(history)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        suffix = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return continuation(seq, start + n, k)
    return []


class DrafterSlot:
    """The worker's single drafter handle and which session it is bound to."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self.holder: str | None = None

    def take(self, session_id: str) -> Drafter:
        if self.holder is not None and self.holder != session_id:
            raise RuntimeError(f"drafter is held by session {self.holder!r}; {session_id!r} cannot take it")
        self.holder = session_id
        return self.drafter

    def return_(self, session_id: str) -> None:
        """Unbind (idempotent). Touches no session's draft state."""
        if self.holder == session_id:
            self.holder = None


class NgramIndex:
    """`ngram_lookup` over a growing history in O(max_ngram) per call: for every n, the
    most recent start of each n-gram that something followed. One per classic row
    (`models.batch.slab_batch`), extended with the tokens the row emits.
    >>> index = NgramIndex([1, 2, 3, 9, 1, 2], max_ngram=2)
    >>> index.propose(2), ngram_lookup([1, 2, 3, 9, 1, 2], 2, 2), index.last_match
    ([3, 9], [3, 9], 2)
    """

    def __init__(self, history: Sequence[int], max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.history: list[int] = []
        self._starts: list[dict[tuple, int]] = [{} for _ in range(max_ngram + 1)]
        self.last_match = 0  # the suffix length the last `propose` matched (0: none)
        self._index_all(list(history))

    def _index_all(self, seq: list[int]) -> None:
        """`extend(seq)` on an empty index, each n's n-grams zipped from shifted slices
        of the sequence (not a per-token loop of dict stores: this runs on a first token's
        path). Later starts overwrite earlier ones, as in `extend`."""
        self.history = seq
        m = len(seq)
        for n in range(self.min_ngram, self.max_ngram + 1):
            if m > n:  # the n-grams starting at 0 .. m - n - 1 have a follower
                self._starts[n].update(zip(zip(*(seq[i : m - n + i] for i in range(n))), range(m - n)))

    def extend(self, tokens: Sequence[int]) -> None:
        seq = self.history
        for token in tokens:
            seq.append(token)
            end = len(seq) - 1  # the n-grams ending just before the new token now have a follower
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end - n >= 0:
                    self._starts[n][tuple(seq[end - n : end])] = end - n

    def propose(self, k: int) -> list[int]:
        """`k` tokens that followed the most recent earlier occurrence of the longest
        suffix (n from max_ngram down), read on as a repeat past the history's end, as
        `ngram_lookup` proposes."""
        seq = self.history
        self.last_match = 0
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            start = self._starts[n].get(tuple(seq[-n:]))
            if start is not None:
                self.last_match = n
                return continuation(seq, start + n, k)
        return []
