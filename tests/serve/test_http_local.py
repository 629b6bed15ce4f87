"""The HTTP layer without Ray: a scripted EngineClient behind the real Starlette app."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from scheduler.events import TokenEvent
from scheduler.request import Lane, SpecStats
from serve_app.client import QueueFull
from serve_app.codec import TextCodec
from serve_app.config import ServeArgs
from serve_app.http import OpenAIService
from serve_app.responses import StopMatcher

pytestmark = pytest.mark.model


class ScriptedClient:
    """Answers every request with `script` (token id lists), recording what it saw."""

    def __init__(self, script, eos=0, full=False):
        self.script = script
        self.info = {"max_context": 512, "eos_token_ids": [eos]}
        self.full = full
        self.submitted, self.cancelled = [], []
        self.healthy, self.num_open_streams, self.num_restarts = True, 0, 0

    async def submit(self, request):
        if self.full:
            raise QueueFull()
        self.submitted.append(request)
        return self._events(request)

    async def _events(self, request):
        for i, ids in enumerate(self.script):
            await asyncio.sleep(0.01)
            last = i == len(self.script) - 1
            yield TokenEvent(request.request_id, ids, "length" if last else None,
                             stats=SpecStats(num_rounds=2, num_drafted=6, num_accepted=4) if last else None)

    async def cancel(self, request_id):
        self.cancelled.append(request_id)

    def release(self, request_id):
        pass

    async def snapshot(self):
        return {"counters": {"grants": 1}}


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    from models.tiny import build_tiny_pair

    target, _ = build_tiny_pair(str(tmp_path_factory.mktemp("tiny-http")))
    return TextCodec.from_path(target)


def make_app(codec, client, **args):
    service = OpenAIService(client, codec, ServeArgs.model_validate({"model": "m", **args}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=service.app()), base_url="http://t")


def run(coro):
    return asyncio.run(coro)


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


@pytest.mark.parametrize("header, cap, expected", [
    ("high", "high", Lane.HIGH), ("high", "normal", Lane.NORMAL), ("low", "normal", Lane.LOW),
    (None, "low", Lane.LOW), ("weird", "high", Lane.NORMAL),
])
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
            r = await http.post("/v1/completions", json={"prompt": "hi"},
                                headers={"Authorization": "Bearer secret-key-1", "X-Priority": "high"})
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
    assert body["usage"]["speculative"] == {"rounds": 2, "probe_rounds": 0, "row_rounds": 0, "drafted": 6,
                                            "accepted": 4, "grants": 0, "parks": 0,
                                            "acceptance_length": 3.0, "drafters": {}}
    assert full.status_code == 503 and full.headers["retry-after"] == "1"
    assert full.json()["error"]["code"] == "queue_full"


class FailingClient(ScriptedClient):
    """Streams one token, then the scheduler reports an internal error (with detail)."""

    async def _events(self, request):
        yield TokenEvent(request.request_id, [5])
        yield TokenEvent(request.request_id, [], "error",
                         error="Traceback (most recent call last): File /srv/secret.py")


class DeadClient(ScriptedClient):
    async def submit(self, request):
        from serve_app.client import SchedulerLost

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
    lines = [l for l in stream.text.splitlines() if l.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    assert full.status_code == 500 and full.json()["error"]["code"] == "generation_failed"
    assert dead.status_code == 503 and dead.json()["error"]["code"] == "scheduler_unavailable"
    for text in (stream.text, full.text, dead.text):
        assert "Traceback" not in text and "secret" not in text and "/tmp" not in text


def _samples(text: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_streamed_request_observes_one_inter_token_gap_per_token_after_the_first(codec):
    client = ScriptedClient([[5], [6, 7], [8], [9, 10, 11]])  # 7 tokens in 4 chunks
    async def go():
        async with make_app(codec, client, served_model_name="tiny-served") as http:
            first = await http.get("/metrics")
            r = await http.post("/v1/completions", json={"prompt": "hi", "stream": True,
                                                         "stream_options": {"include_usage": True}})
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
    assert {labels for (name, labels) in values if name.startswith("specslot:")
            and dict(labels).get("model_name") != "tiny-served"} == set()
