"""Greedy parity: speculative output equals classic (BatchGenerator) output, token for
token, for every prompt, K in 1..6 and both drafters."""

import pytest

from models.tiny import greedy_margins

from .conftest import make_request
from .helpers import make_drafter, run_classic, run_session

pytestmark = pytest.mark.model

MAX_TOKENS = 24
# Largest |logit| difference seen between a multi-token verify and single steps on the
# tiny models is ~1e-6; parity is only meaningful when every greedy choice wins by far more.
MIN_MARGIN = 1e-4


@pytest.fixture(scope="module")
def classic_outputs(loaded, prompt_ids):
    requests = [make_request(f"r{i}", ids, MAX_TOKENS) for i, ids in enumerate(prompt_ids)]
    return run_classic(loaded[0].model, requests, sorted(loaded[0].tokenizer.eos_token_ids))


def test_prompt_set_is_large_enough(prompt_ids):
    assert len(prompt_ids) >= 20
    assert any(len(ids) == 1 for ids in prompt_ids)


def test_greedy_margins_are_far_above_float_noise(loaded, prompt_ids):
    """Guards the parity tests against passing or failing by float luck."""
    worst = min(min(greedy_margins(loaded[0].model, ids, MAX_TOKENS)) for ids in prompt_ids)
    assert worst > MIN_MARGIN, f"tiny model has a near-tie (margin {worst:.2e}); rebuild it"


def test_classic_batched_equals_classic_alone(loaded, prompt_ids, classic_outputs):
    eos = sorted(loaded[0].tokenizer.eos_token_ids)
    for i in (0, 4, 7):
        alone = run_classic(loaded[0].model, [make_request(f"r{i}", prompt_ids[i], MAX_TOKENS)], eos)
        assert alone[f"r{i}"] == classic_outputs[f"r{i}"]


@pytest.mark.parametrize("kind", ["draft_model", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_speculative_equals_classic(loaded, prompt_ids, classic_outputs, kind, k):
    drafter = make_drafter(kind, loaded)
    num_drafted = num_accepted = 0
    for i, ids in enumerate(prompt_ids):
        tokens, reason, rounds = run_session(loaded, make_request(f"r{i}", ids, MAX_TOKENS), k, drafter)
        assert (tokens, reason) == classic_outputs[f"r{i}"], f"prompt {i} diverged at K={k}"
        num_drafted += sum(r[1] for r in rounds)
        num_accepted += sum(r[2] for r in rounds)
    # Both accepted and rejected drafts must occur, or the parity check proves little.
    assert 0 < num_accepted < num_drafted
