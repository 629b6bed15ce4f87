"""Where Ray's and Serve's own start goes on this machine, without specslot: the imports,
`ray.init` as the CLI calls it (a local instance, no dashboard), `serve.start` (controller and
HTTP proxy) and two `num_cpus: 0` actors, each timed, in one process; `--profile` adds the
functions `ray.init` spent its time in (docs/gpu.md, "Known issues": cold start).

    python -m scripts.experiments.ray_start
    RAY_prestart_worker_first_driver=0 python -m scripts.experiments.ray_start
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="profile ray.init (top functions by cumulative time)")
    ap.add_argument("--num-cpus", type=int, default=None, help="ray.init's num_cpus (default: Ray's, every core)")
    ap.add_argument("--port", type=int, default=8123, help="the HTTP proxy's port")
    args = ap.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only, as the CLI
    mark = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        print(f"{name}: {now - mark:.2f} s", flush=True)
        mark = now

    import ray

    lap("import ray")
    import ray.serve

    lap("import ray.serve")
    from ray.serve.scripts import cli  # noqa: F401  (what the CLI imports before serve run)

    lap("import ray.serve.scripts")
    profile = cProfile.Profile() if args.profile else None
    if profile:
        profile.enable()
    ray.init(address="local", namespace="serve", include_dashboard=False, num_cpus=args.num_cpus)
    if profile:
        profile.disable()
    lap("ray.init")
    if profile:
        pstats.Stats(profile).sort_stats("cumulative").print_stats(15)
        mark = time.perf_counter()
    from ray import serve

    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, proxy_location="HeadOnly")
    lap("serve.start (controller and proxy)")

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self) -> int:
            return os.getpid()

    for name in ("a num_cpus: 0 actor", "another"):
        ray.get(Probe.remote().pid.remote())
        lap(name)
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
