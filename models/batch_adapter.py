"""Classic continuous batching over mlx-lm 0.32.2's `BatchGenerator`.

This is the only module that knows `BatchGenerator`'s API (including two private
attributes, see `prefill`); mlx-lm is pinned exactly for that reason.

How mlx-lm's generator works (0.32.2): `insert` queues prompts and returns uids; each
`next()` first decodes the generation batch (one forward for all rows) and then
advances prompt processing (prefill chunks; a prompt whose last token remains moves to
the generation batch, whose constructor runs the forward on that token). Decoding is
pipelined: a token returned by `next()` has already been fed to the model, and the
following token is being computed.

Our contract is one model action per call:
- `prefill(requests)` runs prompt processing for just these requests, until each has
  emitted its first token, without advancing existing rows;
- `decode()` runs one batched decode step over all rows and returns one token per row.
Finish reasons are mlx-lm's: "stop" (an EOS or per-request stop token, which is
emitted) or "length" (max_tokens reached); stop wins when both apply.
"""

from __future__ import annotations

from typing import Sequence

import mlx.nn as nn
from mlx_lm.generate import BatchGenerator, GenerationBatch, StopSequences

from models.sampling import RequestSampler, stop_token_ids
from scheduler.request import Request
from scheduler.runner import TokenBatch


class ClassicBatch:
    """Rows of classic decode, keyed by request id."""

    def __init__(
        self,
        model: nn.Module,
        *,
        eos_token_ids: Sequence[int],
        max_batch_size: int = 16,
        prefill_batch_size: int = 8,
    ):
        self._model = model
        self._eos_token_ids = tuple(eos_token_ids)
        self._gen = BatchGenerator(
            model,
            stop_tokens=[[t] for t in self._eos_token_ids],
            completion_batch_size=max_batch_size,
            prefill_batch_size=prefill_batch_size,
        )
        self._uid_by_request: dict[str, int] = {}
        self._request_by_uid: dict[int, str] = {}

    def num_rows(self) -> int:
        return len(self._uid_by_request)

    def request_ids(self) -> list[str]:
        return list(self._uid_by_request)

    def _stop_sequences(self, request: Request) -> StopSequences:
        return StopSequences([[t] for t in stop_token_ids(self._eos_token_ids, request.sampling)])

    def prefill(self, requests: Sequence[Request]) -> list[TokenBatch]:
        """Admit and prefill `requests`; returns each one's first token(s).

        Existing rows are set aside while the new group is processed, so they do not
        advance (`_generation_batch` is swapped for an empty one and merged back;
        merging is what `BatchGenerator` itself does when rows leave prefill). A
        one-token prompt can reach decode before a longer one in the same group and
        then emits more than one token here.
        """
        if not requests:
            return []
        for r in requests:
            if r.request_id in self._uid_by_request:
                raise ValueError(f"request {r.request_id!r} is already a classic row")
            if not r.prompt_ids:
                raise ValueError(f"request {r.request_id!r} has an empty prompt")
        uids = self._gen.insert(
            [list(r.prompt_ids) for r in requests],
            max_tokens=[r.sampling.max_tokens for r in requests],
            samplers=[RequestSampler(r.sampling) for r in requests],
            stop_sequences=[self._stop_sequences(r) for r in requests],
        )
        for uid, r in zip(uids, requests):
            self._uid_by_request[r.request_id] = uid
            self._request_by_uid[uid] = r.request_id

        outputs: dict[int, TokenBatch] = {}
        existing = self._gen._generation_batch
        self._gen._generation_batch = GenerationBatch.empty(self._model, self._gen.sampler)
        try:
            waiting = set(uids)
            while waiting:
                _, responses = self._gen.next()
                for resp in responses:
                    batch = outputs.setdefault(
                        resp.uid, TokenBatch(self._request_by_uid[resp.uid], [])
                    )
                    batch.token_ids.append(resp.token)
                    batch.finish_reason = resp.finish_reason
                    waiting.discard(resp.uid)
        finally:
            new_rows = self._gen._generation_batch
            if len(new_rows):
                existing.extend(new_rows)
            self._gen._generation_batch = existing
        return [outputs[uid] for uid in uids]

    def decode(self) -> list[TokenBatch]:
        """One batched decode step: one token for every active row."""
        if not self._uid_by_request:
            return []
        _, responses = self._gen.next()
        return [
            TokenBatch(self._request_by_uid[r.uid], [r.token], r.finish_reason)
            for r in responses
        ]

    def remove(self, request_id: str) -> None:
        """Drop a row (finished rows are already out of the batch). Idempotent."""
        uid = self._uid_by_request.pop(request_id, None)
        if uid is None:
            return
        self._request_by_uid.pop(uid, None)
        self._gen.remove([uid])

    def close(self) -> None:
        self._gen.close()
