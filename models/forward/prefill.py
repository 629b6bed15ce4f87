"""Chunked prefill: a prompt's head run through a model in bounded pieces.

Every path that fills a cache from a prompt outside `BatchGenerator` (a speculative
session's target, a lone classic row, the draft model's state) prefills the same way,
so their caches hold the same values as the batch's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

PREFILL_STEP = 2048  # BatchGenerator's prefill_step_size default


def prefill_chunks(
    model: nn.Module, cache: list, token_ids: Sequence[int], forward: Callable[[list[int]], object] | None = None
) -> None:
    """Append `token_ids` to `cache`, `PREFILL_STEP` tokens per forward, evaluating the
    cache after each so memory holds one chunk's activations. `forward(chunk)` runs one
    chunk (default: `model` over `cache`). E.g. 5000 tokens: forwards of 2048, 2048, 904."""
    if forward is None:

        def forward(chunk: list[int]) -> object:
            return model(mx.array([chunk]), cache=cache)

    token_ids = list(token_ids)
    for start in range(0, len(token_ids), PREFILL_STEP):
        forward(token_ids[start : start + PREFILL_STEP])
        mx.eval([c.state for c in cache])
