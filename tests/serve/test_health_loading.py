"""/health while the replica loads: 503 with an OpenAI error body at once, 200 when ready,
503 `model_load_failed` naming the fault when loading failed (the real `load_replica`).
/v1 requests wait for the load instead (Serve routes to a replica that is still loading)."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from serve_app.app import load_replica
from serve_app.configuration.args import ServeArgs
from serve_app.openai.http import OpenAIService

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TARGET = os.path.join(REPO, "models", "bundled", "target")


class SlowStartClient:
    """An EngineClient stand-in whose scheduler starts when the test says so."""

    def __init__(self):
        self.may_start = asyncio.Event()
        self.info, self.healthy, self.num_open_streams, self.num_restarts = {}, False, 0, 0
        self.num_events_merged = 0
        self.started = False

    async def start(self):
        self.started = True
        await self.may_start.wait()
        self.info = {"max_context": 512, "eos_token_ids": [0], "spec_off_reason": None, "fuse_blocker": None}
        self.healthy = True


def make_service(client, model=TARGET):
    args = ServeArgs.model_validate({"model": model, "served_model_name": "tiny", "drafter": {"kind": "ngram"}})
    service = OpenAIService(client, None, args)
    return service, httpx.AsyncClient(transport=httpx.ASGITransport(app=service.app()), base_url="http://t")


def test_health_is_503_at_once_while_loading_and_200_when_ready():
    async def go():
        client = SlowStartClient()
        service, http = make_service(client)
        loading = asyncio.create_task(load_replica(service))
        async with http:
            while not client.started:  # the tokenizer loads first, on a thread
                await asyncio.sleep(0.01)
            started = time.monotonic()
            loading_health = await http.get("/health")
            elapsed = time.monotonic() - started
            models = asyncio.create_task(http.get("/v1/models"))
            await asyncio.sleep(0.1)
            models_waited = not models.done()
            client.may_start.set()
            await loading
            ready_health = await http.get("/health")
            return loading_health, elapsed, models_waited, await models, ready_health

    loading_health, elapsed, models_waited, models, ready_health = asyncio.run(go())
    assert loading_health.status_code == 503 and elapsed < 1.0
    assert loading_health.json()["error"]["code"] == "model_loading"
    assert loading_health.json()["error"]["type"] == "server_error"
    assert loading_health.headers["retry-after"] == "1"
    assert models_waited and models.status_code == 200
    assert ready_health.status_code == 200
    body = ready_health.json()
    assert set(body.pop("replica_startup_s")) == {"tokenizer"}  # built beside the (stand-in) actor
    assert body == {
        "status": "ok",
        "model": "tiny",
        "drafter": "ngram",
        "speculation": "on",
        "speculation_reason": "fused tick",
    }


def test_a_missing_model_fails_our_check_before_the_tokenizer_or_hub(monkeypatch):
    import serve_app.app

    def no_tokenizer(path):
        raise AssertionError("the tokenizer loaded before the path check")

    monkeypatch.setattr(serve_app.app.TextCodec, "from_path", staticmethod(no_tokenizer))

    async def go():
        client = SlowStartClient()
        service, http = make_service(client, model="/nonexistent/target")
        await load_replica(service)
        async with http:
            return client, service, await http.get("/health")

    client, service, health = asyncio.run(go())
    assert not client.started
    assert service.load_error == "target model path '/nonexistent/target' does not exist"
    assert health.status_code == 503
    assert health.json()["error"] == {
        "message": service.load_error,
        "type": "server_error",
        "param": None,
        "code": "model_load_failed",
    }


@pytest.mark.parametrize(
    "error_text, expected",
    [
        ("target model at '/m' failed to load: bad header", "target model at '/m' failed to load: bad header"),
        (
            "The actor died because of an error raised in its creation task\nTraceback ...\n"
            '  File "x"\nRuntimeError: out of memory',
            "out of memory",
        ),
    ],
)
def test_a_failed_scheduler_start_is_one_line(error_text, expected):
    class FailingClient(SlowStartClient):
        async def start(self):
            raise RuntimeError(error_text)

    async def go():
        service, http = make_service(FailingClient())
        async with http:
            waiting = asyncio.create_task(http.get("/v1/models"))
            await load_replica(service)
            return service, await waiting

    service, waiting = asyncio.run(go())
    assert service.load_error == expected
    assert waiting.status_code == 503 and waiting.json()["error"]["code"] == "model_load_failed"
