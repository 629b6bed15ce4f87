"""MLX on Linux CPU must run on the fast BLAS, not mlx-cpu's reference one."""

import sys

import pytest

import models._blas as blas

# Reference BLAS measures ~5.5 GFLOP/s for a 1024² float32 matmul here; OpenBLAS 100-200.
MIN_GFLOPS = 25
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="macOS uses Accelerate")


@linux_only
def test_openblas_is_loaded_and_fast():
    result = blas.probe()
    assert result["path"] is not None and result["openblas_mapped"], "models did not load OpenBLAS"
    assert result["gflops"] > MIN_GFLOPS, f"{result['gflops']:.1f} GFLOP/s: slow reference BLAS"


def test_rewrite_soname_keeps_length():
    data = b"\x7fELF....libgfortran-abc.so.5.0.0\0other\0"
    out = blas._rewrite_soname(data, b"libgfortran-abc.so.5.0.0", b"libgfortran.so.5")
    assert len(out) == len(data)
    assert b"libgfortran.so.5\0" in out and out.endswith(b"other\0")


def test_rewrite_soname_refuses_a_missing_or_longer_name():
    with pytest.raises(OSError):
        blas._rewrite_soname(b"libfoo.so\0", b"libbar.so", b"libbar.so")
    with pytest.raises(OSError):
        blas._rewrite_soname(b"libg.so\0", b"libg.so", b"libgfortran.so.5")
