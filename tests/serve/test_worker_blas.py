"""Ray workers (where replicas and scheduler actors run) get the fast BLAS too, on every
core but one (left to Serve's proxy, the replicas and Ray: models/platform/_blas.py): Ray's
OMP_NUM_THREADS=1 for workers that reserve no CPU is not the user's choice."""

import os
import sys

import pytest

from tests.conftest import FAST_BLAS_MIN_RATIO

pytestmark = [
    pytest.mark.serve,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate"),
]


def test_ray_worker_runs_mlx_on_openblas_with_every_core_but_one(ray_cluster, reference_gflops):
    import ray

    @ray.remote(num_cpus=0)
    def probe_worker():
        import os

        import models  # noqa: F401  (what every specslot path to mlx imports first)
        import models.platform._blas

        return {
            **models.platform._blas.probe(),
            "omp": os.environ.get("OMP_NUM_THREADS"),
            "cores": models.platform._blas._usable_cores(),
        }

    result = ray.get(probe_worker.remote(), timeout=120)
    assert result["library"] == "scipy-openblas32" and result["openblas_mapped"], result
    if {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"} & set(os.environ):
        pytest.skip("the user chose the thread count")  # pragma: no cover (CI sets neither)
    assert result["omp"] == "1", "Ray no longer sets OMP_NUM_THREADS=1 in workers: revisit models.platform._blas"
    assert result["threads"] == min(max(result["cores"] - 1, 1), 64), result
    assert result["gflops"] > FAST_BLAS_MIN_RATIO * reference_gflops, (
        f"{result['gflops']:.1f} GFLOP/s in a Ray worker against the reference's {reference_gflops:.1f}: slow BLAS"
    )
