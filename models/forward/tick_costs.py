"""Measure what a tick's forward costs on this machine, for `scheduler.costs`.

At load, on a throwaway slab (`models.forward.slab`) of rows holding `CONTEXT` tokens each: a
decode step of b rows (the classic batch alone), the same step carrying one verify of 1 + K
tokens (the fused tick), b rows each verifying 1 + K tokens (rows that draft), b rows of which
one brings a draft (a step's first draft), for b in `batch_sizes`, and from 4 rows b rows of
which half bring one draft each, plus the drafter proposing K tokens. The forwards of one size
run in turns, five rounds after one warm-up each (three once a round takes `ROUND_BUDGET_S`):
the decode step by its median, every other as the decode step plus the median of its differences
from the decode step of its round, so a machine that slows down for a moment moves both sides of
a difference.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from models.forward.slab import Slab
from models.speculative.drafters import Drafter
from scheduler.costs import TickCosts
from scheduler.json_store import KeyedStore

log = logging.getLogger(__name__)

CONTEXT = 128
REPEATS = 5
MIN_REPEATS = 3
BUDGET_S = 0.1  # past this much time a measurement stops at MIN_REPEATS runs
ROUND_BUDGET_S = 1.0  # past this much time a round, the forwards of one size stop at MIN_REPEATS rounds


# Measured tables kept across restarts (`policy_cache_dir`): a replica that starts again on the
# same machine with the same models and knobs reads them instead of measuring for seconds.
CACHE_FILE = "tick_costs.json"
CACHE_VERSION = 2  # of the measurement: bump when `measure` changes what it times


class TickCostStore(KeyedStore):
    """The measured tables by key (`MlxRunner._tick_costs_key`) in `CACHE_FILE`; an
    unreadable entry reads as none and a failed write only logs, as `scheduler.adaptive`'s
    `PolicyStore` does for verdicts."""

    def __init__(self, cache_dir: str) -> None:
        super().__init__(os.path.join(cache_dir, CACHE_FILE), CACHE_VERSION, "tick_costs")

    def load(self, key: str) -> TickCosts | None:
        entry = super().load(key)
        try:
            return TickCosts.from_json(entry) if entry is not None else None
        except (ValueError, TypeError, AttributeError):
            return None

    def save(self, key: str, costs: TickCosts) -> None:
        try:
            super().save(key, costs.to_json())
        except OSError as exc:  # serving goes on; the next start measures again
            log.warning("could not keep the tick costs in %s: %s", self.path, exc)


# A cached table whose one-row decode step now runs this much faster was measured while the
# machine was busy (a start beside Ray's and Serve's): `spot_check` measures again. A slower
# step now says only that the machine is busy now, so the table stays.
STALE_FASTER = 0.85


def spot_check(model: nn.Module, cached: TickCosts, vocab_size: int) -> float | None:
    """Time a one-row decode step as `measure` does; returns its seconds when the cached
    table's step is slower than that by more than `STALE_FASTER` allows, else None."""
    if 1 not in cached.decode:
        return None
    slab, (row,), prompt = _filled_slab(model, 1, vocab_size)
    step = _forward(model, slab, [(row, prompt[:1])])
    step()  # warm-up
    seconds = min(_timed_once(step) for _ in range(MIN_REPEATS))
    return seconds if seconds < STALE_FASTER * cached.decode[1] else None


def _timed_once(fn) -> float:
    tic = time.perf_counter()
    fn()
    return time.perf_counter() - tic


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


def _timed_in_turns(fns: dict[str, object]) -> dict[str, float]:
    """Seconds of each of `fns` run in turns: the first (the baseline) by its median,
    every other as the baseline plus the median of its per-round difference from it."""
    for fn in fns.values():
        fn()  # warm-up: first use of a shape allocates
    runs: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 0
    while rounds < REPEATS:
        tic = time.perf_counter()
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            runs[name].append(time.perf_counter() - start)
        rounds += 1
        if rounds >= MIN_REPEATS and time.perf_counter() - tic > ROUND_BUDGET_S:
            break
    base_name, *others = fns
    base = runs[base_name]
    out = {base_name: statistics.median(base)}
    for name in others:
        out[name] = out[base_name] + statistics.median(t - b for t, b in zip(runs[name], base))
    return out


def measure(
    model: nn.Module, drafter: Drafter | None, num_draft_tokens: int, max_rows: int, vocab_size: int
) -> TickCosts:
    sizes = batch_sizes(max_rows)
    slab, rows, prompt = _filled_slab(model, max(sizes) + 1, vocab_size)
    verify = prompt[: num_draft_tokens + 1]

    def steps(b: int) -> dict:
        # b decoding rows in slots 0..b-1; beside them, in turn: the verifying row next to
        # them (a fused tick), every row verifying (rows that draft), the first row bringing
        # one draft (a step's first draft), half the rows bringing one draft each (a step
        # where every row drafts runs differently on a CPU: no one-token rows share a call)
        one = [(r, [prompt[i]]) for i, r in enumerate(rows[:b])]
        variants = {"decode": one, "fused": one + [(rows[b], verify)]}
        if b > 1:
            variants["all_verify"] = [(r, verify) for r in rows[:b]]
        variants["one_draft"] = [(rows[0], prompt[:2])] + one[1:]
        if b >= 4:
            variants["half_one"] = [
                (r, prompt[i : i + 2] if i < b // 2 else [prompt[i]]) for i, r in enumerate(rows[:b])
            ]
        return _timed_in_turns({name: _forward(model, slab, entries) for name, entries in variants.items()})

    by_size = {b: steps(b) for b in sizes}
    decode = {b: t["decode"] for b, t in by_size.items()}
    fused = {0: _timed(_forward(model, slab, [(rows[0], verify)]))} | {b: t["fused"] for b, t in by_size.items()}
    all_verify = {b: t["all_verify"] for b, t in by_size.items() if "all_verify" in t}
    one_draft = {b: t["one_draft"] for b, t in by_size.items()}
    half_one = {b: t["half_one"] for b, t in by_size.items() if "half_one" in t}
    return TickCosts(decode, fused, _draft_seconds(drafter, prompt, num_draft_tokens), all_verify, one_draft, half_one)


def _filled_slab(model: nn.Module, num_rows: int, vocab_size: int) -> tuple[Slab, list, list[int]]:
    """A throwaway slab of `num_rows` rows, each holding the same `CONTEXT`-token prompt."""
    prompt = [(7 * i + 3) % vocab_size for i in range(CONTEXT)]
    slab = Slab(model, rows=num_rows)
    rows = [slab.add() for _ in range(num_rows)]
    slab.forward(model, [(r, prompt) for r in rows])
    mx.eval(slab.arrays())
    return slab, rows, prompt


def _forward(model: nn.Module, slab: Slab, entries: list) -> Callable[[], None]:
    """One forward of `entries` on `slab`, evaluated, its new tokens then trimmed away."""

    def run():
        mx.eval(slab.forward(model, entries), slab.arrays())
        for row, tokens in entries:
            for view in row.cache:
                view.trim(len(tokens))

    return run


# A drafter whose rounds stop by confidence (`draft_confidence`) is timed drafting all k,
# waiting at each step as its rounds do: on this prompt it would stop at once, and the
# gate scales the k-draft time by the drafts rounds verify (`scheduler.costs.LiveCosts`).
NEVER_STOPS = 1e-300


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

    threshold = getattr(drafter, "min_confidence", 0.0)
    if threshold > 0:
        drafter.min_confidence = NEVER_STOPS
    try:
        return _timed(propose)
    finally:
        if threshold > 0:
            drafter.min_confidence = threshold
