"""How much freed memory MLX keeps for reuse on a CUDA GPU.

MLX keeps the buffers a computation frees in a cache, to hand them out again without a
device allocation, and by default lets that cache grow to its whole memory limit. A
serving process frees buffers of ever new sizes (prefill chunks, growing KV rows, the
prefix cache's copies), so its cache only grows: on the H200, a replica's held 18-29 GB
after a few bursts of 32 long prompts while its arrays took 5-7 GB. Two processes on one
GPU (two replicas given half a GPU each, or a benchmark's servers side by side) then run
out of memory, and a request whose prefill cannot allocate fails. `bound_cache` caps
the cache at `CACHE_SHARE` of the device's memory on a CUDA GPU; what is freed beyond it
goes back to the device.
"""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger(__name__)

CACHE_SHARE = 1 / 8  # of the device's memory, at least MIN_CACHE_BYTES
MIN_CACHE_BYTES = 2 << 30


def on_cuda() -> bool:
    """Whether MLX runs on a CUDA GPU."""
    cuda = getattr(mx, "cuda", None)  # a build without the CUDA backend may lack the module
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def total_memory() -> int | None:
    """The device's memory in bytes as MLX reports it (None where it does not)."""
    info = mx.device_info()
    total = info.get("memory_size") or info.get("total_memory")
    return int(total) if total else None


def cache_limit(total_bytes: int) -> int:
    """The cache limit for a device of `total_bytes`.

    >>> cache_limit(141 << 30) >> 30, cache_limit(8 << 30) >> 30
    (17, 2)
    """
    return max(MIN_CACHE_BYTES, int(total_bytes * CACHE_SHARE))


def bound_cache() -> int | None:
    """Cap MLX's buffer cache on a CUDA GPU (`cache_limit`); returns the limit set, None
    elsewhere (a CPU's cache is host memory, Apple silicon's is unified and bounded by
    MLX's own default)."""
    total = total_memory() if on_cuda() else None
    if total is None:
        return None
    limit = cache_limit(total)
    mx.set_cache_limit(limit)
    log.info("MLX buffer cache capped at %.1f GB (%d%% of the GPU's %.0f GB)", limit / 1e9, CACHE_SHARE * 100,
             total / 1e9)
    return limit
