"""Replicas, nodes, autoscaling, scheduler-actor recovery and `serve run`, on loopback."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from serve_helpers import MODEL, PROMPT, REPO_ROOT, deploy, free_port, new_router, oai, replica_serving, wait_until

from serve_app.deployment.affinity import preferred_replica
from tests.conftest import SMOLLM2_QUESTIONS

pytestmark = pytest.mark.serve


def running_replicas(app_name: str) -> int:
    from ray import serve

    dep = serve.status().applications[app_name].deployments["SpecslotServer"]
    return dep.replica_states.get("RUNNING", 0)


def test_two_replicas_one_per_node_both_serve(ray_cluster, tiny_pair):
    from ray import serve

    base = deploy(
        ray_cluster,
        tiny_pair,
        "pair",
        "/p",
        args={"affinity_stats_period_s": 0.5},
        num_replicas=2,
        max_replicas_per_node=1,
    )
    wait_until(lambda: running_replicas("pair") == 2, 60)
    client = oai(base)
    answered: dict[str, str] = {}
    for _ in range(60):
        raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        answered[raw.headers["x-specslot-replica"]] = raw.parse().choices[0].text
        if len(answered) == 2:
            break
    assert len(answered) == 2, answered
    nodes = {}
    for _ in range(60):
        state = httpx.get(f"{base}/v1/internal/scheduler").json()["replica"]
        assert state["scheduler_node_id"] == state["node_id"]  # the actor lives by its replica
        nodes[state["replica_id"]] = state["node_id"]
        if len(nodes) == 2:
            break
    assert len(set(nodes.values())) == 2, nodes  # one replica on each Ray node
    assert len(set(answered.values())) == 1  # same greedy text from both
    # A session's requests stay on one replica (idle replicas: the load bound never moves them).
    sessions = {}
    for i in range(12):
        for _ in range(4):
            raw = client.completions.with_raw_response.create(
                model=MODEL,
                prompt=PROMPT,
                max_tokens=2,
                temperature=0,
                extra_headers={"X-Session-Id": f"conversation-{i}"},
            )
            sessions.setdefault(i, set()).add(raw.headers["x-specslot-replica"])
    assert all(len(replicas) == 1 for replicas in sessions.values()), sessions
    assert len(set().union(*sessions.values())) == 2  # and sessions spread over both
    # The replicas report the sessions the proxy's router placed: another router (a new
    # handle) sends one placed where its hash does not point to the same replica.
    replica_ids = sorted(set().union(*sessions.values()))
    placed = {f"conversation-{i}": replica for i, (replica,) in sessions.items()}
    for i in range(40):  # every other new session is placed by session counts alone
        if any(replica != preferred_replica(key, replica_ids) for key, replica in placed.items()):
            break
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, extra_headers={"X-Session-Id": f"extra-{i}"}
        )
        placed[f"extra-{i}"] = raw.headers["x-specslot-replica"]
    session, home = next((k, r) for k, r in placed.items() if r != preferred_replica(k, replica_ids))
    time.sleep(5)  # ten stats periods
    assert replica_serving(new_router("pair"), session) == home
    serve.delete("pair")


def test_autoscaling_goes_1_to_2_under_load_and_back(ray_cluster, tiny_pair):
    from ray import serve

    with open(os.path.join(REPO_ROOT, "configs", "autoscale.yaml")) as f:
        scaling = yaml.safe_load(f)["applications"][0]["deployments"][0]["autoscaling_config"]
    scaling.update(
        max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0.5, downscale_delay_s=2, look_back_period_s=1
    )
    base = deploy(ray_cluster, tiny_pair, "auto", "/a", autoscaling_config=scaling)
    assert running_replicas("auto") == 1
    stop = threading.Event()

    def load():
        while not stop.is_set():
            httpx.post(
                f"{base}/v1/completions", timeout=60, json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0}
            )

    with cf.ThreadPoolExecutor(4) as pool:
        for _ in range(4):
            pool.submit(load)
        try:
            wait_until(lambda: running_replicas("auto") == 2, 90, 0.5)
        finally:
            stop.set()
    wait_until(lambda: running_replicas("auto") == 1, 90, 0.5)
    serve.delete("auto")


def test_killed_scheduler_actor_ends_streams_cleanly_and_is_recreated(ray_cluster, main_app):
    import ray

    state = httpx.get(f"{main_app}/v1/internal/scheduler").json()["replica"]
    actor = ray.get_actor(state["scheduler_actor"], namespace="specslot")
    lines: list[str] = []

    def stream():
        with httpx.stream(
            "POST",
            f"{main_app}/v1/completions",
            timeout=60,
            json={"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True},
        ) as r:
            for line in r.iter_lines():
                lines.append(line)

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: len(lines) >= 4, 20, 0.01)
    killed_at = time.monotonic()
    ray.kill(actor, no_restart=True)
    t.join(30)
    assert not t.is_alive()
    payloads = [line for line in lines if line.startswith("data: ")]
    assert payloads[-1] == "data: [DONE]"
    assert '"error"' in payloads[-2] and "Traceback" not in payloads[-2]
    client = oai(main_app)
    wait_until(
        lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3,
        60,
        0.2,
    )
    recovery_s = time.monotonic() - killed_at
    after = httpx.get(f"{main_app}/v1/internal/scheduler").json()["replica"]
    assert after["scheduler_restarts"] == state["scheduler_restarts"] + 1
    assert after["scheduler_actor"] != state["scheduler_actor"]
    print(f"\nscheduler actor recovery: {recovery_s:.2f}s from kill to the next good response")


def test_serve_run_local_config_answers_and_shuts_down_on_sigterm(tmp_path):
    """configs/local.yaml as shipped (SmolLM2-135M-Instruct from its PyPI wheel, which
    `make model` fetched; relative paths), only the port and the policy cache moved: the
    default deployment answers a question; `serve run` in the background ignores SIGINT,
    so SIGTERM."""
    with open(os.path.join(REPO_ROOT, "configs", "local.yaml")) as f:
        config = yaml.safe_load(f)
    port = free_port()
    config["http_options"]["port"] = port
    app_args = config["applications"][0]["args"]
    app_args["policy_cache_dir"] = str(tmp_path / "policy")
    path = tmp_path / "local.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it
    env["RAY_ADDRESS"] = "local"
    serve_bin = os.path.join(os.path.dirname(sys.executable), "serve")
    proc = subprocess.Popen(
        [serve_bin, "run", str(path)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(f"{base}/health", timeout=5).status_code == 200, 180, 0.5)
        client = oai(base)
        name = "SmolLM2-135M-Instruct"
        assert app_args["served_model_name"] == name
        assert name in [m.id for m in client.models.list().data]
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        chunks = list(
            client.chat.completions.create(
                model=name,
                messages=messages,
                max_tokens=24,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        full = client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)
        assert text == full.choices[0].message.content
        assert re.search(r"\bParis\b", text), text  # e.g. "The capital of France is Paris."
        # The shipped config speculates: the slot serves, its verify rides in the batch's
        # forward, and rows draft. Whether a given request's drafts pay is decided by the
        # costs measured at load (a benchmark's business, not this test's); `make serve`
        # with concurrent completions is where the rounds show.
        assert set(chunks[-1].usage.model_extra["speculative"]) >= {"rounds", "row_rounds", "drafters"}
        snapshot = httpx.get(f"{base}/v1/internal/scheduler", timeout=10).json()
        assert snapshot["speculation"] == {"off_reason": None, "tick": "fused", "fused_off_reason": None}
        assert snapshot["config"]["row_drafts"] is True and snapshot["config"]["b1_policy"] != "off"
        check_default_features_over_http(client, name)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) is not None
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{base}/health", timeout=2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


LONG_NOTE = (
    "Meeting notes. The team reviewed the quarterly plan, agreed to move the release of the "
    "reporting tool to the second week of the month, asked the design group for two more "
    "mock-ups of the settings page, and noted that the test servers need more disk space. "
    "Open questions: who owns the migration scripts, and whether the old API stays up until "
    "the end of the year. Next meeting on Thursday at ten."
)


def check_default_features_over_http(client, name: str) -> None:
    """The shipped default with its real model, through Serve: four greedy chats at once
    (rows batched and drafting, the rotating slot) say what each says alone, and a resent
    long prompt comes from the prefix cache."""

    def ask(question):
        messages = [{"role": "user", "content": question}]
        return client.chat.completions.create(model=name, messages=messages, max_tokens=24, temperature=0)

    alone = [ask(q).choices[0].message.content for q in SMOLLM2_QUESTIONS]
    with cf.ThreadPoolExecutor(len(SMOLLM2_QUESTIONS)) as pool:
        together = list(pool.map(ask, SMOLLM2_QUESTIONS))
    assert [r.choices[0].message.content for r in together] == alone
    for reply in together:
        assert {"rounds", "row_rounds"} <= set(reply.usage.model_extra["speculative"])
    question = f"{LONG_NOTE}\n\nSummarise these notes in one sentence."
    first, again = ask(question), ask(question)
    assert first.usage.prompt_tokens > 64  # more than one of the prefix cache's blocks
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 64
    assert again.choices[0].message.content.strip()
