"""At temperature > 0, speculation keeps the target's distribution, under both accept
rules: token equality (greedy drafts, as the n-gram drafter gives) and rejection
sampling (drafts sampled from the draft model's distribution, `models.speculative.rejection`).

Two-sample chi-square test on the joint distribution of the first three tokens:
speculative sessions (K = 2, so each run has one verify round with a draft that is
sometimes accepted and sometimes rejected) against classic decode, each with its own
per-request seeds. Seeds are fixed, so the test is deterministic. Each rule's typical
bug (equality: accepting every draft; rejection: drawing the correction from p instead
of the residual) fails the same check, which shows the test has power.

Rejection sampling is checked with a draft that is the target plus a logit bonus for
the target's likeliest second token (the first one drafted): q overlaps p a lot but
overweights that token, so a correction drawn from p instead of the residual shows at
once (the tiny random draft model overlaps the target too little for that bug to show
in 600 runs).
"""

import collections

import mlx.core as mx
import pytest

from models.sampling.samplers import RequestSampler
from models.speculative.drafters import DraftModelDrafter
from scheduler.request import SamplingParams

from .conftest import make_request
from .helpers import chi2_critical, homogeneity_chi2, run_classic, run_session

pytestmark = pytest.mark.model

N = 600
TEMPERATURE = 0.05  # the tiny models' logits are flat; this gives ~40 likely 3-token paths
RULES = {"equality": False, "rejection": True}  # DraftModelDrafter's sample_drafts


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


class BiasedTarget:
    """A draft model: the target's logits plus `bonus` on one token."""

    def __init__(self, target, token: int, bonus: float):
        self.target = target
        self.layers = target.layers
        self.bias = mx.zeros((target.args.vocab_size,)).at[token].add(bonus)

    def __call__(self, inputs, cache=None):
        return self.target(inputs, cache=cache) + self.bias


def speculative_paths(loaded, prompt, rule, target_paths=None):
    if rule == "rejection":  # bonus 0.2 at temperature 0.05: x e^4 in the draft's odds
        likeliest = max(target_paths, key=target_paths.get)[1]  # the first draft is token 2
        drafter = DraftModelDrafter(BiasedTarget(loaded[0].model, likeliest, 0.2), "biased", sample_drafts=True)
    else:
        drafter = DraftModelDrafter(loaded[1].model, loaded[1].name, sample_drafts=False)
    paths, drafted, accepted = collections.Counter(), 0, 0
    for i in range(N):
        req = make_request(f"s{i}", prompt, 3, temperature=TEMPERATURE, seed=10_000 + i)
        tokens, _, rounds = run_session(loaded, req, 2, drafter)
        paths[tuple(tokens)] += 1
        drafted += sum(r[1] for r in rounds)
        accepted += sum(r[2] for r in rounds)
    return paths, drafted, accepted


@pytest.mark.parametrize("rule", RULES)
def test_speculative_sampling_matches_classic(loaded, prompt, target_paths, rule):
    spec, drafted, accepted = speculative_paths(loaded, prompt, rule, target_paths)
    assert 0.2 * drafted < accepted < 0.95 * drafted  # both outcomes well represented
    stat, df = homogeneity_chi2(spec, target_paths)
    assert df >= 10
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    tv = 0.5 * sum(abs(spec[k] - target_paths[k]) for k in set(spec) | set(target_paths)) / N
    assert tv < 0.15


@pytest.mark.parametrize("rule", RULES)
def test_the_statistic_catches_a_biased_rule(loaded, prompt, target_paths, monkeypatch, rule):
    """Equality: accepting every draft (a classic bug); rejection: drawing the
    correction from p, not from the residual max(0, p - q)."""
    import models.speculative.session

    if rule == "equality":
        monkeypatch.setattr(models.speculative.session, "accept_count", lambda draft, target: len(draft))
    else:
        monkeypatch.setattr(models.speculative.rejection, "residual", lambda p, q: p)
    spec, _, _ = speculative_paths(loaded, prompt, rule, target_paths)
    stat, df = homogeneity_chi2(spec, target_paths)
    assert stat > chi2_critical(df), f"chi2={stat:.1f} df={df}"


def test_a_positions_draw_depends_on_the_seed_and_the_position_alone():
    """Output position p is drawn with p's key whatever call draws it: six positions in
    one call (a verify) give the tokens six one-position calls (classic decode) give."""
    logprobs = mx.log(mx.ones((6, 64)) / 64)
    together = RequestSampler(SamplingParams(8, temperature=1.0, seed=7))(logprobs).tolist()
    one_by_one = RequestSampler(SamplingParams(8, temperature=1.0, seed=7))
    tokens = []
    for i in range(6):
        tokens += one_by_one(logprobs[i : i + 1]).tolist()
        one_by_one.accept(tokens[-1:])
    assert tokens == together
    assert len(set(together)) > 1  # positions are independent draws
    a = RequestSampler(SamplingParams(8, temperature=1.0, seed=7))
    assert a(logprobs[:1], ahead=3).tolist() == together[3:4]  # a pipelined draw, one ahead
    assert a(logprobs).tolist() == together  # drawing changes nothing; accepting moves on
    a.accept(together[:2])
    assert a(logprobs[:4]).tolist() == together[2:]
    other = RequestSampler(SamplingParams(8, temperature=1.0, seed=8))(logprobs).tolist()
    assert other != together
