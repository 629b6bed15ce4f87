"""The prompt-keyed front door without a cluster: keys, forwarding, failures and
disconnects, over a fake deployment handle; `run_asgi` over a real Starlette app."""

import asyncio
import json

import pytest

pytest.importorskip("ray.serve")

from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from serve_app.deployment.ingress import Forwarder, read_body, request_key, run_asgi  # noqa: E402
from serve_app.deployment.prompt_key import prompt_affinity_key  # noqa: E402

CHAT = "/v1/chat/completions"
BODY = json.dumps({"messages": [{"role": "user", "content": "hello"}], "stream": True}).encode()
START = {"type": "http.response.start", "status": 200, "headers": [(b"x-specslot-replica", b"r1")]}


def scope(path=CHAT, headers=(), method="POST"):
    return {
        "type": "http",
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": list(headers),
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {"not": "forwarded"},
    }


class FakeResponses:
    def __init__(self, messages, fail=None, hang=False):
        self.messages, self.fail, self.hang, self.cancelled = messages, fail, hang, False

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        for message in self.messages:
            yield message
        if self.fail:
            raise self.fail
        if self.hang:
            await asyncio.sleep(60)


class FakeHandle:
    def __init__(self, responses, options=None, calls=None):
        self.responses, self.opts, self.calls = responses, options or {}, calls if calls is not None else []

    def options(self, **kw):
        return FakeHandle(self.responses, {**self.opts, **kw}, self.calls)

    def remote(self, forwarded, body):
        self.calls.append((self.opts, forwarded, body))
        return self.responses


def make_ingress(responses, max_body_bytes=1 << 20):
    return Forwarder(
        FakeHandle(responses, {"method_name": "forward_http", "stream": True}), max_body_bytes, "x_session_id"
    )


def client(body=BODY, disconnect_after=None):
    """An ASGI receive that gives `body` in two chunks, then waits (or disconnects after
    `disconnect_after` seconds)."""
    chunks = [
        {"type": "http.request", "body": body[:5], "more_body": True},
        {"type": "http.request", "body": body[5:], "more_body": False},
    ]

    async def receive():
        if chunks:
            return chunks.pop(0)
        if disconnect_after is None:
            await asyncio.sleep(60)
        await asyncio.sleep(disconnect_after)
        return {"type": "http.disconnect"}

    sent = []

    async def send(message):
        sent.append(message)

    return receive, send, sent


def forward(ingress, request_scope, body=BODY, disconnect_after=None):
    receive, send, sent = client(body, disconnect_after)
    asyncio.run(asyncio.wait_for(ingress(request_scope, receive, send), 5))
    return sent


def test_a_request_without_a_session_goes_with_its_prompts_key():
    body_msgs = [
        START,
        {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True},
        {"type": "http.response.body", "body": b"", "more_body": False},
    ]
    ingress = make_ingress(FakeResponses(body_msgs))
    sent = forward(ingress, scope())
    assert sent == body_msgs
    options, forwarded, body = ingress.server.calls[0]
    assert options["session_id"] == prompt_affinity_key(CHAT, BODY) and body == BODY
    assert options["method_name"] == "forward_http" and options["stream"] is True
    assert "state" not in forwarded and forwarded["path"] == CHAT


def test_a_session_header_wins_over_the_prompt():
    assert request_key(scope(headers=[(b"X-Session-Id", b"conv-7")]), BODY, "x_session_id") == "conv-7"
    assert request_key(scope(headers=[(b"x_session_id", b"conv-7")]), BODY, "x_session_id") == "conv-7"
    assert request_key(scope(headers=[(b"x-session-id", b"")]), BODY, "x_session_id") == request_key(
        scope(), BODY, "x_session_id"
    )


def test_a_request_without_a_key_goes_without_a_session():
    ingress = make_ingress(FakeResponses([START]))
    forward(ingress, scope(path="/v1/models", method="GET"), body=b"")
    assert "session_id" not in ingress.server.calls[0][0]


def test_under_a_route_prefix_the_path_is_keyed_without_it():
    prefixed = {**scope(path="/p" + CHAT), "root_path": "/p"}
    assert request_key(prefixed, BODY, "x_session_id") == prompt_affinity_key(CHAT, BODY)


def test_a_failure_before_the_response_starts_is_a_503():
    ingress = make_ingress(FakeResponses([], fail=RuntimeError("replica died")))
    sent = forward(ingress, scope())
    assert sent[0]["status"] == 503 and json.loads(sent[1]["body"])["error"]["code"] == "replica_unavailable"


def test_a_failure_mid_stream_ends_the_body():
    ingress = make_ingress(FakeResponses([START], fail=RuntimeError("replica died")))
    sent = forward(ingress, scope())
    assert sent == [START, {"type": "http.response.body", "body": b"", "more_body": False}]


def test_a_client_that_leaves_cancels_the_forwarded_call():
    responses = FakeResponses([START], hang=True)
    sent = forward(make_ingress(responses), scope(), disconnect_after=0.05)
    assert sent == [START] and responses.cancelled


def test_a_cancelled_forward_cancels_the_forwarded_call():
    responses = FakeResponses([START], hang=True)
    receive, send, sent = client()

    async def cancel_soon():
        task = asyncio.ensure_future(make_ingress(responses)(scope(), receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_soon())
    assert sent == [START] and responses.cancelled


def test_a_finished_request_cancels_nothing():
    responses = FakeResponses([START, {"type": "http.response.body", "body": b"", "more_body": False}])
    forward(make_ingress(responses), scope())
    assert not responses.cancelled


def test_the_body_read_stops_past_the_limit():
    receive, _, _ = client(b"x" * 100)
    assert len(asyncio.run(read_body(receive, 10))) == 11  # enough for the server to say 413


def streaming_app(seen):
    async def stream(request):
        async def chunks():
            for i in range(100):
                yield f"{i}\n"
                await asyncio.sleep(0.01)

        seen["body"] = await request.body()
        return StreamingResponse(chunks())

    async def plain(request):
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route("/stream", stream, methods=["POST"]), Route("/plain", plain)])


def test_the_front_door_answers_lifespan():
    messages = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message["type"])

    asyncio.run(make_ingress(FakeResponses([]))({"type": "lifespan"}, receive, send))
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_run_asgi_yields_what_the_app_sends():
    async def collect():
        return [m async for m in run_asgi(streaming_app({}), scope(path="/plain", method="GET"), b"")]

    messages = asyncio.run(collect())
    assert messages[0]["status"] == 200 and json.loads(messages[1]["body"]) == {"ok": True}


def test_run_asgi_gives_the_body_and_tells_the_app_when_the_reader_leaves():
    seen = {}

    async def read_three():
        gen = run_asgi(streaming_app(seen), scope(path="/stream"), b"the body")
        messages = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()  # the client left: the app sees http.disconnect and stops
        return messages

    messages = asyncio.run(asyncio.wait_for(read_three(), 5))
    assert seen["body"] == b"the body" and messages[1]["body"] == b"0\n"
