"""What SDKs and agent frameworks send: chat histories with tool calls, chat templates
(the tokenizer's, a configured one, none), accepted no-op fields, prompt lists, and
OpenAI-style 400s naming the field for what is not supported. Fake engine, real tiny
tokenizer, no Ray."""

from __future__ import annotations

import json
import os

import pytest
from local_service import ScriptedClient, make_app, run

from serve_app.configuration.args import ConfigError, ServeArgs, is_template_path, read_chat_template
from serve_app.openai.codec import TextCodec

pytestmark = pytest.mark.model

USER = [{"role": "user", "content": "hi"}]

# Shows everything a template is given, without special tokens, so the prompt's decoded
# text is exactly what it rendered (jinja's trim_blocks eats newlines after tags: '\n' is
# an expression).
RENDER_ALL = (
    "{% for m in messages %}[{{ m.role }}{% if m.name %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}]"
    "{% if m.content is defined %}{{ m.content }}{% endif %}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}>{% endfor %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
# As Gemma's and Mistral's templates do.
NO_SYSTEM = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
)


@pytest.fixture(scope="module")
def bare_dir(tiny_pair, tmp_path_factory):
    """The tiny tokenizer without its chat template."""
    out = tmp_path_factory.mktemp("bare-tokenizer")
    with open(os.path.join(tiny_pair[0], "tokenizer.json")) as src:
        (out / "tokenizer.json").write_text(src.read())
    with open(os.path.join(tiny_pair[0], "tokenizer_config.json")) as src:
        config = json.load(src)
    del config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return str(out)


def post(codec, route, body, script=([5],)):
    """(status, JSON body, the prompt the engine was given as text or None)."""
    client = ScriptedClient([list(ids) for ids in script])

    async def go():
        async with make_app(codec, client) as http:
            return await http.post(f"/v1/{route}", json=body)

    r = run(go())
    prompt = codec.decode(client.submitted[0].prompt_ids) if client.submitted else None
    return r.status_code, r.json(), prompt


def test_agent_histories_reach_the_template_with_tool_calls_names_and_text_parts(tiny_pair):
    codec = TextCodec.from_path(tiny_pair[0], RENDER_ALL)
    messages = [
        {"role": "developer", "content": "be brief"},
        {
            "role": "user",
            "name": "ann",
            "content": [{"type": "text", "text": "weather in "}, {"type": "text", "text": "Oslo?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    ]
    status, _, prompt = post(codec, "chat/completions", {"messages": messages})
    assert status == 200
    assert prompt == (
        "[system]be brief\n[user name=ann]weather in Oslo?\n"
        '[assistant]<call call_1 get_weather {"city": "Oslo"}>\n'
        "[tool id=call_1]12 C\n[assistant]"
    )


def test_chat_template_kwargs_become_template_variables(tiny_pair):
    codec = TextCodec.from_path(tiny_pair[0], "{{ greeting | default('none') }} {{ enable_thinking }}")
    assert post(codec, "chat/completions", {"messages": USER})[2] == "none False"
    body = {"messages": USER, "chat_template_kwargs": {"greeting": "hello", "enable_thinking": True}}
    assert post(codec, "chat/completions", body)[2] == "hello True"
    status, err, _ = post(
        codec, "chat/completions", {"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}
    )
    assert status == 400 and err["error"]["param"] == "chat_template_kwargs.add_generation_prompt"


@pytest.mark.parametrize(
    "template, messages, status, code, fragment",
    [
        (NO_SYSTEM, USER, 200, None, None),
        (
            NO_SYSTEM,
            [{"role": "system", "content": "s"}, *USER],
            400,
            "chat_template_error",
            "System role not supported",
        ),
        # a template that expects content on every message, given a tool-calling assistant turn
        (
            "{% for m in messages %}{{ m.content + '!' }}{{ m.tool_calls }}{% endfor %}",
            [
                *USER,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                },
            ],
            400,
            "chat_template_error",
            "content",
        ),
        ("{% for m in messages %}", USER, 500, "chat_template_invalid", "does not parse"),
    ],
)
def test_template_failures_are_openai_errors_not_500s(tiny_pair, template, messages, status, code, fragment):
    codec = TextCodec.from_path(tiny_pair[0], template)
    got, body, prompt = post(codec, "chat/completions", {"messages": messages})
    assert got == status
    if status == 200:
        assert prompt == "hi"
    else:
        err = body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
        assert fragment in err["message"] and "Traceback" not in err["message"]


def test_without_a_template_chat_is_a_400_unless_the_config_supplies_one(bare_dir, tmp_path):
    bare = TextCodec.from_path(bare_dir)
    status, body, _ = post(bare, "chat/completions", {"messages": USER})
    assert status == 400 and body["error"]["code"] == "no_chat_template"
    assert post(bare, "completions", {"prompt": "hi"})[0] == 200  # completions need no template

    (tmp_path / "plain.jinja").write_text(
        "{% for m in messages %}{{ m.role }}> {{ m.content }}{{ '\\n' }}{% endfor %}bot>"
    )
    args = ServeArgs.model_validate({"model": "m", "chat_template": "plain.jinja"})
    resolved = args.with_resolved_paths(tmp_path)
    assert resolved.chat_template.startswith("{% for m in messages %}")
    configured = TextCodec.from_path(bare_dir, resolved.chat_template)
    assert post(configured, "chat/completions", {"messages": USER})[2] == "user> hi\nbot>"


def test_the_tokenizers_own_template_renders_chat(codec):
    # the tiny tokenizer's ChatML template; its <|im_start|> / <|im_end|> decode to nothing
    assert post(codec, "chat/completions", {"messages": USER})[2] == "user\nhi\nassistant\n"


@pytest.mark.parametrize(
    "value, is_path",
    [
        ("templates/chatml.jinja", True),
        ("/abs/t.jinja ", True),
        ("{{ messages }}", False),
        ("{% raw %}x.jinja{% endraw %}", False),
        ("line\nx.jinja", False),
        ("chatml", False),
    ],
)
def test_a_chat_template_value_is_a_path_only_when_it_names_a_jinja_file(value, is_path):
    assert is_template_path(value) is is_path


def test_a_chat_template_file_is_read_when_the_app_is_built(tmp_path):
    assert read_chat_template("{{ x }}", tmp_path) == "{{ x }}"
    assert read_chat_template(None, tmp_path) is None
    with pytest.raises(ConfigError, match=r"args.chat_template: cannot read .*missing.jinja"):
        ServeArgs.model_validate({"model": "m", "chat_template": "missing.jinja"}).with_resolved_paths(tmp_path)
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(ConfigError, match="is empty"):
        read_chat_template("empty.jinja", tmp_path)


@pytest.mark.parametrize(
    "route, body, status, param, code",
    [
        # accepted, and change nothing
        ("chat/completions", {"messages": USER, "store": True}, 200, None, None),
        ("chat/completions", {"messages": USER, "response_format": {"type": "text"}}, 200, None, None),
        (
            "chat/completions",
            {
                "messages": USER,
                "n": 1,
                "logprobs": False,
                "presence_penalty": 0,
                "frequency_penalty": 0.0,
                "logit_bias": {},
                "top_k": -1,
                "repetition_penalty": 1.0,
            },
            200,
            None,
            None,
        ),
        # sampling fields (tests/serve/test_sampling_fields.py checks what they become)
        (
            "completions",
            {
                "prompt": "hi",
                "logit_bias": {"5": 10},
                "top_k": 40,
                "min_p": 0.1,
                "repetition_penalty": 1.1,
                "presence_penalty": 0.5,
                "frequency_penalty": -1,
            },
            200,
            None,
            None,
        ),
        # structured output and tools (tests/serve/test_structured_http.py checks the replies)
        ("chat/completions", {"messages": USER, "response_format": {"type": "json_object"}}, 200, None, None),
        (
            "chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
            200,
            None,
            None,
        ),
        ("chat/completions", {"messages": USER, "parallel_tool_calls": True}, 200, None, None),
        ("chat/completions", {"messages": USER, "tool_choice": "auto"}, 400, "tool_choice", "invalid_value"),
        # logprobs and n (tests/serve/test_logprobs_http.py checks the replies)
        ("chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2, "n": 2}, 200, None, None),
        ("completions", {"prompt": "hi", "logprobs": 5, "n": 8}, 200, None, None),
        ("chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
        (
            "chat/completions",
            {"messages": USER, "logprobs": True, "top_logprobs": 21},
            400,
            "top_logprobs",
            "invalid_value",
        ),
        ("completions", {"prompt": "hi", "logprobs": 6}, 400, "logprobs", "invalid_value"),
        ("completions", {"prompt": "hi", "n": 9}, 400, "n", "invalid_value"),
        # not implemented yet: a 400 naming the field
        ("completions", {"prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
        # malformed, named as the client wrote it
        ("completions", {"prompt": "hi", "n": 0}, 400, "n", "invalid_value"),
        ("completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", "invalid_value"),
        (
            "chat/completions",
            {"messages": [*USER, {"role": "user", "content": 5}]},
            400,
            "messages[1].content",
            "invalid_value",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
            400,
            "messages[0].content[0].text",
            "invalid_value",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x"}}]}]},
            400,
            "messages[0].content[0]",
            "unsupported_value",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
            400,
            "messages[0].tool_calls",
            "invalid_value",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "tool", "content": "r"}]},
            400,
            "messages[0].tool_call_id",
            "invalid_value",
        ),
        (
            "chat/completions",
            {"messages": [*USER, {"role": "assistant", "content": None}]},
            400,
            "messages[1].content",
            "invalid_value",
        ),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "hi", "audio": 1}]},
            400,
            "messages[0].audio",
            "invalid_value",
        ),
        ("completions", {"prompt": ["one", "two"]}, 400, "prompt", "unsupported_value"),
        ("completions", {"prompt": [[1], [2]]}, 400, "prompt", "unsupported_value"),
        ("completions", {"prompt": 5}, 400, "prompt", "invalid_value"),
    ],
)
def test_request_surface(codec, route, body, status, param, code):
    got, response, _ = post(codec, route, body)
    assert got == status, response
    if status != 200:
        err = response["error"]
        assert (err["param"], err["code"]) == (param, code)
        assert err["message"].startswith(param)  # names the field first, as the client wrote it
        if code == "unsupported_parameter":
            assert "not supported yet" in err["message"]


def test_a_list_holding_one_prompt_is_that_prompt(codec):
    ids = codec.encode("hi there")
    for prompt in ("hi there", ["hi there"], ids, [ids]):
        status, _, as_text = post(codec, "completions", {"prompt": prompt})
        assert (status, as_text) == (200, "hi there"), prompt
