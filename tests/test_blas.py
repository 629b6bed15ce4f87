"""MLX on Linux CPU must run on the fast BLAS, not mlx-cpu's reference one."""

import sys
import time

import pytest

import models._blas as blas


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate")
def test_openblas_is_loaded_before_mlx():
    assert blas.fast_blas_path() is not None, "models did not load OpenBLAS"
    with open("/proc/self/maps") as f:
        assert "libopenblas" in f.read()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate")
def test_float32_matmul_is_fast():
    import mlx.core as mx

    a = mx.random.normal((1024, 1024), stream=mx.cpu)
    b = mx.random.normal((1024, 1024), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    gflops = 2 * 1024**3 / best / 1e9
    # Reference BLAS measures ~5.5 GFLOP/s here; OpenBLAS 100-200. Fail well below that.
    assert gflops > 25, f"{gflops:.1f} GFLOP/s: MLX is on the slow reference BLAS"


def test_rewrite_soname_keeps_length():
    data = b"\x7fELF....libgfortran-abc.so.5.0.0\0other\0"
    out = blas._rewrite_soname(data, b"libgfortran-abc.so.5.0.0", b"libgfortran.so.5")
    assert len(out) == len(data)
    assert b"libgfortran.so.5\0" in out and out.endswith(b"other\0")
