"""Pure arithmetic of one speculative round: acceptance, clipping, cache rollback.

A round starts with the target KV cache holding every token but the pending one `y`
(the last emitted token). The drafter proposes d1..dK; the target runs one forward over
[y, d1..dK] and picks t0..tK (t_i: its own choice after d_i; t0 after y). Worked
example, K = 4, draft [a, b, c, d], target [a, b, x, ...]:
- `accept_count` = 2 (a, b match); the round emits [a, b, x] (= t0..t2);
- the target cache gained K + 1 = 5 entries (y, a, b, c, d); y, a, b stay:
  `target_cache_trim(4, 2)` = 2;
- the draft cache gained y, a, b, c (it never ran on its last draft d); y, a, b stay:
  `draft_cache_trim(4, 2)` = 1. When all K are accepted the draft cache lacks dK
  (trim 0), and the drafter feeds it next round together with the new pending token.
"""

from __future__ import annotations

from typing import Sequence


def accept_count(draft: Sequence[int], target: Sequence[int]) -> int:
    """Length of the longest prefix with draft[i] == target[i].

    `target` has one more entry than `draft` (the bonus position), so the result is at
    most len(draft) and the round emits target[: result + 1].
    """
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n


def target_cache_trim(num_drafted: int, num_accepted: int) -> int:
    """Target cache entries to drop after verifying [y, d1..dK]: the rejected drafts."""
    return num_drafted - num_accepted


def draft_cache_trim(num_drafted: int, num_accepted: int) -> int:
    """Draft cache entries to drop: it holds y, d1..d(K-1); keep y, d1..dn."""
    if num_drafted == 0:
        return 0
    return max(num_drafted - 1 - num_accepted, 0)


def clip_tokens(tokens: Sequence[int], num_remaining: int, stop_ids: Sequence[int]) -> tuple[list[int], str | None]:
    """Cut a round's tokens at the first stop token (kept) or at `num_remaining`.

    Returns (tokens to emit, finish_reason). "stop" wins over "length" when the stop
    token is also the last allowed one, as in mlx-lm.
    >>> clip_tokens([5, 2, 7], 10, stop_ids=[2])
    ([5, 2], 'stop')
    >>> clip_tokens([5, 6, 7], 2, stop_ids=[2])
    ([5, 6], 'length')
    """
    out: list[int] = []
    for token in tokens[: max(num_remaining, 0)]:
        out.append(token)
        if token in stop_ids:
            return out, "stop"
    if len(out) >= num_remaining:
        return out, "length"
    return out, None


def draft_budget(num_draft_tokens: int, num_remaining: int) -> int:
    """Drafts worth proposing: a round emits at most K + 1, so never more than remaining - 1."""
    return max(min(num_draft_tokens, num_remaining - 1), 0)
