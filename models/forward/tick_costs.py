"""Measure what a tick's forward costs on this machine, for `scheduler.costs`.

At load, on a throwaway slab (`models.forward.slab`) of rows holding `CONTEXT` tokens each: a
decode step of b rows (the classic batch alone), the same step carrying one verify
of 1 + K tokens (the fused tick), b rows each verifying 1 + K tokens (rows that
draft), for b in `batch_sizes`, and at every other size and the largest b rows of which
one brings a draft (a step's first draft) and b rows of which half bring one draft each, plus the
drafter proposing K tokens. Medians of five synchronised runs after one warm-up each
(three once they take `BUDGET_S`).
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import mlx.nn as nn

from models.forward.slab import Slab
from models.speculative.drafters import Drafter
from scheduler.costs import TickCosts

CONTEXT = 128
REPEATS = 5
MIN_REPEATS = 3
BUDGET_S = 0.1  # past this much time a measurement stops at MIN_REPEATS runs


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
    # A slow forward (a real model on a CPU) gets fewer runs, so that measuring every size
    # stays a small part of a replica's start.
    while len(runs) < REPEATS and (len(runs) < MIN_REPEATS or sum(runs) < BUDGET_S):
        tic = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - tic)
    return statistics.median(runs)


def measure(
    model: nn.Module, drafter: Drafter | None, num_draft_tokens: int, max_rows: int, vocab_size: int
) -> TickCosts:
    prompt = [(7 * i + 3) % vocab_size for i in range(CONTEXT)]
    sizes = batch_sizes(max_rows)
    slab = Slab(model, rows=max(sizes) + 1)
    rows = [slab.add() for _ in range(max(sizes) + 1)]
    slab.forward(model, [(r, prompt) for r in rows])
    mx.eval(slab.arrays())
    verify = prompt[: num_draft_tokens + 1]

    def timed_forward(entries):
        def run():
            mx.eval(slab.forward(model, entries), slab.arrays())
            for row, tokens in entries:
                for view in row.cache:
                    view.trim(len(tokens))

        return _timed(run)

    # b decoding rows in slots 0..b-1, the verifying row next to them (as in a fused tick)
    decode = {b: timed_forward([(r, [prompt[i]]) for i, r in enumerate(rows[:b])]) for b in sizes}
    fused = {
        b: timed_forward([(r, [prompt[i]]) for i, r in enumerate(rows[:b])] + [(rows[b], verify)]) for b in [0, *sizes]
    }
    all_verify = {b: timed_forward([(r, verify) for r in rows[:b]]) for b in sizes if b > 1}
    # b rows, the first bringing one draft: a step's first draft (every other size)
    some = sizes[::2] + sizes[-1:] * (len(sizes) % 2 == 0)  # every other size and the largest
    one_draft = {
        b: timed_forward([(rows[0], prompt[:2])] + [(r, [prompt[i]]) for i, r in enumerate(rows[1:b], 1)]) for b in some
    }
    # half of b rows bring one draft each (a step where every row drafts runs differently
    # on a CPU: no one-token rows are left to share an attention call)
    half_one = {
        b: timed_forward([(r, prompt[i : i + 2] if i < b // 2 else [prompt[i]]) for i, r in enumerate(rows[:b])])
        for b in some
        if b >= 4
    }
    return TickCosts(decode, fused, _draft_seconds(drafter, prompt, num_draft_tokens), all_verify, one_draft, half_one)


def _draft_seconds(drafter: Drafter | None, prompt: list[int], k: int) -> float:
    if drafter is None:
        return 0.0
    base = len(prompt) - REPEATS - 2
    state = drafter.new_state(prompt[: base - 1])
    calls = iter(range(REPEATS + 1))

    def propose():  # each call sees one more token, as a round after a rejection does
        history = prompt[: base + next(calls)]
        drafter.propose(state, history, k)
        drafter.rollback(state, k, 0)

    return _timed(propose)
