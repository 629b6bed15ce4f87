"""The HTTP layer without Ray: a scripted EngineClient behind the real Starlette app."""

from __future__ import annotations

import asyncio

import httpx

from scheduler.events import TokenEvent
from scheduler.ledger import QueueFull
from scheduler.request import SpecStats
from serve_app.configuration.args import ServeArgs
from serve_app.openai.http import OpenAIService


class ScriptedClient:
    """Answers every request with `script` (token id lists), recording what it saw."""

    def __init__(self, script, eos=0, full=False, cached=0, finish="length"):
        self.script = script
        self.finish = finish  # the last event's finish_reason
        self.cached = cached  # the finishing event's num_cached_tokens
        self.info = {"max_context": 512, "eos_token_ids": [eos]}
        self.full = full
        self.submitted, self.cancelled = [], []
        self.healthy, self.num_open_streams, self.num_restarts, self.num_events_merged = True, 0, 0, 0

    async def submit(self, request):
        if self.full:
            raise QueueFull()
        self.submitted.append(request)
        return self._events(request)

    async def _events(self, request):
        for i, ids in enumerate(self.script):
            await asyncio.sleep(0.01)
            last = i == len(self.script) - 1
            yield TokenEvent(
                request.request_id,
                ids,
                self.finish if last else None,
                stats=SpecStats(num_rounds=2, num_drafted=6, num_accepted=4) if last else None,
                num_cached_tokens=self.cached if last else 0,
            )

    async def cancel(self, request_id):
        self.cancelled.append(request_id)

    def release(self, request_id):
        pass

    async def snapshot(self):
        return {"counters": {"grants": 1}}


def make_app(codec, client, **args):
    service = OpenAIService(client, codec, ServeArgs.model_validate({"model": "m", **args}))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=service.app()), base_url="http://t")


def run(coro):
    return asyncio.run(coro)
