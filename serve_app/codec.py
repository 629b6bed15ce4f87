"""Text ↔ token ids on the replica: prompt encoding, chat template, streaming decode.

The replica tokenizes and detokenizes so the scheduler actor only ever sees token ids.
Tokenizers without a chat template (the tiny test models) get a plain
`role: content` transcript ending in `assistant:`.
"""

from __future__ import annotations

from pathlib import Path


class IncrementalDecoder:
    """Text deltas for a growing token list, never splitting a UTF-8 character.

    Decodes a sliding window (previous read point onward) so the cost per call stays
    small; a delta ending in U+FFFD (an incomplete multi-byte character) is held back
    until the next tokens complete it.
    """

    def __init__(self, tokenizer, skip_ids: frozenset[int] = frozenset()) -> None:
        self._tok = tokenizer
        self._skip_ids = skip_ids
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
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if not final and new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True) if ids else ""


class TextCodec:
    def __init__(self, tokenizer) -> None:
        self._tok = tokenizer

    @classmethod
    def from_path(cls, model_path: str) -> "TextCodec":
        import models  # noqa: F401  (fast BLAS before anything imports mlx)
        from mlx_lm.tokenizer_utils import load

        return cls(load(Path(model_path)))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids)
        transcript = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(transcript)

    def decoder(self, skip_ids=()) -> IncrementalDecoder:
        return IncrementalDecoder(self._tok, frozenset(skip_ids))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self) -> int:
        return len(self._tok.get_vocab())
