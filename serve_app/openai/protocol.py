"""OpenAI request bodies, validated, and OpenAI-style errors.

Bodies are parsed strictly (unknown fields, wrong types and out-of-range values are a
4xx, never a crash); the result is a `GenerationSpec`, plain data the HTTP layer turns
into a scheduler `Request` once the prompt is tokenized. Error messages name the field
as the client wrote it (`messages[1].content`) and never carry internal detail (paths,
stack traces). Fields OpenAI defines that this server does not implement yet are
accepted with the values that change nothing (`echo: false`, `best_of: 1`) and are a 400
`unsupported_parameter` naming the field otherwise. `response_format`, `tools` and
`tool_choice` become an `OutputSpec` (`serve_app.openai.structured`). Sampling fields a request omits stay
unset here: their defaults depend on the deployment and the model
(`serve_app.openai.sampling_defaults`).
"""

from __future__ import annotations

import json
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve_app.openai.chat import ChatMessage, template_messages
from serve_app.openai.errors import APIError
from serve_app.openai.sampling_defaults import sampling_fields
from serve_app.openai.structured import OutputSpec, resolve
from serve_app.openai.tool_formats import ToolFormat

_BODY = ConfigDict(extra="forbid", strict=True)
MAX_CHOICES = 8  # `n`: independent completions of one prompt, each an engine request
_TOKEN_ID = re.compile(r"[0-9]{1,12}")


class StreamOptions(BaseModel):
    model_config = _BODY
    include_usage: bool = False


class ResponseFormatSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # json_schema carries its schema
    type: Literal["text", "json_object", "json_schema"]


class _Common(BaseModel):
    """Fields shared by both endpoints; unknown fields are rejected."""

    model_config = _BODY
    model: str | None = Field(None, min_length=1, max_length=256)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # Typed here so a malformed value is a plain 400; `_NOT_YET` serves the neutral values.
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, Any] | None = None  # token id (as a string) -> bias in [-100, 100]
    top_k: int | None = Field(None, ge=-1)  # 0 or -1 = off
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v):
        for key, bias in (v or {}).items():
            if not _TOKEN_ID.fullmatch(key):
                raise ValueError(f"keys are token ids (decimal strings), got {key[:32]!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)):
                raise ValueError(f"the bias of token {key} must be a number")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"the bias of token {key} must be between -100 and 100")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        if any(len(s) > 256 for s in stops):
            raise ValueError("stop sequences must be at most 256 characters")
        return stops


class CompletionBody(_Common):
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(
        ..., description="Prompt text or token ids; a list holding one prompt is that prompt."
    )
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=5)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)
    chat_template_kwargs: dict[str, Any] | None = None
    store: bool | None = None  # accepted and ignored: nothing is stored
    response_format: ResponseFormatSpec | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None


# Fields this server does not implement yet, with the values that change nothing (served,
# and ignored); any other value is a 400 naming the field.
_NOT_YET: dict[str, tuple] = {"echo": (False,), "best_of": (1,), "suffix": ()}
# Body fields that are `SamplingParams` fields of the same name.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)

# apply_chat_template's own arguments and the variables every template gets from it.
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "sanitize_control_tokens",
    }
)


@dataclass(frozen=True)
class GenerationSpec:
    """A validated generation request, before tokenization."""

    chat: bool
    model: str | None
    prompt_text: str | None  # completions with a text prompt
    prompt_ids: list[int] | None  # completions with token ids
    messages: list[dict] | None  # chat, as templates take them (`serve_app.openai.chat`)
    chat_template_kwargs: dict
    max_tokens: int | None
    # The sampling fields the request set, as `SamplingParams` takes them (`top_k: -1`
    # is 0, `logit_bias` sorted (token id, bias) pairs); omitted ones are absent.
    sampling: dict
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool
    output: OutputSpec = OutputSpec()  # structured output and tools (chat only)
    # Report each token's log-probability and this many alternatives (None: no logprobs).
    logprobs: int | None = None
    n: int = 1  # independent choices


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def decode_json(raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", code="invalid_body") from None
    try:
        body = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_body")
    # JSON may escape a lone UTF-16 surrogate ("\ud800"): valid JSON, but not text the
    # tokenizer can encode. Only bodies with surrogate escapes pay for the full check.
    if _SURROGATE_ESCAPE.search(text):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, "request body contains an unpaired surrogate escape", code="invalid_body") from None
    return body


def parse_generation(body: dict, chat: bool, tool_format: ToolFormat = ToolFormat()) -> GenerationSpec:
    """Validate an OpenAI completions / chat body (tool calls in `tool_format`, the
    model's); raises `APIError` (400) naming the field."""
    model_cls = ChatBody if chat else CompletionBody
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as err:
        raise _invalid(err) from None
    _check_not_yet(parsed)
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else parsed.max_completion_tokens
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value")
    if parsed.stream_options is not None and not parsed.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    prompt_text = prompt_ids = messages = None
    template_kwargs, output = {}, OutputSpec()
    if chat:
        messages = template_messages(parsed.messages)
        template_kwargs = _template_kwargs(parsed.chat_template_kwargs)
        output = resolve(
            parsed.response_format, parsed.tools, parsed.tool_choice, parsed.parallel_tool_calls, tool_format
        )
    else:
        prompt_text, prompt_ids = _one_prompt(parsed.prompt)
    return GenerationSpec(
        chat=chat,
        model=parsed.model,
        prompt_text=prompt_text,
        prompt_ids=prompt_ids,
        messages=messages,
        chat_template_kwargs=template_kwargs,
        max_tokens=max_tokens,
        sampling=_sampling(parsed),
        stop=list(parsed.stop or []),
        seed=parsed.seed,
        stream=parsed.stream,
        include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
        output=output,
        logprobs=_logprobs(parsed, chat),
        n=parsed.n,
    )


def _logprobs(parsed: BaseModel, chat: bool) -> int | None:
    """How many alternatives each token reports, None for no logprobs: completions'
    `logprobs` (0..5), chat's `top_logprobs` (0..20) once `logprobs` is true."""
    if not chat:
        return parsed.logprobs
    if not parsed.logprobs:
        if parsed.top_logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        return None
    return parsed.top_logprobs or 0


def _sampling(parsed: _Common) -> dict:
    out = sampling_fields({name: getattr(parsed, name) for name in _SAMPLING_FIELDS})
    if parsed.logit_bias:
        biases = {int(k): float(b) for k, b in parsed.logit_bias.items()}  # "5" and "05" are one id
        out["logit_bias"] = tuple(sorted(biases.items()))
    return out


def _one_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a completions prompt: a string, token ids, or a list of one of those."""
    if isinstance(prompt, str):
        return prompt, None
    if prompt and not isinstance(prompt[0], int):  # a list of prompts
        if len(prompt) > 1:
            raise APIError(
                400,
                f"prompt: a batch of {len(prompt)} prompts is not supported; send one prompt per request",
                param="prompt",
                code="unsupported_value",
            )
        return _one_prompt(prompt[0])
    if any(t < 0 for t in prompt):
        raise APIError(400, "prompt token ids must be non-negative", param="prompt")
    return None, list(prompt)


def _check_not_yet(parsed: BaseModel) -> None:
    for name, neutral in _NOT_YET.items():
        value = getattr(parsed, name, None)
        if value is None or any(_same(value, n) for n in neutral):
            continue
        if neutral:
            allowed = " or ".join(json.dumps(n) for n in neutral)
            message = f"{name}: values other than {allowed} are not supported yet"
        else:
            message = f"{name} is not supported yet"
        raise APIError(400, message, param=name, code="unsupported_parameter")


def _same(value, neutral) -> bool:
    """Equal, and both booleans or neither (`False == 0` in Python, not in JSON)."""
    return value == neutral and isinstance(value, bool) == isinstance(neutral, bool)


def _template_kwargs(kwargs: dict | None) -> dict:
    for key in kwargs or {}:
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise APIError(
                400,
                f"chat_template_kwargs.{key}: set by the server, not the request",
                param=f"chat_template_kwargs.{key}",
                code="invalid_value",
            )
    return dict(kwargs or {})


# -- validation messages ---------------------------------------------------------------------


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    """Every field name of the body models and the models nested in them."""
    names, todo, seen = set(), list(models), set()
    while todo:
        model = todo.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, field in model.model_fields.items():
            names.add(name)
            todo.extend(_models_in(field.annotation))
    return frozenset(names)


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


_FIELD_NAMES = _field_names(ChatBody, CompletionBody)


def _clean_loc(loc: tuple) -> tuple[list, int | None]:
    """pydantic's location without its union tags (`'str'`, `'list[int]'`), and the index
    of the first tag: `('messages', 1, 'content', 'str')` -> `(['messages', 1, 'content'], 3)`."""
    parts, tag_at = [], None
    for i, part in enumerate(loc):
        if isinstance(part, int) or part in _FIELD_NAMES:
            parts.append(part)
        elif tag_at is None:
            tag_at = i
    return parts, tag_at


def format_param(parts: list) -> str:
    """`['messages', 1, 'content']` -> `messages[1].content`."""
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _invalid(err: ValidationError) -> APIError:
    """One 400 for a failed body: the first problem, named as the client wrote the field.

    A value no member of a union accepts reports the member that got furthest into it
    (`messages[0].content[0].text: Field required`), or, when none got past the value
    itself, the types it may have (`prompt: expected one of str, list[int], ...`).
    """
    errors = err.errors()
    first = errors[0]
    if first["type"] == "extra_forbidden":
        param = format_param([*_clean_loc(first["loc"][:-1])[0], first["loc"][-1]])
        return APIError(400, f"{param}: unknown field", param=param, code="invalid_value")
    parts, tag_at = _clean_loc(first["loc"])
    message = first["msg"]
    if tag_at is not None:
        members = [e for e in errors if e["loc"][:tag_at] == first["loc"][:tag_at]]
        deepest = max(members, key=lambda e: len(_clean_loc(e["loc"])[0]))
        if len(_clean_loc(deepest["loc"])[0]) > len(parts):
            parts, message = _clean_loc(deepest["loc"])[0], deepest["msg"]
        else:
            tags = dict.fromkeys(str(e["loc"][tag_at]) for e in members)
            message = "expected one of " + ", ".join(tags)
    if first["type"] in ("model_type", "dict_type") and message is first["msg"]:
        message = "Input should be a JSON object"  # not pydantic's class names
    param = format_param(parts) or None
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")
