"""`python -m serve_app.cli [config.yaml]`: `serve run` that fails fast and says when it is ready.

Before Ray starts, every specslot application's args are checked in-process
(`serve_app.deployment.launch.Checks`): a bad arg or missing model path exits 1 with one
message. Then a local Ray instance (no dashboard, loopback only) starts unless RAY_ADDRESS
is set, while the models are found and each application is built on a thread (a model that
fails there exits 1 with one message once Ray has started, and Ray is shut down); on
that local instance, on a machine of 4 cores or more, each application's scheduler actors
start next, loading the models while Serve starts (`launch.prestart_schedulers`; each replica claims one);
`serve run --non-blocking` deploys the config, and the CLI waits for each app's /health:
it logs `specslot ready at http://HOST:PORT/v1 — model …` once loaded, or exits 1 with
the load error. SIGTERM and SIGINT both lead to `serve.shutdown()` (replicas stop their
scheduler actors; waited for at most SERVE_SHUTDOWN_S) followed by Ray's own shutdown,
even when the process was started in the background with SIGINT ignored, or the signal
went to the whole process group (Ray's daemons included).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

DEFAULT_CONFIG = "configs/local.yaml"
# The environment a Ray instance this CLI starts gets (unless already set), so its
# daemons and every worker they start (Serve's proxy included) inherit it:
# - RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps Ray's services on loopback (Ray otherwise
#   binds them to the host's routable IP); the HTTP address comes from http_options.
# - RAY_SERVE_PROXY_USE_GRPC=1: Serve's HTTP proxy sends each request to its replica,
#   and reads the streamed chunks back, over the replica's gRPC server instead of Ray
#   actor calls; per streamed token the proxy uses about half the CPU and the replica
#   about two thirds (docs/configuration.md, "HTTP proxy transport").
LOCAL_RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_SERVE_PROXY_USE_GRPC": "1"}
# Replicas stop their scheduler actors within this (graceful_shutdown_timeout_s is 5).
SERVE_SHUTDOWN_S = 7.0
RAY_SHUTDOWN_S = 2.0


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _fail(message: str) -> int:
    print(f"specslot: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = argv[0] if argv else DEFAULT_CONFIG
    if not os.path.isfile(config_path):
        print(f"no such config file: {config_path}", file=sys.stderr)
        return 2

    if not os.environ.get("RAY_ADDRESS"):
        for name, value in LOCAL_RAY_ENV.items():
            os.environ.setdefault(name, value)
    phases: dict[str, float] = {}  # where the start goes, logged with the ready line
    mark = [time.perf_counter()]

    def done(name: str) -> None:
        now = time.perf_counter()
        phases[name] = now - mark[0]
        mark[0] = now

    import models  # noqa: F401  (fast BLAS before anything imports mlx)
    from models.platform import _blas
    from serve_app.deployment.launch import (
        PRESTART_MIN_CORES,
        Checks,
        LaunchError,
        app_targets,
        prestart_schedulers,
        read_config,
        release_unclaimed,
        wait_until_ready,
    )

    _log_to_stderr()
    try:
        config = read_config(config_path)
        # The replicas of a Ray instance started here run on this machine: their kernels
        # build while Ray, Serve and the replica's process start.
        checks = Checks(config, prebuild=not os.environ.get("RAY_ADDRESS"))
    except LaunchError as exc:
        return _fail(str(exc))
    done("checks")

    import ray
    from ray.serve.scripts import cli

    connected_here = not ray.is_initialized()
    if connected_here:
        # "local" always starts a fresh instance: with no address, ray.init joins the
        # cluster recorded under /tmp/ray, which may be another user's or a dead one.
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", namespace="serve", include_dashboard=False)
    done("Ray")
    local = connected_here and not os.environ.get("RAY_ADDRESS")
    try:
        checks.result()
        # Their load overlaps Serve's start; on a joined cluster the replicas may run elsewhere.
        prestarted = prestart_schedulers(config) if local and _blas._usable_cores() >= PRESTART_MIN_CORES else []
    except BaseException as exc:
        if connected_here:  # a connection this process had before stays
            ray.shutdown()
        if isinstance(exc, LaunchError):
            return _fail(str(exc))
        raise
    if time.perf_counter() - mark[0] >= 0.05:  # the checks outlasted Ray's start
        done("model checks")
    beside = {"Ray": {"model checks": checks.seconds}}
    # After ray.init, which installs its own SIGTERM handler (a bare sys.exit).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    rc = 1  # what an unexpected exception exits with, after the shutdown below
    try:
        cli.main(["run", "--non-blocking", config_path], prog_name="serve", standalone_mode=False)
        done("Serve deploy")
        wait_until_ready(app_targets(config), phases=phases, beside=beside)
        release_unclaimed(prestarted)
        while True:  # serve until a signal; Ray streams the replicas' logs meanwhile
            time.sleep(3600)
    except LaunchError as exc:
        rc = _fail(str(exc))
    except KeyboardInterrupt:
        rc = 0
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 0
    finally:
        _shutdown(rc)
    return rc


def _shutdown(rc: int) -> None:
    import ray
    from ray import serve

    if _bounded(serve.shutdown, SERVE_SHUTDOWN_S, give_up=lambda: not _local_ray_intact()):
        ray.shutdown()
    elif not _bounded(ray.shutdown, RAY_SHUTDOWN_S):
        # Ray's daemons are gone (the signal went to the whole process group) and its
        # atexit hook would wait for them again: leave now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def _local_ray_intact() -> bool:
    """False when a Ray daemon this process started (raylet, GCS, ...) has died, as when
    the signal went to the whole process group: Serve cannot shut down gracefully then.
    Reads `ray._private.worker._global_node` (Ray is pinned); True for a joined cluster."""
    import ray._private.worker

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        return node is None or not node.dead_processes()
    except Exception:  # a Ray without this internal: assume intact, the timeout still bounds it
        return True


def _bounded(fn, timeout_s: float, give_up=lambda: False) -> bool:
    """Run `fn`; False if it is still running after `timeout_s` or once `give_up()`. When
    the whole process group got the signal, Ray's daemons are dying: serve.shutdown would
    wait 30 s for a controller that cannot answer, and ray.shutdown for a raylet."""
    worker = threading.Thread(target=fn, name=f"{fn.__name__}-bounded", daemon=True)
    worker.start()
    deadline = time.monotonic() + timeout_s
    while worker.is_alive() and time.monotonic() < deadline and not give_up():
        worker.join(0.2)
    if worker.is_alive():
        print(f"specslot: {fn.__module__}.{fn.__name__} did not return; Ray is going away", file=sys.stderr, flush=True)
    return not worker.is_alive()


def _log_to_stderr() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for name in ("specslot", "models.platform.kernel_prebuild"):  # the latter: helpers this process starts
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # Ray may configure the root logger too; print once


if __name__ == "__main__":
    sys.exit(main())
