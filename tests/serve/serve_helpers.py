"""Shared helpers of the serve tests: deploy an app on the session cluster, wait, connect."""

from __future__ import annotations

import os
import socket
import time

import httpx
import openai

from serve_app.app import build_app

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = "tiny"
PROMPT = "def parse(text):\n    "


def deploy(ray_cluster, tiny_pair, name, route, args=None, **options):
    from ray import serve

    target, draft = tiny_pair
    full_args = {
        "model": target,
        "served_model_name": MODEL,
        "drafter": {"kind": "draft_model", "path": draft},
        **(args or {}),
    }
    app = build_app(full_args)
    if options:
        # Over build_app's options (the request router), as a YAML `deployments` entry is.
        app = app._bound_deployment.options(**options).bind(*app._bound_deployment.init_args)
    serve.run(app, name=name, route_prefix=route, blocking=False)
    base = ray_cluster["base"] + (route if route != "/" else "")
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 120)
    return base


def wait_until(predicate, timeout_s, interval_s=0.1):
    deadline = time.monotonic() + timeout_s
    last_exc = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except Exception as exc:  # the service may still be starting
            last_exc = exc
        time.sleep(interval_s)
    raise AssertionError(f"condition not met within {timeout_s}s (last error: {last_exc!r})")


def oai(base, **kw):
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, **kw)


def new_router(app_name: str):
    """A handle to the app's `SpecslotServer.forward_http` with a router of its own
    (`serve.get_deployment_handle` returns one cached handle, one router), as another
    HTTP proxy or ingress replica has."""
    from ray.serve.handle import DeploymentHandle

    return DeploymentHandle("SpecslotServer", app_name).options(method_name="forward_http", stream=True)


def replica_serving(handle, session_id: str) -> str:
    """The replica `handle`'s router sends `session_id` to (a GET /metrics through it)."""
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": "/metrics",
        "raw_path": b"/metrics",
        "root_path": "",
        "query_string": b"",
        "headers": [],
    }
    messages = handle.options(session_id=session_id).remote(scope, b"")
    starts = [m for m in messages if m["type"] == "http.response.start"]
    return dict(starts[0]["headers"])[b"x-specslot-replica"].decode()
