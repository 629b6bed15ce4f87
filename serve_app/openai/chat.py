"""Chat messages as clients send them, and as Hugging Face chat templates take them.

A history may hold what agents replay: `tool` messages answering a call
(`tool_call_id`), assistant messages whose `content` is null because they carry
`tool_calls`, a participant `name`, content as a list of text parts. `template_messages`
checks what pydantic cannot (which role may carry what) and returns plain dicts in the
shape templates expect:

>>> [call] = template_messages([ChatMessage(role="assistant", tool_calls=[ToolCall(id="c1",
...     function=FunctionCall(name="f", arguments='{"x": 1}'))])])[0]["tool_calls"]
>>> call
{'id': 'c1', 'type': 'function', 'function': {'name': 'f', 'arguments': {'x': 1}}}

Many templates (SmolLM2's, plain ChatML ones) never render `tool_calls` and read
`content` on every message; for those, `calls_as_content` writes the calls into the
assistant's `content` as text, in the model's tool-call format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from serve_app.openai.errors import APIError

_BODY = ConfigDict(extra="forbid", strict=True)


class ContentPart(BaseModel):
    # Parts of other types (image_url, input_audio) carry their own fields; they are
    # rejected by type, naming the part, rather than as unknown fields.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = _BODY
    name: str = Field(..., max_length=256)
    arguments: str


class ToolCall(BaseModel):
    model_config = _BODY
    id: str = Field(..., max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = _BODY
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = Field(None, max_length=256)
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(None, max_length=256)


def template_messages(messages: list[ChatMessage]) -> list[dict]:
    """The messages as chat templates take them; raises `APIError` (400) naming the field.

    `developer` (OpenAI's newer name for the system role) becomes `system`, which is the
    role templates know. A null `content` is left out, as in Hugging Face's own tool-use
    examples (`calls_as_content` fills it for templates that need it). Tool-call
    `arguments` that are a JSON object are passed parsed, since templates render them
    with `tojson`; anything else is passed as the string it is.
    """
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.tool_calls is not None and m.role != "assistant":
            _reject(f"{where}.tool_calls", "only assistant messages carry tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            _reject(f"{where}.tool_call_id", "only tool messages carry tool_call_id")
        if m.role == "tool" and m.tool_call_id is None:
            _reject(f"{where}.tool_call_id", "required for tool messages")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            _reject(f"{where}.content", "required (null only for an assistant message with tool_calls)")
        message = {"role": "system" if m.role == "developer" else m.role}
        if m.content is not None:
            message["content"] = _content_text(m.content, f"{where}.content")
        if m.name is not None:
            message["name"] = m.name
        if m.tool_calls:
            message["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


def calls_as_content(messages: list[dict], write: Callable[[list[tuple[str, Any]]], str]) -> list[dict]:
    """`messages` as `template_messages` returns them, reshaped for a template that does
    not render tool calls: an assistant message's `tool_calls` are replaced by their text,
    `write([(name, arguments), ...])` (a `ToolFormat.text`), appended to its `content`
    (null as "", a newline between text and calls). Other messages are returned as they
    are; the list given is not modified."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = write([(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]])
            text = message.get("content") or ""
            message = {k: v for k, v in message.items() if k != "tool_calls"}
            message["content"] = f"{text}\n{calls}" if text else calls
        out.append(message)
    return out


def _content_text(content: str | list[ContentPart], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(
                400,
                f"{where}[{j}]: content parts of type '{part.type[:64]}' are not supported; only 'text'",
                param=f"{where}[{j}]",
                code="unsupported_value",
            )
        if part.text is None:
            _reject(f"{where}[{j}].text", "required for a text part")
        texts.append(part.text)
    return "".join(texts)


def _tool_call(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except (json.JSONDecodeError, RecursionError):
        arguments = None
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    return {"id": call.id, "type": call.type, "function": {"name": call.function.name, "arguments": arguments}}


def _reject(param: str, reason: str) -> None:
    raise APIError(400, f"{param}: {reason}", param=param, code="invalid_value")
