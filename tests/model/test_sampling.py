"""At temperature > 0, token-equality acceptance keeps the target's distribution.

Two-sample chi-square test on the joint distribution of the first three tokens:
speculative sessions (K = 2, so each run has one verify round with a draft that is
sometimes accepted and sometimes rejected) against classic decode, each with its own
per-request seeds. Seeds are fixed, so the test is deterministic; the same statistic
separates the target from its draft model, which shows the test has power.
"""

import collections
import math

import pytest

from models.sampling import RequestSampler
from scheduler.request import SamplingParams

from .conftest import make_request
from .helpers import make_drafter, run_classic, run_session

pytestmark = pytest.mark.model

N = 600
TEMPERATURE = 0.05  # the tiny models' logits are flat; this gives ~40 likely 3-token paths
Z_999 = 3.0902  # standard normal quantile for alpha = 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Wilson–Hilferty approximation of the chi-square upper quantile."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def homogeneity_chi2(a: collections.Counter, b: collections.Counter, min_count: int = 10):
    """(statistic, degrees of freedom) for equal-size samples; rare paths pooled."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= min_count]
    rows = [(a[k], b[k]) for k in keys]
    rows.append((sum(a.values()) - sum(r[0] for r in rows), sum(b.values()) - sum(r[1] for r in rows)))
    stat = sum((x - y) ** 2 / (x + y) for x, y in rows if x + y > 0)
    return stat, len(rows) - 1


def classic_paths(model, prompt, seed_base):
    reqs = [make_request(f"r{i}", prompt, 3, temperature=TEMPERATURE, seed=seed_base + i) for i in range(N)]
    out = run_classic(model, reqs, [0], max_batch_size=64, prefill_batch_size=64)
    return collections.Counter(tuple(tokens) for tokens, _ in out.values())


@pytest.fixture(scope="module")
def prompt(prompt_ids):
    return prompt_ids[0]


@pytest.fixture(scope="module")
def target_paths(loaded, prompt):
    return classic_paths(loaded[0].model, prompt, seed_base=0)


def speculative_paths(loaded):
    drafter = make_drafter("draft_model", loaded)
    paths, drafted, accepted = collections.Counter(), 0, 0
    prompt = loaded[2]
    for i in range(N):
        req = make_request(f"s{i}", prompt, 3, temperature=TEMPERATURE, seed=10_000 + i)
        tokens, _, rounds = run_session(loaded[:2], req, 2, drafter)
        paths[tuple(tokens)] += 1
        drafted += sum(r[1] for r in rounds)
        accepted += sum(r[2] for r in rounds)
    return paths, drafted, accepted


def test_speculative_sampling_matches_classic(loaded, prompt, target_paths):
    spec, drafted, accepted = speculative_paths((*loaded, prompt))
    assert 0.2 * drafted < accepted < 0.95 * drafted  # both outcomes well represented
    stat, df = homogeneity_chi2(spec, target_paths)
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    tv = 0.5 * sum(abs(spec[k] - target_paths[k]) for k in set(spec) | set(target_paths)) / N
    assert tv < 0.15


def test_the_statistic_catches_biased_acceptance(loaded, prompt, target_paths, monkeypatch):
    """Accepting every draft token (a classic bug) must fail the same check."""
    import models.session

    monkeypatch.setattr(models.session, "accept_count", lambda draft, target: len(draft))
    spec, _, _ = speculative_paths((*loaded, prompt))
    stat, df = homogeneity_chi2(spec, target_paths)
    assert stat > chi2_critical(df), f"chi2={stat:.1f} df={df}"


def test_seeded_sampler_is_reproducible_and_independent():
    import mlx.core as mx

    logprobs = mx.log(mx.ones((4, 64)) / 64)
    a = RequestSampler(SamplingParams(8, temperature=1.0, seed=7))
    b = RequestSampler(SamplingParams(8, temperature=1.0, seed=7))
    first = a(logprobs).tolist()
    assert first == b(logprobs).tolist()
    assert a(logprobs).tolist() != first  # the stream advances
    assert len(set(first)) > 1 or len(set(a(logprobs).tolist())) > 1  # rows are independent draws
