"""Load a fast BLAS in front of mlx-cpu's reference BLAS (Linux only).

The `mlx-cpu` wheel links a reference BLAS (~5 GFLOP/s for a 1024² float32 matmul on
two cores). Loading OpenBLAS (from the `cmeel-openblas` wheel) with RTLD_GLOBAL before
`mlx.core` is imported makes MLX resolve `cblas_*` to it instead (~100+ GFLOP/s).

OpenBLAS needs `libgfortran.so.5`. Where the system has none, we reuse the copy that
mlx-cpu (or numpy) bundles under a hashed name: copied into a cache directory with its
SONAME rewritten in place to `libgfortran.so.5`, so the loader matches OpenBLAS's
DT_NEEDED entry against it. This module must not import mlx.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import sysconfig
import tempfile

_GFORTRAN = "libgfortran.so.5"
_loaded_from: str | None = None


def fast_blas_path() -> str | None:
    """Path of the OpenBLAS this module loaded, or None."""
    return _loaded_from


def _site_dirs() -> list[str]:
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    return list(dict.fromkeys(d for d in dirs if os.path.isdir(d)))


def _find(pattern: str) -> str | None:
    for site in _site_dirs():
        hits = sorted(glob.glob(os.path.join(site, pattern)))
        if hits:
            return hits[0]
    return None


def _cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "specslot", "blas")
    os.makedirs(path, exist_ok=True)
    return path


def _rewrite_soname(data: bytes, old: bytes, new: bytes) -> bytes:
    """Replace a NUL-terminated string in an ELF string table with a shorter one."""
    needle = old + b"\0"
    at = data.find(needle)
    if at < 0 or len(new) > len(old):
        raise OSError(f"cannot rewrite SONAME {old!r}")
    padded = new + b"\0" * (len(old) - len(new) + 1)
    return data[:at] + padded + data[at + len(needle):]


def _preload_bundled_gfortran() -> None:
    lib = _find("mlx_cpu.libs/libgfortran-*.so.5*") or _find("numpy.libs/libgfortran-*.so.5*")
    if lib is None:
        raise OSError("no libgfortran.so.5 on the system and none bundled in mlx-cpu/numpy")
    libs_dir = os.path.dirname(lib)
    for quadmath in sorted(glob.glob(os.path.join(libs_dir, "libquadmath-*.so*"))):
        ctypes.CDLL(quadmath, mode=ctypes.RTLD_GLOBAL)
    target = os.path.join(_cache_dir(), f"{os.path.basename(lib)}.{_GFORTRAN}")
    if not os.path.exists(target):
        with open(lib, "rb") as f:
            data = f.read()
        patched = _rewrite_soname(data, os.path.basename(lib).encode(), _GFORTRAN.encode())
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target))
        with os.fdopen(fd, "wb") as f:
            f.write(patched)
        os.replace(tmp, target)
    ctypes.CDLL(target, mode=ctypes.RTLD_GLOBAL)


def load_fast_blas() -> str | None:
    """Load OpenBLAS globally if we are on Linux and mlx.core is not imported yet.

    Returns the library path, or None where nothing was loaded (macOS uses Accelerate;
    `SPECSLOT_FAST_BLAS=0` opts out). Safe to call more than once.
    """
    global _loaded_from
    if _loaded_from or not sys.platform.startswith("linux"):
        return _loaded_from
    if os.environ.get("SPECSLOT_FAST_BLAS", "1") == "0":
        return None
    openblas = _find("cmeel.prefix/lib/libopenblas.so.0")
    if openblas is None:
        return None
    if "mlx.core" in sys.modules:
        print("specslot: mlx.core was imported before models; CPU BLAS stays slow", file=sys.stderr)
        return None
    try:
        ctypes.CDLL(_GFORTRAN, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        _preload_bundled_gfortran()
    ctypes.CDLL(openblas, mode=ctypes.RTLD_GLOBAL)
    _loaded_from = openblas
    return openblas


def probe(size: int = 1024, repeats: int = 5) -> dict:
    """What this process runs MLX's CPU matmuls on: the loaded library, whether
    OpenBLAS is mapped, and the best float32 `size`² matmul rate in GFLOP/s."""
    import time

    import mlx.core as mx

    a = mx.random.normal((size, size), stream=mx.cpu)
    b = mx.random.normal((size, size), stream=mx.cpu)
    mx.eval(mx.matmul(a, b, stream=mx.cpu))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    mapped = False
    if os.path.exists("/proc/self/maps"):
        with open("/proc/self/maps") as f:
            mapped = "libopenblas" in f.read()
    return {"path": _loaded_from, "openblas_mapped": mapped, "gflops": 2 * size**3 / best / 1e9}
