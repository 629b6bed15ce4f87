"""Tiny real mlx models for the model tests, built once per test session."""

import pytest

import models  # noqa: F401  (fast BLAS before mlx.core)
from scheduler.request import Request, SamplingParams

# 24 short code-like prompts; one is a single token.
PROMPTS = [
    "def foo(x):\n    return",
    "import os\n",
    "class A:\n",
    "for i in range(10):",
    "x",
    "    if not text:\n        return ''",
    "def dedent(text):\n",
    "from collections import",
    "while lo < hi:\n    mid = (lo + hi) // 2",
    "heap.append(item)",
    "# Copyright",
    "raise ValueError(",
    "lines = text.splitlines()",
    "return ''.join(result)",
    "def __init__(self, width=70):",
    "self.width = width",
    "try:\n    import re\nexcept ImportError:",
    "assert len(x) == 3",
    "print('hello world')",
    "if __name__ == '__main__':",
    "pattern = re.compile(r'\\s+')",
    "def wrap(text, width=70, **kwargs):",
    '    """Return a list',
    "a = b",
]


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_path, draft_path) of a tiny random Llama pair sharing one tokenizer."""
    from models.tiny import build_tiny_pair

    return build_tiny_pair(str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="session")
def loaded(tiny_pair):
    """(target LoadedModel, draft LoadedModel)."""
    from models.loading.loader import load_pair

    return load_pair(*tiny_pair)


@pytest.fixture(scope="session")
def prompt_ids(loaded):
    tokenizer = loaded[0].tokenizer
    return [tokenizer.encode(p) for p in PROMPTS]


def make_request(request_id, prompt_ids, max_tokens=24, **sampling):
    return Request(request_id, list(prompt_ids), SamplingParams(max_tokens=max_tokens, **sampling))


def drain(scheduler, streams: dict | None = None, max_ticks: int = 100_000) -> dict:
    """Tick `scheduler` until it has no work, adding each event's tokens to `streams`
    ({request id: tokens}); a scheduler that never runs dry fails the test."""
    streams = {} if streams is None else streams
    for _ in range(max_ticks):
        if not scheduler.has_work():
            return streams
        for event in scheduler.tick():
            streams.setdefault(event.request_id, []).extend(event.token_ids)
    raise AssertionError(f"the scheduler still had work after {max_ticks} ticks")


def isolated_streams(runner, prompts, max_tokens=24):
    """Each prompt alone through a classic-only scheduler (B=1 policy off), greedy: the
    reference streams, keyed r0, r1, ... in `prompts`' order."""
    from scheduler.config import SchedulerConfig
    from scheduler.core import Scheduler

    out = {}
    for i, p in enumerate(prompts):
        scheduler = Scheduler(runner, SchedulerConfig(b1_policy="off"))
        scheduler.submit(make_request("solo", p, max_tokens=max_tokens))
        out[f"r{i}"] = drain(scheduler, {"solo": []})["solo"]
    return out
