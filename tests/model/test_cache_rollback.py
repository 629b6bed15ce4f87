"""`models.speculative.cache_rollback` on real mlx-lm caches, one key per token: each key (and
value) is its token's position, so what an update hands attention reads as positions.

A rolled-back cache must hand the next update exactly what a cache that never saw the
rejected tokens hands it (one prefilled from scratch with the accepted history), also
once a sliding window's ring has wrapped; where that cannot be done it must raise."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from models.speculative.cache_rollback import (
    RollbackError,
    can_roll_back,
    checkpoint,
    restore,
    trim_exact,
)

pytestmark = pytest.mark.model

WINDOW = 8


def update(cache, positions):
    """One update with a token per position (as a forward over them makes); returns
    the positions of the keys it hands attention."""
    x = mx.array(positions, dtype=mx.float32).reshape(1, 1, -1, 1)
    keys, _ = cache.update_and_fetch(x, x)
    return [int(p) for p in keys.reshape(-1).tolist()]


def prefilled(num_tokens, single_steps=0):
    """A ring holding tokens 0..num_tokens-1 the way a session builds it: all but the
    last prompt token in one update, the last alone, then `single_steps` decode steps."""
    cache = RotatingKVCache(max_size=WINDOW)
    prompt = num_tokens - single_steps
    if prompt > 1:
        update(cache, list(range(prompt - 1)))
    for p in range(max(prompt - 1, 0), num_tokens):
        update(cache, [p])
    return cache


def next_updates_match(cache, num_tokens):
    """The updates after a rollback (one token, three, one) hand attention what they
    hand a cache prefilled with the kept tokens: the same keys in the same order for a
    multi-token update (its mask is positional), the same set for a one-token update
    (the ring's order, attended without a mask); and that set is the last window."""
    fresh = prefilled(num_tokens)
    assert (cache.offset, cache.size()) == (fresh.offset, fresh.size())
    p = num_tokens
    for width in (1, 3, 1):
        new = list(range(p, p + width))
        got, want = update(cache, new), update(fresh, new)
        if width == 1:
            assert sorted(got) == sorted(want) == list(range(max(p + 1 - WINDOW, 0), p + 1))
        else:
            assert got == want
        p += width


@pytest.mark.parametrize("num_tokens", [3, 6, 9, 20])  # before, across, just past, far past the window
@pytest.mark.parametrize("single_steps", [0, 5])  # ring order at the verify: fresh or rotated
@pytest.mark.parametrize("num_rejected", [0, 1, 3, 4])
def test_dropping_rejected_verify_entries_equals_prefilling_the_kept_ones(num_tokens, single_steps, num_rejected):
    cache = prefilled(num_tokens, min(single_steps, num_tokens - 1))
    k = 4
    update(cache, list(range(num_tokens, num_tokens + k + 1)))  # verify [y, d1..d4]
    trim_exact([cache], num_rejected)
    next_updates_match(cache, num_tokens + k + 1 - num_rejected)


def test_the_check_catches_mlx_lm_trim_on_a_wrapped_ring():
    """Why `trim_exact` exists, and that the check above sees it: mlx-lm's trim of the
    same rollback trims nothing once the ring is full (its result was never read)."""
    from mlx_lm.models.cache import trim_prompt_cache

    cache = prefilled(20, 5)
    update(cache, list(range(20, 25)))
    trim_prompt_cache([cache], 3)
    with pytest.raises(AssertionError):
        next_updates_match(cache, 22)


def test_one_token_writes_into_a_full_ring_cannot_be_dropped():
    cache = prefilled(12, 3)  # the last three writes overwrote the ring's oldest slots
    before = (cache.offset, cache._idx, cache.keys.shape)
    with pytest.raises(RollbackError, match="RotatingKVCache"):
        trim_exact([cache], 1)
    assert (cache.offset, cache._idx, cache.keys.shape) == before  # untouched
    next_updates_match(cache, 12)
    # Before the ring fills nothing is overwritten: then it can.
    young = prefilled(6, 3)
    trim_exact([young], 2)
    next_updates_match(young, 4)


def test_too_long_a_rollback_raises_and_changes_nothing():
    kv, ring = KVCache(), prefilled(20, 2)
    update(kv, list(range(20)))
    update(ring, list(range(20, 25)))
    with pytest.raises(RollbackError):
        trim_exact([kv, ring], 5)  # the verify added 5: only 4 can go and keep a window
    assert (kv.offset, ring.offset) == (20, 25)
    with pytest.raises(RollbackError):
        trim_exact([kv], 21)
    assert kv.offset == 20


def test_state_space_caches_cannot_roll_back():
    assert can_roll_back([KVCache(), RotatingKVCache(max_size=WINDOW)])
    assert not can_roll_back([KVCache(), ArraysCache(size=2)])
    with pytest.raises(RollbackError, match="ArraysCache"):
        trim_exact([ArraysCache(size=2)], 1)
    trim_exact([ArraysCache(size=2)], 0)  # nothing to drop is always fine


@pytest.mark.parametrize("num_tokens", [4, 12])
def test_checkpoint_restore_undoes_one_token_writes(num_tokens):
    """The draft model's way back: one-token steps over a ring, then restore."""
    ring, kv = prefilled(num_tokens), KVCache()
    update(kv, list(range(num_tokens)))
    saved = checkpoint([kv, ring])
    for p in range(num_tokens, num_tokens + 3):
        update(ring, [p])
        update(kv, [p])
    restore(saved)
    assert kv.offset == num_tokens
    next_updates_match(ring, num_tokens)
