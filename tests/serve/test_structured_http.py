"""Structured output and tool calls through the HTTP layer (scripted engine, no Ray):
what reaches the scheduler (the grammar, the tools in the prompt) and the reply shapes
(`message.tool_calls`, `finish_reason: "tool_calls"`, streamed deltas)."""

from __future__ import annotations

import json

import pytest
from local_service import ScriptedClient, make_app, run

pytestmark = pytest.mark.model

USER = [{"role": "user", "content": "weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}
CALL = '{"name":"get_weather","arguments":{"city":"Paris"}}'
# Renders the tools the request passes, so a test can see them in the prompt.
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


def chat(codec, body, script_text=None, finish="stop"):
    """(status, reply json or SSE events, the request the scheduler got)."""
    script = [codec.encode(script_text)] if script_text is not None else [[5]]
    client = ScriptedClient(script, finish=finish)

    async def go():
        async with make_app(codec, client) as http:
            return await http.post("/v1/chat/completions", json={"messages": USER, **body})

    r = run(go())
    if r.status_code != 200:
        return r.status_code, r.json(), None
    if body.get("stream"):
        events = [
            json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
        return 200, events, client.submitted[0]
    return 200, r.json(), client.submitted[0]


def test_json_schema_reaches_the_scheduler_as_a_grammar(codec):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    body = {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}}
    status, reply, request = chat(codec, body, '{"a":1}')
    assert status == 200 and request.sampling.grammar is not None and '"required":["a"]' in request.sampling.grammar
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": '{"a":1}'}
    assert reply["choices"][0]["finish_reason"] == "stop"
    _, _, plain = chat(codec, {}, "x")
    assert plain.sampling.grammar is None
    _, _, obj = chat(codec, {"response_format": {"type": "json_object"}}, "{}")
    assert obj.sampling.grammar is not None and '"type":"object"' in obj.sampling.grammar


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_is_returned_as_tool_calls(codec, choice):
    body = {"tools": [WEATHER, CLOCK], "tool_choice": choice}
    status, reply, request = chat(codec, body, f"<tool_call>\n{CALL}\n</tool_call>")  # the template's format
    assert status == 200
    grammar = request.sampling.grammar
    assert '"const":"get_weather"' in grammar and ('"const":"get_time"' in grammar) == (choice == "required")
    assert grammar.startswith("start: block") and ("block)*" in grammar) == (choice == "required")
    choice0 = reply["choices"][0]
    assert choice0["finish_reason"] == "tool_calls"
    message = choice0["message"]
    assert message["content"] is None and len(message["tool_calls"]) == 1
    call = message["tool_calls"][0]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_a_forced_call_cut_by_max_tokens_is_content_with_length(codec):
    status, reply, _ = chat(codec, {"tools": [WEATHER], "tool_choice": "required"}, CALL[:20], finish="length")
    assert status == 200
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["choices"][0]["message"] == {"role": "assistant", "content": CALL[:20]}


def test_auto_reads_a_hermes_tool_call_or_returns_content(codec):
    _, reply, request = chat(codec, {"tools": [WEATHER]}, f"Let me check.<tool_call>{CALL}</tool_call>")
    assert request.sampling.grammar is None  # auto: unconstrained
    assert reply["choices"][0]["finish_reason"] == "tool_calls"
    assert reply["choices"][0]["message"]["content"] == "Let me check."
    assert reply["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    _, reply, _ = chat(codec, {"tools": [WEATHER], "tool_choice": "auto"}, "It is sunny.")
    assert reply["choices"][0] | {"logprobs": None} == {
        "index": 0,
        "message": {"role": "assistant", "content": "It is sunny."},
        "logprobs": None,
        "finish_reason": "stop",
    }
    unknown = CALL.replace("get_weather", "launch")
    _, reply, _ = chat(codec, {"tools": [WEATHER]}, f"<tool_call>{unknown}</tool_call>")
    assert reply["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in reply["choices"][0]["message"]


def test_tools_reach_the_chat_template_unless_tool_choice_is_none(tiny_pair):
    from serve_app.openai.codec import TextCodec

    codec = TextCodec.from_path(tiny_pair[0], chat_template=TOOLS_TEMPLATE)
    for body, shown in [({"tools": [WEATHER, CLOCK]}, True), ({"tools": [WEATHER], "tool_choice": "none"}, False)]:
        _, reply, request = chat(codec, body, CALL)
        prompt = codec.decode(request.prompt_ids)
        assert ("TOOLS:get_weather;get_time;" in prompt) is shown, prompt
        if not shown:  # none: the reply is content, even when it looks like a call
            assert reply["choices"][0]["message"]["content"] == CALL
            assert reply["choices"][0]["finish_reason"] == "stop"


def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(codec):
    body = {"tools": [WEATHER], "tool_choice": "required", "stream": True}
    status, events, _ = chat(codec, body, CALL)
    assert status == 200
    deltas = [e["choices"][0]["delta"] for e in events]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    assert calls[0][0]["function"] == {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    # a json_schema reply streams as text
    schema_body = {"response_format": {"type": "json_object"}, "stream": True}
    _, events, _ = chat(codec, schema_body, '{"a":1}')
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == '{"a":1}'
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}},
            "response_format",
        ),
        ({"tools": []}, "tools"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice.function.name",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_malformed_structured_fields_are_a_400_naming_the_field(codec, body, param):
    status, reply, _ = chat(codec, body)
    assert status == 400 and reply["error"]["param"] == param, reply
