"""`python -m serve_app.cli [config.yaml]`: `serve run` with clean shutdown on signals.

Starts a local Ray instance (no dashboard, loopback only) unless RAY_ADDRESS is set, then hands the
config to `serve run`. SIGTERM and SIGINT both lead to `serve.shutdown()` (replicas
stop their scheduler actors) followed by Ray's own shutdown, even when the process was
started in the background with SIGINT ignored.
"""

from __future__ import annotations

import os
import signal
import sys

DEFAULT_CONFIG = "configs/local.yaml"


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config = argv[0] if argv else DEFAULT_CONFIG
    if not os.path.isfile(config):
        print(f"no such config file: {config}", file=sys.stderr)
        return 2

    if not os.environ.get("RAY_ADDRESS"):
        # A local Ray instance stays on loopback (Ray otherwise binds its services to the
        # host's routable IP); the HTTP address comes from the config's http_options.
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import models  # noqa: F401  (fast BLAS before anything imports mlx)
    import ray
    from ray.serve.scripts import cli

    if not ray.is_initialized():
        # "local" always starts a fresh instance: with no address, ray.init joins the
        # cluster recorded under /tmp/ray, which may be another user's or a dead one.
        ray.init(address=os.environ.get("RAY_ADDRESS") or "local", namespace="serve",
                 include_dashboard=False)
    # After ray.init, which installs its own SIGTERM handler (a bare sys.exit).
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        cli.main(["run", config], prog_name="serve", standalone_mode=False)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
