"""`draft_confidence`: a draft model's round stops where the product of its drafts' top
probabilities falls below the threshold. The drafts kept are the fixed-K drafts' first
ones, the stop is where that product says, and after any accept count the draft cache
holds exactly the accepted history (mlx-lm's forward and the compiled steps alike);
sampled drafts keep at least one, with a distribution row each."""

from __future__ import annotations

import mlx.core as mx
import pytest

from models.speculative.drafters import DraftModelDrafter


def reference_round(model, history: list[int], k: int) -> tuple[list[int], list[float]]:
    """The k greedy drafts after `history` and each one's top probability, from fresh
    full forwards (no cache)."""
    drafts, tops = [], []
    for _ in range(k):
        logits = model(mx.array([history + drafts]))[0, -1].astype(mx.float32)
        token = mx.argmax(logits).item()
        drafts.append(token)
        tops.append(mx.softmax(logits)[token].item())
    return drafts, tops


def kept(tops: list[float], threshold: float) -> int:
    product, n = 1.0, 0
    for top in tops:
        product *= top
        if product < threshold:
            break
        n += 1
    return n


@pytest.mark.parametrize("compiled", [False, True])
def test_rounds_keep_the_fixed_drafts_until_the_product_falls(loaded, compiled):
    draft = loaded[1]
    drafter = DraftModelDrafter(draft.model, draft.name)
    if compiled:
        drafter.compile_forwards(0)
    vocab = loaded[0].model.args.vocab_size
    history = [(17 * i + 3) % vocab for i in range(40)]
    k = 5
    # A threshold in the middle of what two drafts' products come to, so rounds differ.
    products = []
    for n in range(20, 40):
        _, tops = reference_round(draft.model, history[:n], 2)
        products.append(tops[0] * tops[1])
    drafter.min_confidence = sorted(products)[len(products) // 2]
    state = drafter.new_state(history[:20])
    n, lengths = 21, []
    for step in range(24):
        expected, tops = reference_round(draft.model, history[:n], k)
        got = drafter.propose(state, history[:n], k)
        assert got == expected[: kept(tops, drafter.min_confidence)], step
        lengths.append(len(got))
        accepted = step % (len(got) + 1)  # every count from none to all, in turn
        if got:
            drafter.rollback(state, len(got), accepted)
        assert state.cache[0].offset == state.num_cached  # the cache holds the history it says
        # The target's next tokens: the accepted drafts, then one of its own.
        history = history[:n] + got[:accepted] + [(31 * step + 7) % vocab] + history[n + accepted + 1 :]
        n += accepted + 1
        history = history + [(13 * i + 5) % vocab for i in range(max(0, n + k - len(history)))]
    assert min(lengths) < max(lengths)  # rounds stopped at different lengths


def test_sampled_rounds_keep_at_least_one_draft_with_its_row(loaded):
    from models.sampling.samplers import RequestSampler
    from scheduler.request import SamplingParams

    draft = loaded[1]
    drafter = DraftModelDrafter(draft.model, draft.name)
    drafter.min_confidence = 0.999  # stops after the first draft every round
    vocab = loaded[0].model.args.vocab_size
    history = [(17 * i + 3) % vocab for i in range(60)]
    sampler = RequestSampler(SamplingParams(temperature=0.8, seed=3, max_tokens=64))
    state = drafter.new_state(history[:30])
    for n in range(31, 40):
        tokens, rows = drafter.propose_sampled(state, history[:n], 4, sampler, vocab)
        assert tokens.shape == (1,) and rows.shape == (1, vocab)
        assert rows.sum().item() == pytest.approx(1.0, abs=1e-4)
        drafter.rollback(state, 1, 0)
        assert state.cache[0].offset == state.num_cached == n
    drafter.min_confidence = 0.0
    tokens, rows = drafter.propose_sampled(state, history[:40], 4, sampler, vocab)
    assert tokens.shape == (4,) and rows.shape == (4, vocab)


def test_tick_costs_time_a_confident_drafter_drafting_all_k(loaded):
    from models.forward import tick_costs

    draft = loaded[1]
    drafter = DraftModelDrafter(draft.model, draft.name)
    drafter.min_confidence = 0.999  # on the measurement's prompt it would stop at the first draft
    lengths, propose = [], drafter.propose
    drafter.propose = lambda *args: lengths.append(len(out := propose(*args))) or out
    vocab = loaded[0].model.args.vocab_size
    assert tick_costs._draft_seconds(drafter, [(7 * i + 3) % vocab for i in range(64)], 3) > 0
    assert lengths and set(lengths) == {3}
    assert drafter.min_confidence == 0.999
