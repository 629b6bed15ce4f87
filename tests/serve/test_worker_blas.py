"""Ray workers (where replicas and scheduler actors run) get the fast BLAS too."""

import sys

import pytest

pytestmark = [pytest.mark.serve,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate")]


def test_ray_worker_runs_mlx_on_openblas(ray_cluster):
    import ray


    @ray.remote(num_cpus=0)
    def probe_worker():
        import models  # noqa: F401  (what every specslot path to mlx imports first)
        import models._blas

        return models._blas.probe()

    result = ray.get(probe_worker.remote(), timeout=120)
    assert result["path"] is not None and result["openblas_mapped"], "Ray worker lacks OpenBLAS"
    assert result["gflops"] > 25, f"{result['gflops']:.1f} GFLOP/s in a Ray worker: slow BLAS"
