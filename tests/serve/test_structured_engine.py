"""Structured output and a tool-call round trip with the official `openai` client against
the real HTTP layer and an in-process engine (bundled pair, n-gram drafts; no Ray)."""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import jsonschema
import pytest

pytestmark = pytest.mark.model

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 12},
        "lines": {"type": "integer", "minimum": 1, "maximum": 500},
        "tags": {"type": "array", "items": {"enum": ["io", "math", "text"]}, "maxItems": 2},
    },
    "required": ["title", "lines", "tags"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "Describe the module textwrap."}]
# A template that renders tool calls as Mistral's does, so the deployment reads and forces
# calls in that format (the bundled tokenizer's own ChatML template: Hermes; the other
# formats are checked on the HTTP layer, tests/serve/test_tool_call_formats.py).
CALLS_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{% if m.tool_calls %}assistant: MARK{{ m.tool_calls | tojson }}"
    "{% else %}{{ m.role }}: {{ m.content }}{% endif %}\n{% endfor %}assistant:"
)
TEMPLATES = {"hermes": None, "mistral": CALLS_TEMPLATE.replace("MARK", "[TOOL_CALLS]")}


async def _session(test, chat_template=None):
    from openai import AsyncOpenAI

    from serve_app.configuration.args import ServeArgs
    from serve_app.deployment.actor import build_engine
    from serve_app.deployment.client import EngineClient, LocalSource
    from serve_app.openai.codec import TextCodec
    from serve_app.openai.http import OpenAIService

    args = ServeArgs.model_validate({"model": os.path.abspath(TARGET), "drafter": {"kind": "ngram"}})
    client = EngineClient(LocalSource(lambda: build_engine(args)))
    service = OpenAIService(client, None, args)
    await client.start()
    service.mark_ready(TextCodec.from_path(args.model, chat_template))
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=service.app()), base_url="http://t/v1")
    try:
        return await test(AsyncOpenAI(base_url="http://t/v1", api_key="unused", http_client=http))
    finally:
        await http.aclose()
        await client.close()


def test_json_schema_reply_parses_and_validates_streamed_or_not():
    async def test(openai):
        fmt = {"type": "json_schema", "json_schema": {"name": "module", "schema": SCHEMA, "strict": True}}
        reply = await openai.chat.completions.create(
            model="target", messages=USER, response_format=fmt, max_tokens=120, temperature=0
        )
        stream = await openai.chat.completions.create(
            model="target", messages=USER, response_format=fmt, max_tokens=120, temperature=0, stream=True
        )
        chunks = [c async for c in stream]
        return reply, chunks

    reply, chunks = asyncio.run(_session(test))
    text = reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert reply.usage.speculative["rounds"] >= 0  # our usage extension rides along


@pytest.mark.parametrize("fmt", list(TEMPLATES))
def test_a_tool_call_round_trip(fmt):
    from serve_app.openai.codec import TextCodec

    assert TextCodec.from_path(os.path.abspath(TARGET), TEMPLATES[fmt]).tool_format.name == fmt

    async def test(openai):
        messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
        first = await openai.chat.completions.create(
            model="target",
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=80,
            temperature=0,
            logprobs=True,
            parallel_tool_calls=False,
        )
        # (one call: the tiny model, allowed more, may write calls until max_tokens)
        call = first.choices[0].message.tool_calls[0]
        messages += [
            first.choices[0].message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'},
        ]
        second = await openai.chat.completions.create(
            model="target", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=16, temperature=0
        )
        return first, second

    first, second = asyncio.run(_session(test, TEMPLATES[fmt]))
    assert first.choices[0].finish_reason == "tool_calls" and first.choices[0].message.content is None
    written = b"".join(bytes(e.bytes) for e in first.choices[0].logprobs.content).decode()
    assert written.startswith({"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}[fmt])
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert second.choices[0].message.tool_calls is None
    # the answer after the tool result: plain content (the tiny model may end at once)
    assert isinstance(second.choices[0].message.content, str)
    assert second.choices[0].finish_reason in ("stop", "length")
