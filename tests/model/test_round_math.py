"""Rollback arithmetic of one speculative round, as tables."""

import pytest

from models.speculative.drafters import ngram_lookup
from models.speculative.round_math import (
    accept_count,
    clip_tokens,
    draft_budget,
    draft_cache_trim,
    target_cache_trim,
)

EOS = 0

# (case, draft, target samples, accepted, emitted, target trim, draft trim)
ROUNDS = [
    ("all accepted", [5, 6, 7, 8], [5, 6, 7, 8, 9], 4, [5, 6, 7, 8, 9], 0, 0),
    ("first rejected", [5, 6, 7, 8], [4, 6, 7, 8, 9], 0, [4], 4, 3),
    ("partial", [5, 6, 7, 8], [5, 6, 1, 8, 9], 2, [5, 6, 1], 2, 1),
    ("last rejected", [5, 6, 7, 8], [5, 6, 7, 3, 9], 3, [5, 6, 7, 3], 1, 0),
    ("K=1 accepted", [5], [5, 2], 1, [5, 2], 0, 0),
    ("K=1 rejected", [5], [4, 2], 0, [4], 1, 0),
    ("probe (empty draft)", [], [3], 0, [3], 0, 0),
    ("match after a mismatch is not accepted", [5, 6, 7], [1, 6, 7, 8], 0, [1], 3, 2),
]


@pytest.mark.parametrize("case,draft,target,accepted,emitted,t_trim,d_trim", ROUNDS, ids=[r[0] for r in ROUNDS])
def test_round_arithmetic(case, draft, target, accepted, emitted, t_trim, d_trim):
    n = accept_count(draft, target)
    assert n == accepted
    assert target[: n + 1] == emitted
    assert target_cache_trim(len(draft), n) == t_trim
    assert draft_cache_trim(len(draft), n) == d_trim


# (case, round tokens, remaining, stop ids, emitted, finish_reason)
CLIPS = [
    ("nothing to clip", [5, 6, 7], 10, [EOS], [5, 6, 7], None),
    ("max_tokens inside the accepted run", [5, 6, 7, 8, 9], 2, [EOS], [5, 6], "length"),
    ("exactly reaches max_tokens", [5, 6, 7], 3, [EOS], [5, 6, 7], "length"),
    ("EOS inside the accepted run", [5, EOS, 7, 8], 10, [EOS], [5, EOS], "stop"),
    ("EOS as the bonus token", [5, 6, EOS], 10, [EOS], [5, 6, EOS], "stop"),
    ("per-request stop id", [5, 42, 7], 10, [EOS, 42], [5, 42], "stop"),
    ("stop wins over length on the last allowed token", [5, EOS, 7], 2, [EOS], [5, EOS], "stop"),
    ("EOS past max_tokens is never seen", [5, 6, EOS], 2, [EOS], [5, 6], "length"),
    ("first token is EOS", [EOS, 5], 10, [EOS], [EOS], "stop"),
]


@pytest.mark.parametrize("case,tokens,remaining,stops,emitted,reason", CLIPS, ids=[c[0] for c in CLIPS])
def test_clip_tokens(case, tokens, remaining, stops, emitted, reason):
    assert clip_tokens(tokens, remaining, stops) == (emitted, reason)


@pytest.mark.parametrize(
    "k,remaining,budget",
    [(4, 100, 4), (4, 5, 4), (4, 4, 3), (4, 2, 1), (4, 1, 0), (1, 1, 0), (6, 3, 2)],
)
def test_draft_budget(k, remaining, budget):
    # A round emits at most K + 1 tokens: drafting past remaining - 1 is wasted work.
    assert draft_budget(k, remaining) == budget


@pytest.mark.parametrize(
    "history,k,max_n,expected",
    [
        ([1, 2, 3, 9, 1, 2], 2, 2, [3, 9]),
        # past the end of history the match's period repeats: 3 9 1 2 | 3
        ([1, 2, 3, 9, 1, 2], 5, 2, [3, 9, 1, 2, 3]),
        ([5, 6, 6, 6], 3, 3, [6, 6, 6]),  # a run of one token drafts the run on
        ([1, 2, 3, 1, 2, 3, 1], 4, 3, [2, 3, 1, 2]),
        ([1, 2, 3, 4], 3, 3, []),  # no earlier occurrence
        ([7, 1, 8, 2, 1], 2, 3, [8, 2]),  # falls back to a 1-gram
        ([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, [6]),  # most recent occurrence wins
        ([1, 2, 3], 0, 2, []),
        ([4], 3, 3, []),
    ],
)
def test_ngram_lookup(history, k, max_n, expected):
    assert ngram_lookup(history, k, max_n) == expected
