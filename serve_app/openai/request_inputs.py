"""A generation request's input, checked: each helper turns one part of the HTTP request
into what the scheduler's `Request` needs, or raises an `APIError` (an OpenAI error body)
naming what is wrong.

- `lane_cap`: the API key's lane cap (401 without a valid key).
- `read_body`: the body, at most `max_body_bytes` (413).
- `prompt_ids`: token ids as given (in the vocabulary) or the tokenized prompt or chat.
- `max_tokens`: the request's `max_tokens`, or the default, within the context.
- `sampling`: one choice's `SamplingParams`, the request's fields over the defaults.
"""

from __future__ import annotations

from typing import Sequence

from starlette.requests import Request as HTTPRequest

from scheduler.request import Lane, SamplingParams
from serve_app.configuration.args import ServeArgs
from serve_app.openai.codec import TextCodec
from serve_app.openai.protocol import APIError, GenerationSpec


def lane_cap(args: ServeArgs, http: HTTPRequest) -> Lane:
    auth = http.headers.get("authorization", "")
    key = auth[7:].strip() if auth[:7].lower() == "bearer " else None
    cap = args.lane_cap_for(key)
    if cap is None:
        raise APIError(401, "missing or invalid API key", code="invalid_api_key")
    return cap


async def read_body(http: HTTPRequest, limit: int) -> bytes:
    too_big = APIError(413, f"request body exceeds {limit} bytes", code="body_too_large")
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


def prompt_ids(spec: GenerationSpec, codec: TextCodec) -> list[int]:
    if spec.prompt_ids is not None:
        ids = spec.prompt_ids
        if any(t >= codec.vocab_size for t in ids):
            raise APIError(400, "prompt contains token ids outside the vocabulary", param="prompt")
    elif spec.chat:
        tools = list(spec.output.tools) if spec.output.tools else None
        ids = codec.encode_chat(spec.messages, spec.chat_template_kwargs, tools)
    else:
        ids = codec.encode(spec.prompt_text)
    if not ids:
        raise APIError(400, "prompt is empty", param="messages" if spec.chat else "prompt")
    return ids


def max_tokens(spec: GenerationSpec, num_prompt: int, max_context: int | None, args: ServeArgs) -> int:
    """`max_context` None: the model's context is unknown and only `max_tokens_limit` bounds."""
    param = "messages" if spec.chat else "prompt"
    if max_context is not None and num_prompt >= max_context:
        raise APIError(
            400,
            f"prompt has {num_prompt} tokens; this model's context is {max_context}",
            param=param,
            code="context_length_exceeded",
        )
    limit = args.max_tokens_limit
    if spec.max_tokens is None:
        room = limit if max_context is None else max_context - num_prompt
        return min(args.default_max_tokens, room)
    if spec.max_tokens > limit:
        raise APIError(400, f"max_tokens must be at most {limit}", param="max_tokens", code="invalid_value")
    if max_context is not None and num_prompt + spec.max_tokens > max_context:
        raise APIError(
            400,
            f"prompt ({num_prompt} tokens) plus max_tokens exceeds the context of {max_context}",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return spec.max_tokens


def sampling(
    spec: GenerationSpec, max_tokens: int, choice: int, defaults: dict, vocab_size: int, eos_token_ids: Sequence[int]
) -> SamplingParams:
    """The parameters of choice `choice` (of `spec.n`): the request's fields over
    `defaults`; a seeded request's choice i has seed + i (wrapping at 2**64), so choices
    differ and each is reproducible. E.g. seed 7, n 3: seeds 7, 8, 9."""
    fields = {**defaults, **spec.sampling}
    for token_id, _ in fields.get("logit_bias", ()):
        if token_id >= vocab_size:
            raise APIError(
                400,
                f"logit_bias: token id {token_id} is outside the vocabulary ({vocab_size} tokens)",
                param="logit_bias",
                code="invalid_value",
            )
    seed = spec.seed
    if seed is not None and choice:
        seed = (seed + choice) % 2**64 if seed >= 0 else seed + choice
    return SamplingParams(
        max_tokens=max_tokens,
        seed=seed,
        grammar=spec.output.grammar,
        logprobs=spec.logprobs,
        stop_token_ids=tuple(eos_token_ids),
        **fields,
    )
