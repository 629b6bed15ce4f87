"""`logprobs` / `top_logprobs` and `n` on the HTTP layer, without Ray: a scripted engine
whose events carry logprobs, behind the real Starlette app. What the values are is
tested on every decode path in tests/model/test_logprobs.py; here, the shapes OpenAI
defines, streaming, the cut at a text stop, and n choices."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
from local_service import ScriptedClient, make_app, run

from scheduler.events import TokenEvent
from scheduler.request import SpecStats, TokenLogprob

pytestmark = pytest.mark.model

EOS = 0


def logprob_of(token: int, k: int = 5) -> TokenLogprob:
    """A made-up report: the token at -0.25, alternatives token + 1.. below it."""
    return TokenLogprob(-0.25, tuple((token + j, -0.25 - j) for j in range(k)))


class LogprobClient(ScriptedClient):
    """Every event carries a report per token; requests whose ids are in `fail` error."""

    def __init__(self, script, **kw):
        super().__init__(script, eos=EOS, **kw)
        self.fail: set[str] = set()
        self.released: list[str] = []

    def release(self, request_id):
        self.released.append(request_id)

    async def _events(self, request):
        for i, ids in enumerate(self.script):
            await asyncio.sleep(0.01)
            if request.request_id in self.fail:
                yield TokenEvent(request.request_id, [], "error", error="boom")
                return
            last = i == len(self.script) - 1
            yield TokenEvent(
                request.request_id,
                ids,
                self.finish if last else None,
                stats=SpecStats(num_rounds=2, num_drafted=6, num_accepted=4) if last else None,
                logprobs=[logprob_of(t, request.sampling.logprobs or 0) for t in ids],
            )


def call(codec, route, body, client):
    async def go():
        async with make_app(codec, client) as http:
            r = await http.post(f"/v1/{route}", json=body)
            await asyncio.sleep(0.05)  # cancels run in the background
            return r.status_code, (r.text if body.get("stream") else r.json())

    return run(go())


def sse_chunks(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.fixture
def words(codec):
    return codec.encode("alpha beta gamma delta")


def test_chat_logprobs_have_openais_shape(codec, words):
    client = LogprobClient([[t] for t in words] + [[EOS]], finish="stop")
    status, body = call(
        codec,
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        client,
    )
    assert status == 200
    assert client.submitted[0].sampling.logprobs == 2
    assert client.released == [client.submitted[0].request_id]
    choice = body["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == len(words) + 1  # EOS is billed and reported
    for token_id, entry in zip([*words, EOS], content):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["token"] == codec.token_text(token_id)
        assert entry["bytes"] == list(entry["token"].encode("utf-8")) and entry["logprob"] == -0.25
        assert [t["logprob"] for t in entry["top_logprobs"]] == [-0.25, -1.25]
        assert [set(t) for t in entry["top_logprobs"]] == [{"token", "logprob", "bytes"}] * 2
    assert "".join(e["token"] for e in content[:-1]) == choice["message"]["content"]


BUNDLED = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")


@pytest.mark.parametrize("text", ["é", "€", "日本", "😀"])
def test_a_token_holding_part_of_a_character_reports_its_own_bytes(text):
    from serve_app.openai.codec import TextCodec

    codec = TextCodec.from_path(BUNDLED)  # byte-level BPE: each of these characters spans tokens
    ids = codec.encode(text)
    assert len(ids) > len(text) and all(codec.token_text(t) == "\ufffd" for t in ids)
    assert b"".join(codec.token_bytes(t) for t in ids) == text.encode("utf-8")
    assert codec.token_bytes(codec.encode("alpha")[0]) == codec.token_text(codec.encode("alpha")[0]).encode()
    client = LogprobClient([ids, [EOS]], finish="stop")
    status, body = call(
        codec,
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1},
        client,
    )
    assert status == 200 and body["choices"][0]["message"]["content"] == text
    content = body["choices"][0]["logprobs"]["content"][:-1]  # the last entry is EOS
    assert [e["token"] for e in content] == ["\ufffd"] * len(ids)
    assert bytes(b for e in content for b in e["bytes"]) == text.encode("utf-8")
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [e["bytes"] for e in content]


def test_completions_logprobs_have_openais_shape(codec, words):
    client = LogprobClient([list(words[:2]), list(words[2:])])
    status, body = call(codec, "completions", {"prompt": "hi", "logprobs": 0}, client)
    assert status == 200
    choice = body["choices"][0]
    lp, text = choice["logprobs"], choice["text"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["tokens"] == [codec.token_text(t) for t in words]
    assert lp["token_logprobs"] == [-0.25] * len(words)
    assert lp["top_logprobs"] == [{token: -0.25} for token in lp["tokens"]]  # k = 0: the chosen token only
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for token, offset in zip(lp["tokens"], lp["text_offset"]):
        assert text[offset:].startswith(token)


def test_a_request_that_does_not_ask_gets_null_and_computes_none(codec, words):
    client = LogprobClient([list(words)])
    status, body = call(codec, "completions", {"prompt": "hi"}, client)
    assert body["choices"][0]["logprobs"] is None and client.submitted[0].sampling.logprobs is None


def test_streaming_chunks_carry_their_tokens_logprobs(codec, words):
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    _, full = call(codec, "chat/completions", body, LogprobClient([[t] for t in words]))
    _, text = call(codec, "chat/completions", {**body, "stream": True}, LogprobClient([[t] for t in words]))
    chunks = sse_chunks(text)
    with_tokens = [c for c in chunks if c["choices"][0]["logprobs"] and c["choices"][0]["logprobs"]["content"]]
    assert len(with_tokens) >= len(words) - 1  # per-token chunks, not one at the end
    streamed = [e for c in with_tokens for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == full["choices"][0]["logprobs"]["content"]
    for c in with_tokens:  # a chunk's logprobs are those of the text it carries
        content = c["choices"][0]["logprobs"]["content"]
        assert "".join(e["token"] for e in content) == c["choices"][0]["delta"].get("content", "")


def test_a_text_stop_cuts_the_logprobs_at_the_billed_tokens(codec, words):
    client = LogprobClient([[t] for t in words])
    for stream in (False, True):
        _, body = call(
            codec,
            "completions",
            {
                "prompt": "hi",
                "stop": ["gam"],
                "logprobs": 1,
                "stream": stream,
                **({"stream_options": {"include_usage": True}} if stream else {}),
            },
            client,
        )
        if stream:
            chunks = sse_chunks(body)
            tokens = [
                t
                for c in chunks
                if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]
            ]
            billed = chunks[-1]["usage"]["completion_tokens"]
        else:
            tokens, billed = body["choices"][0]["logprobs"]["tokens"], body["usage"]["completion_tokens"]
        # the tokens whose text the client saw, and the one the stop begins in
        assert len(tokens) == billed < len(words)
        assert "".join(tokens) == "alpha beta g"


def test_an_impossible_token_is_reported_as_minus_9999(codec, words):
    class Masked(LogprobClient):
        async def _events(self, request):
            yield TokenEvent(
                request.request_id,
                [words[0]],
                "length",
                logprobs=[TokenLogprob(-0.5, ((words[0], -0.5), (7, -math.inf)))],
            )

    _, body = call(
        codec,
        "chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2},
        Masked([]),
    )
    assert [t["logprob"] for t in body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]] == [-0.5, -9999.0]


@pytest.mark.parametrize("seed, seeds", [(5, [5, 6, 7]), (None, [None] * 3), (2**64 - 2, [2**64 - 2, 2**64 - 1, 0])])
def test_n_choices_are_independent_requests_with_consecutive_seeds(codec, words, seed, seeds):
    client = LogprobClient([list(words[:2]), list(words[2:])])
    status, body = call(codec, "completions", {"prompt": "hi", "n": 3, "seed": seed, "max_tokens": 9}, client)
    assert status == 200
    assert [r.sampling.seed for r in client.submitted] == seeds
    assert len({r.request_id for r in client.submitted}) == 3
    assert all(r.prompt_ids == client.submitted[0].prompt_ids for r in client.submitted)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert sorted(client.released) == sorted(r.request_id for r in client.submitted) and not client.cancelled
    assert all(c["text"] == "alpha beta gamma delta" for c in body["choices"])
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(client.submitted[0].prompt_ids)  # the prompt counted once
    assert usage["completion_tokens"] == 3 * len(words)
    assert usage["speculative"]["rounds"] == 6 and usage["speculative"]["accepted"] == 12


def test_n_choices_stream_by_index_with_one_usage_chunk(codec, words):
    client = LogprobClient([[t] for t in words], finish="stop")
    _, text = call(
        codec,
        "chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "n": 2,
            "logprobs": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        client,
    )
    chunks = sse_chunks(text)
    assert sorted(client.released) == sorted(r.request_id for r in client.submitted) and not client.cancelled
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage[0]["usage"]["completion_tokens"] == 2 * len(words)
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(m["delta"].get("content") or "" for m in mine) == "alpha beta gamma delta"
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == ["stop"]
        assert sum(len(m["logprobs"]["content"]) for m in mine if m["logprobs"]) == len(words)


@pytest.mark.parametrize("stream", [False, True])
def test_one_failed_choice_fails_the_request_and_cancels_the_others(codec, words, stream):
    class FailSecond(LogprobClient):
        async def _events(self, request):
            if request.request_id.endswith("-1"):
                self.fail.add(request.request_id)
            async for event in super()._events(request):
                yield event

    client = FailSecond([[t] for t in words] * 20)
    status, body = call(codec, "completions", {"prompt": "hi", "n": 3, "stream": stream}, client)
    if stream:
        chunks = sse_chunks(body)
        assert chunks[-1]["error"]["code"] == "generation_failed"
        assert not any(c.get("choices") and c["choices"][0]["finish_reason"] for c in chunks)
    else:
        assert status == 500 and body["error"]["code"] == "generation_failed"
    others = {r.request_id for r in client.submitted if not r.request_id.endswith("-1")}
    assert others <= set(client.cancelled)


def test_a_full_queue_refuses_all_choices(codec):
    client = LogprobClient([[5]], full=True)
    status, body = call(codec, "completions", {"prompt": "hi", "n": 4}, client)
    assert status == 503 and body["error"]["code"] == "queue_full"
