"""Structured output and tool calls: what a chat body asks the output to be, and how the
output is read back.

`resolve` turns `response_format`, `tools` and `tool_choice` into an `OutputSpec`: the
grammar that constrains decoding (`SamplingParams.grammar`, llguidance's, built from a
JSON schema by `models.grammar`), the tools the chat template renders, and how the
finished text is returned. A forced tool call (`tool_choice: "required"` or a named
function) is constrained to the JSON object

    {"name": <one of the tools>, "arguments": <that function's parameters>}

and returned as `message.tool_calls`. With `tool_choice: "auto"` nothing is constrained:
the model sees the tools through its template, and a call it writes in the Hermes /
Qwen form (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, or the whole reply
being that object) naming one of the tools is returned as a tool call; anything else is
plain content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from serve_app.errors import APIError

FORCED, AUTO, NONE = "forced", "auto", "none"
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class OutputSpec:
    """`grammar`: the decoding constraint (None: free text); `tools`: the function
    definitions the chat template gets (None: no tools); `tool_mode`: how the output is
    read back (`FORCED`: it is one tool call; `AUTO`: it may hold tool calls; `NONE`)."""

    grammar: str | None = None
    tools: tuple[dict, ...] | None = None
    tool_mode: str = NONE

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or ())


def resolve(response_format: Any, tools: list[dict] | None, tool_choice: Any) -> OutputSpec:
    """The output spec of a chat body's fields; raises `APIError` (400) naming the field."""
    from models.grammar import grammar_error, json_schema_grammar  # llguidance: loaded on first use

    functions = _functions(tools)
    mode, forced_names = _tool_choice(tool_choice, functions)
    schema_grammar = _response_format_grammar(response_format, json_schema_grammar)
    if mode == FORCED and schema_grammar is not None:
        raise APIError(400, "response_format and a forced tool_choice both constrain the output; "
                       "give one", param="response_format", code="invalid_value")
    grammar, param = schema_grammar, "response_format"
    if mode == FORCED:
        grammar, param = json_schema_grammar(tool_call_schema([functions[n] for n in forced_names])), "tools"
    if grammar is not None:
        error = grammar_error(grammar)
        if error is not None:
            raise APIError(400, f"{param}: the schema cannot be enforced: {error[:300]}", param=param,
                           code="invalid_value")
    rendered = tuple({"type": "function", "function": f} for f in functions.values())
    return OutputSpec(grammar=grammar, tools=rendered if mode != NONE and rendered else None, tool_mode=mode)


def tool_call_schema(functions: list[dict]) -> dict:
    """The JSON schema of one call of any of `functions` (OpenAI function objects)."""
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]},
                       "arguments": f.get("parameters") or {"type": "object", "properties": {}}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in functions]
    return options[0] if len(options) == 1 else {"anyOf": options}


def read_tool_calls(text: str, spec: OutputSpec) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply: the calls (OpenAI's shape, arguments
    as a JSON string) and the text around them (None when nothing else was said)."""
    if spec.tool_mode == NONE:
        return text, []
    if spec.tool_mode == FORCED:
        call = _as_call(text, spec.tool_names)
        return (None, [call]) if call is not None else (text, [])
    calls, rest = [], text
    for block in _TOOL_CALL_BLOCK.findall(text):
        call = _as_call(block, spec.tool_names)
        if call is not None:
            calls.append(call)
    if calls:
        rest = _TOOL_CALL_BLOCK.sub("", text).strip()
    else:
        call = _as_call(text, spec.tool_names)
        if call is not None:
            calls, rest = [call], ""
    return (rest or None) if calls else text, calls


def _as_call(text: str, names: frozenset[str]) -> dict | None:
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(arguments)}}


def _functions(tools: list[dict] | None) -> dict[str, dict]:
    """The tools' function objects by name, checked."""
    out: dict[str, dict] = {}
    if tools is not None and not tools:
        _reject("tools", "give at least one tool, or leave tools out")
    for i, tool in enumerate(tools or ()):
        where = f"tools[{i}]"
        if tool.get("type") != "function":
            _reject(f"{where}.type", "only 'function' tools are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            _reject(f"{where}.function", "required (an object with a name)")
        unknown = set(tool) - {"type", "function"}
        if unknown:
            _reject(f"{where}.{sorted(unknown)[0]}", "unknown field")
        name = function.get("name")
        if not isinstance(name, str) or not _FUNCTION_NAME.fullmatch(name):
            _reject(f"{where}.function.name", "required: 1-64 letters, digits, '_', '.' or '-'")
        if name in out:
            _reject(f"{where}.function.name", f"'{name}' is defined twice")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            _reject(f"{where}.function.parameters", "must be a JSON schema object")
        if "description" in function and not isinstance(function["description"], str):
            _reject(f"{where}.function.description", "must be a string")
        out[name] = function
    return out


def _tool_choice(choice: Any, functions: dict[str, dict]) -> tuple[str, list[str]]:
    """(mode, the names a forced call may use)."""
    if choice is None:
        return (AUTO if functions else NONE), []
    if choice == "none":
        return NONE, []
    if choice in ("auto", "required"):
        if not functions:
            _reject("tool_choice", f"'{choice}' needs tools")
        return (AUTO, []) if choice == "auto" else (FORCED, list(functions))
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            _reject("tool_choice.function.name", f"'{str(name)[:64]}' is not among the tools")
        return FORCED, [name]
    _reject("tool_choice", "expected 'none', 'auto', 'required' or "
            "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    raise AssertionError  # unreachable


def _response_format_grammar(response_format: Any, json_schema_grammar) -> str | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return json_schema_grammar(None)
    spec = (response_format.model_extra or {}).get("json_schema")
    if not isinstance(spec, dict):
        _reject("response_format.json_schema", "required for type 'json_schema'")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        _reject("response_format.json_schema.name", "required (a non-empty string)")
    schema = spec.get("schema")
    if schema is not None and not isinstance(schema, dict):
        _reject("response_format.json_schema.schema", "must be a JSON schema object")
    if "strict" in spec and not isinstance(spec["strict"], bool):
        _reject("response_format.json_schema.strict", "must be a boolean")
    return json_schema_grammar(schema)


def _reject(param: str, reason: str) -> None:
    raise APIError(400, f"{param}: {reason}", param=param, code="invalid_value")
