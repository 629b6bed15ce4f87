"""The measured tick costs kept across restarts (`policy_cache_dir`, `tick_costs.json`):
a runner that starts again with the same models, machine and knobs reads them; another
knob, or a file it cannot read, measures again."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.model

TARGET = os.path.join(os.path.dirname(__file__), "..", "..", "models", "bundled", "target")


def test_a_restart_reads_the_tick_costs_it_measured(tmp_path, monkeypatch):
    from models.forward import tick_costs
    from models.runner import MlxRunner

    measured = []
    real = tick_costs.measure
    monkeypatch.setattr(tick_costs, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))

    def start(**knobs):
        runner = MlxRunner.from_paths(
            TARGET, drafter_kind="ngram", num_draft_tokens=4, policy_cache_dir=str(tmp_path), **knobs
        )
        try:
            return runner.tick_costs()
        finally:
            runner.close()

    first = start(max_batch_size=4)
    path = tmp_path / tick_costs.CACHE_FILE
    assert len(measured) == 1 and path.is_file()
    assert start(max_batch_size=4) == first and len(measured) == 1  # read back, not measured
    assert set(start(max_batch_size=8).decode) == {1, 2, 4, 8} and len(measured) == 2  # another knob
    assert len(json.loads(path.read_text())["tick_costs"]) == 2
    path.write_text("{not json")
    assert start(max_batch_size=4) is not None and len(measured) == 3  # unreadable: measured again
    assert len(json.loads(path.read_text())["tick_costs"]) == 1


def test_without_a_cache_directory_every_start_measures(monkeypatch):
    from models.forward import tick_costs
    from models.runner import MlxRunner

    measured = []
    real = tick_costs.measure
    monkeypatch.setattr(tick_costs, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))
    for _ in range(2):
        runner = MlxRunner.from_paths(TARGET, drafter_kind="ngram", num_draft_tokens=4, max_batch_size=2)
        runner.tick_costs()
        runner.close()
    assert len(measured) == 2
