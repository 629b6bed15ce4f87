"""Sampling fields from body to `SamplingParams`: what a request sets, what it omits
(the deployment's `sampling_defaults`, the model's generation_config.json, OpenAI's
defaults), and 400s naming the field for bad values. Fake engine, real tiny tokenizer,
no Ray."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from local_service import ScriptedClient, run

from serve_app.app import validate_args
from serve_app.configuration.args import ConfigError, ServeArgs
from serve_app.openai.http import OpenAIService
from serve_app.openai.sampling_defaults import SamplingDefaults, read_generation_config, request_defaults

pytestmark = pytest.mark.model

NEUTRAL = dict(top_k=0, min_p=0.0, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=())


def submit(codec, body, generation_config=None, route="completions", **args):
    """(status, JSON body, the SamplingParams the engine got or None)."""
    client = ScriptedClient([[5]])
    service = OpenAIService(client, None, ServeArgs.model_validate({"model": "m", **args}))
    service.mark_ready(codec, generation_config)

    async def go():
        transport = httpx.ASGITransport(app=service.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(f"/v1/{route}", json=body if "messages" in body else {"prompt": "hi", **body})

    r = run(go())
    return r.status_code, r.json(), client.submitted[0].sampling if client.submitted else None


def fields(params, names):
    return {name: getattr(params, name) for name in names}


def test_every_field_reaches_the_engine(codec):
    body = {
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 7,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "seed": 3,
        "logit_bias": {"17": 100, "5": -2.5, "005": -3},
    }
    status, response, params = submit(codec, body)
    assert status == 200, response
    assert fields(
        params,
        (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
        ),
    ) == {
        "temperature": 0.3,
        "top_p": 0.8,
        "top_k": 7,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.25,
        "repetition_penalty": 1.2,
        "seed": 3,
    }
    assert params.logit_bias == ((5, -3.0), (17, 100.0))  # "5" and "005" are one token: the last wins
    assert params.has_processors


def test_chat_takes_the_same_fields(codec):
    body = {"messages": [{"role": "user", "content": "hi"}], "top_k": -1, "repetition_penalty": 1.3}
    status, _, params = submit(codec, body, route="chat/completions")
    assert status == 200 and params.top_k == 0 and params.repetition_penalty == 1.3  # -1: off, as vLLM


def test_omitted_fields_take_openais_defaults_without_a_generation_config(codec):
    status, _, params = submit(codec, {})
    assert status == 200
    assert fields(params, ("temperature", "top_p", *NEUTRAL)) == {"temperature": 1.0, "top_p": 1.0, **NEUTRAL}
    assert not params.has_processors


GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}


@pytest.mark.parametrize(
    "args, body, expected",
    [
        ({}, {}, GENERATION_CONFIG),
        ({}, {"temperature": 0, "top_k": 0}, {**GENERATION_CONFIG, "temperature": 0.0, "top_k": 0}),  # the request wins
        (
            {"sampling_defaults": {"top_k": 40, "presence_penalty": 0.1}},
            {},
            {**GENERATION_CONFIG, "top_k": 40, "presence_penalty": 0.1},
        ),  # the deployment over the model
        ({"sampling_defaults": {"top_k": 40}}, {"top_k": 3}, {**GENERATION_CONFIG, "top_k": 3}),
        (
            {"use_generation_config": False},
            {},
            {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "repetition_penalty": 1.0},
        ),
        (
            {"use_generation_config": False, "sampling_defaults": {"temperature": 0.0}},
            {},
            {"temperature": 0.0, "top_p": 1.0},
        ),
    ],
)
def test_defaults_precedence(codec, args, body, expected):
    status, response, params = submit(codec, body, GENERATION_CONFIG, **args)
    assert status == 200, response
    assert fields(params, expected) == expected


@pytest.mark.parametrize(
    "body, param",
    [
        ({"top_k": -2}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"temperature": 2.5}, "temperature"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"-5": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": True}}, "logit_bias"),
        ({"logit_bias": {"5": "1"}}, "logit_bias"),
        ({"logit_bias": [5]}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # outside the tiny tokenizer's vocabulary
    ],
)
def test_bad_values_are_400s_naming_the_field(codec, body, param):
    status, response, params = submit(codec, body)
    assert status == 400 and params is None
    err = response["error"]
    assert (err["param"], err["code"]) == (param, "invalid_value")
    assert err["message"].startswith(param)


def test_the_vocabulary_bound_is_the_tokenizers(codec):
    last = codec.vocab_size - 1
    assert submit(codec, {"logit_bias": {str(last): 5}})[2].logit_bias == ((last, 5.0),)
    assert submit(codec, {"logit_bias": {str(last + 1): 5}})[0] == 400


def test_read_generation_config_keeps_valid_sampling_fields(tmp_path, caplog):
    assert read_generation_config(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 1.5,
                "top_k": -1,
                "max_new_tokens": 5,
                "repetition_penalty": 1.1,
                "min_p": None,
                "eos_token_id": [1, 2],
            }
        )
    )
    with caplog.at_level(logging.WARNING):
        got = read_generation_config(str(tmp_path))
    assert got == {"temperature": 0.7, "top_k": 0, "repetition_penalty": 1.1}
    assert "top_p" in caplog.text  # the bad value is named, not silently dropped
    (tmp_path / "generation_config.json").write_text("{not json")
    assert read_generation_config(str(tmp_path)) == {}


def test_request_defaults_layer_the_sources():
    assert request_defaults(SamplingDefaults(), None) == {"temperature": 1.0, "top_p": 1.0}
    assert request_defaults(SamplingDefaults(top_p=0.5, top_k=-1), {"top_p": 0.9, "temperature": 0.2}) == {
        "temperature": 0.2,
        "top_p": 0.5,
        "top_k": 0,
    }


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"sampling_defaults": {"top_p": 0}}, "args.sampling_defaults.top_p"),
        ({"sampling_defaults": {"top_kk": 5}}, "args.sampling_defaults.top_kk: unknown key (did you mean 'top_k'?)"),
        ({"use_generation_config": "yes"}, "args.use_generation_config"),
    ],
)
def test_bad_sampling_config_is_rejected_with_the_field_named(bad, fragment):
    with pytest.raises(ConfigError) as err:
        validate_args({"model": "m", **bad})
    assert fragment in str(err.value)
