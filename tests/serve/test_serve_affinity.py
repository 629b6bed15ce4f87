"""Prompt-keyed affinity on loopback: `affinity_key: prompt` puts SpecslotIngress in
front of two replicas; conversations that send no session id keep their replica, and
routers that never saw a conversation send it where another router placed it."""

from __future__ import annotations

import pytest
from serve_helpers import MODEL, new_router, oai, replica_serving, wait_until

from serve_app.app import build_app
from serve_app.deployment.affinity import preferred_replica

pytestmark = pytest.mark.serve

STATS_PERIOD_S = 0.5


def deploy_prompt_keyed(ray_cluster, tiny_pair, name, route, num_replicas):
    import httpx
    from ray import serve

    target, draft = tiny_pair
    app = build_app(
        {
            "model": target,
            "served_model_name": MODEL,
            "affinity_key": "prompt",
            "affinity_stats_period_s": STATS_PERIOD_S,
            "drafter": {"kind": "draft_model", "path": draft},
        }
    )
    ingress = app._bound_deployment
    assert ingress.name == "SpecslotIngress"
    server_app, *rest = ingress.init_args
    server = server_app._bound_deployment.options(num_replicas=num_replicas, max_replicas_per_node=1)
    serve.run(
        ingress.bind(server.bind(*server_app._bound_deployment.init_args), *rest),
        name=name,
        route_prefix=route,
        blocking=False,
    )
    base = ray_cluster["base"] + route

    def both_running():
        dep = serve.status().applications[name].deployments["SpecslotServer"]
        return dep.replica_states.get("RUNNING", 0) == num_replicas

    wait_until(both_running, 120)
    wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 120)
    return base


def test_conversations_without_a_session_id_keep_their_replica(ray_cluster, tiny_pair):
    from ray import serve

    base = deploy_prompt_keyed(ray_cluster, tiny_pair, "prompt_keyed", "/pk", num_replicas=2)
    client = oai(base)
    replicas: dict[int, set[str]] = {}
    for conversation in range(6):
        messages = [{"role": "user", "content": f"conversation {conversation}: " + "tell me more. " * 30}]
        for turn in range(3):
            stream = turn == 2  # streamed through the ingress too
            raw = client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=stream
            )
            replicas.setdefault(conversation, set()).add(raw.headers["x-specslot-replica"])
            parsed = raw.parse()
            text = (
                "".join(c.choices[0].delta.content or "" for c in parsed if c.choices)
                if stream
                else parsed.choices[0].message.content
            )
            assert isinstance(text, str)
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"turn {turn}"}]
    assert all(len(r) == 1 for r in replicas.values()), replicas
    per_replica = [sum(1 for r in replicas.values() if r == {rid}) for rid in set().union(*replicas.values())]
    assert sorted(per_replica) == [3, 3]  # new conversations go to the replica with fewer
    # Completions and the small endpoints pass through too; errors keep their status.
    completion = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=3, temperature=0)
    assert completion.choices[0].text is not None
    assert client.models.list().data[0].id == MODEL
    import httpx

    bad = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": "nope"}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages"
    # A client that leaves mid-stream cancels its request on the replica (the session id
    # sends the streams and the probes to one replica).
    pinned = {"X-Session-Id": "leaver"}

    def disconnects():
        text = httpx.get(f"{base}/metrics", headers=pinned, timeout=30).text
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("specslot_requests_total") and 'finish_reason="disconnected"' in line
        )

    before = disconnects()
    for _ in range(3):
        with httpx.stream(
            "POST",
            f"{base}/v1/completions",
            headers=pinned,
            timeout=30,
            json={"prompt": "def f(x):", "max_tokens": 300, "temperature": 0, "stream": True},
        ) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: {") for _ in range(6))

    def drained():
        state = httpx.get(f"{base}/v1/internal/scheduler", headers=pinned, timeout=30).json()
        return state["unfinished"] == 0 and disconnects() - before >= 3

    wait_until(drained, 30)
    serve.delete("prompt_keyed")


def test_a_router_sends_a_session_where_another_router_placed_it(ray_cluster, tiny_pair):
    """Two handles, two routers (as two HTTP proxies, or two ingress replicas, would have):
    a session one router placed against its hash goes to the same replica through the
    other router once the replica has reported it."""
    import time

    from ray import serve

    deploy_prompt_keyed(ray_cluster, tiny_pair, "shared_pins", "/sp", num_replicas=2)
    first, second = new_router("shared_pins"), new_router("shared_pins")
    assert first._router is not second._router
    replica_ids = sorted({replica_serving(first, f"warm-{i}") for i in range(4)})
    assert len(replica_ids) == 2  # four new sessions, balanced: both replicas
    # A session the first router placed where its hash does not point (by session counts):
    # a router that knows nothing of it would follow the hash instead.
    for i in range(40):
        session = f"shared-{i}"
        home = replica_serving(first, session)
        if home != preferred_replica(session, replica_ids):
            break
    else:
        raise AssertionError("every session went where its hash points")
    time.sleep(10 * STATS_PERIOD_S)  # the replica's next report reaches every router (~1 s here)
    assert replica_serving(second, session) == home
    assert replica_serving(first, session) == home
    serve.delete("shared_pins")
