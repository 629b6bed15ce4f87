"""What `python -m serve_app.cli` does around `serve run`: check first, then watch.

`Checks` validates every specslot application of a config in-process before Ray starts
(`quick_check`), so a bad arg or a missing model path fails in about a second with one
message; building each app (`build_apps`: finding, hashing and converting the models) and
the kernel prebuild then run on a thread while Ray starts. Once Ray is up, for a Ray instance
on this machine, `prestart_schedulers` starts each application's scheduler actors before Serve
does, so the models load while Serve's controller, proxy and replicas start; each replica
claims one (`serve_app.deployment.actor`). `wait_until_ready` then polls each
application's /health on loopback until it answers 200 (logging the ready line) or reports
a failed load, or Serve marks the application failed.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from serve_app.deployment.ready import last_error_line, ready_line, startup_line

logger = logging.getLogger("specslot")

IMPORT_PATH = "serve_app.app:build_app"
FAILED_STATUSES = ("DEPLOY_FAILED", "UNHEALTHY")


class LaunchError(Exception):
    """The config is unusable or an application failed; the message is for operators."""


@dataclass(frozen=True)
class AppTarget:
    name: str
    base_url: str  # as operators reach it, from http_options
    probe_url: str  # /health on 127.0.0.1, whatever host the proxy binds


def read_config(path: str) -> dict:
    """The YAML as Serve validates it; raises LaunchError with pydantic's message."""
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    try:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        ServeDeploySchema.model_validate(config)
    except (OSError, yaml.YAMLError, ValidationError) as exc:
        raise LaunchError(f"invalid Serve config {path}: {exc}") from None
    return config


def _specslot_apps(config: dict) -> list[dict]:
    return [app for app in config.get("applications", []) if app.get("import_path") == IMPORT_PATH]


def _checked(app: dict, check: Callable[[], object]):
    """`check()`, with a bad config or model as a LaunchError naming the application
    (anything else is a bug: let it show)."""
    from models.loading.checks import ModelLoadError
    from serve_app.configuration.args import ConfigError

    try:
        return check()
    except (ConfigError, ModelLoadError) as exc:
        raise LaunchError(f"application {app.get('name')!r}: {exc}") from None


def quick_check(config: dict) -> list:
    """Each specslot app's args and user_config validated, and its model sources checked
    where no weights are read and nothing is downloaded (`ServeArgs.check_sources`), without
    importing Ray Serve; returns the apps' `ServeArgs`."""
    from serve_app.configuration.args import validate_args, validate_user_config

    def check(app: dict):
        args = validate_args(app.get("args"))
        for deployment in app.get("deployments", []):
            validate_user_config(deployment.get("user_config"))
        args.with_resolved_paths(Path.cwd()).check_sources()
        return args

    return [_checked(app, lambda app=app: check(app)) for app in _specslot_apps(config)]


def build_apps(config: dict) -> None:
    """Build each specslot app, as Serve would, but here: the models found, hashed and
    converted (`build_app`)."""
    from serve_app.app import build_app

    for app in _specslot_apps(config):
        _checked(app, lambda app=app: build_app(app.get("args") or {}))


class Checks:
    """`quick_check` here, so a bad arg or a missing path fails before anything starts;
    then `build_apps` and, for a Ray instance on this machine, `prebuild_kernels`, on a
    thread while Ray starts. `result()` waits for them."""

    def __init__(self, config: dict, prebuild: bool) -> None:
        self.apps = quick_check(config)  # the apps' validated `ServeArgs`
        self.seconds: float | None = None  # how long the thread took, once done
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config, prebuild), name="specslot-checks", daemon=True)
        self._thread.start()

    def _run(self, config: dict, prebuild: bool) -> None:
        tic = time.perf_counter()
        try:
            build_apps(config)
            if prebuild:
                prebuild_kernels(self.apps)
        except BaseException as exc:  # handed to result(), on the main thread
            self._error = exc
        self.seconds = time.perf_counter() - tic

    def result(self) -> list:
        """The apps' `ServeArgs` once the checks are done; raises what they raised."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.apps


def prebuild_kernels(apps: list) -> int:
    """Start building each app's first GPU kernel families (`prebuild_kernels`) on this
    machine now, for the replicas the local Ray instance about to start will run here:
    they build while Ray, Serve and the replica's process start, and the replica finds
    its cache being filled (`models.platform.kernel_prebuild`). Returns how many builds
    started; none without an NVIDIA GPU or where the cache holds kernels."""
    from models.platform import kernel_cache

    started, seen = 0, set()
    for args in apps:
        key = (args.kernel_cache_dir, args.model)
        if not args.prebuild_kernels or key in seen:
            continue
        seen.add(key)
        started += kernel_cache.prebuild(kernel_cache.home_dir(args.kernel_cache_dir), args.model) is not None
    return started


# Below this many cores the actor's load and Serve's start compete for them: prestarting
# gained nothing on 2 cores and measured the tick costs on a busy machine.
PRESTART_MIN_CORES = 4


def prestart_count(app: dict) -> int:
    """How many scheduler actors to prestart for `app`: one per replica of a fixed
    replica count; none where Serve decides the count (autoscaling) or the app or its
    deployment sets a runtime_env (its actor would run elsewise than the replica's)."""
    if app.get("runtime_env"):
        return 0
    count = 1
    for deployment in app.get("deployments") or []:
        if deployment.get("name") not in (None, "SpecslotServer"):
            continue
        if deployment.get("autoscaling_config") or (deployment.get("ray_actor_options") or {}).get("runtime_env"):
            return 0
        count = deployment.get("num_replicas", 1)
    return count if isinstance(count, int) and count > 0 else 0


def prestart_schedulers(config: dict) -> list:
    """Start each specslot application's scheduler actors now, on this node, named for
    their application (`actor.prestart_name`) and with the args its replicas will hold
    (`replica_args`): they load while Serve starts, and each replica claims one. Returns
    their handles; this process owns them, so they go with it unless a replica claims them."""
    import ray

    from serve_app.app import replica_args
    from serve_app.deployment.actor import SchedulerActor, actor_options, prestart_name

    node_id = ray.get_runtime_context().get_node_id()
    handles = []
    for app in _specslot_apps(config):
        args = _checked(app, lambda app=app: replica_args(app.get("args") or {}))
        for i in range(prestart_count(app)):
            options = actor_options(args, node_id, prestart_name(app.get("name", "default"), i))
            handles.append(ray.remote(SchedulerActor).options(**options).remote(args.model_dump(mode="json")))
    return handles


def release_unclaimed(handles: list, timeout_s: float = 10.0) -> int:
    """Stop the prestarted actors no replica claimed (they hold a model, maybe a GPU);
    returns how many."""
    import ray

    stopped = 0
    for handle in handles:
        try:
            claimed = ray.get(handle.claimed.remote(), timeout=timeout_s)
        except Exception:  # dead already, or stuck: either way not serving
            claimed = False
        if not claimed:
            ray.kill(handle, no_restart=True)
            stopped += 1
    return stopped


def app_targets(config: dict) -> list[AppTarget]:
    http = config.get("http_options") or {}
    host, port = http.get("host", "127.0.0.1"), http.get("port", 8000)
    targets = []
    for app in config.get("applications", []):
        prefix = (app.get("route_prefix") or "/").rstrip("/")
        targets.append(
            AppTarget(
                app.get("name", "default"), f"http://{host}:{port}{prefix}", f"http://127.0.0.1:{port}{prefix}/health"
            )
        )
    return targets


def probe_health(url: str) -> tuple[int, dict] | None:
    """(status, JSON body) of one GET; None while nothing answers or the body is not JSON."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())
        except ValueError:
            return err.code, {}
    except (OSError, ValueError):
        return None


def serve_app_statuses() -> dict[str, tuple[str, str]]:
    from ray import serve

    return {name: (str(app.status), app.message or "") for name, app in serve.status().applications.items()}


def wait_until_ready(
    targets: list[AppTarget],
    probe: Callable[[str], tuple[int, dict] | None] = probe_health,
    statuses: Callable[[], dict[str, tuple[str, str]]] = serve_app_statuses,
    interval_s: float = 0.5,
    phases: dict[str, float] | None = None,
    beside: dict[str, dict[str, float]] | None = None,
) -> list[str]:
    """Block until every app's /health is 200; log and return one ready line per app.
    `phases`: the seconds the CLI spent before this, by phase; with them, each ready line
    is followed by where the start went (`startup_line`; the wait is its "replica" phase),
    and `beside`, what ran alongside a phase.
    Raises LaunchError on a failed model load or a failed Serve application."""
    waiting = time.perf_counter()
    pending = {t.name: t for t in targets}
    lines = []
    while pending:
        for name, (status, message) in statuses().items():
            if name in pending and status.rsplit(".", 1)[-1] in FAILED_STATUSES:
                raise LaunchError(f"application {name!r} failed: {last_error_line(message)}")
        for name, target in list(pending.items()):
            answer = probe(target.probe_url)
            if answer is None:
                continue
            code, body = answer
            error = body.get("error") if isinstance(body, dict) else None
            if code == 503 and isinstance(error, dict) and error.get("code") == "model_load_failed":
                raise LaunchError(f"application {name!r} failed to load: {error.get('message')}")
            if code == 200:
                lines.append(ready_line(target.base_url, body))
                logger.info(lines[-1])
                if phases is not None:
                    logger.info(startup_line({**phases, "replica": time.perf_counter() - waiting}, body, beside))
                del pending[name]
        if pending:
            time.sleep(interval_s)
    return lines
