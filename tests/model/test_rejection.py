"""Rejection sampling (`models.speculative.rejection`) emits exactly the target's distribution.

A hand-built pair of bigram "models" over five tokens: the target P forbids token 4
everywhere (as a grammar mask would), the draft Q likes it, and otherwise Q is far from
P. Speculative rounds (K = 2, drafts drawn from Q, cut at a forbidden token the way
`RequestSampler.allowed_drafts` cuts them, the cut draft's row kept as the session keeps
it) run from token 0 until two tokens are out; the joint distribution of those two
tokens is known exactly (P[0][a] * P[a][b]), so a chi-square goodness-of-fit test over
many seeds checks it. The same test fails when the correction is drawn from p instead of
the residual, or when a cut draft's row is dropped: the check has power.
"""

import collections

import mlx.core as mx
import numpy as np
import pytest

import models.speculative.rejection
from models.speculative.rejection import verify_drafts, with_bonus_row

from .helpers import chi2_critical

N = 4000
K = 2

P = np.array(
    [
        [0.10, 0.50, 0.30, 0.10, 0.0],
        [0.40, 0.10, 0.10, 0.40, 0.0],
        [0.25, 0.25, 0.25, 0.25, 0.0],
        [0.70, 0.10, 0.10, 0.10, 0.0],
        [0.20, 0.20, 0.30, 0.30, 0.0],
    ],
    dtype=np.float32,
)
Q = np.array(
    [
        [0.40, 0.10, 0.10, 0.10, 0.30],
        [0.10, 0.60, 0.10, 0.10, 0.10],
        [0.50, 0.10, 0.10, 0.10, 0.20],
        [0.10, 0.10, 0.10, 0.40, 0.30],
        [0.25, 0.25, 0.25, 0.25, 0.00],
    ],
    dtype=np.float32,
)
FORBIDDEN = 4


def speculative_pair(seed: int) -> tuple[int, int]:
    """The first two tokens after token 0, from rounds of K sampled drafts."""
    rng = np.random.default_rng(seed)
    key = mx.random.key(seed)
    out = [0]
    while len(out) < 3:
        proposed = []
        for _ in range(K):
            proposed.append(int(rng.choice(5, p=Q[([out[-1]] + proposed)[-1]])))
        cut = proposed.index(FORBIDDEN) if FORBIDDEN in proposed else K
        draft = proposed[:cut]
        before = [out[-1]] + proposed
        q = with_bonus_row(mx.array(Q[before[:K]]), len(draft))
        p = mx.array(P[([out[-1]] + draft)])
        key, subkey = mx.random.split(key)
        tokens, m = verify_drafts(p, q, mx.array(draft, dtype=mx.int32), subkey)
        out += tokens.tolist()[: m.item() + 1]
    return out[1], out[2]


def goodness_of_fit() -> tuple[float, int, collections.Counter]:
    counts = collections.Counter(speculative_pair(seed) for seed in range(N))
    stat, df = 0.0, -1
    for a in range(5):
        for b in range(5):
            expected = N * P[0][a] * P[a][b]
            if expected == 0:
                assert counts[(a, b)] == 0, f"emitted the forbidden pair {(a, b)}"
                continue
            stat += (counts[(a, b)] - expected) ** 2 / expected
            df += 1
    return stat, df, counts


def test_speculative_tokens_follow_the_target_exactly():
    stat, df, counts = goodness_of_fit()
    assert df == 15 and min(N * P[0][a] * P[a][b] for a, b in counts) >= 40
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"


@pytest.mark.parametrize("mutant", ["correction_from_p", "cut_row_dropped"])
def test_the_check_catches_a_wrong_correction(monkeypatch, mutant):
    if mutant == "correction_from_p":
        monkeypatch.setattr(models.speculative.rejection, "residual", lambda p, q: p)
    else:
        monkeypatch.setitem(
            globals(), "with_bonus_row", lambda q, n: mx.concatenate([q[:n], mx.zeros((1, q.shape[-1]), q.dtype)])
        )
    stat, df, _ = goodness_of_fit()
    assert stat > chi2_critical(df), f"chi2={stat:.1f} df={df}"


@pytest.mark.parametrize(
    "p_row, q_row, draft, accept",
    [
        ([0.5, 0.5], [0.5, 0.5], 0, 1.0),  # q = p: always accepted
        ([0.9, 0.1], [0.5, 0.5], 0, 1.0),  # p > q at the draft: always accepted
        ([0.0, 1.0], [0.5, 0.5], 0, 0.0),  # p forbids it: never accepted
        ([0.25, 0.75], [0.5, 0.5], 0, 0.5),  # p / q
    ],
)
def test_acceptance_rate_is_min_1_p_over_q(p_row, q_row, draft, accept):
    p = mx.array([p_row, p_row])
    q = mx.array([q_row, [0.0, 0.0]])
    accepted = [verify_drafts(p, q, mx.array([draft]), mx.random.key(s))[1].item() for s in range(400)]
    assert abs(np.mean(accepted) - accept) < 0.08


def test_a_rejection_never_emits_the_rejected_draft():
    p, q = mx.array([[0.3, 0.7], [0.5, 0.5]]), mx.array([[0.9, 0.1], [0.0, 0.0]])
    for s in range(200):
        tokens, m = verify_drafts(p, q, mx.array([0]), mx.random.key(s))
        if m.item() == 0:
            assert tokens.tolist()[0] == 1  # the residual (0, 0.6) has no mass on 0
        else:
            assert tokens.tolist()[0] == 0


def test_same_key_same_tokens():
    p = mx.softmax(mx.random.normal((4, 50), key=mx.random.key(1)), axis=-1)
    q = mx.softmax(mx.random.normal((4, 50), key=mx.random.key(2)), axis=-1)
    q = with_bonus_row(q[:3], 3)
    draft = mx.array([3, 7, 11])
    a = verify_drafts(p, q, draft, mx.random.key(9))
    b = verify_drafts(p, q, draft, mx.random.key(9))
    assert a[0].tolist() == b[0].tolist() and a[1].item() == b[1].item()
