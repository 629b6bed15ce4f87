"""Scheduler actors the CLI starts before Serve (`launch.prestart_schedulers`): a replica
claims one on its node with its own args, stops one with other args, the CLI stops the
ones nobody claimed, and a claimed actor ends once its replica is gone."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import MODEL, deploy, wait_until

pytestmark = pytest.mark.serve


def app_args(tiny_pair, **more) -> dict:
    """What `deploy` hands `build_app` for these args (an n-gram drafter: no draft weights)."""
    target, _ = tiny_pair
    return {"model": target, "served_model_name": MODEL, "drafter": {"kind": "ngram"}, **more}


def prestart_on_every_node(app: str, args: dict) -> list:
    """One prestarted actor per live node, as the CLI makes on its own node, so the
    replica finds one on whichever node Serve puts it."""
    import ray

    from serve_app.app import replica_args
    from serve_app.deployment.actor import SchedulerActor, actor_options, prestart_name

    held = replica_args(args)
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    return [
        ray.remote(SchedulerActor)
        .options(**actor_options(held, node, prestart_name(app, i)))
        .remote(held.model_dump(mode="json"))
        for i, node in enumerate(nodes)
    ]


def actor_alive(name: str) -> bool:
    """Whether a live actor holds `name` (not `ray.get_actor`: this process created these
    actors, and an owner's lookup finds a dead one's handle)."""
    import ray

    from serve_app.deployment.actor import ACTOR_NAMESPACE

    named = ray.util.list_named_actors(all_namespaces=True)
    return any(a["name"] == name and a["namespace"] == ACTOR_NAMESPACE for a in named)


def replica_state(base: str) -> dict:
    return httpx.get(f"{base}/v1/internal/scheduler", timeout=10).json()["replica"]


def test_replica_claims_a_prestarted_actor_and_it_ends_with_the_replica(ray_cluster, tiny_pair):
    import ray
    from ray import serve

    from serve_app.deployment.launch import release_unclaimed

    args = app_args(tiny_pair)
    handles = prestart_on_every_node("pre1", args)
    base = deploy(ray_cluster, tiny_pair, "pre1", "/pre1", args=args)
    try:
        assert httpx.get(f"{base}/health", timeout=10).json()["scheduler_prestarted"] is True
        claimed = replica_state(base)["scheduler_actor"]
        assert claimed.startswith("prestart-pre1-"), claimed
        # The replica claimed the one on its node; the CLI stops the others.
        assert release_unclaimed(handles) == len(handles) - 1
        assert actor_alive(claimed)
        r = httpx.post(f"{base}/v1/completions", timeout=60, json={"prompt": "abc", "max_tokens": 4})
        assert r.status_code == 200, r.text

        # The replica dies: its claimed actor follows, as one it had created would.
        replica = next(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith("SERVE_REPLICA::pre1#")
        )
        ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
        wait_until(lambda: not actor_alive(claimed), 30, 0.5)
        # Serve's new replica starts a scheduler of its own.
        wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 120, 0.5)
        assert "scheduler_prestarted" not in httpx.get(f"{base}/health", timeout=10).json()
        assert replica_state(base)["scheduler_actor"].startswith("scheduler-")
    finally:
        serve.delete("pre1")


def test_a_prestarted_actor_with_other_args_is_stopped_not_claimed(ray_cluster, tiny_pair):
    from ray import serve

    from serve_app.deployment.launch import release_unclaimed

    handles = prestart_on_every_node("pre2", app_args(tiny_pair, max_batch_size=7))
    base = deploy(ray_cluster, tiny_pair, "pre2", "/pre2", args=app_args(tiny_pair))
    try:
        assert "scheduler_prestarted" not in httpx.get(f"{base}/health", timeout=10).json()
        node = replica_state(base)["scheduler_node_id"]
        # The one on the replica's node was stopped by the replica; the CLI stops the rest.
        alive = [i for i in range(len(handles)) if actor_alive(f"prestart-pre2-{i}")]
        assert len(alive) == len(handles) - 1, (alive, node)
        assert release_unclaimed(handles) == len(handles)
        wait_until(lambda: not any(actor_alive(f"prestart-pre2-{i}") for i in range(len(handles))), 30, 0.5)
    finally:
        serve.delete("pre2")


def test_prestart_schedulers_makes_one_per_fixed_replica(ray_cluster, tiny_pair):
    import ray

    from serve_app.deployment.launch import prestart_count, prestart_schedulers, release_unclaimed

    def app(name: str, **deployment) -> dict:
        spec = {"name": name, "import_path": "serve_app.app:build_app", "args": app_args(tiny_pair)}
        if deployment:
            spec["deployments"] = [{"name": "SpecslotServer", **deployment}]
        return spec

    assert prestart_count(app("a")) == 1
    assert prestart_count(app("a", num_replicas=3)) == 3
    assert prestart_count(app("a", num_replicas="auto")) == 0
    assert prestart_count(app("a", autoscaling_config={"min_replicas": 1})) == 0
    assert prestart_count(app("a", ray_actor_options={"runtime_env": {"env_vars": {"A": "1"}}})) == 0
    assert prestart_count({**app("a"), "runtime_env": {"env_vars": {"A": "1"}}}) == 0
    config = {"applications": [app("pre3", num_replicas=2), {"name": "other", "import_path": "elsewhere:app"}]}
    handles = prestart_schedulers(config)
    assert len(handles) == 2
    assert ray.get([h.claimed.remote() for h in handles], timeout=120) == [False, False]
    assert actor_alive("prestart-pre3-0") and actor_alive("prestart-pre3-1")
    assert release_unclaimed(handles) == 2
    wait_until(lambda: not actor_alive("prestart-pre3-0") and not actor_alive("prestart-pre3-1"), 30, 0.5)
