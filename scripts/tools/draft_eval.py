"""How well a draft predicts its target, and what a draft token costs (`scripts.tools.train_draft`).

Acceptance is measured along the target's own greedy continuations of held-out prompts:
at each generated position the draft, fed the same history, proposes its argmax, and a
position agrees when that equals the target's token. That is exactly what a greedy
speculative round checks, so a round of K drafts accepts the agreeing run at its start
(`accepted_per_round`), then the target adds one token of its own.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from scripts.tools.draft_data import Example, padded_length


def completion_logits(model: nn.Module, example: Example) -> mx.array:
    """`model`'s logits (lazy) at each completion position of `example`, from one
    teacher-forced forward. Inputs are padded on the right to `padded_length` (causal
    attention: padding changes no earlier position), so a GPU builds attention kernels for
    a few lengths, not one per example."""
    seq = example.prompt_ids + example.completion_ids
    inputs = seq[:-1] + [0] * (padded_length(len(seq)) - len(seq) + 1)
    return model(mx.array(inputs)[None])[0, len(example.prompt_ids) - 1 : len(seq) - 1]


def draft_matches(draft: nn.Module, examples: list[Example]) -> list[list[bool]]:
    """Per example, whether the draft's argmax equals the target's token at each
    completion position (`completion_logits`)."""
    out = []
    for e in examples:
        predicted = mx.argmax(completion_logits(draft, e), axis=-1).tolist()
        out.append([p == t for p, t in zip(predicted, e.completion_ids)])
    return out


def accepted_per_round(matches: list[list[bool]], k: int) -> float:
    """Mean accepted drafts per simulated round of `k` drafts: a round accepts the run of
    agreeing positions at its start (at most `k`), then the target's own token follows.

    >>> accepted_per_round([[True, True, False, False, True, True, True]], 2)  # rounds take 2, 0, 2
    1.3333333333333333
    >>> accepted_per_round([[True] * 8], 4)  # rounds take 4 (+1), then 3 to the end
    3.5
    """
    accepted = rounds = 0
    for row in matches:
        pos = 0
        while pos < len(row):
            m = 0
            while m < k and pos + m < len(row) and row[pos + m]:
                m += 1
            accepted, rounds, pos = accepted + m, rounds + 1, pos + m + 1
    return accepted / rounds if rounds else 0.0


def rejection_acceptance(
    target: nn.Module, draft: nn.Module, examples: list[Example], temperature: float
) -> list[list[float]]:
    """Per example, at each completion position, the probability that rejection sampling
    accepts a draft token sampled there: sum over the vocabulary of min(p, q), p and q the
    target's and the draft's distributions at `temperature`, both fed the same history
    (`completion_logits`)."""
    out = []
    for e in examples:
        p, q = (mx.softmax(completion_logits(m, e).astype(mx.float32) / temperature, axis=-1) for m in (target, draft))
        out.append(mx.minimum(p, q).sum(axis=-1).tolist())
    return out


def expected_per_round(alphas: list[list[float]], k: int) -> float:
    """`accepted_per_round` in expectation: the draft at a position is accepted with
    probability `alphas[row][position]`, a round of `k` drafts stops at its first rejection
    (or at the continuation's end), and the next round starts after the target's own token.
    Returns expected accepted drafts over expected rounds, summed over rows; for 0/1
    alphas it is `accepted_per_round` exactly.

    >>> expected_per_round([[1.0, 1.0, 1.0]], 2)  # one round takes 2, then the target's token ends it
    2.0
    >>> expected_per_round([[0.5, 0.5]], 2)  # from 0: 0 (then a round from 1), 1 or 2
    0.6666666666666666
    """
    accepted = rounds = 0.0
    for row in alphas:
        n = len(row)
        drafts, count = [0.0] * (n + 2), [0.0] * (n + 2)  # expected from a round starting there on
        for start in range(n - 1, -1, -1):
            width = min(k, n - start)  # drafts this round can bring
            reach, d, c = 1.0, 0.0, 0.0
            for m in range(width + 1):  # m drafts accepted, then the target's token
                p = reach * (1.0 - row[start + m] if m < width else 1.0)
                d += p * (m + drafts[start + m + 1])
                c += p * (1 + count[start + m + 1])
                if m < width:
                    reach *= row[start + m]
            drafts[start], count[start] = d, c
        accepted, rounds = accepted + drafts[0], rounds + count[0]
    return accepted / rounds if rounds else 0.0


def acceptance(matches: list[list[bool]], ks=(2, 4, 6)) -> dict:
    """Per-token agreement and simulated accepted drafts per round at each K."""
    positions = sum(len(row) for row in matches)
    result = {
        "prompts": len(matches),
        "positions": positions,
        "agreement": round(sum(map(sum, matches)) / positions, 4) if positions else 0.0,
    }
    for k in ks:
        result[f"accepted_per_round_k{k}"] = round(accepted_per_round(matches, k), 3)
    return result


def step_seconds(model: nn.Module, prompt_ids: list[int], steps: int = 24, warmup: int = 4) -> float:
    """Median seconds of one single-token decode step (batch 1, KV cache after `prompt_ids`)."""
    cache = make_prompt_cache(model)
    token = mx.argmax(model(mx.array(prompt_ids)[None], cache=cache)[:, -1], axis=-1)
    mx.eval(token)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)
