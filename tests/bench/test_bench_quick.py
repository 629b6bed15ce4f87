"""Quick mode of scenarios 1 and 2 against the bundled pair: the commands run end to
end, write their JSON, and the numbers show the behaviour the scenarios measure."""

import json
import os

import pytest

from scripts.bench import rotation as bench_rotation
from scripts.bench import single as bench_single

pytestmark = pytest.mark.model
BUNDLED = os.path.isfile("models/bundled/target/model.safetensors")


@pytest.mark.skipif(not BUNDLED, reason="bundled pair not present")
def test_single_stream_quick(tmp_path):
    assert bench_single.main(["--quick", "--with-auto", "--out", str(tmp_path), "--no-plot"]) == 0
    result = json.loads((tmp_path / "single_stream.json").read_text())
    assert result["scenario"] == "single_stream" and result["quick"] is True
    assert {"date_utc", "nproc", "cpu", "versions"} <= set(result["machine"])
    assert {(r["drafter"], r["k"]) for r in result["rows"]} == {
        (d, k) for d in ("draft_model", "ngram") for k in (2, 4)
    }
    for row in result["rows"]:
        assert row["classic_tok_s"] > 0 and row["spec_tok_s"] > 0
        assert row["ratio_min"] <= row["ratio_median"] <= row["ratio_max"]
        assert 1.0 <= row["acceptance_length"] <= row["k"] + 1
        for pair in row["pairs"]:
            assert pair["ratio"] == pytest.approx(pair["speculative"]["tokens_per_s"] / pair["classic"]["tokens_per_s"])
            assert pair["classic"]["speculative"]["rounds"] == 0  # policy "off": classic decode
            assert pair["speculative"]["speculative"]["rounds"] > 0
            # Greedy on all paths: same length (an EOS would end them at the same token).
            assert pair["classic"]["output_tokens"] == pair["speculative"]["output_tokens"]
            assert pair["auto"]["output_tokens"] == pair["classic"]["output_tokens"]
            assert pair["auto_ratio"] == pytest.approx(pair["auto"]["tokens_per_s"] / pair["classic"]["tokens_per_s"])
        assert row["auto_ratio_min"] <= row["auto_ratio_median"]
        assert row["auto_estimate"] > 0
        # A settled policy: full rounds exactly when its verdict enables the slot.
        assert (row["auto_spec_rounds"] > 0) == row["auto_enabled"]
        # The slot's rounds only: a lone row whose slot is off still verifies its own n-gram drafts.
        assert row["auto_spec_rounds"] == sum(
            s["rounds"] - s["probe_rounds"] - s.get("row_rounds", 0)
            for s in (p["auto"]["speculative"] for p in row["pairs"])
        )
    table = (tmp_path / "single_stream.md").read_text()
    assert table.startswith("| drafter |") and "auto / classic (median)" in table


@pytest.mark.skipif(not BUNDLED, reason="bundled pair not present")
def test_rotation_quick(tmp_path):
    assert bench_rotation.main(["--quick", "--repeats", "1", "--out", str(tmp_path), "--no-plot"]) == 0
    result = json.loads((tmp_path / "rotation.json").read_text())
    rows = {(r["streams"], r["config"]): r for r in result["rows"]}
    assert set(rows) == {(n, c) for n in (2, 3, 4) for c in ("g8", "g2", "g1", "g0", "classic")}
    for (streams, config), row in rows.items():
        assert len(row["rounds"]) == len(row["stream_tok_s"]) == streams
        assert len(row["late_ttft_ms"]) == streams - 1 and all(t > 0 for t in row["late_ttft_ms"])
        assert row["aggregate_tok_s"] > 0
        assert 1 / streams - 1e-9 <= row["jain_rate"] <= 1 + 1e-9
        assert all(n == result["max_tokens"] or n > 0 for n in row["output_tokens"])
        if config == "classic":
            assert row["rounds"] == [0] * streams and row["jain_rounds"] is None
        else:
            assert sum(row["round_share"]) == pytest.approx(1.0)
    for streams in (2, 3, 4):
        # Budget 0: the first stream holds the slot, latecomers decode classic.
        assert rows[(streams, "g0")]["rounds"][0] > 0 and rows[(streams, "g0")]["rounds"][1:] == [0] * (streams - 1)
        assert rows[(streams, "g0")]["parks"] == [0] * streams
    # Two streams under a small budget rotate: both get rounds and both are parked.
    for config in ("g2", "g1"):
        row = rows[(2, config)]
        assert all(r > 0 for r in row["rounds"]) and all(p > 0 for p in row["parks"])
        assert row["jain_rounds"] > 0.9


@pytest.mark.skipif(not BUNDLED, reason="bundled pair not present")
def test_concurrency_quick(tmp_path):
    from scripts.bench import concurrency as bench_concurrency

    assert (
        bench_concurrency.main(["--quick", "--repeats", "1", "--waves", "1", "--out", str(tmp_path), "--no-plot"]) == 0
    )  # non-zero: greedy outputs differ between configs
    result = json.loads((tmp_path / "concurrency.json").read_text())
    rows = {(r["streams"], r["config"]): r for r in result["rows"]}
    configs = ("default", "slot_only", "alternate", "classic", "classic_batchgen")
    assert set(rows) == {(n, c) for n in (1, 2, 4) for c in configs}
    for (streams, config), row in rows.items():
        assert row["aggregate_tok_s"] > 0 and row["same_lengths"]
        assert len(row["runs"][0]["rounds"]) == streams
        if config.startswith("classic"):  # b1_policy off: no slot rounds, no row drafts
            assert row["rounds_per_stream"] == 0
        if config == "classic":
            assert row["ratio_vs_classic"] == 1.0
        if config == "alternate" or streams == 1:
            assert row["fused_ticks"] == 0  # nothing to ride with, or the seed's tick
    assert (tmp_path / "concurrency.md").read_text().startswith("| streams |")


def arrivals_seen(monkeypatch, bench_concurrency) -> list:
    """Each run's arrivals, as scenario 6 hands them to `drive` (which still runs them)."""
    seen = []
    inner = bench_concurrency.drive
    monkeypatch.setattr(
        bench_concurrency,
        "drive",
        lambda runner, config, arrivals: seen.append(arrivals) or inner(runner, config, arrivals),
    )
    return seen


@pytest.mark.skipif(not BUNDLED, reason="bundled pair not present")
def test_concurrency_mixed_workload_samples_every_other_request(tmp_path, monkeypatch):
    """`--workload mixed`: the even-numbered requests greedy, the odd ones sampled at 0.7
    with their own seeds; every configuration gives the same output lengths."""
    from scripts.bench import concurrency as bench_concurrency

    seen = arrivals_seen(monkeypatch, bench_concurrency)
    assert (
        bench_concurrency.main(
            [
                "--quick",
                "--repeats",
                "1",
                "--waves",
                "1",
                "--workload",
                "mixed",
                "--configs",
                "default,classic",
                "--out",
                str(tmp_path),
                "--no-plot",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "concurrency.json").read_text())["temperature"] == 0.7
    for arrivals in seen:
        assert [a.sampling for a in arrivals] == [
            dict(temperature=0.7, seed=i) if i % 2 else {} for i in range(len(arrivals))
        ]


@pytest.mark.skipif(not BUNDLED, reason="bundled pair not present")
def test_closed_loop_replaces_whichever_request_finishes(monkeypatch):
    """Scenario 6's closed loop is one queue, as `vllm bench serve --max-concurrency` runs:
    the next request starts when any request finishes. Per-stream chains would tie each
    stream to one kind of request under `--workload mixed` (an even concurrency keeps the
    sampled requests on their own streams, whose time then bounds the run)."""
    from scheduler.config import SchedulerConfig
    from scripts.bench import concurrency as bench_concurrency
    from scripts.bench.engine import drive, load_runner
    from scripts.bench.prompts import token_prompts

    runner = load_runner(drafter="ngram", max_batch_size=2)
    prompts = token_prompts(runner.tokenizer, 4, 1, num_tokens=24)
    seen = arrivals_seen(monkeypatch, bench_concurrency)
    bench_concurrency.one_run(runner, "classic", prompts, 2, 16, grant_rounds=8, temperature=0.7, mixed=True)
    assert [(a.after_request, a.after_finishes) for a in seen[0]] == [(None, 0), (None, 0), (None, 1), (None, 2)]
    # The long first request is still running when the short second one's successor starts.
    arrivals = [
        bench_concurrency.Arrival("long", prompts[0], 40),
        bench_concurrency.Arrival("short", prompts[1], 4),
        bench_concurrency.Arrival("next", prompts[2], 4, after_finishes=1),
    ]
    records = drive(runner, SchedulerConfig(b1_policy="off"), arrivals).records
    assert records["short"]["finish_s"] <= records["next"]["arrival_s"] < records["long"]["finish_s"]
