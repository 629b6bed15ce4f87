"""`python -m serve_app.cli` as an operator runs it: the ready line, then SIGTERM to the
whole process group (Ray's daemons included) ends every process within 10 s."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import yaml
from serve_helpers import REPO_ROOT, free_port, wait_until

from scripts.bench import proc_tree

pytestmark = pytest.mark.serve


def alive(kill, target: int) -> bool:
    """Whether signal 0 reaches `target` (`kill` = os.kill for a pid, os.killpg for a group)."""
    try:
        kill(target, 0)
    except ProcessLookupError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    return alive(os.killpg, pgid)


def pid_alive(pid: int) -> bool:
    return alive(os.kill, pid)


def test_cli_prints_one_ready_line_and_a_group_sigterm_ends_everything(tmp_path):
    with open(os.path.join(REPO_ROOT, "configs", "bundled.yaml")) as f:  # the fast model
        config = yaml.safe_load(f)
    port = free_port()
    config["http_options"]["port"] = port
    config["applications"][0]["args"]["policy_cache_dir"] = str(tmp_path / "policy")
    path = tmp_path / "bundled.yaml"
    path.write_text(yaml.safe_dump(config))
    # Without the proxy's transport variable (the test session sets it for its own
    # cluster): the CLI must set it for the Ray it starts.
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_SERVE_PROXY_USE_GRPC")}
    env["PYTHONPATH"] = REPO_ROOT
    log_path = tmp_path / "cli.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "serve_app.cli", str(path)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_until(lambda: "specslot ready at" in log_path.read_text(errors="replace"), 120, 0.5)
        ready = [line for line in log_path.read_text(errors="replace").splitlines() if "specslot ready at" in line]
        assert ready == [
            f"specslot ready at http://127.0.0.1:{port}/v1 — model specslot-bundled, "
            "drafter ngram, speculation on (fused tick)"
        ]
        # Where the start went: the CLI's phases, then the scheduler actor's load by phase.
        started = [line for line in log_path.read_text(errors="replace").splitlines() if "specslot started in" in line]
        assert len(started) == 1 and all(
            f"{phase} " in started[0] for phase in ("checks", "Ray", "Serve deploy", "replica", "scheduler actor")
        ), started
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        assert health["speculation"] == "on"
        assert {"scheduler actor", "weights", "slab check", "tick costs"} <= set(health["startup_s"])
        # Ray starts its workers in their own sessions: follow the replica and its actor too.
        replica = httpx.get(f"http://127.0.0.1:{port}/v1/internal/scheduler", timeout=5).json()["replica"]
        worker_pids = [replica["pid"], replica["scheduler_pid"]]
        # Serve's HTTP proxy, a worker of the Ray the CLI started, reaches the replicas over gRPC.
        proxies = [pid for pid, (kind, _) in proc_tree.cpu_seconds(proc.pid).items() if kind == "ProxyActor"]
        assert len(proxies) == 1
        with open(f"/proc/{proxies[0]}/environ", "rb") as f:
            assert b"RAY_SERVE_PROXY_USE_GRPC=1" in f.read().split(b"\0")
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0  # reaped here: a zombie leader keeps the group "alive"
        wait_until(
            lambda: not group_alive(proc.pid) and not any(map(pid_alive, worker_pids)),
            10 - (time.monotonic() - signalled),
            0.1,
        )
        print(f"\nprocess group gone {time.monotonic() - signalled:.1f}s after SIGTERM")
    finally:
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
