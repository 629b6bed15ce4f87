"""Quick mode of scenario 7 against the bundled model: two services (prefix cache on and
off) start and run the same conversations, and from the second turn the cached service
reuses the history. How much TTFT drops is the benchmark's table, not a test: timing on a
shared 2-core machine is noise."""

import json
import os

import pytest

from scripts.bench import multiturn as bench_multiturn

pytestmark = [pytest.mark.model, pytest.mark.serve]
BUNDLED = os.path.isfile("models/bundled/target/model.safetensors")


def test_turn_rows_are_per_turn_and_per_server():
    records = [
        {
            "server": s,
            "turn": t,
            "ttft_s": 0.1 * t * (2 if s == "cache_off" else 1),
            "prompt_tokens": 100 * t,
            "cached_tokens": 0 if s == "cache_off" else 50 * t,
        }
        for s in ("cache_on", "cache_off")
        for t in (1, 2)
        for _ in range(3)
    ]
    rows = bench_multiturn.turn_rows(records, ["cache_on", "cache_off"])
    assert [r["turn"] for r in rows] == [1, 2]
    assert rows[1]["prompt_tokens"] == 200 and rows[1]["cache_on_cached"] == 100
    assert rows[1]["cache_on_p50_ms"] == pytest.approx(200.0)
    assert rows[1]["off_over_on_p50"] == pytest.approx(2.0)


def test_phases_are_what_each_run_added():
    def text(replica, queue, prefill, n):
        return "\n".join(
            f'{bench_multiturn.PHASES[p]}_{kind}{{model_name="m"}} {v}'
            for p, s in (("replica", replica), ("queue", queue), ("prefill", prefill))
            for kind, v in (("sum", s), ("count", n))
        )

    total = {}
    start, mid, end = (
        bench_multiturn.phase_totals(text(*v)) for v in ((1.0, 0.1, 0.5, 4), (2.0, 0.2, 1.3, 8), (2.9, 0.3, 2.0, 12))
    )
    bench_multiturn.add_phases(total, start, mid, [{"ttft_s": 0.3}] * 4)
    bench_multiturn.add_phases(total, mid, end, [{"ttft_s": 0.3}] * 3 + [{"ttft_s": None}])
    (row,) = bench_multiturn.phase_rows({"cache_on": total})
    assert row["turns"] == 7 and row["client_ms"] == pytest.approx(300.0)
    assert row["replica_ms"] == pytest.approx(1900 / 8) and row["prefill_ms"] == pytest.approx(1500 / 8)
    assert row["serving_ms"] == pytest.approx(300.0 - 1900 / 8)
    assert row["hop_ms"] == pytest.approx((1900 - 200 - 1500) / 8)
    assert bench_multiturn.phase_rows({"idle": {**total, "client": [0.0, 0]}}) == []


@pytest.mark.skipif(not BUNDLED, reason="bundled model not present")
def test_multiturn_quick(tmp_path):
    assert (
        bench_multiturn.main(["--quick", "--config", "configs/bundled.yaml", "--out", str(tmp_path), "--no-plot"]) == 0
    )
    result = json.loads((tmp_path / "multiturn.json").read_text())
    assert result["scenario"] == "multiturn" and result["quick"] is True
    assert result["server_names"] == ["cache_on", "cache_off"]
    assert result["exit_codes"] == {"cache_on": 0, "cache_off": 0}
    assert {"date_utc", "nproc", "cpu", "versions"} <= set(result["machine"])
    num_turns = result["num_turns"]
    assert len(result["records"]) == 2 * result["num_conversations"] * num_turns * result["repeats"]
    rows = {r["turn"]: r for r in result["rows"]}
    assert sorted(rows) == list(range(1, num_turns + 1))
    assert all(rows[t]["prompt_tokens"] > rows[t - 1]["prompt_tokens"] for t in range(2, num_turns + 1))
    assert all(r["cache_off_cached"] == 0 for r in rows.values())
    for turn in range(2, num_turns + 1):
        # The history up to the last reply is reused.
        assert rows[turn]["cache_on_cached"] > rows[turn - 1]["prompt_tokens"] / 2
        assert rows[turn]["cache_on_p50_ms"] > 0 and rows[turn]["cache_off_p50_ms"] > 0
    for info in result["peak_rss"].values():
        assert info["peak_rss_mb"] > 0
    # Every measured turn reached each phase, and the engine's part fits in the replica's.
    phases = {r["server"]: r for r in result["phases"]}
    assert sorted(phases) == ["cache_off", "cache_on"]
    for row in phases.values():
        assert row["turns"] == result["num_conversations"] * num_turns * result["repeats"]
        assert 0 < row["prefill_ms"] < row["replica_ms"] < row["client_ms"]
    text = (tmp_path / "multiturn.md").read_text()
    assert text.startswith("| turn |") and "Where a turn's TTFT goes" in text


def test_affinity_stats_counts_turns_that_stay_home():
    def rec(conversation, turn, replica):
        return {"server": "cache_on_x2", "repeat": 0, "conversation": conversation, "turn": turn, "replica": replica}

    records = [
        rec(0, 1, "a"),
        rec(0, 2, "a"),
        rec(0, 3, "b"),
        rec(1, 1, "b"),
        rec(1, 2, "b"),
        {**rec(0, 2, "b"), "server": "other"},
    ]
    stats = bench_multiturn.affinity_stats(records, "cache_on_x2")
    assert stats["same_replica_share"] == pytest.approx(2 / 3)
    assert stats["requests_per_replica"] == {"a": 2, "b": 3}


@pytest.mark.skipif(not BUNDLED, reason="bundled model not present")
def test_multiturn_quick_in_process(tmp_path):
    """`--engine`: the same conversations on bundled.yaml's scheduler in-process; every
    turn of every conversation is answered, and from the second turn on the cached
    runner starts from the conversation so far while the other prefills it all."""
    assert (
        bench_multiturn.main(
            ["--quick", "--engine", "--config", "configs/bundled.yaml", "--out", str(tmp_path), "--no-plot"]
        )
        == 0
    )
    result = json.loads((tmp_path / "multiturn.json").read_text())
    assert result["level"] == "engine" and result["server_names"] == ["cache_on", "cache_off"]
    records = result["records"]
    assert len(records) == 2 * result["num_conversations"] * result["num_turns"]
    assert all(r["ttft_s"] and r["ttft_s"] > 0 and r["error"] is None for r in records)
    by_key = {(r["server"], r["conversation"], r["turn"]): r for r in records}
    for (server, conversation, turn), r in by_key.items():
        if server == "cache_off" or turn == 1:
            assert r["cached_tokens"] == 0
        else:  # the previous turn's prompt is reused (blocks of 64: all but its tail)
            previous = by_key[(server, conversation, turn - 1)]["prompt_tokens"]
            assert previous - 64 < r["cached_tokens"] < r["prompt_tokens"]
        # the same conversation gets the same prompts with the cache on and off
        assert r["prompt_tokens"] == by_key[("cache_on", conversation, turn)]["prompt_tokens"]


@pytest.mark.skipif(not BUNDLED, reason="bundled model missing")
def test_no_two_conversations_open_alike_at_the_gpu_sizes():
    """At 2,000-token first messages most snippets are whole held-out files, which two
    draws of a run (or of two runs' seeds) can repeat: each conversation's first
    message still differs from every other's within its first line, and keeps its size."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained("models/bundled/target")
    firsts = [conv[0] for seed in (0, 1) for conv in bench_multiturn.user_texts(tokenizer, 8, 2, 2000, 16, seed)]
    assert len({text.split("\n", 1)[0] for text in firsts}) == len(firsts) == 16
    assert all(abs(len(tokenizer.encode(text)) - 2000) <= 2 for text in firsts)
