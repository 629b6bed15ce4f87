"""The HTTP layer without Ray: a scripted EngineClient behind the real Starlette app."""

from __future__ import annotations

import json

import pytest
from local_service import ScriptedClient, make_app, run

from scheduler.events import TokenEvent
from scheduler.request import Lane
from serve_app.openai.responses import StopMatcher

pytestmark = pytest.mark.model


def test_stop_matcher_table():
    cases = [
        (["END"], ["abcE", "ND tail"], ["ab", "c"], True),
        (["\n\n"], ["a\n", "\nb"], ["a", ""], True),
        (["xyz"], ["ab", "cd"], ["", "ab"], False),
        ([], ["ab", "cd"], ["ab", "cd"], False),
    ]
    for stops, feeds, outs, hits in cases:
        m = StopMatcher(stops)
        got = [m.feed(f) for f in feeds]
        assert [g[0] for g in got] == outs
        assert any(g[1] for g in got) is hits


def test_incremental_decoder_matches_full_decode(codec):
    ids = codec.encode("def f(x):\n    return 'héllo wörld' + str(x)\n")
    decoder = codec.decoder()
    text = "".join(decoder.add([t]) for t in ids) + decoder.flush()
    assert text == codec.decode(ids)


def _byte_token(codec, byte: int) -> int:
    """The bundled byte-level tokenizer's token for one byte."""
    return next(t for t in range(codec.vocab_size) if codec.token_bytes(t) == bytes([byte]))


def test_decoder_holds_a_split_character_until_it_completes(codec):
    lead, tail = _byte_token(codec, 0xC3), _byte_token(codec, 0xA9)  # "é" = C3 A9
    decoder = codec.decoder()
    assert [decoder.add([lead]), decoder.add([tail])] == ["", "é"]


def test_decoder_sends_stray_bytes_at_once(codec):
    """A model emitting a byte that starts no character (random weights do) must not
    hold its stream back: each stray byte goes out as U+FFFD with its own token."""
    stray = _byte_token(codec, 0xA9)
    decoder = codec.decoder()
    assert [decoder.add([stray]) for _ in range(5)] == ["\ufffd"] * 5


def test_decoder_holds_repeated_lead_bytes_for_a_bounded_number_of_tokens(codec):
    from serve_app.openai.codec import MAX_HELD_TOKENS

    lead = _byte_token(codec, 0xE4)  # each one could start a character; the next breaks it
    decoder = codec.decoder()
    deltas = [decoder.add([lead]) for _ in range(3 * MAX_HELD_TOKENS)]
    waits = [i for i, d in enumerate(deltas) if d]
    assert waits[0] < MAX_HELD_TOKENS and all(b - a <= MAX_HELD_TOKENS for a, b in zip(waits, waits[1:]))
    assert "".join(deltas) + decoder.flush() == codec.decode([lead] * 3 * MAX_HELD_TOKENS)


def test_decoder_deltas_add_up_to_the_full_decode_on_random_tokens(codec):
    import random

    rng = random.Random(7)
    bytes_tokens = [t for t in range(codec.vocab_size) if "\ufffd" in codec.token_text(t)]
    for _ in range(50):
        pool = bytes_tokens if rng.random() < 0.5 else range(codec.vocab_size)
        ids = [
            rng.choice(pool) if rng.random() < 0.7 else rng.randrange(codec.vocab_size)
            for _ in range(rng.randrange(1, 60))
        ]
        decoder = codec.decoder()
        text = "".join(decoder.add(ids[i : i + 2]) for i in range(0, len(ids), 2)) + decoder.flush()
        assert text == codec.decode(ids), ids


@pytest.mark.parametrize(
    "header, cap, expected",
    [
        ("high", "high", Lane.HIGH),
        ("high", "normal", Lane.NORMAL),
        ("low", "normal", Lane.LOW),
        (None, "low", Lane.LOW),
        ("weird", "high", Lane.NORMAL),
    ],
)
def test_x_priority_is_capped_by_the_deployment(codec, header, cap, expected):
    client = ScriptedClient([[5], [6]])

    async def go():
        async with make_app(codec, client, max_lane_unauthenticated=cap) as http:
            headers = {"X-Priority": header} if header else {}
            r = await http.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 200

    run(go())
    assert client.submitted[0].lane is expected


def test_api_keys_gate_v1_routes_but_not_health(codec):
    client = ScriptedClient([[5]])
    keys = [{"key": "secret-key-1", "max_lane": "normal"}]

    async def go():
        async with make_app(codec, client, api_keys=keys) as http:
            assert (await http.get("/health")).status_code == 200
            r = await http.post("/v1/completions", json={"prompt": "hi"})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await http.post(
                "/v1/completions",
                json={"prompt": "hi"},
                headers={"Authorization": "Bearer secret-key-1", "X-Priority": "high"},
            )
            assert r.status_code == 200

    run(go())
    assert client.submitted[0].lane is Lane.NORMAL


def test_text_stop_across_tokens_cancels_and_reports_usage(codec):
    ids = codec.encode("alpha beta gamma delta")
    client = ScriptedClient([[t] for t in ids])

    async def go():
        async with make_app(codec, client) as http:
            r = await http.post("/v1/completions", json={"prompt": "hi", "stop": ["gam"]})
            return r.json()

    body = run(go())
    assert body["choices"][0]["text"] == "alpha beta "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert client.cancelled == [client.submitted[0].request_id]


def test_usage_carries_speculative_stats_and_queue_full_is_503(codec):
    async def go():
        async with make_app(codec, ScriptedClient([[5], [6, 7]])) as http:
            body = (await http.post("/v1/completions", json={"prompt": "hi"})).json()
        async with make_app(codec, ScriptedClient([], full=True)) as http:
            full = await http.post("/v1/completions", json={"prompt": "hi"})
        return body, full

    body, full = run(go())
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["speculative"] == {
        "rounds": 2,
        "probe_rounds": 0,
        "row_rounds": 0,
        "drafted": 6,
        "accepted": 4,
        "grants": 0,
        "parks": 0,
        "acceptance_length": 3.0,
        "drafters": {},
    }
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full"


def test_usage_reports_cached_prompt_tokens_as_openai_does(codec):
    async def go():
        async with make_app(codec, ScriptedClient([[5], [6]], cached=7)) as http:
            full = (await http.post("/v1/completions", json={"prompt": "hi"})).json()
            stream = await http.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        async with make_app(codec, ScriptedClient([[5]])) as http:
            miss = (await http.post("/v1/completions", json={"prompt": "hi"})).json()
        return full, stream, miss

    full, stream, miss = run(go())
    assert full["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
    assert miss["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


class FailingClient(ScriptedClient):
    """Streams one token, then the scheduler reports an internal error (with detail)."""

    async def _events(self, request):
        yield TokenEvent(request.request_id, [5])
        yield TokenEvent(
            request.request_id, [], "error", error="Traceback (most recent call last): File /srv/secret.py"
        )


class DeadClient(ScriptedClient):
    async def submit(self, request):
        from serve_app.deployment.client import SchedulerLost

        raise SchedulerLost("actor died: /tmp/ray/session_x")


def test_scheduler_failures_are_clean_errors_without_internal_detail(codec):
    async def go():
        async with make_app(codec, FailingClient([])) as http:
            stream = await http.post("/v1/completions", json={"prompt": "hi", "stream": True})
            full = await http.post("/v1/completions", json={"prompt": "hi"})
        async with make_app(codec, DeadClient([])) as http:
            dead = await http.post("/v1/completions", json={"prompt": "hi"})
        return stream, full, dead

    stream, full, dead = run(go())
    lines = [line for line in stream.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    assert full.status_code == 500 and full.json()["error"]["code"] == "generation_failed"
    assert dead.status_code == 503 and dead.json()["error"]["code"] == "scheduler_unavailable"
    for text in (stream.text, full.text, dead.text):
        assert "Traceback" not in text and "secret" not in text and "/tmp" not in text


def billed_before(codec, ids, stop):
    """The spec, from full decodes: tokens whose text starts before the stop's cut."""
    cut = codec.decode(ids).index(stop)
    return sum(1 for k in range(len(ids)) if len(codec.decode(ids[:k])) < cut)


@pytest.mark.parametrize("chunking", ["one event", "token per event", "stop across events"])
@pytest.mark.parametrize("stream", [False, True])
def test_usage_counts_only_tokens_emitted_before_a_stop(codec, chunking, stream):
    ids = codec.encode("alpha beta gamma delta epsilon")
    split = len(codec.encode("alpha beta g"))  # the stop "gam" starts inside the last of these
    script = {
        "one event": [ids],
        "token per event": [[t] for t in ids],
        "stop across events": [ids[:split], ids[split:]],
    }[chunking]
    expected = billed_before(codec, ids, "gam")
    assert 0 < expected < len(ids) - 3  # tokens after the stop were generated and are not billed
    client = ScriptedClient(script)
    body = {"prompt": "hi", "stop": ["gam"], "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}

    async def go():
        async with make_app(codec, client) as http:
            return await http.post("/v1/completions", json=body)

    r = run(go())
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
    else:
        text, usage = r.json()["choices"][0]["text"], r.json()["usage"]
    assert text == "alpha beta "
    assert usage["completion_tokens"] == expected


def test_model_retrieve_answers_for_the_served_id_only(codec):
    async def go():
        async with make_app(codec, ScriptedClient([]), served_model_name="org/tiny-1") as http:
            listed = (await http.get("/v1/models")).json()["data"][0]
            return listed, await http.get("/v1/models/org/tiny-1"), await http.get("/v1/models/gpt-4o")

    listed, found, missing = run(go())
    assert found.status_code == 200 and found.json() == listed
    assert listed["id"] == "org/tiny-1" and listed["object"] == "model"
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "model 'gpt-4o' is not served here; use 'org/tiny-1'",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


def _samples(text: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_streamed_request_observes_one_inter_token_gap_per_token_after_the_first(codec):
    client = ScriptedClient([[5], [6, 7], [8], [9, 10, 11]])  # 7 tokens in 4 chunks

    async def go():
        async with make_app(codec, client, served_model_name="tiny-served") as http:
            first = await http.get("/metrics")
            r = await http.post(
                "/v1/completions", json={"prompt": "hi", "stream": True, "stream_options": {"include_usage": True}}
            )
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            return first.text, (await http.get("/metrics")).text

    before, after = run(go())
    model = (("model_name", "tiny-served"),)
    values = _samples(after)
    assert values[("specslot:inter_token_latency_seconds_count", model)] == 6
    assert values[("specslot:time_to_first_token_seconds_count", model)] == 1
    assert values[("specslot:e2e_request_latency_seconds_count", model)] == 1
    assert values[("specslot:generation_tokens_total", model)] == 7
    assert values[("specslot:prompt_tokens_total", model)] == len(client.submitted[0].prompt_ids)
    assert values[("specslot:request_success_total", (("finished_reason", "length"),) + model)] == 1
    # Scripted chunks 10 ms apart: the gaps sum to first -> last token, about 30 ms.
    assert 0.02 < values[("specslot:inter_token_latency_seconds_sum", model)] < 1.0
    # Every series of the first scrape (before any request) is there after, same name and
    # labels; `specslot:` ones carry the served model id.
    assert set(_samples(before)) == set(values)
    assert {
        labels
        for (name, labels) in values
        if name.startswith("specslot:") and dict(labels).get("model_name") != "tiny-served"
    } == set()
