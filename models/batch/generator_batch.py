"""Classic continuous batching over mlx-lm 0.32.2's `BatchGenerator`.

The only module that knows `BatchGenerator`'s API (two private attributes included, see
`prefill`); mlx-lm is pinned exactly for that reason. One model action per call: `prefill`
runs prompt processing for just the given requests until each has emitted its first token,
without advancing existing rows; `decode` runs one batched decode step and returns one token
per row. Finish reasons are mlx-lm's: "stop" (an EOS or per-request stop token, emitted) or
"length"; stop wins when both apply. Logprobs are those `BatchGenerator` hands back with each
token, the sampler's own. A lone row runs outside as a `models.batch.solo.SoloRow`; when
another row is admitted (or `adopt` brings a stream in) its pending token is emitted and
becomes the one-token prompt of a batch row that keeps its KV cache, sampler and budget, and
a batch down to one decoding row with nothing to prefill moves it back out. No move
recomputes or redraws a token: docs/CONTINUOUS_BATCHING.md, "Classic rows in the MLX runner".
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch, StopSequences

from models.batch.solo import SoloRow
from models.forward.ragged import Rider
from models.sampling.grammar import Grammars
from models.sampling.samplers import LogprobArrays, RequestSampler, logprob_arrays, stop_token_ids
from scheduler.model_api import TokenBatch
from scheduler.request import Request


def check_admissible(requests: Sequence[Request], rows: Sequence[str]) -> None:
    """Raise ValueError for a request already among `rows` or with an empty prompt."""
    for r in requests:
        if r.request_id in rows:
            raise ValueError(f"request {r.request_id!r} is already a classic row")
        if not r.prompt_ids:
            raise ValueError(f"request {r.request_id!r} has an empty prompt")


def check_adoptable(request_id: str, rows: Sequence[str], num_emitted: int, max_tokens: int) -> None:
    """Raise ValueError for a stream already among `rows` or with no tokens left."""
    if request_id in rows:
        raise ValueError(f"request {request_id!r} is already a classic row")
    if num_emitted >= max_tokens:
        raise ValueError(f"request {request_id!r} has no tokens left to decode")


class RowSampler:
    """A `RequestSampler` as one `BatchGenerator` row's hooks: `penalize` is the row's
    logits processor (mlx-lm normalises its output as `models.sampling.samplers.log_probs`
    does), the call picks from those log-probabilities and accepts the draw, since
    every token a row draws is emitted (or the row ends on the one before)."""

    def __init__(self, sampler: RequestSampler):
        self.sampler = sampler

    def penalize(self, _context, logits):  # mlx-lm's context is ignored: the sampler keeps the stream
        return self.sampler.penalized(logits)

    def processors(self) -> list:
        return [self.penalize] if self.sampler.has_processors else []

    def __call__(self, logprobs):
        token = self.sampler(logprobs)
        self.sampler.accept(token)
        return token


@dataclass
class LiveRow:
    """A stream taken out of the batch mid-way: `cache` holds every token but the last
    one emitted; `sampler` has accepted every token the row emitted."""

    cache: list
    sampler: RequestSampler


class GeneratorBatch:
    """Rows of classic decode, keyed by request id (`models.batch.protocol.ClassicRows`).

    What only the slab batch can do is answered plainly here: sessions own their caches,
    rows never draft, no prefix cache, `interrupt` and prefill pieces are not honoured."""

    shares_slab = False
    row_drafts = False
    replica_index = None
    prefix_cache = None
    costs = None
    skip_cap = 2

    @property
    def draft_step_share(self) -> float:
        return 0.0

    @draft_step_share.setter
    def draft_step_share(self, share: float) -> None:
        pass  # rows never draft here

    @property
    def sampled_drafts(self) -> bool:
        return False

    @sampled_drafts.setter
    def sampled_drafts(self, on: bool) -> None:
        pass

    def drafts_rows_of(self, greedy: bool) -> bool:
        return False

    def step_stats(self) -> dict | None:
        return None

    def prefill_fits(self, prompt_ids: Sequence[int], piece: int) -> bool:
        return len(prompt_ids) <= piece  # `BatchGenerator` prefills a prompt whole

    def new_session_cache(self, prompt_ids: Sequence[int] = ()) -> list:
        raise RuntimeError("sessions own their caches beside a BatchGenerator batch (shares_slab False)")

    def keep_prompt(self, cache: list, prompt_ids: Sequence[int]) -> None:
        pass  # no prefix cache

    def release(self, cache: list, token_ids: Sequence[int] | None = None) -> None:
        pass  # a session's own cache is not this batch's

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 16,
        prefill_batch_size: int = 8,
        single_row_fast_path: bool = True,
        solo_burst_s: float = 0.0,
        grammars: Grammars | None = None,
    ):
        """`solo_burst_s`: a solo row's `decode()` keeps stepping until this much time
        has passed (at least one step; 0 = exactly one), so when steps are fast one
        call returns several tokens and the caller's per-call overhead is shared."""
        if solo_burst_s < 0:
            raise ValueError("solo_burst_s must be >= 0")
        self._model = model
        self._single_row_fast_path = single_row_fast_path
        self._solo_burst_s = solo_burst_s
        self._eos_token_ids = tuple(eos_token_ids)
        self._grammars = grammars
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in self._eos_token_ids],
            completion_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
        )
        self._uid_by_request: dict[str, int] = {}
        self._request_by_uid: dict[int, str] = {}
        self._stop_ids: dict[str, tuple[int, ...]] = {}  # every row, solo or batched
        self._num_top: dict[str, int] = {}  # batch rows that report logprobs: how many alternatives
        self._solo: SoloRow | None = None  # the lone decoding row, if any
        self._finished_solo: set[str] = set()  # finished solo rows not yet removed
        # Streams inserted mid-way whose one-token prompt has not run yet: their state
        # is still exactly what was handed in (see `extract`).
        self._queued_live: dict[str, LiveRow] = {}

    def num_rows(self) -> int:
        """Rows admitted and not yet removed (finished ones included)."""
        return len(self.request_ids())

    def request_ids(self) -> list[str]:
        ids = list(self._uid_by_request) + sorted(self._finished_solo)
        return ids + [self._solo.request_id] if self._solo is not None else ids

    def _stop_sequences(self, request_id: str) -> StopSequences:
        return StopSequences([[t] for t in self._stop_ids[request_id]])

    def _prefill_pending(self) -> bool:
        return bool(len(self._gen._prompt_batch) or self._gen._unprocessed_sequences)

    def _batch_is_empty(self) -> bool:
        return not len(self._gen._generation_batch) and not self._prefill_pending()

    def _solo_path_free(self) -> bool:
        """A new row may run as the lone `SoloRow`: fast path on, no other row."""
        return self._single_row_fast_path and self._solo is None and self._batch_is_empty()

    def _retire_solo_if_finished(self, batch: TokenBatch) -> None:
        if batch.finish_reason is not None:
            self._finished_solo.add(self._solo.request_id)
            self._solo = None

    def _register(self, uid: int, request_id: str) -> None:
        self._uid_by_request[request_id] = uid
        self._request_by_uid[uid] = request_id

    def _insert_live_row(
        self, request_id: str, next_input: int, cache: list, sampler: RequestSampler, num_left: int
    ) -> None:
        """Queue a stream already under way as a batch row: `cache` holds everything
        before `next_input`, which becomes a one-token prompt; `sampler` goes on from
        its position."""
        hooks = RowSampler(sampler)
        self._note_logprobs(request_id, sampler)
        (uid,) = self._gen.insert(
            [[next_input]],
            max_tokens=[num_left],
            caches=[cache],
            samplers=[hooks],
            logits_processors=[hooks.processors()],
            stop_sequences=[self._stop_sequences(request_id)],
        )
        self._register(uid, request_id)
        self._queued_live[request_id] = LiveRow(cache, sampler)

    def _note_logprobs(self, request_id: str, sampler: RequestSampler) -> None:
        if sampler.wants_logprobs:
            self._num_top[request_id] = sampler.params.logprobs

    def _logprobs_of(self, request_id: str, token, logprobs: mx.array) -> LogprobArrays | None:
        """(lazy) a batch row's report for `token` drawn from its processed `logprobs`
        (V,), None when its request did not ask."""
        k = self._num_top.get(request_id)
        if k is None:
            return None
        tokens = token if isinstance(token, mx.array) else mx.array([token])
        return logprob_arrays(logprobs.reshape(1, -1), tokens.reshape(-1), k)

    def _batch(self, request_id: str, token: int, logprobs: mx.array, reason: str | None) -> TokenBatch:
        report = self._logprobs_of(request_id, token, logprobs)
        return TokenBatch(request_id, [token], reason, logprobs=None if report is None else report.tolist())

    def _solo_into_batch(self) -> list[TokenBatch]:
        """Move the solo row into `BatchGenerator` (queued for prefill as a one-token
        prompt). Returns the pending token it emitted on the way."""
        solo, self._solo = self._solo, None
        if solo is None:
            return []
        emitted = solo.step(queue_next=False)
        if emitted.finish_reason is not None:
            self._finished_solo.add(solo.request_id)
            return [emitted]
        (token,) = emitted.token_ids
        self._insert_live_row(solo.request_id, token, solo.cache, solo.sampler, solo.max_tokens - solo.num_emitted)
        return [emitted]

    def adopt(
        self,
        request_id: str,
        cache: list,
        sampler: RequestSampler,
        pending_token: int,
        *,
        max_tokens: int,
        num_emitted: int,
        stop_ids: Sequence[int],
        history: Sequence[int] | None = None,
        lane: int = 1,
    ) -> list[TokenBatch]:
        """Take over a live decode from elsewhere (a speculative session) as a row.

        State handed over: `cache` holds every token of the stream but `pending_token`,
        which is the last token already emitted to the client; `sampler` is the
        request's sampler, at the position where the other path left it; `num_emitted`
        of `max_tokens` are out. The row's first step feeds `pending_token` and samples
        the next token, which is the next token the stream would have had as a classic
        row: nothing is recomputed or redrawn.

        Alone (fast path on, no other row) the row becomes a `SoloRow` whose first
        forward is queued now; otherwise it joins `BatchGenerator` as a one-token
        prompt and emits from a later `decode()` / `prefill()`. A lone row moved into
        the batch on the way emits its pending token: those batches are returned.
        `history` (the stream's earlier tokens) and `lane` are for batches whose rows
        draft; this one's rows do not.
        """
        check_adoptable(request_id, self.request_ids(), num_emitted, max_tokens)
        self._stop_ids[request_id] = tuple(stop_ids)
        if self._solo_path_free():
            self._solo = SoloRow.resume(
                request_id,
                self._model,
                cache,
                sampler,
                self._stop_ids[request_id],
                max_tokens,
                pending_token,
                num_emitted=num_emitted,
            )
            return []
        moved = self._solo_into_batch()
        self._insert_live_row(request_id, pending_token, cache, sampler, max_tokens - num_emitted)
        return moved

    def _solo_burst(self) -> TokenBatch:
        tic = time.perf_counter()
        batch = self._solo.step()
        while batch.finish_reason is None and time.perf_counter() - tic < self._solo_burst_s:
            batch.extend(self._solo.step())
        self._retire_solo_if_finished(batch)
        return batch

    def _batch_into_solo(self) -> None:
        """When exactly one row decodes in the batch and nothing waits for prefill,
        take it out: its cache holds every emitted token and its next token is in
        flight, which is a `SoloRow`'s state."""
        gen = self._gen
        rows = gen._generation_batch
        if self._solo is not None or len(rows) != 1 or self._prefill_pending():
            return
        uid = rows.uids[0]
        request_id = self._request_by_uid[uid]
        solo = SoloRow(
            request_id,
            self._model,
            rows.extract_cache(0),
            rows.samplers[0].sampler,
            self._stop_ids[request_id],
            rows.max_tokens[0],
            rows._next_tokens,
            num_emitted=rows._num_tokens[0],
            pending_logprobs=self._logprobs_of(request_id, rows._next_tokens, rows._next_logprobs[0]),
        )
        gen.remove([uid])
        del self._uid_by_request[request_id], self._request_by_uid[uid]
        self._solo = solo

    def prefill(
        self, requests: Sequence[Request], between: Callable[[], None] | None = None, piece: int = 0
    ) -> list[TokenBatch]:
        """Admit and prefill `requests`; returns each one's first token(s). `between` and
        `piece` are ignored: `BatchGenerator` prefills a group whole.

        Existing batch rows are set aside while the new group is processed, so they
        do not advance (`_generation_batch` is swapped for an empty one and merged
        back; merging is what `BatchGenerator` itself does when rows leave prefill).
        A one-token prompt can reach decode before a longer one in the same group and
        then emits more than one token here. A solo row joins the group (see the
        module docstring), so its tokens can be among the returned batches too.
        """
        if not requests:
            return []
        check_admissible(requests, self.request_ids())
        for r in requests:
            self._stop_ids[r.request_id] = stop_token_ids(self._eos_token_ids, r.sampling)
        if len(requests) == 1 and self._solo_path_free():
            (r,) = requests
            self._solo, first = SoloRow.start(
                r.request_id,
                self._model,
                r.prompt_ids,
                RequestSampler(r.sampling, r.prompt_ids, self._grammars),
                self._stop_ids[r.request_id],
                r.sampling.max_tokens,
            )
            self._retire_solo_if_finished(first)
            return [first]
        moved = self._solo_into_batch()
        hooks = [RowSampler(RequestSampler(r.sampling, r.prompt_ids, self._grammars)) for r in requests]
        for r, h in zip(requests, hooks):
            self._note_logprobs(r.request_id, h.sampler)
        uids = self._gen.insert(
            [list(r.prompt_ids) for r in requests],
            max_tokens=[r.sampling.max_tokens for r in requests],
            samplers=hooks,
            logits_processors=[h.processors() for h in hooks],
            stop_sequences=[self._stop_sequences(r.request_id) for r in requests],
        )
        for uid, r in zip(uids, requests):
            self._register(uid, r.request_id)

        outputs: dict[int, TokenBatch] = {}
        existing = self._gen._generation_batch
        self._gen._generation_batch = GenerationBatch.empty(self._model, self._gen.sampler)
        try:
            waiting = set(uids)
            while waiting:
                _, responses = self._gen.next()
                for resp in responses:
                    step = self._batch(self._request_by_uid[resp.uid], resp.token, resp.logprobs, resp.finish_reason)
                    if resp.uid in outputs:
                        outputs[resp.uid].extend(step)
                    else:
                        outputs[resp.uid] = step
                    waiting.discard(resp.uid)
        finally:
            self._forget_run_inserts()
            new_rows = self._gen._generation_batch
            if len(new_rows):
                existing.extend(new_rows)
            self._gen._generation_batch = existing
        new_uids = set(uids)
        others = [b for uid, b in outputs.items() if uid not in new_uids]
        return moved + others + [outputs[uid] for uid in uids]

    def decode(
        self, rider: Rider | None = None, drafts: bool = False, interrupt: Callable[[], bool] | None = None
    ) -> list[TokenBatch]:
        """One batched decode step: one token for every active row.

        With `rider` (a verify carried along, `models.forward.ragged.Rider`) the step's forward
        goes through it, so the verify runs in the same forward as the rows; a lone row
        then steps exactly once. The rider stays unused when no forward runs (no rows,
        or a lone row emitting its last token). `drafts` and `interrupt` are for the slab
        batch (`models.batch.slab_batch`); this one's rows do not draft, nor stop part-way."""
        if self._single_row_fast_path:
            self._batch_into_solo()
        if self._solo is not None:
            if rider is None:
                return [self._solo_burst()]
            batch = self._solo.step(model=rider)
            self._retire_solo_if_finished(batch)
            return [batch]
        if not self._uid_by_request:
            return []
        rows = self._gen._generation_batch
        if rider is not None:
            rows.model = rider  # GenerationBatch runs its forward as `self.model(...)`
        try:
            _, responses = self._gen.next()
        finally:
            rows.model = self._model
            self._forget_run_inserts()
        return [self._batch(self._request_by_uid[r.uid], r.token, r.logprobs, r.finish_reason) for r in responses]

    def extract(self, request_id: str) -> tuple[TokenBatch, LiveRow | None]:
        """Take a decoding row out, for a speculative session to continue it.

        The row's next token (already drawn by its last forward) is emitted on the way
        and returned first; after it the cache holds every token of the stream but that
        one, which is a session's state between rounds (`LiveRow`). When the emitted
        token ends the row, the row is gone and the state is None. Nothing is
        recomputed or redrawn, so the stream is the one the row would have produced.
        """
        if self._solo is not None and self._solo.request_id == request_id:
            solo, self._solo = self._solo, None
            emitted = solo.step(queue_next=False)
            if emitted.finish_reason is not None:
                self._finished_solo.add(request_id)
                return emitted, None
            self._stop_ids.pop(request_id, None)
            self._num_top.pop(request_id, None)
            return emitted, LiveRow(solo.cache, solo.sampler)
        uid = self._uid_by_request.get(request_id)
        rows = self._gen._generation_batch
        if uid is not None and uid not in rows.uids and request_id in self._queued_live:
            state = self._queued_live[request_id]  # not run yet: nothing to emit
            self.remove(request_id)
            return TokenBatch(request_id, []), state
        if uid is None or uid not in rows.uids:
            raise ValueError(f"request {request_id!r} is not a decoding classic row")
        idx = rows.uids.index(uid)
        token = rows._next_tokens[idx].item()
        reason = None
        if token in self._stop_ids[request_id]:
            reason = "stop"
        elif rows._num_tokens[idx] + 1 >= rows.max_tokens[idx]:
            reason = "length"
        state = None if reason else LiveRow(rows.extract_cache(idx), rows.samplers[idx].sampler)
        emitted = self._batch(request_id, token, rows._next_logprobs[idx], reason)
        self.remove(request_id)
        return emitted, state

    def _forget_run_inserts(self) -> None:
        rows = set(self._gen._generation_batch.uids)
        for request_id in [r for r in self._queued_live if self._uid_by_request.get(r) in rows]:
            del self._queued_live[request_id]

    def remove(self, request_id: str) -> None:
        """Drop a row (finished rows are already out of the batch). Idempotent."""
        self._stop_ids.pop(request_id, None)
        self._num_top.pop(request_id, None)
        self._queued_live.pop(request_id, None)
        self._finished_solo.discard(request_id)
        if self._solo is not None and self._solo.request_id == request_id:
            self._solo = None
            return
        uid = self._uid_by_request.pop(request_id, None)
        if uid is None:
            return
        self._request_by_uid.pop(uid, None)
        self._gen.remove([uid])

    def close(self) -> None:
        self._solo = None
        self._gen.close()
