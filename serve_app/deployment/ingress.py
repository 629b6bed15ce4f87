"""The prompt-keyed front door: a thin deployment in front of `SpecslotServer` that
reads each request's body, gives it an affinity key, and forwards it through a
deployment handle, so that `serve_app.deployment.router` can keep a conversation on its replica
even when the client sends no session id.

Serve's HTTP proxy routes a request before reading its body, so the proxy's router sees
only headers. Here the body is in hand: the key is the session id (Serve's session
header, `X-Session-Id` unless `RAY_SERVE_SESSION_ID_HEADER_KEY` renames it) when the
request has one, else `serve_app.deployment.prompt_key.prompt_affinity_key` (a hash of the
prompt's leading messages), else none. The handle call carries the key as its
`session_id`, which the router reads. `build_app` puts this deployment in front when
`affinity_key` is `prompt`.

The request travels as (scope, body); the replica runs its own Starlette app on it
(`run_asgi`) and streams the ASGI messages back, which this deployment sends on
unchanged: status, headers (`X-Specslot-Replica` included) and body chunks as they come.
A client that goes away cancels the forwarded call; the replica's app then sees
`http.disconnect`, as it would behind the proxy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import AsyncIterator

from ray import serve
from ray.serve.handle import DeploymentHandle

from serve_app.deployment.prompt_key import prompt_affinity_key

logger = logging.getLogger("ray.serve")

INGRESS_NAME = "SpecslotIngress"
APP_EXIT_GRACE_S = 2.0  # after a disconnect, the app's time to cancel its request
SCOPE_KEYS = (
    "type",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "root_path",
    "query_string",
    "headers",
    "client",
    "server",
)


def session_header_name() -> str:
    """Serve's session header, normalized (lower case, `_` for `-`) as Serve matches it."""
    return os.environ.get("RAY_SERVE_SESSION_ID_HEADER_KEY", "x-session-id").lower().replace("-", "_")


def request_key(scope: dict, body: bytes, session_header: str) -> str | None:
    """The request's affinity key: its session id, else its prompt's key, else None."""
    for name, value in scope.get("headers", ()):
        if name.decode("latin-1").lower().replace("-", "_") == session_header and value:
            return value.decode("latin-1")
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return prompt_affinity_key(path, body)


async def read_body(receive, limit: int) -> bytes:
    """The request body, at most `limit` + 1 bytes (enough for the server to answer 413)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        if size <= limit:
            chunks.append(chunk[: limit + 1 - size])
            size += len(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


class Forwarder:
    """The front door's ASGI app: read the body, key the request, forward it through
    `server` (a handle to the replicas' `forward_http`, streaming) and send back what
    the replica's app sends. No Serve here: `server` is any handle-like object."""

    def __init__(self, server, max_body_bytes: int, session_header: str) -> None:
        self.server = server
        self.max_body_bytes = max_body_bytes
        self.session_header = session_header

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
        elif scope["type"] == "http":
            await self.forward(scope, receive, send)

    async def forward(self, scope, receive, send) -> None:
        try:
            body = await read_body(receive, self.max_body_bytes)
        except ConnectionAbortedError:
            return
        key = request_key(scope, body, self.session_header)
        handle = self.server.options(session_id=key) if key else self.server
        forwarded = {k: scope[k] for k in SCOPE_KEYS if k in scope}
        responses = handle.remote(forwarded, body)
        gone = asyncio.ensure_future(_wait_disconnect(receive))
        started = finished = False
        try:
            async for message in _until(responses, gone):
                started = started or message["type"] == "http.response.start"
                finished = message["type"] == "http.response.body" and not message.get("more_body", False)
                await send(message)
        except Exception as exc:  # noqa: BLE001 - the replica died or refused: answer what we can
            logger.warning("forwarding %s %s failed: %r", scope.get("method"), scope.get("path"), exc)
            if not started:
                await _send_unavailable(send)
            else:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            if not finished:  # the client left (or this task was cancelled): stop the replica's work
                responses.cancel()


@serve.deployment(
    name=INGRESS_NAME, max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0}, graceful_shutdown_timeout_s=5
)
@serve.ingress()
class SpecslotIngress:
    def __init__(self, server: DeploymentHandle, max_body_bytes: int) -> None:
        self.forwarder = Forwarder(
            server.options(method_name="forward_http", stream=True), max_body_bytes, session_header_name()
        )

    def __serve_build_asgi_app__(self):
        return self.forwarder


async def run_asgi(app, scope: dict, body: bytes) -> AsyncIterator[dict]:
    """Run ASGI `app` on one request whose body is `body`; yield what it sends. Closing
    this generator early (the client left) makes the app's `receive` answer
    `http.disconnect`, then cancels the app if it has not ended within a grace period."""
    scope = {**scope, "asgi": {"version": "3.0", "spec_version": "2.3"}}
    messages: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body_sent = False

    async def receive() -> dict:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, messages.put)
        finally:
            messages.put_nowait(None)

    task = asyncio.ensure_future(run())
    try:
        while (message := await messages.get()) is not None:
            yield message
        await task  # an app that failed after its last message: raise here
    finally:
        left.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), APP_EXIT_GRACE_S)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001
                task.cancel()


async def _until(responses, gone: asyncio.Future) -> AsyncIterator[dict]:
    """The forwarded call's messages until it ends or the client disconnects."""
    iterator = responses.__aiter__()
    while True:
        step = asyncio.ensure_future(iterator.__anext__())
        done, _ = await asyncio.wait({step, gone}, return_when=asyncio.FIRST_COMPLETED)
        if step not in done:
            step.cancel()
            return
        try:
            yield step.result()
        except StopAsyncIteration:
            return


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send_unavailable(send) -> None:
    body = json.dumps(
        {
            "error": {
                "message": "no replica could serve the request; retry later",
                "type": "server_error",
                "param": None,
                "code": "replica_unavailable",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [(b"content-type", b"application/json"), (b"retry-after", b"1")],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _lifespan(receive, send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
