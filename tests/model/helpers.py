"""Drivers shared by the model tests: classic decode through the adapter, and
speculative sessions run to completion; chi-square helpers for distribution tests."""

import math

from models.batch.generator_batch import GeneratorBatch
from models.speculative.drafters import DraftModelDrafter, NgramDrafter
from models.speculative.session import SpeculativeSession


def run_classic(model, requests, eos_token_ids, **kw):
    """{request_id: (tokens, finish_reason)} from one prefill group plus decode steps."""
    batch = GeneratorBatch(model, eos_token_ids=eos_token_ids, **kw)
    out = {r.request_id: [] for r in requests}
    reasons = {}
    for b in batch.prefill(requests):
        out[b.request_id] += b.token_ids
        if b.finish_reason:
            reasons[b.request_id] = b.finish_reason
    while len(reasons) < len(requests):
        for b in batch.decode():
            out[b.request_id] += b.token_ids
            if b.finish_reason:
                reasons[b.request_id] = b.finish_reason
    for r in requests:
        batch.remove(r.request_id)
    assert batch.num_rows() == 0
    return {rid: (out[rid], reasons[rid]) for rid in out}


def make_drafter(kind, loaded):
    if kind == "draft_model":
        return DraftModelDrafter(loaded[1].model, loaded[1].name)
    return NgramDrafter()


def new_session(loaded, request, k, drafter=None):
    target = loaded[0]
    session = SpeculativeSession(
        request.request_id,
        target.model,
        request.prompt_ids,
        request.sampling,
        num_draft_tokens=k,
        eos_token_ids=sorted(target.tokenizer.eos_token_ids),
    )
    if drafter is not None:
        session.bind(drafter)
    return session


def run_session(loaded, request, k, drafter):
    """(tokens, finish_reason, [(tokens, drafted, accepted) per round])."""
    session = new_session(loaded, request, k, drafter)
    first = session.begin()
    tokens, reason, rounds = list(first.token_ids), first.finish_reason, []
    while reason is None:
        r = session.step()
        tokens += r.token_ids
        reason = r.finish_reason
        rounds.append((r.token_ids, r.num_drafted, r.num_accepted))
    session.finish()
    return tokens, reason, rounds


def mlx_lm_greedy(model, prompt_ids, max_tokens, stop_ids=()):
    """mlx-lm's own greedy decode (`generate_step`), cut after the first stop id."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    out = []
    for token, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        out.append(int(token))
        if token in stop_ids:
            break
    return out


def stepwise_greedy(model, prompt_ids, max_tokens, stop_ids, pick):
    """A reference decode, one token at a time: `pick(logits, out)` chooses the next
    token from the last position's logits (a numpy array) and the output so far.
    Returns (tokens, finish_reason)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt_ids]), cache=cache)[0, -1]
    out = []
    while len(out) < max_tokens:
        token = int(pick(np.array(logits), out))
        out.append(token)
        if token in stop_ids:
            return out, "stop"
        logits = model(mx.array([[token]]), cache=cache)[0, -1]
    return out, "length"


Z_999 = 3.0902  # standard normal quantile for alpha = 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson–Hilferty approximation of the chi-square upper quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity_chi2(a, b, min_count: int = 10):
    """(statistic, degrees of freedom) of two equal-size samples (Counters); rare
    outcomes pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rows = [(a[k], b[k]) for k in keys]
    rows.append((sum(a.values()) - sum(r[0] for r in rows), sum(b.values()) - sum(r[1] for r in rows)))
    stat = sum((x - y) ** 2 / (x + y) for x, y in rows if x + y > 0)
    return stat, len(rows) - 1
