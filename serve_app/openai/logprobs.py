"""OpenAI's `logprobs` objects, from the scheduler's per-token `TokenLogprob`s.

The values are the sampler's processed log-probabilities (`models.sampling.samplers`: after
logit bias, penalties and the grammar mask; before temperature and the top-p / min-p
/ top-k filters). A request reports one entry per billed token (`CompletionText`:
tokens after a text stop are not billed and not reported), the end-of-sequence
token included, so `len(logprobs.content) == usage.completion_tokens` per choice.
A token no path can emit (masked by a grammar, -inf) is reported as -9999.0, as
OpenAI does: JSON has no infinity. A token's `bytes` are its own UTF-8 bytes: a
byte-level token holding part of a multi-byte character has the text U+FFFD and the
bytes of that part, so a client joining the bytes of consecutive tokens gets the text.

Shapes: chat `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token",
"logprob", "bytes"}]}]}`; completions `{"tokens", "token_logprobs", "top_logprobs"
(a dict per token: the k most likely and the chosen token), "text_offset"}`.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from scheduler.request import TokenLogprob

LOGPROB_FLOOR = -9999.0
log = logging.getLogger(__name__)


def _value(logprob: float) -> float:
    return LOGPROB_FLOOR if math.isinf(logprob) or logprob < LOGPROB_FLOOR else logprob


@dataclass
class LogprobTrail:
    """A choice's tokens and their logprobs as they arrive; `release` hands out, once
    each, those whose text has begun to reach the client (`starts`: each token's
    character offset in the choice's text)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_released: int = 0

    def add(self, token_ids: list[int], logprobs: list[TokenLogprob] | None) -> None:
        if len(logprobs or ()) != len(token_ids):  # a decode path that lost them: a bug, made visible
            log.warning(
                "%d tokens arrived with %d logprobs; reported as %s", len(token_ids), len(logprobs or ()), LOGPROB_FLOOR
            )
            logprobs = [TokenLogprob(LOGPROB_FLOOR)] * len(token_ids)
        self.token_ids += token_ids
        self.logprobs += logprobs

    def release(self, starts: list[int], num_chars_sent: int, limit: int | None = None) -> list[tuple]:
        """(token id, TokenLogprob, text offset) of tokens not released yet whose text
        starts before `num_chars_sent`, or of every token up to `limit` (the billed
        count, once the choice has finished)."""
        end = bisect.bisect_left(starts, num_chars_sent) if limit is None else limit
        end = min(end, len(self.token_ids), len(starts))
        out = [(self.token_ids[i], self.logprobs[i], starts[i]) for i in range(self.num_released, end)]
        self.num_released = max(self.num_released, end)
        return out


class LogprobFormat:
    """Entries (token id, TokenLogprob, text offset) as one endpoint's `logprobs` object."""

    def __init__(
        self, token_text: Callable[[int], str], chat: bool, token_bytes: Callable[[int], bytes] | None = None
    ) -> None:
        """`token_text`: one token's text, special tokens spelled out; `token_bytes`: its
        own UTF-8 bytes, which differ from the text's for a token holding part of a
        multi-byte character (its text is U+FFFD). Without it the text's bytes are used."""
        self._text = token_text
        self._bytes = token_bytes or (lambda token_id: token_text(token_id).encode("utf-8"))
        self.chat = chat

    def _token(self, token_id: int, logprob: float) -> dict:
        return {"token": self._text(token_id), "logprob": _value(logprob), "bytes": list(self._bytes(token_id))}

    def build(self, entries: list[tuple]) -> dict:
        if self.chat:
            return {
                "content": [
                    {**self._token(t, lp.logprob), "top_logprobs": [self._token(a, v) for a, v in lp.top]}
                    for t, lp, _ in entries
                ]
            }
        tops = []
        for t, lp, _ in entries:
            top = {}
            for a, v in (*lp.top, (t, lp.logprob)):
                top.setdefault(self._text(a), _value(v))
            tops.append(top)
        return {
            "tokens": [self._text(t) for t, _, _ in entries],
            "token_logprobs": [_value(lp.logprob) for _, lp, _ in entries],
            "top_logprobs": tops,
            "text_offset": [offset for _, _, offset in entries],
        }
