"""OpenAI request bodies, validated, and OpenAI-style errors.

Bodies are parsed strictly (unknown fields, wrong types and out-of-range values are a
4xx, never a crash); the result is a `GenerationSpec`, plain data the HTTP layer turns
into a scheduler `Request` once the prompt is tokenized. Error messages name the field
and never carry internal detail (paths, stack traces).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class APIError(Exception):
    """A client-visible error: HTTP status plus the OpenAI `error` object."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


_BODY = ConfigDict(extra="forbid", strict=True)


class StreamOptions(BaseModel):
    model_config = _BODY
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints; unknown fields are rejected."""

    model_config = _BODY
    model: str | None = Field(None, min_length=1, max_length=256)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    user: str | None = Field(None, max_length=256)
    # Accepted for client compatibility; only their neutral values are supported.
    presence_penalty: Literal[0, 0.0] = 0.0
    frequency_penalty: Literal[0, 0.0] = 0.0

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
    prompt: Union[str, list[int]] = Field(..., description="Prompt text or token ids.")
    echo: Literal[False] = False


class TextPart(BaseModel):
    model_config = _BODY
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _BODY
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatBody(_Common):
    messages: list[ChatMessage] = Field(..., min_length=1, max_length=4096)


@dataclass(frozen=True)
class GenerationSpec:
    """A validated generation request, before tokenization."""

    chat: bool
    model: str | None
    prompt_text: str | None  # completions with a text prompt
    prompt_ids: list[int] | None  # completions with token ids
    messages: list[dict] | None  # chat: [{"role", "content"}]
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool


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
            raise APIError(400, "request body contains an unpaired surrogate escape",
                           code="invalid_body") from None
    return body


def parse_generation(body: dict, chat: bool) -> GenerationSpec:
    """Validate an OpenAI completions / chat body; raises `APIError` (400) naming the field."""
    model_cls = ChatBody if chat else CompletionBody
    try:
        parsed = model_cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param,
                       code="invalid_value") from None
    if parsed.max_tokens is not None and parsed.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_tokens")
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else parsed.max_completion_tokens
    if max_tokens is not None and max_tokens <= 0:
        raise APIError(400, "max_tokens must be at least 1", param="max_tokens", code="invalid_value")
    if parsed.stream_options is not None and not parsed.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    prompt_text = prompt_ids = messages = None
    if chat:
        messages = [{"role": m.role, "content": m.text()} for m in parsed.messages]
    elif isinstance(parsed.prompt, str):
        prompt_text = parsed.prompt
    else:
        if any(t < 0 for t in parsed.prompt):
            raise APIError(400, "prompt token ids must be non-negative", param="prompt")
        prompt_ids = list(parsed.prompt)
    return GenerationSpec(
        chat=chat, model=parsed.model, prompt_text=prompt_text, prompt_ids=prompt_ids,
        messages=messages, max_tokens=max_tokens, temperature=parsed.temperature,
        top_p=parsed.top_p, stop=list(parsed.stop or []), seed=parsed.seed, stream=parsed.stream,
        include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
    )
