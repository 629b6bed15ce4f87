"""An agent's tool round trip (an assistant turn of tool calls with null content, then the
tool's result) through chat templates that do not render tool calls: the calls reach
such a template as text in the deployment's tool-call format, while templates that do
render them keep getting the structured `tool_calls`. Each format's text form reads back
with its own reader. The bundled model's tokenizer (loaded, no weights)."""

from __future__ import annotations

import json
import os

import pytest

from serve_app.openai.chat import ChatMessage, calls_as_content, template_messages
from serve_app.openai.codec import TextCodec
from serve_app.openai.tool_formats import FORMATS, ToolFormat

pytestmark = pytest.mark.model  # loads a real tokenizer through mlx_lm

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")

# SmolLM2-135M-Instruct's template, verbatim: it reads message['content'] on every message.
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
# Renders structured calls, and whether the assistant turn had a content at all.
STRUCTURED = (
    "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}"
    "|{{ m.tool_calls[0].function.arguments.city }}|{{ m.content is defined }}"
    "{% else %}{{ m.content }}{% endif %};{% endfor %}"
)
NAMES = frozenset({"get_weather", "get_time"})
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def history(content=None, tool_result="12 C"):
    """[user, assistant calling get_weather, the tool's result, user] as a client sends it."""
    return template_messages(
        [
            ChatMessage.model_validate(m)
            for m in [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": content,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": tool_result},
                {"role": "user", "content": "Thanks. And tomorrow?"},
            ]
        ]
    )


def rendered(template: str | None, messages: list[dict], tool_call_format: str = "auto") -> str:
    codec = TextCodec.from_path(TARGET, template, tool_call_format)
    ids = codec.encode_chat(messages)
    return codec._tok.decode(ids, skip_special_tokens=False)


def test_a_tool_round_trip_renders_through_a_template_that_reads_only_content():
    text = rendered(SMOLLM2, history())
    assert f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>\n" in text
    assert "<|im_start|>tool\n12 C<|im_end|>\n" in text
    assert text.endswith("<|im_start|>user\nThanks. And tomorrow?<|im_end|>\n<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = ToolFormat("hermes").read(turn, NAMES)  # the model sees what it writes
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]


def test_the_calls_follow_the_assistants_text_in_the_deployments_format():
    text = rendered(SMOLLM2, history(content="Let me check."), tool_call_format="mistral")
    assert (
        "<|im_start|>assistant\nLet me check.\n"
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]<|im_end|>'
    ) in text


def test_the_tokenizers_own_content_only_template_gets_the_calls_as_text_too():
    text = rendered(None, history())  # the bundled template prints message['content'] only
    assert f"<|im_start|>assistant\n{HERMES_CALL}<|im_end|>" in text


def test_a_tool_result_in_text_parts_reaches_the_template_as_one_string():
    parts = [{"type": "text", "text": "12 "}, {"type": "text", "text": "C"}]
    messages = history(tool_result=parts)
    assert messages[2]["content"] == "12 C"
    assert "<|im_start|>tool\n12 C<|im_end|>" in rendered(SMOLLM2, messages)


def test_a_template_that_renders_tool_calls_still_gets_them_structured():
    messages = history()
    assert rendered(STRUCTURED, messages) == "Weather in Oslo?;get_weather|Oslo|False;12 C;Thanks. And tomorrow?;"
    assert "tool_calls" in messages[1] and "content" not in messages[1]  # the list given untouched


def test_calls_as_content_leaves_other_messages_and_its_input_alone():
    messages = history()
    out = calls_as_content(messages, lambda calls: f"CALLS{calls}")
    assert out[1] == {"role": "assistant", "content": "CALLS[('get_weather', {'city': 'Oslo'})]"}
    assert out[0] is messages[0] and out[2] is messages[2] and out[3] is messages[3]
    assert messages[1]["tool_calls"] and "content" not in messages[1]


ONE = [("get_weather", {"city": "Tromsø", "when": ["tomorrow", 2], "hourly": {"on": True}})]
TWO = [*ONE, ("get_time", {})]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("calls", [ONE, TWO], ids=["one", "two"])
def test_each_formats_text_reads_back_with_its_own_reader(name, calls):
    fmt = ToolFormat(name)
    content, read = fmt.read(fmt.text(calls), NAMES)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in read] == calls


@pytest.mark.parametrize(
    "name, text",
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]',
        ),
        ("mistral_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}'),
    ],
)
def test_each_formats_text_is_its_own_form(name, text):
    assert ToolFormat(name).text([("get_weather", {"city": "Oslo"}), ("get_time", {})]) == text
