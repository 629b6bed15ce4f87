"""Ray Serve application: the `SpecslotServer` deployment and `build_app(args)`.

YAML configs point `import_path` at `serve_app.app:build_app`; `args` is validated by
`ServeArgs` and the models are found (directories checked, hub ids looked up in the local
Hugging Face cache) before anything starts. Each replica owns exactly one scheduler actor
(`serve_app.deployment.actor`), tokenizes on its own side, and serves the Starlette app from
`serve_app.openai.http`. The replica loads in the background, so
`/health` answers 503 (model loading) at once and 200 when ready, while /v1 requests
wait for the load; a failed load is reported by `/health` and the health check. `user_config` may carry the
live knobs of
`LiveConfig`. With `affinity_routing`, each replica records the session ids it serves and
reports them to every router as Serve routing stats (`serve_app.deployment.served_keys`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

import models  # noqa: F401  (fast BLAS before anything imports mlx)
from models.platform import startup
from serve_app.configuration.args import (  # noqa: F401 (validate_*: re-exported)
    ConfigError,
    ServeArgs,
    read_chat_template,
    validate_args,
    validate_user_config,
)
from serve_app.deployment.actor import ActorSource, prestart_name
from serve_app.deployment.client import EngineClient
from serve_app.deployment.ingress import SpecslotIngress, run_asgi
from serve_app.deployment.ready import last_error_line
from serve_app.deployment.served_keys import ServedKeys
from serve_app.openai.codec import TextCodec
from serve_app.openai.http import OpenAIService
from serve_app.openai.sampling_defaults import read_generation_config

logger = logging.getLogger("ray.serve")

DEPLOYMENT_NAME = "SpecslotServer"


DEPLOYMENT_OPTIONS = dict(
    name=DEPLOYMENT_NAME,
    # Serve's router is priority-blind: let requests through so they wait in our lanes.
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=5,
    graceful_shutdown_timeout_s=5,
)


class SpecslotReplica:
    """One replica: a scheduler actor and the OpenAI app over it. Deployed as
    `SpecslotServer`, Serve's HTTP ingress, or behind `SpecslotIngress` as
    `SpecslotBackend` (same deployment name; an application has one ASGI ingress), which
    serves HTTP only through `forward_http`."""

    async def __init__(self, args: dict) -> None:
        self.args = validate_args(args)
        identity = _identity()
        app_name = serve.get_replica_context().app_name
        source = ActorSource(
            self.args,
            name_prefix=f"scheduler-{identity['replica_id']}",
            prestarted=prestart_name(app_name, None),
        )
        self.client = EngineClient(source)
        self.service = OpenAIService(self.client, None, self.args, identity=identity)
        self._forwarded_app = None
        # The affinity keys served here, reported to every router (`record_routing_stats`).
        self.served_keys = ServedKeys() if self.args.affinity_routing else None
        # Not awaited: the replica must answer /health (503, loading) while this runs.
        self._loading = asyncio.get_running_loop().create_task(load_replica(self.service, startup.process_age()))

    def __serve_build_asgi_app__(self):
        app = self.service.app()

        async def recording_app(scope, receive, send):
            if scope["type"] == "http":
                self._record_key()
            await app(scope, receive, send)

        return recording_app

    async def forward_http(self, scope: dict, body: bytes):
        """One HTTP request forwarded by `SpecslotIngress` (`affinity_key: prompt`): the
        same app as behind Serve's proxy; yields the ASGI messages it sends."""
        self._record_key()
        if self._forwarded_app is None:
            self._forwarded_app = self.service.app()
        async for message in run_asgi(self._forwarded_app, scope, body):
            yield message

    async def record_routing_stats(self) -> dict:
        """Serve polls this every `affinity_stats_period_s` and hands the result to every
        router as the replica's `routing_stats` (`serve_app.deployment.served_keys`). Async: it runs
        on the event loop that records the keys, never beside it in a thread."""
        return {} if self.served_keys is None else self.served_keys.report(time.time())

    def _record_key(self) -> None:
        """Note the affinity key the router routed this request by: its Serve session id,
        read from Serve's request context (Serve has no public accessor for it)."""
        if self.served_keys is not None:
            self.served_keys.record(serve.context._get_serve_request_context().session_id, time.time())

    async def reconfigure(self, user_config: dict) -> None:
        """Live `grant_rounds` / `skip_cap` / `tick_slice` / `backlog_cap`; next grant."""
        changes = validate_user_config(user_config).changes()
        await self.client.reconfigure(changes)
        logger.info("specslot reconfigured: %s", changes)

    async def check_health(self) -> None:
        """Healthy while loading; a failed load or a stopped pump asks Serve for a new replica."""
        if self.service.load_error is not None:
            raise RuntimeError(self.service.load_error)
        if self.service.ready and not self.client.healthy:
            raise RuntimeError("scheduler event pump stopped")

    async def __del__(self) -> None:
        # __init__ may have failed before the client existed; nothing to close then.
        if getattr(self, "client", None) is not None:
            self._loading.cancel()
            await self.client.close()


SpecslotServer = serve.deployment(**DEPLOYMENT_OPTIONS)(serve.ingress()(SpecslotReplica))
SpecslotBackend = serve.deployment(**DEPLOYMENT_OPTIONS)(SpecslotReplica)


async def load_replica(service: OpenAIService, process_s: float | None = None) -> None:
    """Find the models, then start the scheduler and load the tokenizer side by side;
    then mark the service ready, or record the error (one log line) for /health and
    check_health. `process_s`: how long this replica's process ran before it (for the
    start line, with the tokenizer's seconds)."""
    args = service.args
    try:
        # Before transformers could try the hub, off the event loop (a download may take
        # minutes); the draft too, so the actor finds both in this node's cache.
        target_dir, _ = await asyncio.to_thread(args.model_dirs)
        template = read_chat_template(args.chat_template)  # build_app has inlined a file's text
        # The scheduler actor loads the models while this process builds the tokenizer.
        starting = asyncio.ensure_future(service.client.start())
        try:
            tic = time.perf_counter()
            await asyncio.to_thread(startup.transformers_without_torch)  # before the tokenizer's import
            codec = await asyncio.to_thread(TextCodec.from_path, target_dir, template, args.tool_call_format)
            generation_config = read_generation_config(target_dir)
            tokenizer_s = time.perf_counter() - tic
        except BaseException:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            raise
        await starting
        own = {"replica process": process_s, "tokenizer": tokenizer_s}
        service.client.info["replica_startup_s"] = {name: s for name, s in own.items() if s is not None}
    except Exception as exc:  # ModelLoadError, or the scheduler actor could not start
        service.fail_load(last_error_line(str(exc)))
        logger.error("specslot failed to load: %s", service.load_error)
        return
    service.mark_ready(codec, generation_config)


def _identity() -> dict:
    import ray

    return {
        "replica_id": serve.get_replica_context().replica_id.unique_id,
        "node_id": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
    }


def build_app(args: dict) -> Application:
    """The application a YAML config's `import_path` names: `SpecslotServer`, or
    `SpecslotIngress` in front of `SpecslotBackend` when `affinity_key` is `prompt` (a
    YAML `deployments` entry named SpecslotServer configures either). Validates `args` and finds
    the models first (raises ConfigError / ModelLoadError), so a bad path, an unreadable
    chat template file or a hub id missing from the cache fails here, once, and not in
    every replica; with `allow_download` a missing hub id is downloaded here."""
    serve_args = deployment_args(args)
    serve_args.model_dirs()
    # The proxy routes before the body is read: for prompt keys a front deployment reads it.
    prompt_keyed = serve_args.affinity_routing and serve_args.affinity_key == "prompt"
    deployment = SpecslotBackend if prompt_keyed else SpecslotServer
    if serve_args.affinity_routing:
        deployment = deployment.options(request_router_config=affinity_router_config(serve_args))
    server = deployment.bind(serve_args.model_dump(mode="json"))
    if prompt_keyed:
        return SpecslotIngress.bind(server, serve_args.max_body_bytes)
    return server


def deployment_args(args: dict) -> ServeArgs:
    """The args `build_app` binds its deployment to (relative paths resolved against
    the directory the service starts in)."""
    return validate_args(args).with_resolved_paths(Path.cwd())


def replica_args(args: dict) -> ServeArgs:
    """The args a replica of `build_app(args)` holds, and hands its scheduler actor."""
    return validate_args(deployment_args(args).model_dump(mode="json"))


def affinity_router_config(args: ServeArgs) -> RequestRouterConfig:
    """Serve's request router for `affinity_routing` (by path: the proxy imports it)."""
    from serve_app.deployment.router import ROUTER_PATH

    return RequestRouterConfig(
        request_router_class=ROUTER_PATH,
        request_router_kwargs={"load_margin": args.affinity_load_margin},
        request_routing_stats_period_s=args.affinity_stats_period_s,
    )
