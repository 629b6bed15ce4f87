"""Fixes for bugs in the pinned mlx-lm (0.32.2) that change what a served model outputs.

Each fix wraps one mlx-lm function, says what it repairs and how a test shows it, and is
installed once on import (`models.loader` imports this module, so every loaded model
has it). Remove a fix when the pin moves past the bug; its test then says so.

- gemma2 attention with grouped queries (every real gemma2 checkpoint): mlx-lm reshapes
  the queries to 5-D (batch, kv heads, repeats, L, dim) but applies the 4-D array mask
  (batch, 1, L, keys) of a batch with left padding as it comes, so the mask's batch axis
  lines up with the kv-head axis: with two rows of different lengths each row gets the
  other's padding mask (silently wrong), with three or more the shapes do not broadcast
  (`tests/model/test_families.py`: gemma2 with GQA in the matrix, and
  `test_gemma2_batches_with_grouped_queries`).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import gemma2

_GEMMA2_ATTENTION = gemma2.Attention.__call__


def _gemma2_attention(self, x, mask=None, cache=None):
    if self.repeats > 1 and isinstance(mask, mx.array) and mask.ndim == 4:
        mask = mx.expand_dims(mask, 2)  # (B, 1, L, T) -> (B, 1, 1, L, T): every group alike
    return _GEMMA2_ATTENTION(self, x, mask=mask, cache=cache)


gemma2.Attention.__call__ = _gemma2_attention
