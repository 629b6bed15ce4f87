r"""How model families write tool calls: read back from a finished reply, enforced as a
grammar when a request forces a call, and written as text into a history whose chat
template does not render calls (`ToolFormat.text`).

A deployment uses one format, chosen from the markers its chat template renders
(`detect`) unless the config names one (`tool_call_format`). Two calls, as each writes them:

    hermes       <tool_call>\n{"name": "f", "arguments": {..}}\n</tool_call>, once per
                 call, text around them allowed (Qwen 2.5 / 3, Hermes; the default)
    llama3_json  {"name": "f", "parameters": {..}}; {"name": "g", "parameters": {..}}, the
                 whole reply, optionally after <|python_tag|> (Llama 3.1 - 3.3)
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {..}}, {..}], text before allowed
    mistral_v11  [TOOL_CALLS]f[ARGS]{..}[TOOL_CALLS]g[ARGS]{..} (templates with [ARGS])

Reading is lenient where families disagree: a JSON call may carry "arguments" or
"parameters" (an object, or a string holding one), and both Mistral formats read either
shape. A call must name one of the request's tools. Text that does not read as calls
stays content, character for character: a malformed call is returned as content, never
dropped. The grammar of a forced reply is the format's own form with compact JSON, so
the model writes what it was trained to write; a marker is the tokenizer's special
token where it has one (`<[id]>` in llguidance's lark), literal text otherwise.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

FORMATS = ("hermes", "llama3_json", "mistral", "mistral_v11")
_MARKERS = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
    "mistral_v11": ("[TOOL_CALLS]", "[ARGS]"),
}
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_ARGS_HEADER = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\s*\[ARGS\]\s*")
_JSON = json.JSONDecoder()
# Compact separators, as `models.sampling.grammar.json_schema_grammar`: a small model could
# otherwise spend its budget on whitespace.
_COMPACT = {"whitespace_flexible": False}


def detect(template: str | None) -> str:
    """The format a chat template renders tool calls in (`hermes` when it shows none)."""
    text = template or ""
    if "[TOOL_CALLS]" in text:
        return "mistral_v11" if "[ARGS]" in text else "mistral"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class ToolFormat:
    """One format, as one tokenizer spells its markers. `special_ids`: (marker, token
    id) of the markers that tokenizer has as a single special token."""

    name: str = "hermes"
    special_ids: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.name not in FORMATS:
            raise ValueError(f"unknown tool call format {self.name!r}; expected one of {', '.join(FORMATS)}")

    @property
    def markers(self) -> tuple[str, ...]:
        return _MARKERS[self.name]

    @property
    def kept_ids(self) -> dict[int, str]:
        """Marker tokens a reply's text must keep for `read` (decoding drops special tokens)."""
        return {token_id: marker for marker, token_id in self.special_ids}

    def read(self, text: str, names: frozenset[str]) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a finished reply: the calls in OpenAI's shape
        (arguments as a JSON string) and the text around them (None when there is none).
        No calls: (text, [])."""
        found = _READERS[self.name](text, names)
        if found is None:
            return text, []
        content, calls = found
        return (content.strip() or None), [_openai_call(name, arguments) for name, arguments in calls]

    def text(self, calls: list[tuple[str, Any]]) -> str:
        """`calls` ((name, arguments) pairs; arguments an object, or the string a client
        sent) written as this format's replies write them, spaced as `json.dumps` does,
        so `read` reads them back. For histories whose chat template does not render
        tool calls (`serve_app.openai.chat.calls_as_content`)."""
        if self.name == "mistral_v11":
            return "".join(f"[TOOL_CALLS]{name}[ARGS]{_dumps(arguments)}" for name, arguments in calls)
        key = "parameters" if self.name == "llama3_json" else "arguments"
        objects = [{"name": name, key: arguments} for name, arguments in calls]
        if self.name == "hermes":
            return "\n".join(f"<tool_call>\n{_dumps(o)}\n</tool_call>" for o in objects)
        if self.name == "llama3_json":
            return "; ".join(_dumps(o) for o in objects)
        return "[TOOL_CALLS]" + _dumps(objects)

    def grammar(self, functions: list[dict], parallel: bool) -> str:
        """The llguidance grammar (`SamplingParams.grammar`) of a reply that is one call
        of any of `functions` (OpenAI function objects), or with `parallel` one or more."""
        from llguidance import LLMatcher  # loaded on first use, as models.sampling.grammar

        return LLMatcher.grammar_from_lark(self.lark(functions, parallel))

    def lark(self, functions: list[dict], parallel: bool) -> str:
        """`grammar`'s lark text."""
        special = dict(self.special_ids)
        marker = {m: f"<[{special[m]}]>" if m in special else json.dumps(m) for m in self.markers}
        if self.name == "mistral_v11":
            options = "\n".join(
                f"fn_{i}: {json.dumps(f['name'])} {marker['[ARGS]']} {_json_rule(_parameters(f))}"
                for i, f in enumerate(functions)
            )
            one = " | ".join(f"fn_{i}" for i in range(len(functions)))
            return f"start: call{' call*' if parallel else ''}\ncall: {marker['[TOOL_CALLS]']} ({one})\n{options}\n"
        key = "parameters" if self.name == "llama3_json" else "arguments"
        call = f"call: {_json_rule(_call_schema(functions, key))}\n"
        if self.name == "hermes":
            more = ' ("\\n" block)*' if parallel else ""
            return (
                f'start: block{more}\nblock: {marker["<tool_call>"]} "\\n" call "\\n" {marker["</tool_call>"]}\n{call}'
            )
        if self.name == "llama3_json":
            more = ' ("; " call)*' if parallel else ""
            return f"start: call{more}\n{call}"
        more = ' ("," " "? call)*' if parallel else ""
        return f'start: {marker["[TOOL_CALLS]"]} " "? "[" call{more} "]"\n{call}'


def _dumps(value: Any) -> str:
    # Non-ASCII characters as themselves, as templates' `tojson` writes them.
    return json.dumps(value, ensure_ascii=False)


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, separators=(",", ":"))


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _call_schema(functions: list[dict], key: str) -> dict:
    """The JSON schema of one call object {"name": .., key: ..} of any of `functions`.
    A function's `$defs` / `definitions` move to the root, where its `#/$defs/..`
    references point, renamed `<function>.<def>` so two functions' defs never collide."""
    options, defs = [], {}
    for f in functions:
        parameters = _parameters(f)
        if any(isinstance(parameters.get(section), dict) for section in _DEF_SECTIONS):
            parameters = _hoist_defs(parameters, f["name"] + ".", defs)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: parameters},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


_DEF_SECTIONS = ("$defs", "definitions")


def _hoist_defs(schema: dict, prefix: str, defs: dict) -> dict:
    """`schema` without its def sections, which go into `defs` under `prefix`ed names,
    and with its local references renamed to match."""

    def renamed(node):
        if isinstance(node, list):
            return [renamed(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {k: renamed(v) for k, v in node.items()}
        ref = node.get("$ref")
        for section in _DEF_SECTIONS:
            if isinstance(ref, str) and ref.startswith(f"#/{section}/"):
                out["$ref"] = "#/$defs/" + prefix + ref[len(section) + 3 :]
        return out

    for section in _DEF_SECTIONS:
        for name, definition in (schema.get(section) or {}).items():
            defs[prefix + name] = renamed(definition)
    return renamed({k: v for k, v in schema.items() if k not in _DEF_SECTIONS})


# -- reading ------------------------------------------------------------------------------
# A reader returns (content, [(name, arguments)]) when the text holds calls, else None.


def _read_hermes(text: str, names: frozenset[str]):
    calls, content, end = [], [], 0
    for block in _HERMES_BLOCK.finditer(text):
        call = _call(_loads(block.group(1)), names)
        if call is not None:  # a block that is not a call stays in the content
            calls.append(call)
            content.append(text[end : block.start()])
            end = block.end()
    if calls:
        return "".join(content) + text[end:], calls
    whole = _call(_loads(text.strip()), names)  # some Hermes-style models omit the tags
    return ("", [whole]) if whole is not None else None


def _read_llama3(text: str, names: frozenset[str]):
    body = text.strip().removeprefix("<|python_tag|>")
    objects = _json_sequence(body, ";")
    calls = [_call(obj, names) for obj in objects]
    return ("", calls) if calls and None not in calls else None


def _read_mistral(text: str, names: frozenset[str]):
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return None
    calls = []
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        found = _args_calls(part, names) if "[ARGS]" in part else _list_calls(part, names)
        if found is None:
            return None
        calls += found
    return (text[:start], calls) if calls else None


def _list_calls(part: str, names: frozenset[str]) -> list | None:
    """`[{"name": .., "arguments": ..}, ..]` (or one such object)."""
    obj = _loads(part.strip())
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call(item, names) for item in items]
    return calls if calls and None not in calls else None


def _args_calls(part: str, names: frozenset[str]) -> list | None:
    """`name[ARGS]{..}`, repeated."""
    calls, pos = [], 0
    while pos < len(part.rstrip()):
        header = _ARGS_HEADER.match(part, pos)
        if header is None:
            return None
        try:
            arguments, pos = _JSON.raw_decode(part, header.end())
        except (json.JSONDecodeError, RecursionError):
            return None
        call = _call({"name": header.group(1), "arguments": arguments}, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


_READERS = {"hermes": _read_hermes, "llama3_json": _read_llama3, "mistral": _read_mistral, "mistral_v11": _read_mistral}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return None


def _json_sequence(text: str, separator: str) -> list:
    """The JSON values of `text` written one after another, `separator` between them;
    [] unless the whole text is such a sequence."""
    values, pos = [], 0
    while True:
        try:
            value, pos = _JSON.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return []
        values.append(value)
        rest = text[pos:].lstrip()
        if not rest:
            return values
        if not rest.startswith(separator):
            return []
        pos = len(text) - len(rest) + len(separator)
        while pos < len(text) and text[pos].isspace():
            pos += 1


def _call(obj: Any, names: frozenset[str]) -> tuple[str, dict] | None:
    """(name, arguments) of a call object naming one of `names`, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some templates write the arguments as a JSON string
        arguments = _loads(arguments)
    return (obj["name"], arguments) if isinstance(arguments, dict) else None


def _openai_call(name: str, arguments: dict) -> dict:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def marker_special_ids(markers: Iterable[str], encode, special_ids: set[int]) -> tuple[tuple[str, int], ...]:
    """(marker, id) of each marker that `encode` (text -> ids, no BOS) spells as one of
    `special_ids`."""
    out = []
    for marker in markers:
        ids = list(encode(marker))
        if len(ids) == 1 and ids[0] in special_ids:
            out.append((marker, ids[0]))
    return tuple(out)
