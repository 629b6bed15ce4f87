"""The scheduler actor: one per replica, holding the model and the Engine.

The actor is a threaded Ray actor: `poll` blocks one of its threads in
`Engine.get_events`, while `submit` / `cancel` / `snapshot` run on others; all MLX work
stays on the Engine's own thread. The replica polls in a loop, so one round trip carries
every event of a tick for all of the replica's requests (the hop's cost per token:
docs/configuration.md, "Replica ↔ scheduler actor").

`ActorSource` is the replica side: it creates the actor on the replica's node (hard
affinity), and re-creates it when it dies. `python -m serve_app.cli` starts an
application's actors itself, right after Ray, so that they load while Serve starts
(`launch.prestart_schedulers`); a replica first claims one of those (`SchedulerActor.claim`)
and creates its own only when none is there for it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

from scheduler.ledger import QueueFull
from scheduler.request import Request
from serve_app.configuration.args import ServeArgs
from serve_app.deployment.client import SchedulerLost

logger = logging.getLogger(__name__)

ACTOR_MAX_CONCURRENCY = 8
ACTOR_NAMESPACE = "specslot"  # poll + submits/cancels/snapshots in flight at once
EXIT_DEVICE_LOST = 70  # the scheduler actor's exit status when its device is lost (EX_SOFTWARE)
CLAIMER_CHECK_S = 2.0  # how often a claimed prestarted actor looks for its replica


def prestart_name(app_name: str, index: int | None) -> str:
    """The name of the `index`-th scheduler actor the CLI starts for application
    `app_name`; with no index, the prefix every such name starts with."""
    return f"prestart-{app_name}-" + ("" if index is None else str(index))


def actor_options(args: ServeArgs, node_id: str, name: str | None) -> dict:
    """Ray options of a scheduler actor for `args`, on node `node_id` (hard affinity)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # num_cpus=0: the engine thread is the real CPU user and the replica is idle
    # glue; reserving cores here would make small machines unschedulable.
    return dict(
        num_cpus=0,
        num_gpus=args.actor_num_gpus,
        max_concurrency=ACTOR_MAX_CONCURRENCY,
        max_restarts=0,
        name=name,
        namespace=ACTOR_NAMESPACE if name else None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    )


def build_engine(args: ServeArgs):
    """An unstarted Engine whose runner is built (on the engine thread) from `args`.

    Returns (engine, info): `info` is filled with what the HTTP layer needs once the
    runner exists (after `engine.start()`).
    """
    from models.platform import kernel_cache, startup

    started = time.perf_counter()
    startup.reset()
    before = startup.process_age()  # the worker's own start and imports, before this call
    home = kernel_cache.use(args.kernel_cache_dir)  # before anything touches the GPU
    if args.prebuild_kernels:
        with startup.phase("kernel prebuild"):
            kernel_cache.prebuild(home, args.model)
    with startup.phase("imports"):
        import models  # noqa: F401  (fast BLAS before mlx)

        startup.transformers_without_torch()  # before mlx-lm imports transformers
        from scheduler.engine import Engine

    info: dict = {}

    def runner_factory():
        with startup.phase("imports"):  # mlx-lm and transformers: seconds of a fresh start
            from models.runner import MlxRunner, hardware_name

        drafter = args.drafter
        draft_note = f", draft {drafter.path}" if drafter.needs_weights else f", drafter {drafter.kind}"
        logger.info("loading target %s%s", args.model, draft_note)
        tic = time.perf_counter()
        from models.platform import device_memory

        device_memory.set_share(args.actor_num_gpus)  # a fraction of a GPU sizes its caches from it
        runner = MlxRunner.from_paths(args.model, **args.runner_args())
        logger.info(
            "loaded in %.1f s (device %s, %s batch)",
            time.perf_counter() - tic,
            hardware_name(),
            "slab" if runner.fuse_blocker is None else "BatchGenerator",
        )
        info["max_context"] = runner.max_context
        info["eos_token_ids"] = sorted(runner.eos_token_ids)
        # For the ready line and /health: why the slot is off, and why the fused tick is.
        info["spec_off_reason"] = runner.spec_off_reason
        info["fuse_blocker"] = runner.fuse_blocker
        if args.tick_mode == "fused" and runner.fuse_blocker is not None:
            logger.info("fused tick off (the alternating tick runs): %s", runner.fuse_blocker)
        elif args.tick_mode == "fused" and args.b1_policy == "auto":
            # The cost gate needs this machine's forward costs: measure them now, at load,
            # not on the first request.
            logger.info("fused tick on: %s", runner.tick_costs().to_dict())
        elif args.tick_mode == "fused":
            logger.info("fused tick on (b1_policy %s: no cost gate)", args.b1_policy)
        # From this actor's start (imports and the runner's load) to a runner that serves.
        info["startup_s"] = {
            "scheduler actor": time.perf_counter() - started,
            **({"worker start": before} if before is not None else {}),
            **startup.seconds(),
        }
        logger.info("start: %s", startup.describe(info["startup_s"], startup.SHOWN))
        return runner

    return Engine(runner_factory, args.scheduler_config()), info


def set_process_nice(nice: int) -> int:
    """Set every thread of this process to `nice` (Linux niceness is per thread, and a
    new thread inherits its creator's: the engine thread, MLX's and the BLAS library's
    workers started later get it too). Returns how many threads changed; lowering
    niceness without the privilege to is logged and skipped."""
    changed = 0
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: leave the process as it is
        return 0
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except PermissionError:
            logger.warning(
                "scheduler_nice %d: not permitted (niceness stays %d)", nice, os.getpriority(os.PRIO_PROCESS, tid)
            )
            break
        except ProcessLookupError:  # the thread ended meanwhile
            continue
    return changed


class SchedulerActor:
    """Ray actor body; created through `ActorSource`, never directly by users."""

    _exit = staticmethod(os._exit)  # the process ends without unwinding (its device context is broken)

    def __init__(self, args: dict) -> None:
        from models.loading.checks import ModelLoadError

        self._args = args  # as received: what `claim` compares a replica's with
        self._claim_lock = threading.Lock()
        self._claimed = False
        logging.basicConfig(level=logging.INFO)
        serve_args = ServeArgs.model_validate(args)
        if serve_args.scheduler_nice is not None:
            set_process_nice(serve_args.scheduler_nice)
        self._engine, self._info = build_engine(serve_args)
        try:
            self._engine.start()
        except ModelLoadError as exc:
            # Reported through info() instead of dying: a dead actor's creation error
            # reaches the replica as a traceback wall, this as one line.
            self._info = {"load_error": str(exc)}

    def claim(self, args: dict, node_id: str, claimer: tuple[str, str] | None = None) -> str:
        """A prestarted actor taken over by a replica: "ok" to the first claim from its
        node with this actor's own args, then "taken"; "elsewhere" to a replica on another
        node, "mismatch" to other args. `claimer` (the replica's actor name and namespace)
        is watched from then on: once it is gone the actor stops, as an actor the replica
        had created would have died with it."""
        import ray

        with self._claim_lock:
            if node_id != ray.get_runtime_context().get_node_id():
                return "elsewhere"
            if args != self._args:
                return "mismatch"
            if self._claimed:
                return "taken"
            self._claimed = True
        if claimer is not None:
            threading.Thread(target=self._watch, args=claimer, name="claimer-watch", daemon=True).start()
        return "ok"

    def claimed(self) -> bool:
        return self._claimed

    def _watch(self, name: str, namespace: str) -> None:
        import ray

        while True:
            time.sleep(CLAIMER_CHECK_S)
            try:
                ray.get_actor(name, namespace=namespace)
            except ValueError:  # no live actor of that name: the replica is gone
                break
            except Exception:  # the GCS did not answer this time
                continue
        logger.warning("scheduler actor exits: its replica %s is gone", name)
        self._exit(0)  # its requests went with the replica; nothing to unwind

    def info(self) -> dict:
        import ray

        return {**self._info, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def poll(self, timeout: float) -> list:
        events = self._engine.get_events(timeout)
        if not events and self._engine.fatal_error:
            # The device is lost (scheduler.engine.device_lost) and every request got
            # its error event in an earlier poll: end the process, so the replica sees
            # the actor die and starts a fresh one with a new device context.
            logger.error("scheduler actor exits: the device is lost (%s)", self._engine.fatal_error)
            self._exit(EXIT_DEVICE_LOST)
        return events

    def submit(self, request: Request) -> None:
        self._engine.submit(request)  # QueueFull reaches the replica through `_call`

    def cancel(self, request_id: str) -> None:
        self._engine.cancel(request_id)

    def snapshot(self) -> dict:
        return self._engine.snapshot()

    def reconfigure(self, changes: dict) -> None:
        self._engine.reconfigure(**changes)

    def shutdown(self) -> None:
        self._engine.stop()


class ActorSource:
    """`EventSource` over a `SchedulerActor` this replica owns."""

    def __init__(self, args: ServeArgs, name_prefix: str | None = None, prestarted: str | None = None) -> None:
        self._args = args
        self._name_prefix = name_prefix
        self._num_created = 0
        self._actor = None
        self.actor_name: str | None = None
        self._prestarted = prestarted  # the prefix of prestarted actors to claim, on the first start only

    def _create(self):
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        # Named (per incarnation, so a re-creation never races the dead one's name) so
        # operators and tests can find a replica's scheduler: `ray.get_actor(name, "specslot")`.
        self._num_created += 1
        self.actor_name = f"{self._name_prefix}-{self._num_created}" if self._name_prefix else None
        options = actor_options(self._args, node_id, self.actor_name)
        return ray.remote(SchedulerActor).options(**options).remote(self._args.model_dump(mode="json"))

    async def _claim_prestarted(self):
        """A prestarted actor for this replica's args, claimed; None when there is none."""
        import ray

        prefix, self._prestarted = self._prestarted, None  # a restart creates its own
        if not prefix:
            return None
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        names = [a["name"] for a in named if a["namespace"] == ACTOR_NAMESPACE and a["name"].startswith(prefix)]
        context = ray.get_runtime_context()
        claimer = (context.get_actor_name(), context.namespace) if context.get_actor_name() else None
        for name in sorted(names, key=lambda n: (len(n), n)):
            try:
                actor = await asyncio.to_thread(ray.get_actor, name, ACTOR_NAMESPACE)
            except ValueError:  # gone meanwhile
                continue
            try:  # waits for the actor's load to end
                verdict = await self._call(
                    actor.claim, self._args.model_dump(mode="json"), context.get_node_id(), claimer
                )
            except SchedulerLost as exc:
                logger.warning("prestarted scheduler actor %s died: %s", name, exc)
                continue
            if verdict == "ok":
                self.actor_name = name
                return actor
            if verdict == "mismatch":  # started for other args: free what it holds (a GPU)
                logger.warning("prestarted scheduler actor %s has other args than this replica: stopping it", name)
                ray.kill(actor, no_restart=True)
        return None

    async def start(self) -> dict:
        """The runner info; raises ModelLoadError (the actor killed) when loading failed."""
        from models.loading.checks import ModelLoadError

        actor = await self._claim_prestarted()
        prestarted = actor is not None
        self._actor = actor if prestarted else self._create()
        info = await self._call(self._actor.info)
        if info.get("load_error"):
            self._kill()
            raise ModelLoadError(info["load_error"])
        return {**info, "actor_name": self.actor_name, "prestarted": prestarted}

    async def _call(self, method, *args):
        import ray

        try:
            return await method.remote(*args)
        except (
            ray.exceptions.RayActorError,
            ray.exceptions.ActorDiedError,
            ray.exceptions.ActorUnavailableError,
        ) as err:
            raise SchedulerLost(str(err)) from None
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, QueueFull):  # the replica answers it; no remote traceback
                raise err.cause from None
            raise

    async def poll(self, timeout: float) -> list:
        return await self._call(self._actor.poll, timeout)

    async def submit(self, request: Request) -> None:
        await self._call(self._actor.submit, request)

    async def cancel(self, request_id: str) -> None:
        await self._call(self._actor.cancel, request_id)

    async def snapshot(self) -> dict:
        return await self._call(self._actor.snapshot)

    async def reconfigure(self, changes: dict) -> None:
        await self._call(self._actor.reconfigure, changes)

    async def restart(self) -> dict:
        self._kill()
        return await self.start()

    async def close(self) -> None:
        if self._actor is None:
            return
        try:
            await asyncio.wait_for(self._call(self._actor.shutdown), timeout=10)
        except Exception:
            logger.warning("scheduler actor did not shut down cleanly", exc_info=True)
        self._kill()

    def _kill(self) -> None:
        import ray

        if self._actor is not None:
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:
                pass
            self._actor = None

    @property
    def actor(self):
        return self._actor
