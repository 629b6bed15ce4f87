"""How much freed memory MLX keeps for reuse on a CUDA GPU.

MLX keeps the buffers a computation frees in a cache, to hand them out again without a
device allocation, and by default lets that cache grow to its whole memory limit. A
serving process frees buffers of ever new sizes (prefill chunks, growing KV rows, the
prefix cache's copies), so its cache only grows, to several times what its arrays hold
(docs/history/gpu-2026-12.md, "What runs by default"). Two processes on one
GPU (two replicas given half a GPU each, or a benchmark's servers side by side) then run
out of memory, and a request whose prefill cannot allocate fails. `bound_cache` caps
the cache at `CACHE_SHARE` of the device's memory on a CUDA GPU; what is freed beyond it
goes back to the device.

Several processes may share one GPU by design: replicas given a fraction of a GPU
(`actor_num_gpus: 0.5`). Each sizes what it keeps from its share (`set_share`, set by the
scheduler actor before it loads the model): `total_memory` is the share of the device's
memory, so the buffer cache's cap and the prefix cache's default budget
(`prefix_cache.available_memory`) are fractions of the share, not of the whole device
(the prefix cache's default keeps its absolute cap of 4 GiB).
"""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger(__name__)

CACHE_SHARE = 1 / 8  # of this process's memory (`total_memory`), at least MIN_CACHE_BYTES
MIN_CACHE_BYTES = 2 << 30
_share = 1.0  # of the device, this process's (`set_share`)


def set_share(fraction: float | None) -> float:
    """This process's share of the device: `fraction` when 0 < fraction < 1 (a fraction
    of a GPU, as Ray schedules it), else the whole device. Returns the share set.

    >>> set_share(0.25), set_share(1), set_share(0), set_share(None)
    (0.25, 1.0, 1.0, 1.0)
    """
    global _share
    _share = float(fraction) if fraction is not None and 0 < fraction < 1 else 1.0
    return _share


def on_cuda() -> bool:
    """Whether MLX runs on a CUDA GPU."""
    cuda = getattr(mx, "cuda", None)  # a build without the CUDA backend may lack the module
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


def device_memory() -> int | None:
    """The device's memory in bytes as MLX reports it (None where it does not)."""
    info = mx.device_info()
    total = info.get("memory_size") or info.get("total_memory")
    return int(total) if total else None


def total_memory() -> int | None:
    """This process's share (`set_share`) of the device's memory in bytes (None where
    MLX does not report it)."""
    total = device_memory()
    return int(total * _share) if total else None


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
    share = "" if _share == 1.0 else f" of this process's {_share:g} share"
    log.info(
        "MLX buffer cache capped at %.1f GB (%d%%%s of the GPU's %.0f GB)",
        limit / 1e9,
        CACHE_SHARE * 100,
        share,
        device_memory() / 1e9,
    )
    return limit
