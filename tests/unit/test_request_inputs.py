"""The HTTP layer's input checks as tables: max_tokens within the context, and each
choice's seed."""

from dataclasses import replace

import pytest

from serve_app.configuration.args import ServeArgs
from serve_app.openai import request_inputs
from serve_app.openai.protocol import APIError, GenerationSpec

SPEC = GenerationSpec(
    chat=False,
    model=None,
    prompt_text="x",
    prompt_ids=None,
    messages=None,
    chat_template_kwargs={},
    max_tokens=None,
    sampling={},
    stop=[],
    seed=None,
    stream=False,
    include_usage=False,
)
ARGS = ServeArgs(model="m", default_max_tokens=100, max_tokens_limit=500)


@pytest.mark.parametrize(
    "max_tokens, num_prompt, max_context, expected",
    [
        (None, 10, None, 100),  # the default
        (None, 10, 50, 40),  # the default, clipped to the context left
        (200, 10, None, 200),  # as asked
        (40, 10, 50, 40),  # exactly fills the context
        (600, 10, None, "invalid_value"),  # over max_tokens_limit
        (41, 10, 50, "context_length_exceeded"),  # prompt + max_tokens over the context
        (None, 50, 50, "context_length_exceeded"),  # the prompt alone fills it
    ],
)
def test_max_tokens(max_tokens, num_prompt, max_context, expected):
    spec = replace(SPEC, max_tokens=max_tokens)
    if isinstance(expected, str):
        with pytest.raises(APIError) as err:
            request_inputs.max_tokens(spec, num_prompt, max_context, ARGS)
        assert err.value.code == expected
    else:
        assert request_inputs.max_tokens(spec, num_prompt, max_context, ARGS) == expected


@pytest.mark.parametrize(
    "seed, choice, expected",
    [
        (None, 3, None),
        (7, 0, 7),
        (7, 2, 9),
        (2**64 - 1, 1, 0),
        (-5, 2, -3),
    ],
)
def test_a_seeded_requests_choices_get_seed_plus_index(seed, choice, expected):
    params = request_inputs.sampling(replace(SPEC, seed=seed), 16, choice, {}, vocab_size=100, eos_token_ids=[2])
    assert (params.seed, params.max_tokens, params.stop_token_ids) == (expected, 16, (2,))


def test_a_logit_bias_outside_the_vocabulary_is_refused():
    spec = replace(SPEC, sampling={"logit_bias": ((100, 1.0),)})
    with pytest.raises(APIError) as err:
        request_inputs.sampling(spec, 16, 0, {}, vocab_size=100, eos_token_ids=[])
    assert err.value.param == "logit_bias"
