"""Tool-call formats read back (text -> tool_calls), chosen from chat templates, and the
lark text of a forced call. Plain data: no tokenizer, no grammar engine (the compiled
grammars are checked against a real tokenizer in tests/serve/test_tool_call_formats.py)."""

from __future__ import annotations

import json

import pytest

from serve_app.openai.tool_formats import ToolFormat, detect, marker_special_ids

NAMES = frozenset({"get_weather", "get_time"})
OSLO = {"city": "Oslo"}


def calls_of(name: str, text: str) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = ToolFormat(name).read(text, NAMES)
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert isinstance(call["function"]["arguments"], str)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "name, text, content, calls",
    [
        # Hermes / Qwen: tagged blocks, text around them kept as content
        (
            "hermes",
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
            None,
            [("get_weather", OSLO)],
        ),
        (
            "hermes",
            'Checking.<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>\n'
            '<tool_call>{"name":"get_time","arguments":{}}</tool_call>',
            "Checking.",
            [("get_weather", OSLO), ("get_time", {})],
        ),
        ("hermes", '{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # a bare call object
        (
            "hermes",
            '<tool_call>{"name":"get_time","arguments":"{\\"tz\\": \\"UTC\\"}"}</tool_call>',
            None,
            [("get_time", {"tz": "UTC"})],
        ),  # arguments written as a JSON string
        # Llama 3.x: the whole reply, "parameters", optionally after <|python_tag|>, ";" between calls
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", OSLO)]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [("get_weather", OSLO)],
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", OSLO), ("get_time", {})],
        ),
        # Mistral: a JSON list after [TOOL_CALLS], text before it kept; the v11 shape read too
        (
            "mistral",
            '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]',
            None,
            [("get_weather", OSLO), ("get_time", {})],
        ),
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}]', "Sure.", [("get_time", {})]),
        ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', None, [("get_weather", OSLO)]),
        (
            "mistral_v11",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
            None,
            [("get_weather", OSLO), ("get_time", {})],
        ),
        (
            "mistral_v11",
            '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}get_time[ARGS]{}',
            None,
            [("get_weather", OSLO), ("get_time", {})],
        ),
        ("mistral_v11", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]', None, [("get_time", {})]),
    ],
)
def test_each_format_reads_its_calls(name, text, content, calls):
    assert calls_of(name, text) == (content, calls)


@pytest.mark.parametrize(
    "name, text",
    [
        ("hermes", "It is sunny in Oslo."),
        ("hermes", '<tool_call>{"name":"get_weather","arguments":{"city":</tool_call>'),  # cut JSON
        ("hermes", '<tool_call>{"name":"launch","arguments":{}}</tool_call>'),  # not a tool
        ("hermes", '<tool_call>{"name":"get_time","arguments":[1]}</tool_call>'),  # arguments not an object
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"'),
        ("llama3_json", 'I will call {"name": "get_time", "parameters": {}}'),  # a call must be the whole reply
        ("llama3_json", '{"name": "get_time", "parameters": {}}; {"name": "launch", "parameters": {}}'),
        ("llama3_json", '{"name": "get_time", "parameters": {}} {"name": "get_time", "parameters": {}}'),
        ("llama3_json", '{"city": "Oslo"}'),
        ("mistral", '[{"name": "get_time", "arguments": {}}]'),  # no marker: content
        ("mistral", 'Sure. [TOOL_CALLS][{"name": "get_time", "arguments": {}}'),
        ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "launch", "arguments": {}}]'),
        ("mistral_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Os'),
        ("mistral_v11", '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"} and then some'),
        ("mistral_v11", "[TOOL_CALLS]launch[ARGS]{}"),
    ],
)
def test_text_that_is_not_calls_is_content_character_for_character(name, text):
    assert ToolFormat(name).read(text, NAMES) == (text, [])


def test_a_hermes_block_that_does_not_parse_stays_in_the_content_beside_the_calls():
    bad = '<tool_call>{"name":"launch","arguments":{}}</tool_call>'
    text = f'<tool_call>{{"name":"get_time","arguments":{{}}}}</tool_call>{bad}'
    assert calls_of("hermes", text) == (bad, [("get_time", {})])


@pytest.mark.parametrize(
    "template, name",
    [
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", "hermes"),  # no tool markup: the default
        (None, "hermes"),
        ("{{- '<tool_call>\\n' + tool_call | tojson + '\\n</tool_call>' }}", "hermes"),
        ("{{- '<|start_header_id|>ipython<|end_header_id|>' }}{{ '<|python_tag|>' }}", "llama3_json"),
        ("{%- if message.role == 'ipython' %}{{ m.content }}{% endif %}", "llama3_json"),
        ("{{- '[TOOL_CALLS] [' }}{{ tool_calls | tojson }}", "mistral"),
        ("{{- '[TOOL_CALLS]' + call.name + '[ARGS]' + call.arguments }}", "mistral_v11"),
    ],
)
def test_the_format_is_the_one_the_chat_template_renders(template, name):
    assert detect(template) == name


def test_an_unknown_format_name_is_refused():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        ToolFormat("pythonic")


def test_markers_that_are_one_special_token_are_kept_and_become_that_token_in_the_grammar():
    vocab = {"[TOOL_CALLS]": [7], "[ARGS]": [3, 4]}  # [ARGS] spelled as two ordinary tokens
    special = marker_special_ids(ToolFormat("mistral_v11").markers, vocab.__getitem__, {7})
    fmt = ToolFormat("mistral_v11", special)
    assert fmt.kept_ids == {7: "[TOOL_CALLS]"}
    lark = fmt.lark([{"name": "get_time"}], parallel=False)
    assert "<[7]>" in lark and '"[ARGS]"' in lark and "[TOOL_CALLS]" not in lark
    assert marker_special_ids(["[TOOL_CALLS]"], vocab.__getitem__, set()) == ()  # one token, not special


WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.mark.parametrize(
    "name, key, single, parallel",
    [
        ("hermes", '"arguments"', "start: block\n", 'start: block ("\\n" block)*\n'),
        ("llama3_json", '"parameters"', "start: call\n", 'start: call ("; " call)*\n'),
        (
            "mistral",
            '"arguments"',
            'start: "[TOOL_CALLS]" " "? "[" call "]"\n',
            'start: "[TOOL_CALLS]" " "? "[" call ("," " "? call)* "]"\n',
        ),
        ("mistral_v11", '"city"', "start: call\n", "start: call call*\n"),
    ],
)
def test_a_forced_calls_grammar_is_the_formats_form(name, key, single, parallel):
    fmt = ToolFormat(name)
    one, many = fmt.lark([WEATHER, {"name": "get_time"}], False), fmt.lark([WEATHER, {"name": "get_time"}], True)
    assert one.startswith(single) and many.startswith(parallel)
    assert key in one and '"get_weather"' in one and '"get_time"' in one
    assert '"whitespace_flexible":false' in one  # compact JSON, as response_format's


def test_each_functions_defs_move_to_the_root_renamed_with_their_references():
    item = {"type": "object", "properties": {"sku": {"type": "integer"}}}
    add = {
        "name": "add",
        "parameters": {"type": "object", "properties": {"item": {"$ref": "#/$defs/Item"}}, "$defs": {"Item": item}},
    }
    tag = {
        "name": "tag",
        "parameters": {
            "type": "object",
            "properties": {"x": {"$ref": "#/definitions/Item"}},
            "definitions": {"Item": {"type": "string"}},
        },
    }
    lark = ToolFormat("hermes").lark([add, tag], parallel=True)
    schema = json.loads(lark.split("call: %json ", 1)[1])
    assert schema["$defs"] == {"add.Item": item, "tag.Item": {"type": "string"}}
    add_args, tag_args = (option["properties"]["arguments"] for option in schema["anyOf"])
    assert add_args == {"type": "object", "properties": {"item": {"$ref": "#/$defs/add.Item"}}}
    assert tag_args == {"type": "object", "properties": {"x": {"$ref": "#/$defs/tag.Item"}}}
    assert "$defs" in add["parameters"]  # the request's own schema is left as it was
