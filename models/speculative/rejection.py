"""Speculative rejection sampling: the accept rule for drafts drawn from a distribution.

A drafter that samples its drafts (the draft model at temperature > 0) draws draft i
from its own processed distribution q_i and hands q_i over with it. The target's
processed distribution at verify position i is p_i (the same processors, filters and
temperature, plus the grammar mask). Draft i is accepted with probability
min(1, p_i(d_i) / q_i(d_i)); at the first rejection the round's last token is drawn
from the normalised residual max(0, p_i - q_i), and when all n drafts are accepted it
is drawn from p_n (the residual with q_n = 0). Each emitted token is then distributed
exactly as a draw from the target (Leviathan et al. 2023, Chen et al. 2023), while a
draft close to the target is accepted far more often than by token equality.

Worked example, one draft: p = (0.5, 0.5), q = (0.9, 0.1), draft 0 (drawn with
probability 0.9) is accepted with probability 0.5 / 0.9; a rejection draws from the
residual (0, 0.4) / 0.4, i.e. token 1. P(0) = 0.9 * 0.5 / 0.9 = 0.5, as p says.

Drafters that give no distribution (n-gram) keep the equality rule (`models.speculative.round_math`).

This preserves the distribution, not the sample path: the drafts and the uniforms are
draws classic decode never makes, so a seeded request's tokens differ from its classic
stream (equally likely ones). Under the equality rule each position's draw is classic
decode's own (`models.sampling.samplers.position_keys`), and the tokens are the same.
"""

from __future__ import annotations

import mlx.core as mx


def verify_drafts(p: mx.array, q: mx.array, drafts: mx.array, key: mx.array) -> tuple[mx.array, mx.array]:
    """(tokens (n + 1,), number accepted (scalar)), lazily.

    `p` (n + 1, V): the target's probabilities at the n + 1 verify positions (position
    i after drafts[:i]); `q` (n + 1, V): row i < n the distribution draft i was drawn
    from, row n zeros (every draft verified: the bonus token comes from p_n) or the row
    of a further draft the grammar cut (certain to be rejected, p_n masks it: the token
    comes from that row's residual). `drafts` (n,) int. `key`: the round's own key (the
    request's `ROUNDS` key of the round's first output position, `models.sampling.samplers`;
    rounds start at distinct positions), so a seeded request draws the same uniforms
    every time.

    tokens[:m] are the accepted drafts, tokens[m] the residual (or bonus) draw, and
    later entries repeat it (the caller emits tokens[: m + 1]).
    """
    n = drafts.shape[0]
    accept_key, draw_key = mx.random.split(key)
    if n:
        ids = drafts.astype(mx.int32)[:, None]
        p_draft = mx.take_along_axis(p[:n], ids, axis=-1)[:, 0]
        q_draft = mx.take_along_axis(q[:n], ids, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(n,), key=accept_key)
        accepted = (u * q_draft < p_draft).astype(mx.int32)  # u < p / q, with no division
        m = mx.cumprod(accepted).sum()
    else:
        m = mx.array(0, dtype=mx.int32)
    last = mx.random.categorical(mx.log(residual(mx.take(p, m, axis=0), mx.take(q, m, axis=0))), key=draw_key).astype(
        mx.int32
    )
    padded = mx.concatenate([drafts.astype(mx.int32), mx.zeros((1,), mx.int32)])
    tokens = mx.where(mx.arange(n + 1) < m, padded, last)
    return tokens, m


def residual(p: mx.array, q: mx.array) -> mx.array:
    """max(0, p - q) (V,), unnormalised (a draw normalises): p itself where q is the
    bonus position's zero row."""
    out = mx.maximum(p - q, 0.0)
    # A rejection implies mass where p > q; an all-zero residual is rounding only.
    return mx.where(out.sum() > 0, out, p)


def with_bonus_row(q: mx.array, num_drafts: int) -> mx.array:
    """`q` (num_drafts or num_drafts + 1 rows) as `verify_drafts` takes it: a zero row
    appended for the bonus position when the drafts were not cut."""
    if q.shape[0] > num_drafts:
        return q[: num_drafts + 1]
    return mx.concatenate([q, mx.zeros((1, q.shape[-1]), q.dtype)])


def fit_vocab(logits: mx.array, vocab: int | None) -> mx.array:
    """A draft's logits (…, V_draft) cut or padded (with -inf) to the target's width:
    a draft and target sharing a tokenizer may pad their embeddings differently."""
    if vocab is None or logits.shape[-1] == vocab:
        return logits
    if logits.shape[-1] > vocab:
        return logits[..., :vocab]
    pad = mx.full((*logits.shape[:-1], vocab - logits.shape[-1]), -mx.inf, logits.dtype)
    return mx.concatenate([logits, pad], axis=-1)
