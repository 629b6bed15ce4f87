"""Serve test fixtures: ONE two-node Ray cluster on loopback for the whole session.

Both nodes are processes on this machine (`ray.cluster_utils.Cluster`); every app the
tests deploy uses `num_cpus: 0` replicas and actors, so 2 cores suffice. Tiny random
models from `models.tiny` stand in for the bundled pair (same code path, faster).
"""

from __future__ import annotations

import os

import pytest

import models  # noqa: F401  (fast BLAS before mlx)


# Keep every Ray address on loopback: by default Ray swaps 127.0.0.1 for the host's
# routable IP when connecting, which also sends traffic off loopback.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
# Both "nodes" share one host; without this the proxy sends every request to the
# replica on its own node and the two-node test could not see the other one answer.
os.environ.setdefault("RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING", "0")
# Autoscaling decisions need fresh metrics; Serve's default push interval is 10 s.
os.environ.setdefault("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")
os.environ.setdefault("RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S", "0.5")

# Ray reads the variables above when it is imported: import it only after them.
from serve_helpers import REPO_ROOT, deploy, free_port  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from models.tiny import build_tiny_pair

    return build_tiny_pair(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def ray_cluster():
    """Head + one worker node, both 127.0.0.1; the driver connects to the head."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray import serve
    from ray.cluster_utils import Cluster

    # If another test module imported Ray before this conftest set the variable, the
    # constant it controls is already read: pin it so addresses stay on loopback.
    ray_constants.ENABLE_RAY_CLUSTER = False

    node_args = {"node_ip_address": "127.0.0.1", "num_cpus": 1,
                 "object_store_memory": 100 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**node_args, "include_dashboard": False})
    cluster.add_node(**node_args)
    ray.init(address=cluster.address, namespace="serve",
             runtime_env={"env_vars": {"PYTHONPATH": REPO_ROOT}})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    yield {"cluster": cluster, "port": port, "base": f"http://127.0.0.1:{port}"}
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def main_app(ray_cluster, tiny_pair):
    """The default app at `/`: tiny pair, draft-model drafter, one replica."""
    return deploy(ray_cluster, tiny_pair, "main", "/")
