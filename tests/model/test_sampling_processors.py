"""The logit processors and filters of `models.sampling.samplers`, against a plain reference.

The reference recomputes each position from explicit token lists (prompt, output and
the drafts before the position), one token at a time in numpy: what classic decode
reads at that point. The sampler must give the same logits for the positions of one
verify call, from the state it keeps across `accept` calls. No model needed.
"""

import copy
import random

import mlx.core as mx
import numpy as np
import pytest

from models.sampling.samplers import (
    DRAFTS,
    DRAWS,
    RequestSampler,
    draw_plain,
    draw_rows,
    log_probs,
    min_p_filter,
    penalized_logits,
    position_keys,
    stacked_keys,
    supports_sampling,
    top_k_filter,
    top_p_filter,
)
from scheduler.request import SamplingParams

pytestmark = pytest.mark.model

V = 48


def reference(row: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int]) -> np.ndarray:
    """One position's processed logits, from scratch (float32, the sampler's op order)."""
    x = row.astype(np.float32).copy()
    for token, bias in p.logit_bias:
        x[token] += np.float32(bias)
    if p.repetition_penalty != 1.0:
        for token in set((prompt + output)[-p.repetition_context_size :]):
            x[token] = (
                x[token] * np.float32(p.repetition_penalty)
                if x[token] < 0
                else x[token] / np.float32(p.repetition_penalty)
            )
    for token in set(output):
        count = output.count(token)
        x[token] = x[token] - np.float32(p.frequency_penalty) * np.float32(count) - np.float32(p.presence_penalty)
    return x


KNOBS = {
    "bias": dict(logit_bias=((3, 2.5), (7, -100.0), (40, 0.75))),
    "repetition": dict(repetition_penalty=1.7),
    "repetition_short_window": dict(repetition_penalty=0.6, repetition_context_size=3),
    "presence": dict(presence_penalty=1.25),
    "frequency": dict(frequency_penalty=-0.5),
    "all": dict(
        logit_bias=((3, 2.5),),
        repetition_penalty=1.3,
        repetition_context_size=6,
        presence_penalty=0.5,
        frequency_penalty=0.75,
    ),
}


@pytest.mark.parametrize("knobs", KNOBS.values(), ids=KNOBS.keys())
def test_every_verify_position_matches_the_reference(knobs):
    rng = random.Random(sum(map(ord, str(knobs))))
    params = SamplingParams(8, **knobs)
    for trial in range(40):
        n = rng.randint(1, 5)
        prompt = [rng.randrange(12) for _ in range(rng.randint(1, 30))]  # small ids: repeats happen
        output = [rng.randrange(12) for _ in range(rng.randint(0, 25))]
        drafts = [rng.randrange(12) for _ in range(n - 1)]
        logits = mx.array(np.random.default_rng(trial).normal(0, 3, (n, V)).astype(np.float32))
        sampler = RequestSampler(params, prompt)
        if trial % 3 == 0:  # accepted before the first draw, as lists, as lazy arrays
            sampler.accept(output)
        else:
            sampler.penalized(logits[:1])
            for start in range(0, len(output), 4):
                chunk = output[start : start + 4]
                sampler.accept(mx.array(chunk, dtype=mx.int32) if trial % 2 else chunk)
        got = np.array(sampler.penalized(logits, mx.array(drafts, dtype=mx.int32) if trial % 2 else drafts))
        for i in range(n):
            want = reference(np.array(logits[i]), params, prompt, output + drafts[:i])
            np.testing.assert_allclose(got[i], want, rtol=1e-6, atol=1e-6, err_msg=f"position {i}")


def test_a_verify_call_equals_sequential_single_positions():
    """Position i of one call reads what the sampler reads after accepting drafts[:i]."""
    params = SamplingParams(8, **KNOBS["all"])
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(0, 3, (5, V)).astype(np.float32))
    drafts = [3, 3, 9, 3]
    sampler = RequestSampler(params, [1, 2, 3])
    sampler.accept([9, 3])
    together = sampler.log_probs(logits, drafts)
    for i in range(5):
        alone = copy.copy(sampler)
        alone.accept(drafts[:i])
        assert mx.array_equal(alone.log_probs(logits[i : i + 1])[0], together[i])


def test_output_penalties_count_output_tokens_only():
    params = SamplingParams(8, presence_penalty=0.5, frequency_penalty=0.25)
    sampler = RequestSampler(params, [1, 1, 1])
    logits = mx.zeros((1, V))
    sampler.accept([2, 2, 2, 4])
    got = np.array(sampler.penalized(logits))[0]
    assert got[1] == 0.0  # in the prompt only
    assert got[2] == pytest.approx(-0.5 - 0.75) and got[4] == pytest.approx(-0.5 - 0.25)
    assert np.count_nonzero(got) == 2


def test_repetition_penalty_is_sign_aware_and_windowed():
    params = SamplingParams(8, repetition_penalty=2.0, repetition_context_size=3)
    logits = mx.array([[4.0, -4.0, 4.0, -4.0, 1.0]])
    sampler = RequestSampler(params, [0, 1, 2, 3])  # token 0 is out of the 3-token window
    assert np.array(sampler.penalized(logits)).tolist() == [[4.0, -8.0, 2.0, -8.0, 1.0]]
    sampler.accept([4, 4])  # window now [3, 4, 4]
    assert np.array(sampler.penalized(logits)).tolist() == [[4.0, -4.0, 4.0, -8.0, 0.5]]


def stream_of(sampler, logits, n):
    """n tokens drawn one position at a time from the same (1, V) `logits`, each accepted."""
    out = []
    for _ in range(n):
        out.append(sampler.sample(logits).item())
        sampler.accept(out[-1:])
    return out


def test_a_plus_100_bias_forces_a_token_at_any_temperature():
    logits = mx.array(np.random.default_rng(1).normal(0, 5, (1, V)).astype(np.float32))
    for temperature in (0.0, 1.0, 2.0):
        sampler = RequestSampler(SamplingParams(8, temperature=temperature, seed=3, logit_bias=((11, 100.0),)), [1])
        assert set(stream_of(sampler, logits, 50)) == {11}
    banned = RequestSampler(SamplingParams(8, temperature=1.0, seed=3, logit_bias=((0, -100.0),)), [1])
    assert 0 not in set(stream_of(banned, mx.zeros((1, V)) + mx.eye(V)[0][None] * 5, 200))


def test_top_k_and_min_p_limit_the_draws():
    lp = log_probs(mx.array([[3.0, 2.9, 2.8, 2.0, 1.0, 0.0, -1.0, -2.0]]))
    probs = np.exp(np.array(lp))[0]

    def draws(**knobs):
        sampler = RequestSampler(SamplingParams(8, temperature=1.0, seed=0, **knobs))
        return set(sampler(mx.repeat(lp, 300, axis=0)).tolist())  # positions 0..299

    assert draws(top_k=3) == {0, 1, 2}
    assert draws(min_p=0.3) == {i for i, p in enumerate(probs) if p >= 0.3 * probs.max()}
    assert len(draws()) >= 6  # unfiltered: the tail is drawn too
    assert len(draws(top_k=8)) >= 6 and len(draws(top_k=100)) >= 6  # k >= V: off


def test_without_processors_nothing_changes():
    params = SamplingParams(8, temperature=0.7, top_p=0.9, seed=5)
    logits = mx.array(np.random.default_rng(2).normal(0, 3, (3, V)).astype(np.float32))
    sampler = RequestSampler(params, [1, 2])
    assert sampler.penalized(logits) is logits
    assert mx.array_equal(sampler.log_probs(logits, [4, 5]), log_probs(logits))
    # row i is output position i, drawn with that position's key of the seed's DRAWS stream
    keys = position_keys(mx.random.split(mx.random.key(5), 3)[DRAWS], 0, 3)
    from mlx_lm.sample_utils import apply_top_p

    expected = draw_rows(apply_top_p(log_probs(logits), 0.9) * (1 / 0.7), keys)
    assert sampler.sample(logits, [4, 5]).tolist() == expected.tolist()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_filters_equal_mlx_lms_for_every_value(dtype):
    """Our filters take the value as data (mlx-lm's compile it in, one trace and fused
    kernel per value): the same tokens kept, the same values, for values on both
    sides of the usual ones, one row and several, peaked rows and flat ones, ties."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    rng = np.random.default_rng(11)
    rows = [rng.normal(0, scale, (n, 2048)) for n, scale in ((1, 1.0), (4, 3.0), (3, 8.0))]
    ties = np.zeros((2, 2048))
    ties[:, :5] = 2.0  # five tokens tied for the top, the rest tied below them
    for x in [*rows, ties]:
        logprobs = log_probs(mx.array(x.astype(np.float32)).astype(dtype))
        for top_p in (0.05, 0.5, 0.8, 0.9, 0.93, 0.95, 0.999):
            assert mx.array_equal(top_p_filter(logprobs, top_p), apply_top_p(logprobs, top_p), equal_nan=True), top_p
        for min_p in (0.001, 0.05, 0.1, 0.37, 1.0):
            assert mx.array_equal(min_p_filter(logprobs, min_p), apply_min_p(logprobs, min_p), equal_nan=True), min_p
        for top_k in (1, 5, 40, 2047):
            assert mx.array_equal(top_k_filter(logprobs, top_k), apply_top_k(logprobs, top_k)), top_k
    # a filter keeps at least the row's most likely token
    flat = log_probs(mx.zeros((1, 2048)))
    assert (top_p_filter(flat, 0.01) > -mx.inf).sum().item() >= 1


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_top_p_from_candidates_equals_the_whole_sort(monkeypatch, dtype):
    """On a CPU the nucleus's floor comes from the most likely TOP_P_CANDIDATES tokens;
    a row whose nucleus is wider is sorted whole: every row filters as mlx-lm's
    `apply_top_p` does, peaked, flat, tied and mixed in one batch."""
    from mlx_lm.sample_utils import apply_top_p

    from models.platform import cpu_math
    from models.sampling import samplers

    monkeypatch.setattr(cpu_math, "_installed", True)
    monkeypatch.setattr(samplers, "TOP_P_CANDIDATES", 64)
    rng = np.random.default_rng(12)
    peaked = rng.normal(0, 1.5, (3, 4096))
    peaked[:, :6] += 12.0  # a nucleus of a few tokens: inside the candidates
    flat = rng.normal(0, 0.5, (2, 4096))  # a nucleus of thousands: sorted whole
    ties = np.zeros((1, 4096))
    ties[:, :70] = 3.0  # the candidates end inside a tie
    for x in (peaked, np.concatenate([peaked[:1], flat, ties, peaked[1:]])):
        logprobs = log_probs(mx.array(x.astype(np.float32)).astype(dtype))
        for top_p in (0.05, 0.5, 0.9, 0.95, 0.999):
            got = top_p_filter(logprobs, top_p)
            assert mx.array_equal(got, apply_top_p(logprobs, top_p), equal_nan=True), top_p
    kept = (top_p_filter(log_probs(mx.array(peaked.astype(np.float32))), 0.9) > -mx.inf).sum(axis=-1)
    assert max(kept.tolist()) <= 6


def test_greedy_picks_from_the_processed_logits_and_reports_their_logprobs():
    """Greedy takes the argmax of the processed logits (no normalisation), the token of
    their log-probabilities; a request that asks logprobs still gets them."""
    logits = mx.random.normal((3, V), key=mx.random.key(4)) * 3
    params = SamplingParams(8, temperature=0.0, logit_bias=[(5, 30.0)], logprobs=2)
    sampler = RequestSampler(params, [1, 2])
    tokens, report = sampler.sample_with_logprobs(logits, [7, 8])
    processed = sampler.penalized(logits, [7, 8])
    assert tokens.tolist() == mx.argmax(log_probs(processed), axis=-1).tolist() == [5, 5, 5]
    assert [entry.logprob for entry in report.tolist()] == pytest.approx(
        mx.take_along_axis(log_probs(processed), tokens[:, None], axis=-1).reshape(-1).tolist()
    )
    plain = RequestSampler(SamplingParams(8, temperature=0.0))
    assert plain.sample_with_logprobs(logits)[1] is None


@pytest.mark.parametrize("filters", [{}, {"top_p": 0.9}, {"top_k": 5, "min_p": 0.05}])
def test_one_draw_over_many_samplers_is_each_samplers_own_draw(filters):
    """The batched draw of sampled rows gives every row the tokens its own sampler would
    draw: its keys depend on its seed and positions only, whatever else is stacked."""
    rng = random.Random(3)
    samplers = [
        RequestSampler(SamplingParams(8, temperature=0.7, seed=rng.randrange(1000), **filters)) for _ in range(6)
    ]
    for s in samplers:
        s.accept([rng.randrange(V) for _ in range(rng.randrange(5))])
    logits = [mx.random.normal((rng.randint(1, 4), V), key=mx.random.key(i)) for i in range(6)]
    for ahead in (0, 1):
        batched = draw_plain(samplers, mx.concatenate(logits), [x.shape[0] for x in logits], ahead)
        alone = [s.sample_with_logprobs(x, [], ahead)[0] for s, x in zip(samplers, logits)]
        assert batched.tolist() == mx.concatenate(alone).tolist()
    keys = stacked_keys(samplers, [2, 1, 3, 1, 1, 2], ahead=2, stream=DRAFTS)
    own = mx.concatenate([s.keys(n, 2, DRAFTS) for s, n in zip(samplers, [2, 1, 3, 1, 1, 2])])
    assert keys.tolist() == own.tolist()


def test_a_copied_sampler_is_an_independent_stream():
    params = SamplingParams(8, presence_penalty=1.0, repetition_penalty=1.5)
    a = RequestSampler(params, [1])
    a.penalized(mx.zeros((1, V)))
    b = copy.copy(a)
    b.accept([5, 6])
    assert np.array(a.penalized(mx.ones((1, V))))[0][5] == 1.0
    assert np.array(b.penalized(mx.ones((1, V))))[0][5] == pytest.approx(1 / 1.5 - 1.0)


def test_the_drafts_must_cover_the_positions():
    params = SamplingParams(8, presence_penalty=1.0)
    with pytest.raises(ValueError, match="3 positions need 2 drafts"):
        penalized_logits(mx.zeros((3, V)), params, None, mx.zeros((V,)), [1])
    with pytest.raises(ValueError, match="needs the prompt"):
        RequestSampler(SamplingParams(8, repetition_penalty=1.1))


@pytest.mark.parametrize(
    "knobs, processors, supported",
    [
        ({}, False, True),
        ({"top_k": 5, "min_p": 0.1, "temperature": 0.5}, False, True),  # filters read no tokens
        ({"logit_bias": ((1, 0.5),)}, True, True),
        ({"repetition_penalty": 1.0}, False, True),
        ({"repetition_penalty": 0.9}, True, True),
        ({"presence_penalty": -0.1}, True, True),
        ({"frequency_penalty": 2.0}, True, True),
        ({"top_k": -1}, False, False),
        ({"min_p": 1.5}, False, False),
        ({"repetition_penalty": 0.0}, True, False),
        ({"repetition_penalty": 1.1, "repetition_context_size": 0}, True, False),
    ],
)
def test_params_table(knobs, processors, supported):
    params = SamplingParams(8, **knobs)
    assert params.has_processors is processors
    assert supports_sampling(params) is supported
