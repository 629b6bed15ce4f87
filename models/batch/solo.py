"""One classic row decoded the way mlx-lm's `generate_step` decodes a single stream.

Why it exists: `BatchGenerator` keeps its rows in a `BatchKVCache`, whose attention
always takes an explicit mask array (left padding). For a batch of one that mask buys
nothing and slows every forward (docs/history/benchmarks-2026-11.md, "Second H200
run"). `GeneratorBatch` therefore runs a lone row here and moves it into
the batch when a second row arrives (`models.batch.generator_batch`).

Pipelining is generate_step's: after a token is returned, the forward that feeds it
and samples the next one is already queued (`pending`), so the host's bookkeeping
between two `step()` calls overlaps the device's work. State between steps: the
cache holds every emitted token (the last one lazily), `pending` is the next token,
still being computed, already drawn from the request's sampler (with
`pending_logprobs`, its lazy logprobs, where the request asked for them).
"""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import make_prompt_cache

from models.forward.prefill import prefill_chunks
from models.sampling.samplers import LogprobArrays, RequestSampler
from scheduler.model_api import TokenBatch

CLEAR_CACHE_EVERY = 256  # generate_step's cadence for releasing MLX's buffer cache


class SoloRow:
    def __init__(
        self,
        request_id: str,
        model: nn.Module,
        cache: list,
        sampler: RequestSampler,
        stop_ids: Sequence[int],
        max_tokens: int,
        pending: mx.array,
        num_emitted: int = 0,
        pending_logprobs: LogprobArrays | None = None,
    ):
        """Adopt a row mid-stream: `cache` holds the emitted tokens, `pending` (shape
        (1,)) is the next token, sampled but not yet emitted, `pending_logprobs` its
        logprobs (where the request asked)."""
        self.request_id = request_id
        self.model = model
        self.cache = cache
        self.sampler = sampler
        self.stop_ids = frozenset(stop_ids)
        self.max_tokens = max_tokens
        self.pending = pending
        self.pending_logprobs = pending_logprobs
        self.num_emitted = num_emitted

    @classmethod
    def start(
        cls,
        request_id: str,
        model: nn.Module,
        prompt_ids: Sequence[int],
        sampler: RequestSampler,
        stop_ids: Sequence[int],
        max_tokens: int,
    ) -> tuple["SoloRow", TokenBatch]:
        """Prefill `prompt_ids` (all but the last token in chunks, then the last one,
        like `BatchGenerator`) and emit the first token."""
        if not prompt_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        with mx.stream(generation_stream):
            cache = make_prompt_cache(model)
            prefill_chunks(model, cache, prompt_ids[:-1])
        row = cls.resume(request_id, model, cache, sampler, stop_ids, max_tokens, prompt_ids[-1])
        return row, row.step()

    @classmethod
    def resume(
        cls,
        request_id: str,
        model: nn.Module,
        cache: list,
        sampler: RequestSampler,
        stop_ids: Sequence[int],
        max_tokens: int,
        next_input: int,
        num_emitted: int = 0,
    ) -> "SoloRow":
        """A row whose `cache` holds everything before `next_input` (the last prompt
        token, or the last token already emitted): the forward that feeds it and draws
        the row's next token is queued now."""
        row = cls(request_id, model, cache, sampler, stop_ids, max_tokens, pending=None, num_emitted=num_emitted)
        with mx.stream(generation_stream):
            row.pending, row.pending_logprobs = row._forward(mx.array([next_input], dtype=mx.int32))
            mx.async_eval(row.pending, *row._pending_arrays())
        return row

    def _forward(self, token: mx.array, model=None) -> tuple[mx.array, LogprobArrays | None]:
        """Feed one token (shape (1,)) and draw the next from the request's sampler,
        which takes it as emitted (a drawn token is always emitted, or the row ends on
        the one before); `model` stands in for the row's own (a `models.forward.ragged.Rider`).
        Returns the token and its logprobs (None unless the request asked)."""
        logits = (model or self.model)(token[:, None], cache=self.cache)
        return self.sampler.next_token_with_logprobs(logits[:, -1, :])

    def _pending_arrays(self) -> list[mx.array]:
        return [] if self.pending_logprobs is None else self.pending_logprobs.arrays()

    def _finish_reason(self, token: int) -> str | None:
        # mlx-lm's rule: a stop token ends the row even when max_tokens is also reached.
        if token in self.stop_ids:
            return "stop"
        return "length" if self.num_emitted >= self.max_tokens else None

    def step(self, queue_next: bool = True, model=None) -> TokenBatch:
        """Emit the pending token. Unless it ends the row (or `queue_next` is False:
        the row is about to leave, and its next forward will run elsewhere), the
        forward that feeds it is queued before the host waits for it, through `model`
        when given."""
        with mx.stream(generation_stream):
            token_array, token_logprobs = self.pending, self.pending_logprobs
            self.pending = self.pending_logprobs = None
            if queue_next and self.num_emitted + 1 < self.max_tokens:
                self.pending, self.pending_logprobs = self._forward(token_array, model)
                mx.async_eval(self.pending, *self._pending_arrays())
            token = token_array.item()
        self.num_emitted += 1
        reason = self._finish_reason(token)
        if reason is not None:
            self.pending = self.pending_logprobs = None
        if self.num_emitted % CLEAR_CACHE_EVERY == 0:
            mx.clear_cache()
        logprobs = None if token_logprobs is None else token_logprobs.tolist()
        return TokenBatch(self.request_id, [token], reason, logprobs=logprobs)
