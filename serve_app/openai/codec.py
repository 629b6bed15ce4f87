"""Text ↔ token ids on the replica: prompt encoding, chat template, streaming decode.

The replica tokenizes and detokenizes so the scheduler actor only ever sees token ids.
Chat prompts are rendered by the tokenizer's chat template, or by the deployment's
`chat_template` when it names one; without either, chat is a 400 (`no_chat_template`)
rather than a prompt format the model never saw. A template that never mentions
`tool_calls` gets an assistant's calls as text in its `content` (`chat.calls_as_content`).
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable
from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError

from serve_app.openai.chat import calls_as_content
from serve_app.openai.errors import APIError
from serve_app.openai.tool_formats import ToolFormat, detect, marker_special_ids

MAX_TEMPLATE_MESSAGE = 300  # characters of a template's own error passed on to the client
# Tokens a stream's text may wait on for one character. A UTF-8 character has at most four
# bytes, so real text never waits this long; a model emitting stray bytes would otherwise
# hold its whole stream back until it ends.
MAX_HELD_TOKENS = 16
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table): printable
    Latin-1 bytes stand for themselves, the others for code points from 256 up."""
    kept = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return {chr(b if b in kept else next(extra)): b for b in range(256)}


_BYTE_LEVEL = _byte_level_alphabet()


class IncrementalDecoder:
    """Text deltas for a growing token list, never splitting a UTF-8 character.

    Decodes a sliding window (previous read point onward) so the cost per call stays
    small. A delta ending in U+FFFD is held back while its trailing bytes are the start
    of a character the next tokens can complete; bytes that can never form one (a stray
    continuation byte, a lead byte followed by a non-continuation) go out as U+FFFD at
    once, and no character waits more than `MAX_HELD_TOKENS` tokens. `token_bytes` gives a
    token's bytes, or None where the vocabulary does not say (then the delta is held, up
    to the same cap). Special tokens are dropped, except `kept_ids` (id -> text), which are
    spelled out (a tool call's markers).
    """

    def __init__(
        self,
        tokenizer,
        skip_ids: frozenset[int] = frozenset(),
        kept_ids: dict[int, str] | None = None,
        token_bytes: Callable[[int], bytes | None] | None = None,
    ) -> None:
        self._tok = tokenizer
        self._skip_ids = skip_ids
        self._kept_ids = dict(kept_ids or {})
        self._token_bytes = token_bytes
        self._special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())  # decode drops them
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: list[int]) -> str:
        self._ids.extend(t for t in token_ids if t not in self._skip_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if not final and new_text.endswith("\ufffd") and self._incomplete():
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def _incomplete(self) -> bool:
        """Whether the unread tokens end inside a character that later tokens can complete."""
        pending = self._ids[self._read :]
        if len(pending) >= MAX_HELD_TOKENS:
            return False
        raw = [self._bytes(t) for t in pending]
        if None in raw:
            return True
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.decode(b"".join(raw))
        return bool(utf8.getstate()[0])

    def _bytes(self, token_id: int) -> bytes | None:
        if token_id in self._kept_ids:
            return self._kept_ids[token_id].encode("utf-8")
        if token_id in self._special:
            return b""
        return self._token_bytes(token_id) if self._token_bytes else None

    def _decode(self, ids: list[int]) -> str:
        if not self._kept_ids or not self._kept_ids.keys() & set(ids):
            return self._tok.decode(ids, skip_special_tokens=True) if ids else ""
        parts, run = [], []
        for token_id in ids:
            if token_id in self._kept_ids:
                parts += [self._decode(run), self._kept_ids[token_id]]
                run = []
            else:
                run.append(token_id)
        return "".join(parts) + self._decode(run)


class TextCodec:
    def __init__(self, tokenizer, chat_template: str | None = None, tool_call_format: str = "auto") -> None:
        """`chat_template`: a jinja template used instead of the tokenizer's own;
        `tool_call_format`: how the model writes tool calls (`serve_app.openai.tool_formats`;
        "auto": as the chat template shows them)."""
        self._tok = tokenizer
        self._chat_template = chat_template
        self._token_texts: dict[int, str] = {}
        self._template_text = self._template_source()
        self.tool_format = self._tool_format(tool_call_format)
        # A template that never mentions tool_calls reads only `content` (SmolLM2's, plain
        # ChatML): it would fail on, or silently drop, an assistant's structured calls.
        self._calls_as_text = self._template_text is not None and "tool_calls" not in self._template_text

    @classmethod
    def from_path(
        cls, model_path: str, chat_template: str | None = None, tool_call_format: str = "auto"
    ) -> "TextCodec":
        from mlx_lm.tokenizer_utils import load

        import models  # noqa: F401  (fast BLAS before anything imports mlx)

        return cls(load(Path(model_path)), chat_template, tool_call_format)

    def _template_source(self) -> str | None:
        """The jinja source chat is rendered with (all of a tokenizer's named templates
        together), or None where there is none (or only a Python renderer)."""
        template = self._chat_template or getattr(self._tok, "chat_template", None)
        if isinstance(template, dict):  # named templates (e.g. "default" and "tool_use")
            template = "\n".join(t for t in template.values() if isinstance(t, str))
        return template if isinstance(template, str) else None

    def _tool_format(self, name: str) -> ToolFormat:
        name = detect(self._template_text) if name == "auto" else name
        added = getattr(self._tok, "added_tokens_decoder", None) or {}
        special = {token_id for token_id, token in added.items() if getattr(token, "special", False)}
        markers = ToolFormat(name).markers
        return ToolFormat(
            name, marker_special_ids(markers, lambda text: self._tok.encode(text, add_special_tokens=False), special)
        )

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    @property
    def has_chat_template(self) -> bool:
        if self._chat_template is not None:
            return True
        own = getattr(self._tok, "has_chat_template", None)  # mlx-lm's wrapper: Python renderers too
        return bool(own if own is not None else getattr(self._tok, "chat_template", None))

    def encode_chat(
        self, messages: list[dict], template_kwargs: dict | None = None, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of `messages` rendered with a generation prompt; `template_kwargs`
        become template variables (e.g. `enable_thinking`); `tools` (OpenAI function
        tools) are the template's `tools`, for templates that render them. A template
        whose source never mentions `tool_calls` gets assistant tool calls written into
        `content` in `tool_format`'s text form; others get them structured.

        Raises APIError: 400 `no_chat_template` without a template, 400
        `chat_template_error` when the template refuses the messages (Gemma's and
        Mistral's `raise_exception('System role not supported')`, a missing field), 500
        `chat_template_invalid` when the template itself does not parse.
        """
        if not self.has_chat_template:
            raise APIError(
                400,
                "this model has no chat template; use the completions "
                "endpoint, or set chat_template in the deployment's args",
                param="messages",
                code="no_chat_template",
            )
        if self._calls_as_text:
            messages = calls_as_content(messages, self.tool_format.text)
        kwargs = dict(template_kwargs or {})
        if self._chat_template is not None:
            kwargs["chat_template"] = self._chat_template
        if tools:
            kwargs["tools"] = tools
        try:
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kwargs)
        except TemplateSyntaxError as exc:
            raise APIError(
                500, f"the chat template does not parse: {_short(exc)}", "server_error", code="chat_template_invalid"
            ) from None
        except TemplateError as exc:
            raise APIError(400, f"chat template: {_short(exc)}", param="messages", code="chat_template_error") from None
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # Python errors inside the template: these messages do not fit what it expects.
            raise APIError(
                400,
                f"the chat template cannot render these messages: {_short(exc)}",
                param="messages",
                code="chat_template_error",
            ) from None
        return list(ids)

    def decoder(self, skip_ids=(), kept_ids: dict[int, str] | None = None) -> IncrementalDecoder:
        return IncrementalDecoder(self._tok, frozenset(skip_ids), kept_ids, self.known_bytes)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token's text, special tokens spelled out (logprobs name every token)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own UTF-8 bytes. A token holding part of a multi-byte character
        decodes to U+FFFD; its bytes are read from its vocabulary entry instead (a
        byte-level BPE piece, or a SentencePiece byte token `<0xE2>`)."""
        raw = self.known_bytes(token_id)
        return self.token_text(token_id).encode("utf-8") if raw is None else raw

    def known_bytes(self, token_id: int) -> bytes | None:
        """`token_bytes`, or None when the token's text is U+FFFD and its vocabulary entry
        is neither byte form."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self._tok.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            byte = _BYTE_FALLBACK.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            if all(c in _BYTE_LEVEL for c in piece):
                return bytes(_BYTE_LEVEL[c] for c in piece)
        return None

    @property
    def vocab_size(self) -> int:
        return len(self._tok.get_vocab())


def _short(exc: Exception) -> str:
    text = str(getattr(exc, "message", None) or exc) or type(exc).__name__
    return text[:MAX_TEMPLATE_MESSAGE]
