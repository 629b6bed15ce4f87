"""models.platform.device_memory: a process given a fraction of a GPU sizes its caches from its
share of the device's memory (two replicas at 0.5 together keep what one alone would)."""

import pytest

from models.batch import prefix_cache
from models.platform import device_memory


@pytest.fixture
def gpu_of(monkeypatch):
    """A device of `n` GiB as MLX would report it; the share is restored afterwards."""

    def make(gib: int):
        monkeypatch.setattr(device_memory.mx, "device_info", lambda: {"memory_size": gib << 30})

    yield make
    device_memory.set_share(None)


def test_a_fraction_of_the_gpu_scales_what_the_process_sizes_from(gpu_of):
    gpu_of(144)
    assert device_memory.total_memory() == 144 << 30
    whole_cache = device_memory.cache_limit(device_memory.total_memory())
    whole_prefix = prefix_cache.default_budget(device_memory.total_memory())
    device_memory.set_share(0.25)
    assert device_memory.device_memory() == 144 << 30 and device_memory.total_memory() == 36 << 30
    # four such processes together hold the one process's cache cap
    assert 4 * device_memory.cache_limit(device_memory.total_memory()) == whole_cache
    # the prefix cache's default is capped at 4 GiB: on a smaller GPU it scales too
    assert prefix_cache.default_budget(device_memory.total_memory()) == whole_prefix == 4 << 30
    gpu_of(24)
    device_memory.set_share(0.5)
    assert prefix_cache.default_budget(device_memory.total_memory()) == 1.5 * (1 << 30)
    device_memory.set_share(1.0)
    assert prefix_cache.default_budget(device_memory.total_memory()) == 3 << 30


def test_no_reported_memory_stays_none(monkeypatch):
    monkeypatch.setattr(device_memory.mx, "device_info", lambda: {"device_name": "cpu"})
    device_memory.set_share(0.5)
    try:
        assert device_memory.total_memory() is None and device_memory.device_memory() is None
    finally:
        device_memory.set_share(None)
