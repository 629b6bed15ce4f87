"""Constrained decoding: a request's grammar as a token mask at every sampled position.

The engine is llguidance (docs/configuration.md, "Structured output", says why). A
request carries its grammar as plain data (`SamplingParams.grammar`, an llguidance
grammar string: `json_schema_grammar` builds one); the runner owns one `Grammars` per
model, which reads the model's tokenizer once and compiles each request's grammar into
a `GrammarMatcher`. The matcher follows the request's emitted tokens (`accept`) and
gives the allowed tokens of n consecutive positions, position i after the drafts
before it (`masks`), so a verify masks every position exactly as classic decode
would have masked it had those drafts been emitted. `allowed_prefix` cuts a draft at
its first token the grammar forbids: that token could never be accepted.
"""

from __future__ import annotations

import json
import logging
from typing import Sequence

import llguidance
import llguidance.hf
import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

# Compact separators ("," and ":") rather than free whitespace: a small model
# could otherwise spend its whole budget on indentation.
_JSON_OPTIONS = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict | None) -> str:
    """The llguidance grammar of JSON text matching `schema` (None: any JSON object)."""
    return llguidance.LLMatcher.grammar_from_json_schema(
        json.dumps(schema if schema is not None else {"type": "object"}), defaults=_JSON_OPTIONS
    )


def grammar_error(grammar: str) -> str | None:
    """Why `grammar` cannot be compiled (an unsupported schema keyword, a bad regex), or
    None. Checked without a tokenizer, so the serve layer can answer 400 up front."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return messages[0] if is_error else None


class Grammars:
    """A model's tokenizer as the grammar engine reads it. Building its index takes
    about a second for a large vocabulary: the runner builds it at load (`index`), so
    the first constrained request does not stall every stream of the engine thread."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int]):
        self.eos_token_ids = tuple(eos_token_ids)
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer: llguidance.LLTokenizer | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer, eos_token_ids: Sequence[int]) -> "Grammars":
        """From mlx-lm's `TokenizerWrapper`, which keeps the Hugging Face tokenizer that
        llguidance reads in `_tokenizer` (no public accessor in mlx-lm 0.32.2)."""
        return cls(getattr(tokenizer, "_tokenizer", tokenizer), eos_token_ids)

    def index(self) -> llguidance.LLTokenizer:
        """The tokenizer index llguidance matches against, built on the first call."""
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, eos_token=list(self.eos_token_ids))
        return self._tokenizer

    def matcher(self, grammar: str) -> "GrammarMatcher":
        return GrammarMatcher(llguidance.LLMatcher(self.index(), grammar, log_level=0), self.eos_token_ids)


class GrammarMatcher:
    """One request's position in its grammar. Invariant: the matcher has consumed
    exactly the accepted output tokens; `masks` and `allowed_prefix` leave it there.

    A matcher that fails (a grammar that does not compile against this tokenizer, a
    parser resource limit, a token outside the grammar) allows only EOS from then on:
    that request ends, with a warning logged, and the batch it shares is unaffected."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_token_ids: Sequence[int]):
        self._matcher = matcher
        self._eos_token_ids = tuple(eos_token_ids)
        self._warn_if_failed()

    @property
    def is_finished(self) -> bool:
        """The grammar is complete (or failed) and allows nothing but the end of the stream."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None

    def accept(self, tokens: Sequence[int]) -> None:
        """Emitted tokens (each allowed by the mask it was drawn under). A token after the
        grammar stopped (an EOS, or what a stop id let through) is ignored."""
        for token in tokens:
            if self.is_finished:
                return
            if not self._matcher.consume_token(int(token)):
                self._warn_if_failed()
                return

    def _warn_if_failed(self) -> None:
        if self._matcher.is_error():
            log.warning("grammar matcher failed; the request ends: %s", self._matcher.get_error()[:300])

    def allowed_prefix(self, drafts: Sequence[int]) -> list[int]:
        """`drafts` up to (not including) the first token the grammar forbids after the
        accepted stream and the drafts before it."""
        return list(drafts[: self._matcher.validate_tokens([int(t) for t in drafts])])

    def masks(self, num_positions: int, drafts: Sequence[int], vocab: int) -> mx.array:
        """(num_positions, vocab) bool: the tokens allowed at each position, position
        i > 0 after drafts[:i]. Positions after a draft the grammar forbids allow every
        token: the verify stops before them (the forbidden draft is never drawn)."""
        words = (vocab + 31) // 32
        bits = np.full((num_positions, words), -1, dtype=np.int32)
        valid = self._matcher.validate_tokens([int(t) for t in drafts[: num_positions - 1]])
        consumed = 0
        for i in range(min(num_positions, valid + 1)):
            if i > 0:
                if not self._matcher.consume_token(int(drafts[i - 1])):
                    raise RuntimeError(self._matcher.get_error())
                consumed += 1
            self._fill(bits[i], words)
        if consumed:
            self._matcher.rollback(consumed)
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        return mx.array(allowed.astype(np.bool_))

    def _fill(self, row: np.ndarray, words: int) -> None:
        if self.is_finished:  # complete (or failed): only the end of the stream
            row[:] = 0
            for eos in self._eos_token_ids:
                row[eos // 32] |= np.int32(np.uint32(1 << (eos % 32)).view(np.int32))
            return
        mask = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.int32)
        n = min(words, mask.shape[0])
        row[:n] = mask[:n]
        row[n:] = 0
