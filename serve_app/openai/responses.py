"""OpenAI response shapes and text stop sequences.

`StopMatcher` finds text stop sequences across token boundaries: it holds back the last
`len(longest stop) - 1` characters until they can no longer start a match, so a client
never sees text that a later token turns into a stop. `CompletionText` puts it behind a
request's streaming decoder and counts the tokens the client is billed for.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import json
import time
from dataclasses import dataclass

from serve_app.openai.logprobs import LogprobFormat
from serve_app.openai.structured import NONE, OutputSpec, read_tool_calls


class StopMatcher:
    """Emit text up to (not including) the first stop sequence.

    >>> m = StopMatcher(["END"]); m.feed("abcE"), m.feed("ND tail")
    (('ab', False), ('c', True))
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._buf = ""
        self._num_fed = 0
        self.cut_at: int | None = None  # where the first stop starts, in characters fed

    def feed(self, text: str) -> tuple[str, bool]:
        """Text safe to emit now, and whether a stop sequence was hit (text ends before it)."""
        self._buf += text
        self._num_fed += len(text)
        hits = [i for i in (self._buf.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.cut_at = self._num_fed - len(self._buf) + min(hits)
            out, self._buf = self._buf[: min(hits)], ""
            return out, True
        cut = max(len(self._buf) - self._hold, 0)
        out, self._buf = self._buf[:cut], self._buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buf = self._buf, ""
        return out


class CompletionText:
    """A request's text, decoded token by token and cut at its first stop sequence, and
    the number of tokens it is billed for.

    Without a stop every token counts. After a stop only the tokens whose text starts
    before the cut count (their text was emitted, at least partly); tokens generated
    after it, the stop's own and those drained after the cancel, do not. With stop
    "END" and tokens "ab", "cE", "ND", "x" the client sees "abc" and is billed for 2.
    """

    def __init__(self, decoder, stops: list[str], per_token: bool = False) -> None:
        """`per_token`: record where each token's text starts (`starts`) even without
        stops (logprobs report it)."""
        self._decoder = decoder
        self._stops = StopMatcher(stops)
        self._per_token = bool(stops) or per_token  # a stop needs to know where each token starts
        self.starts: list[int] = []  # character offset of each token's text
        self._num_chars = 0
        self.num_sent = 0  # characters returned to the caller so far
        self.num_generated = 0
        self.stopped = False

    @property
    def num_billed(self) -> int:
        if not self.stopped:
            return self.num_generated
        return bisect.bisect_left(self.starts, self._stops.cut_at)

    def add(self, token_ids: list[int]) -> str:
        """Text to emit for these tokens; sets `stopped` when a stop sequence is hit."""
        self.num_generated += len(token_ids)
        if self._per_token:
            parts = []
            for token_id in token_ids:
                self.starts.append(self._num_chars)
                parts.append(self._decoder.add([token_id]))
                self._num_chars += len(parts[-1])
            text = "".join(parts)
        else:
            text = self._decoder.add(token_ids)
        return self._feed(text)

    def finish(self) -> str:
        """The rest of the text once generation has ended (held-back characters included)."""
        text = self._feed(self._decoder.flush())
        if not self.stopped:
            rest = self._stops.flush()
            self.num_sent += len(rest)
            text += rest
        return text

    def _feed(self, text: str) -> str:
        if self.stopped:
            return ""
        out, self.stopped = self._stops.feed(text)
        self.num_sent += len(out)
        return out


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    stats: object | None = None  # scheduler.request.SpecStats
    cached_tokens: int = 0  # prompt tokens the prefix cache held (OpenAI's prompt_tokens_details)

    @classmethod
    def of_choices(cls, usages: list["Usage"]) -> "Usage":
        """n choices of one prompt: the prompt counted once, their completions summed,
        their speculative counters summed (`merge_stats`)."""
        first = usages[0]
        if len(usages) == 1:
            return first
        stats = [u.stats for u in usages]
        return cls(
            first.prompt_tokens,
            sum(u.completion_tokens for u in usages),
            None if None in stats else merge_stats(stats),
            first.cached_tokens,
        )

    def to_dict(self) -> dict:
        out = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }
        s = self.stats
        if s is not None:
            out["speculative"] = s.as_usage()
        return out


def merge_stats(stats: list):
    """Field by field sums of `SpecStats` (counts, per-position lists, per-drafter lists)."""
    total = type(stats[0])()
    for s in stats:
        for f in dataclasses.fields(s):
            mine, theirs = getattr(total, f.name), getattr(s, f.name)
            if isinstance(theirs, list):
                setattr(total, f.name, _add_lists(mine, theirs))
            elif isinstance(theirs, dict):
                setattr(total, f.name, {k: _add_lists(mine.get(k, []), theirs.get(k, [])) for k in {**mine, **theirs}})
            else:
                setattr(total, f.name, mine + theirs)
    return total


def _add_lists(a: list, b: list) -> list:
    return [x + y for x, y in itertools.zip_longest(a, b, fillvalue=0)]


class ResponseFormat:
    """Chunk and response bodies for one request of either endpoint, its choices
    numbered by `index`.

    A chat reply that may hold tool calls (`output.tool_mode` not none) is read back
    whole once it finishes with "stop": its calls become `tool_calls` and the finish
    reason "tool_calls". A reply cut by max_tokens ("length") is returned as content.
    Such a reply is not streamed token by token (`holds_back_stream`): its stream
    carries it in one delta, content or tool calls, before the finishing chunk.
    With `logprobs` (the request asked) a choice carries its tokens' logprobs: a chunk
    those of the tokens whose text it begins, a full response all of them."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        output: OutputSpec | None = None,
        logprobs: LogprobFormat | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.chat = chat
        self.output = output or OutputSpec()
        self.logprobs = logprobs
        self.created = int(time.time())

    @property
    def holds_back_stream(self) -> bool:
        return self.chat and self.output.tool_mode != NONE

    def _logprobs(self, entries: list | None) -> dict | None:
        return None if self.logprobs is None or entries is None else self.logprobs.build(entries)

    def _message(self, text: str, finish_reason: str) -> tuple[dict, str]:
        """The reply's message fields (content, tool_calls) and its finish reason."""
        if finish_reason == "stop" and self.output.tool_mode != NONE:
            content, calls = read_tool_calls(text, self.output)
            if calls:
                return {"content": content, "tool_calls": calls}, "tool_calls"
        return {"content": text}, finish_reason

    def final_chunks(self, text: str, finish_reason: str, index: int = 0, entries: list | None = None) -> list[dict]:
        """A held-back stream's end: the reply as one delta, then the finishing chunk."""
        message, finish_reason = self._message(text, finish_reason)
        delta = {k: v for k, v in message.items() if v}
        if "tool_calls" in delta:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
        chunks = (
            [
                self._envelope(
                    "chat.completion.chunk",
                    [{"index": index, "delta": delta, "logprobs": self._logprobs(entries), "finish_reason": None}],
                )
            ]
            if delta
            else []
        )
        return chunks + [self.chunk(None, finish_reason, index=index, entries=None if delta else entries)]

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None,
        first: bool = False,
        index: int = 0,
        entries: list | None = None,
    ) -> dict:
        """`entries`: logprobs of the tokens this chunk carries (None: none)."""
        logprobs = self._logprobs(entries)
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage.to_dict()
        return body

    def choice(self, index: int, text: str, finish_reason: str, entries: list | None = None) -> dict:
        """One choice of a full response; `entries`: its tokens' logprobs."""
        logprobs = self._logprobs(entries)
        if self.chat:
            message, finish_reason = self._message(text, finish_reason)
            return {
                "index": index,
                "message": {"role": "assistant", **message},
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def full(self, choices: list[dict], usage: Usage) -> dict:
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        body["usage"] = usage.to_dict()
        return body


def sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
