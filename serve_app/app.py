"""Ray Serve application: the `SpecslotServer` deployment and `build_app(args)`.

YAML configs point `import_path` at `serve_app.app:build_app`; `args` is validated by
`ServeArgs` before anything starts. Each replica owns exactly one scheduler actor
(`serve_app.actor`), tokenizes on its own side, and serves the Starlette app from
`serve_app.http`. `user_config` may carry the live knobs of `LiveConfig`.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import models  # noqa: F401  (fast BLAS before anything imports mlx)
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from serve_app.actor import ActorSource
from serve_app.client import EngineClient
from serve_app.codec import TextCodec
from serve_app.config import LiveConfig, ServeArgs, format_validation_error
from serve_app.http import OpenAIService
from serve_app.metrics import ReplicaMetrics

logger = logging.getLogger("ray.serve")

DEPLOYMENT_NAME = "SpecslotServer"


class ConfigError(ValueError):
    """Deployment args or user_config failed validation (message lists every problem)."""


def validate_args(args: dict | None) -> ServeArgs:
    try:
        return ServeArgs.model_validate(dict(args or {}))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def validate_user_config(user_config: dict | None) -> LiveConfig:
    try:
        return LiveConfig.model_validate(dict(user_config or {}))
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, prefix="user_config")) from None


@serve.deployment(
    name=DEPLOYMENT_NAME,
    # Serve's router is priority-blind: let requests through so they wait in our lanes.
    max_ongoing_requests=1024,
    ray_actor_options={"num_cpus": 0},
    health_check_period_s=5,
    graceful_shutdown_timeout_s=5,
)
@serve.ingress()
class SpecslotServer:
    async def __init__(self, args: dict) -> None:
        self.args = validate_args(args)
        self.codec = TextCodec.from_path(self.args.model)
        identity = _identity()
        source = ActorSource(self.args, num_gpus=self.args.actor_num_gpus,
                             name_prefix=f"scheduler-{identity['replica_id']}")
        self.client = EngineClient(source)
        await self.client.start()
        self.service = OpenAIService(self.client, self.codec, self.args, ReplicaMetrics(),
                                     identity=identity)

    def __serve_build_asgi_app__(self):
        return self.service.app()

    async def reconfigure(self, user_config: dict) -> None:
        """Live `grant_rounds` / `skip_cap` / `tick_slice` / `backlog_cap`; next grant."""
        changes = validate_user_config(user_config).changes()
        await self.client.reconfigure(changes)
        logger.info("specslot reconfigured: %s", changes)

    async def check_health(self) -> None:
        if not self.client.healthy:
            raise RuntimeError("scheduler event pump stopped")

    async def __del__(self) -> None:
        await self.client.close()


def _identity() -> dict:
    import ray

    return {"replica_id": serve.get_replica_context().replica_id.unique_id,
            "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}


def build_app(args: dict) -> Application:
    """The application a YAML config's `import_path` names; validates `args` first."""
    serve_args = validate_args(args).with_resolved_paths(Path.cwd())
    return SpecslotServer.bind(serve_args.model_dump(mode="json"))
