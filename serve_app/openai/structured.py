"""Structured output and tool calls: what a chat body asks the output to be, and how the
output is read back.

`resolve` turns `response_format`, `tools` and `tool_choice` into an `OutputSpec`: the
grammar that constrains decoding (`SamplingParams.grammar`, llguidance's: a JSON
schema's from `models.sampling.grammar`, a forced tool call's from the `ToolFormat`), the tools the chat template
renders, and how the
finished text is returned. Tool calls are written and read in the deployment's
`ToolFormat` (`serve_app.openai.tool_formats`: Hermes / Qwen, Llama 3 JSON, Mistral), chosen
from the model's chat template. A forced tool call (`tool_choice: "required"` or a named
function) is constrained to that format's form of a call naming one of the allowed
tools with arguments matching that function's parameters: one call for a named
function, one or more for "required" unless `parallel_tool_calls` is false. It is
returned as `message.tool_calls`. With `tool_choice: "auto"` nothing is constrained: the
model sees the tools through its template, and the calls it writes in the format naming
one of the tools are returned as tool calls; anything else is plain content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from serve_app.openai.errors import APIError
from serve_app.openai.tool_formats import ToolFormat

FORCED, AUTO, NONE = "forced", "auto", "none"
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class OutputSpec:
    """`grammar`: the decoding constraint (None: free text); `tools`: the function
    definitions the chat template gets (None: no tools); `tool_mode`: how the output is
    read back (`FORCED`: it is tool calls; `AUTO`: it may hold tool calls; `NONE`);
    `tool_format`: the form tool calls are written in."""

    grammar: str | None = None
    tools: tuple[dict, ...] | None = None
    tool_mode: str = NONE
    tool_format: ToolFormat = field(default_factory=ToolFormat)

    @property
    def kept_ids(self) -> dict[int, str]:
        """Special tokens the reply's text keeps so it can be read back (tool markers)."""
        return self.tool_format.kept_ids if self.tool_mode != NONE else {}

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or ())


def resolve(
    response_format: Any,
    tools: list[dict] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None = None,
    tool_format: ToolFormat = ToolFormat(),
) -> OutputSpec:
    """The output spec of a chat body's fields, tool calls in `tool_format`; raises
    `APIError` (400) naming the field."""
    from models.sampling.grammar import grammar_error, json_schema_grammar  # llguidance: loaded on first use

    functions = _functions(tools)
    mode, forced_names = _tool_choice(tool_choice, functions)
    schema_grammar = _response_format_grammar(response_format, json_schema_grammar)
    if mode == FORCED and schema_grammar is not None:
        raise APIError(
            400,
            "response_format and a forced tool_choice both constrain the output; give one",
            param="response_format",
            code="invalid_value",
        )
    grammar, param = schema_grammar, "response_format"
    if mode == FORCED:
        parallel = tool_choice == "required" and parallel_tool_calls is not False
        grammar = tool_format.grammar([functions[n] for n in forced_names], parallel)
        param = "tools"
    if grammar is not None:
        error = grammar_error(grammar)
        if error is not None:
            raise APIError(
                400, f"{param}: the schema cannot be enforced: {error[:300]}", param=param, code="invalid_value"
            )
    rendered = tuple({"type": "function", "function": f} for f in functions.values())
    return OutputSpec(
        grammar=grammar, tools=rendered if mode != NONE and rendered else None, tool_mode=mode, tool_format=tool_format
    )


def read_tool_calls(text: str, spec: OutputSpec) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a finished reply: the calls (OpenAI's shape, arguments
    as a JSON string) and the text around them (None when nothing else was said)."""
    if spec.tool_mode == NONE:
        return text, []
    return spec.tool_format.read(text, spec.tool_names)


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
    _reject(
        "tool_choice", 'expected \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}'
    )
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
