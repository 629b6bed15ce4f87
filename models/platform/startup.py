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


def describe(phases: dict[str, float]) -> str:
    """Phases as the load log and the CLI's start line write them."""
    return ", ".join(f"{name} {s:.1f} s" for name, s in phases.items())
