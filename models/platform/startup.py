"""Where a replica's start goes: seconds per named phase of its load, in the order they
first ran, for the load log, /health and the CLI's start line.

One process loads one runner (the scheduler actor), so the record is the process's;
`reset` starts a new one (the actor, before it builds its engine).

>>> reset()
>>> with phase("weights"):
...     pass
>>> list(seconds())
['weights']
>>> describe({"weights": 1.25, "tick costs": 2.0})
'weights 1.2 s, tick costs 2.0 s'
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager
from typing import Iterator

_seconds: dict[str, float] = {}


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Add the block's wall time to phase `name` (a phase that runs twice adds up)."""
    tic = time.perf_counter()
    try:
        yield
    finally:
        _seconds[name] = _seconds.get(name, 0.0) + time.perf_counter() - tic


def seconds() -> dict[str, float]:
    return dict(_seconds)


def reset() -> None:
    _seconds.clear()


SHOWN = 0.05  # a load's phase that took less is left out of the start line


def process_age() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that is unknown: what
    a new Ray worker spends starting and importing before our code runs."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return None


def describe(phases: dict[str, float], at_least: float = 0.0) -> str:
    """Phases as the load log and the CLI's start line write them (those that took
    `at_least` seconds: a load's phases that took no time are left out)."""
    return ", ".join(f"{name} {s:.1f} s" for name, s in phases.items() if s >= at_least)


TORCH_ENV = "SPECSLOT_TRANSFORMERS_TORCH"  # "1": transformers may import PyTorch where installed


def transformers_without_torch() -> bool:
    """Import transformers with PyTorch hidden, so that it never imports torch: specslot
    uses only its tokenizers, and on an image with PyTorch installed, transformers'
    import of torch took 8.6 s, once in the scheduler actor before the weights and once
    in the replica's tokenizer (a fresh H100 start: 52.4 s with it, 41.6 s without).
    transformers probes torch once per process (`is_torch_available`, cached), so torch
    is hidden only for that probe: anything else may import it afterwards. Returns whether it hid torch; False (nothing
    done) once transformers or torch is imported, without transformers, or with
    SPECSLOT_TRANSFORMERS_TORCH=1 (a tokenizer whose code needs PyTorch)."""
    if os.environ.get(TORCH_ENV) == "1" or "transformers" in sys.modules or "torch" in sys.modules:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec("torch") is None: no PyTorch
    try:
        from transformers.utils import import_utils

        import_utils.is_torch_available()
    except ImportError:
        return False
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return True
