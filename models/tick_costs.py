"""Measure what a tick's forward costs on this machine, for `scheduler.costs`.

At load, on throwaway caches of `CONTEXT` tokens per row: a decode step of b rows
(the classic batch alone) and the same step carrying one verify of 1 + K tokens (the
fused tick), for b in `batch_sizes`, plus the drafter proposing K tokens. Medians of a
few synchronised runs after one warm-up each; a CPU replica spends well under a
second here with the bundled pair.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from models.drafters import Drafter
from models.ragged import Group, packed_forward
from scheduler.costs import TickCosts

CONTEXT = 128
REPEATS = 3


def batch_sizes(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to `max_rows` (and `max_rows` itself)."""
    sizes, b = [], 1
    while b < max_rows:
        sizes.append(b)
        b *= 2
    return sizes + [max_rows]


def _timed(fn) -> float:
    fn()  # warm-up: first use of a shape allocates
    runs = []
    for _ in range(REPEATS):
        tic = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - tic)
    return statistics.median(runs)


def measure(model: nn.Module, drafter: Drafter | None, num_draft_tokens: int, max_rows: int,
            vocab_size: int) -> TickCosts:
    prompt = [(7 * i + 3) % vocab_size for i in range(CONTEXT)]

    def prefilled() -> list:
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def trim(cache: list, n: int) -> None:
        for c in cache:
            c.trim(n)

    sizes = batch_sizes(max_rows)
    rows = [prefilled() for _ in range(max(sizes))]
    verify_cache = prefilled()
    verify = mx.array(prompt[: num_draft_tokens + 1], dtype=mx.int32)
    decode, fused = {}, {}

    def verify_alone():
        mx.eval(model(verify[None], cache=verify_cache))
        trim(verify_cache, verify.size)

    fused[0] = _timed(verify_alone)
    for b in sizes:
        batch = rows[0] if b == 1 else [BatchKVCache.merge([r[i] for r in rows[:b]]) for i in range(len(rows[0]))]
        step = mx.array(prompt[:b], dtype=mx.int32)

        def decode_step():
            mx.eval(model(step[:, None], cache=batch))
            trim(batch, 1)

        def fused_step():
            mx.eval(packed_forward(model, [Group(batch, step), Group(verify_cache, verify)]))
            trim(batch, 1)
            trim(verify_cache, verify.size)

        decode[b] = _timed(decode_step)
        fused[b] = _timed(fused_step)
    return TickCosts(decode, fused, _draft_seconds(drafter, prompt, num_draft_tokens))


def _draft_seconds(drafter: Drafter | None, prompt: list[int], k: int) -> float:
    if drafter is None:
        return 0.0
    base = len(prompt) - REPEATS - 2
    state = drafter.new_state(prompt[:base - 1])
    calls = iter(range(REPEATS + 1))

    def propose():  # each call sees one more token, as a round after a rejection does
        history = prompt[: base + next(calls)]
        drafter.propose(state, history, k)
        drafter.rollback(state, k, 0)

    return _timed(propose)
