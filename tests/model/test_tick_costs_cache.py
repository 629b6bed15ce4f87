"""The measured tick costs kept across restarts (`policy_cache_dir`, `tick_costs.json`):
a runner that starts again with the same models, machine and knobs reads them; another
knob, a file it cannot read, or a table whose one-row step now runs much faster (it was
measured on a busy machine), measures again."""

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
    monkeypatch.setattr(tick_costs, "STALE_FASTER", 0.0)  # the toy's ~1 ms steps: no spot check verdicts

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


def test_a_table_measured_on_a_busy_machine_is_measured_again(tmp_path, monkeypatch):
    from models.forward import tick_costs
    from models.runner import MlxRunner
    from scheduler.costs import TickCosts

    measured = []
    real = tick_costs.measure
    monkeypatch.setattr(tick_costs, "measure", lambda *a, **k: measured.append(1) or real(*a, **k))

    def start():
        runner = MlxRunner.from_paths(
            TARGET, drafter_kind="ngram", num_draft_tokens=4, policy_cache_dir=str(tmp_path), max_batch_size=2
        )
        try:
            return runner, runner.tick_costs()
        finally:
            runner.close()

    runner, first = start()
    assert runner._classic.price_by_steps  # the rows' drafts: these costs, kept true to the steps served
    store, key = tick_costs.TickCostStore(str(tmp_path)), runner._tick_costs_key()

    def cache_scaled(factor: float) -> TickCosts:
        scaled = TickCosts({b: s * factor for b, s in first.decode.items()}, first.fused, first.draft)
        store.save(key, scaled)
        return scaled

    slow = cache_scaled(20.0)  # as if measured while the machine ran something else
    _, again = start()
    assert len(measured) == 2 and again != slow and store.load(key) == again
    fast = cache_scaled(0.05)  # faster than this machine now: now is the busy time, the table stays
    _, kept = start()
    assert len(measured) == 2 and kept == fast
